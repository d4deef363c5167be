"""Megatron-style tensor and sequence parallelism for timm ViT blocks (model-agnostic).

- :mod:`.distributed`: process groups for every launcher (:func:`.distributed.init_distributed`, ranks)
- :mod:`.state`: :class:`ParallelState` (who am I in ``tp x cp x pp x dp``), :func:`make_state`, :func:`from_grid`
- :mod:`.comm`: counted collectives and :class:`CommRecorder`
- :mod:`.mappings`: autograd collectives between replicated / TP / sequence regions
- :mod:`.layers`: :class:`ColumnParallelLinear`, :class:`RowParallelLinear`, sharding helpers
- :mod:`.timm_tp`: :class:`TPAttention`, :class:`TPMlp`, the sequence-parallel region's edges
- :mod:`.norms`: :class:`TPRMSNorm`, an RMSNorm over a width split by heads (statistic summed over the TP group)
- :mod:`.styles`: parallel styles (column/row-parallel attention and MLP, gathered column, partial
  gradients, sequence enter/exit, partial sync), each declaring its parameters and collectives
- :mod:`.plan`: :class:`ParallelPlan` (pattern -> style table), :func:`apply_plan`, :func:`describe_plan`,
  and :func:`tensor_parallelize` for stock timm blocks
- :mod:`.ring`: :func:`ring_attention`, exact attention over a context-parallel group (K/V passed round a ring)
- :mod:`.context`: context parallelism (tokens split over ``cp`` ranks): :class:`ContextAttention`
  (Ulysses all-to-all, ring, frame-sharded factorized attention)
- :mod:`.random`: RNG streams (:func:`model_parallel_seed`, :func:`get_rng_tracker`,
  :func:`checkpoint_activations`)

Nothing here knows a particular model: a model's plan (e.g. :data:`vitp.models.GENERATOR_PLAN`)
composes these pieces.
"""
from .comm import CommCounter, CommRecord, CommRecorder
from .context import ContextAttention
from .layers import ColumnParallelLinear, RowParallelLinear, full_weight, register_grad_allreduce, shard_like, shard_tensor
from .mappings import (
    copy_to_tp_region,
    gather_from_sequence_region_to_replicated,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
    sum_over_tp_region,
)
from .norms import TPRMSNorm
from .ring import ring_attention
from .random import RNGStatesTracker, checkpoint_activations, get_rng_tracker, model_parallel_seed
from .state import ParallelState, from_grid, make_state, validate_tp
from .timm_tp import (
    TPAttention,
    TPCrossAttention,
    TPMlp,
    full_state_dict,
    is_timm_block,
    load_full_state_dict,
    sequence_parallel_enter,
    sequence_parallel_exit,
)
from .plan import ParallelPlan, PlanReport, PlanRow, apply_plan, describe_plan, tensor_parallelize
from .styles import Collective, StepShape

__all__ = [
    "CommCounter",
    "ContextAttention",
    "ColumnParallelLinear",
    "CommRecord",
    "CommRecorder",
    "Collective",
    "ParallelPlan",
    "PlanReport",
    "PlanRow",
    "StepShape",
    "apply_plan",
    "describe_plan",
    "ParallelState",
    "RNGStatesTracker",
    "RowParallelLinear",
    "TPAttention",
    "TPCrossAttention",
    "TPMlp",
    "TPRMSNorm",
    "checkpoint_activations",
    "copy_to_tp_region",
    "from_grid",
    "full_state_dict",
    "full_weight",
    "gather_from_sequence_region_to_replicated",
    "gather_from_tp_region",
    "get_rng_tracker",
    "is_timm_block",
    "load_full_state_dict",
    "make_state",
    "model_parallel_seed",
    "reduce_from_tp_region",
    "sum_over_tp_region",
    "reduce_scatter_to_sequence_region",
    "register_grad_allreduce",
    "ring_attention",
    "scatter_to_sequence_region",
    "sequence_parallel_enter",
    "sequence_parallel_exit",
    "shard_like",
    "shard_tensor",
    "tensor_parallelize",
    "validate_tp",
]
