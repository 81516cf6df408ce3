"""FSDP's memory and communication choices as passes over a joint train-step graph.

Each pass is a function ``GraphModule -> GraphModule`` with keyword options that returns a new
graph module and leaves its input unchanged; passes compose in any order (apply them with
``TrainStep.with_passes``). The graphs they accept follow [Note: graph-mode node conventions]
in ``fsdp_core/graph/_meta.py``.
"""

from .bucketing import bucket_all_gathers, bucket_reduce_scatters
from .prefetch import prefetch
from .reshard import reshard_after_forward

__all__ = ["bucket_all_gathers", "bucket_reduce_scatters", "prefetch", "reshard_after_forward"]
