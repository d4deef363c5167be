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

from vitp.utils import lazy_exports as _lazy_exports

# names load on first use: a command that needs none of them (vitp-plan, the config check) imports no torch
_EXPORTS = {
    "apply_plan": ".plan",
    "checkpoint_activations": ".random",
    "Collective": ".styles",
    "ColumnParallelLinear": ".layers",
    "CommCounter": ".comm",
    "CommRecord": ".comm",
    "CommRecorder": ".comm",
    "ContextAttention": ".context",
    "copy_to_tp_region": ".mappings",
    "describe_plan": ".plan",
    "from_grid": ".state",
    "full_state_dict": ".timm_tp",
    "full_weight": ".layers",
    "gather_from_sequence_region_to_replicated": ".mappings",
    "gather_from_tp_region": ".mappings",
    "get_rng_tracker": ".random",
    "is_timm_block": ".timm_tp",
    "load_full_state_dict": ".timm_tp",
    "make_state": ".state",
    "model_parallel_seed": ".random",
    "ParallelPlan": ".plan",
    "ParallelState": ".state",
    "PlanReport": ".plan",
    "PlanRow": ".plan",
    "reduce_from_tp_region": ".mappings",
    "reduce_scatter_to_sequence_region": ".mappings",
    "register_grad_allreduce": ".layers",
    "ring_attention": ".ring",
    "RNGStatesTracker": ".random",
    "RowParallelLinear": ".layers",
    "scatter_to_sequence_region": ".mappings",
    "sequence_parallel_enter": ".timm_tp",
    "sequence_parallel_exit": ".timm_tp",
    "shard_like": ".layers",
    "shard_tensor": ".layers",
    "StepShape": ".styles",
    "sum_over_tp_region": ".mappings",
    "tensor_parallelize": ".plan",
    "TPAttention": ".timm_tp",
    "TPCrossAttention": ".timm_tp",
    "TPMlp": ".timm_tp",
    "TPRMSNorm": ".norms",
    "validate_tp": ".state",
}
__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)


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
