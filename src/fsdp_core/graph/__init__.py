"""Graph mode: one joint forward + loss + backward graph of a ``fully_shard`` model, with FSDP's
choices (reshard after forward, bucketing, prefetch) as passes over it."""

from . import passes
from ._step import TrainStep, trace_train_step
from ._units import GraphParam, GraphUnit
from .memory import memory_timeline, peak_memory

__all__ = [
    "GraphParam",
    "GraphUnit",
    "TrainStep",
    "memory_timeline",
    "passes",
    "peak_memory",
    "trace_train_step",
]
