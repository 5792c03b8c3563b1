"""What-if (issue 35): measured kernels, links and quality studies turned into capacity, latency, throughput and
quality for a model, a GPU and a workload, every number with its source.

- :mod:`~workbench.whatif.models`: model shapes (SmolLM2-135M, public presets, a ``config.json``), their weights
  and FLOPs;
- :mod:`~workbench.whatif.profile`: :class:`GpuProfile`, the measured numbers of one GPU (committed result files),
  each a :class:`Measured` with its source;
- :mod:`~workbench.whatif.step_time`: :class:`StepModel`, one decode or prefill step as parts with sources;
- :mod:`~workbench.whatif.serve`: :func:`simulate`, a trace through continuous batching with those step times;
- :mod:`~workbench.whatif.quality`: the quality column, from the committed real-model studies;
- :mod:`~workbench.whatif.report`: :func:`whatif` (all of it as plain data, with sources) and :func:`sensitivity`.
"""

from workbench.whatif.models import PRESETS
from workbench.whatif.profile import GpuProfile, Measured
from workbench.whatif.report import sensitivity, whatif
from workbench.whatif.serve import Knobs, Result, simulate
from workbench.whatif.step_time import Part, StepModel, fit_layer_overhead, step_seconds

__all__ = ["PRESETS", "GpuProfile", "Knobs", "Measured", "Part", "Result", "StepModel", "fit_layer_overhead",
           "sensitivity", "simulate", "step_seconds", "whatif"]
