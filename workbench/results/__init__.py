"""Results: where a result came from, where the files of benchmark runs go and how they are read back, and the
committed runs shaped into the plain tables the notebooks plot (no plotly, no widgets).

- ``provenance``: the stamp on every result file (GPU, versions, commit, date);
- ``run_files``: a run's file written, found by its metadata and read back, rows picked and printed;
- ``decode``, ``tiers``, ``compress``, ``shared_prefix``, ``byok``: one benchmark's committed runs each, as tables
  (notebooks 02, 05, 07, 08, 09);
- ``model_paths``: the model runner's decode through the cascade and through Quest (``bench model_decode``'s
  sections ``cascade`` and ``quest``; notebooks 07, 08);
- ``gpu_tests``: the GPU test run's results file (``python -m workbench.results.gpu_tests``).
- ``quant_speed``: the quantized decode run joined with the error study, per scheme bytes, error and speed, and
  the schemes no other beats on all three (notebook 03).

The benchmarks (``workbench.bench``) write through ``run_files``; nothing here imports them. Nothing is imported
here.
"""
