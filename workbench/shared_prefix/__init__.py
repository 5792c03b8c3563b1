"""Shared-prefix decode: read a block held by several sequences once for all of them, where it measurably wins.

- :mod:`.runs`: the shared runs of a batch (the prefix tree of its block tables), and the cut a plan takes;
- :mod:`.cost`: bytes read by both paths, the cost model fitted to measured times, the selector;
- :mod:`.decode`: :class:`SharedPrefixDecode`, plain or cascade as the selector says (the kernels:
  ``workbench.kernels.CascadePlan``);
- :mod:`.batching`: overlap-aware batching (sequences that share blocks run in one batch);
- :mod:`.scenarios`: notebook 08's batches described by a few numbers, what each path reads (no tensors, no GPU).

docs/shared_prefix.md has the measurements; notebook 08 the panels.
"""

from workbench.shared_prefix.batching import group_by_overlap, step_bytes_of_batches
from workbench.shared_prefix.cost import Choice, CostModel, Geometry, choose, fit, step_bytes
from workbench.shared_prefix.decode import SharedPrefixDecode, cost_model
from workbench.shared_prefix.runs import SharedRun, cut, find_shared_runs

__all__ = ["Choice", "CostModel", "Geometry", "SharedPrefixDecode", "SharedRun", "choose", "cost_model", "cut",
           "find_shared_runs", "fit", "group_by_overlap", "step_bytes", "step_bytes_of_batches"]
