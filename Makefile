# The two commands the README opens with: `make tour` and `make test`.
# Both set up the environment first (scripts/setup.sh), so they work on a fresh clone.
SHELL := /bin/bash
NBVAL := --nbval-lax --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg

.PHONY: tour report test lint lab info
tour:
	@py=$$(scripts/setup.sh) && $$py -m workbench tour

# Every notebook headless at smoke sizes, then a static site in reports/site (index.html: the key numbers).
report:
	@py=$$(scripts/setup.sh) && $$py -m workbench report

# One pytest session on two workers, whole files each (--dist loadfile), in the order given (--no-loadscope-reorder):
# the browser test first (tests/browser, JupyterLab in Chromium, the longest file: one worker from the start),
# then the longest of the rest, the many short files last, so the two workers finish together. xdist's own order
# (most tests first) started the browser test minutes late. pytest keeps the order given only while no argument
# holds another (given `tests/browser ... tests`, it collects the whole folder in its own order), so the rest is
# listed file by file (tests/test_packaging.py checks it). Measured slower on 2 cores: three workers,
# OMP_NUM_THREADS=1, and the browser test split in two halves (two browsers at once). nbval checks every notebook's
# outputs (the project validates its notebooks with nbval); the browser test runs them again in JupyterLab, moves
# their widgets, and compares the same outputs by nbval's rules (tests/stored_outputs.py) on the page it ran.
LONG_FIRST := tests/browser tests/test_conformance.py notebooks/09_write_your_own_kernel.ipynb \
	tests/test_quant_layer_scales_kernels.py tests/test_sweeps_ray.py notebooks/06_real_model.ipynb \
	tests/test_quant_cache.py notebooks/04_fragmentation_and_compaction.ipynb tests/test_conformance_isolation.py \
	notebooks/05_prefetch_and_tiers.ipynb tests/test_quant_kernels.py notebooks/08_shared_prefix.ipynb \
	notebooks/07_compression.ipynb notebooks/10_serving_whatif.ipynb notebooks/03_dtypes_and_quantization.ipynb \
	tests/test_shared_prefix_panels.py tests/test_shared_prefix.py tests/test_model_decode_paths.py \
	tests/test_quant_range.py tests/test_model_quality.py tests/test_anatomy.py tests/test_bench_model_decode_paths.py \
	tests/test_notebook_float_stability.py tests/test_decode_streams.py tests/test_model.py tests/test_quest.py \
	tests/test_decode_plan.py tests/test_compaction.py tests/test_quant_bench.py tests/test_write_families.py \
	tests/test_decode_planes.py tests/test_panels.py tests/test_cache.py tests/test_write_copy.py \
	tests/test_model_runner.py
TEST_ORDER := $(LONG_FIRST) $(filter-out $(LONG_FIRST),$(sort $(wildcard notebooks/[0-9]*.ipynb tests/test_*.py)))
# Chromium's apt install (a fresh machine: ~30-60 s) runs beside the Python setup, not after it.
test:
	@scripts/setup_browser.sh & browser=$$!; \
	py=$$(scripts/setup.sh) && wait $$browser && \
	$$py -m ruff check . && \
	WORKBENCH_REQUIRE_BROWSER=1 $$py -m pytest -n 2 --dist loadfile --no-loadscope-reorder $(NBVAL) $(TEST_ORDER)

lint:
	@py=$$(scripts/setup.sh) && $$py -m ruff check .

info:
	@py=$$(scripts/setup.sh) && $$py -m workbench info

lab:
	@py=$$(scripts/setup.sh) && $$py -m jupyter lab notebooks $$([ "$$(id -u)" = 0 ] && echo --allow-root)  # root: containers, our machines
