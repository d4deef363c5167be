"""Megatron-style tensor and sequence parallelism for timm ViT blocks.

- :mod:`.state`: :class:`ParallelState`, :func:`make_state`, :func:`from_grid`, :func:`validate_tp`
- :mod:`.mappings`: autograd collectives between replicated / TP / sequence regions
- :mod:`.layers`: :class:`ColumnParallelLinear`, :class:`RowParallelLinear`, :func:`full_weight`
- :mod:`.timm_tp`: :class:`TPAttention`, :class:`TPMlp`, :func:`tensor_parallelize`
- :mod:`.random`: RNG streams (:func:`model_parallel_seed`, :func:`get_rng_tracker`)
- :mod:`.comm`: counted collectives and :class:`CommRecorder`
"""
from .comm import CommRecord, CommRecorder
from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    full_weight,
    register_grad_allreduce,
    shard_like,
    shard_tensor,
)
from .mappings import (
    copy_to_tp_region,
    gather_from_sequence_region,
    gather_from_sequence_region_to_replicated,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
    scatter_to_tp_region,
)
from .random import RNGStatesTracker, checkpoint, get_rng_tracker, model_parallel_seed
from .state import ParallelState, from_grid, make_state, validate_tp
from .timm_tp import (
    SequenceInfo,
    TPAttention,
    TPMlp,
    full_state_dict,
    load_full_state_dict,
    sequence_parallel_enter,
    sequence_parallel_exit,
    tensor_parallelize,
)

__all__ = [
    "ColumnParallelLinear",
    "CommRecord",
    "CommRecorder",
    "ParallelState",
    "RNGStatesTracker",
    "RowParallelLinear",
    "SequenceInfo",
    "TPAttention",
    "TPMlp",
    "checkpoint",
    "copy_to_tp_region",
    "from_grid",
    "full_state_dict",
    "full_weight",
    "gather_from_sequence_region",
    "gather_from_sequence_region_to_replicated",
    "gather_from_tp_region",
    "get_rng_tracker",
    "load_full_state_dict",
    "make_state",
    "model_parallel_seed",
    "reduce_from_tp_region",
    "reduce_scatter_to_sequence_region",
    "register_grad_allreduce",
    "scatter_to_sequence_region",
    "scatter_to_tp_region",
    "sequence_parallel_enter",
    "sequence_parallel_exit",
    "shard_like",
    "shard_tensor",
    "tensor_parallelize",
    "validate_tp",
]
