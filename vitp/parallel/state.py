"""Who am I in the ``tp x cp x pp x dp`` layout: :class:`ParallelState` and its construction.

The process groups come from DeepSpeed's ``PipelineParallelGrid`` over a
``PipeModelDataParallelTopology(num_pp, num_mp, num_dp=dp * cp)`` (deepspeed
``runtime/pipe/topology.py``): its "model" axis is the tensor-parallel ("slice") group and is
the fastest-varying axis, so the ranks of a TP group are consecutive (same node). Its "data"
axis holds ``dp * cp`` ranks with cp the faster one, so the rank order is Megatron-Core's
``tp-cp-dp-pp`` (tp innermost): DeepSpeed reduces gradients over data x context (a sample's
token shards contribute parts of its gradient) while the data loader shards over dp only. The
context-parallel groups are the "context" axis of the equivalent
``ProcessTopology(axes=["pipe", "data", "context", "model"])``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List

import torch.nn as nn

from vitp.utils import divisors


@dataclass
class ParallelState:
    """Ranks, sizes and the tensor-parallel process group of this process.

    ``tp_group`` is a ``torch.distributed`` ``ProcessGroup`` (``None`` means the default group,
    which is only correct when ``tp_size`` equals the world size or is 1). ``sequence_parallel``
    is forced to ``False`` when ``tp_size == 1`` (there is nothing to shard). ``defer_grad_sync``:
    replicated parameters with TP-partial gradients are summed once per step by
    :func:`vitp.parallel.grads.sync_partial_grads` (which the caller runs) instead of by a
    gradient hook per backward. ``partial_sync`` (``p``) and ``partial_sync_scale``: the
    fraction of channels summed after each row-parallel layer and the factor on the others
    (:mod:`vitp.parallel.partial_sync`); ``p = 1`` is exact tensor parallelism.
    """

    tp_group: Any = None
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    sequence_parallel: bool = False
    defer_grad_sync: bool = False
    partial_sync: float = 1.0
    partial_sync_scale: str = "sqrt_tp"
    cp_group: Any = None
    cp_rank: int = 0
    cp_size: int = 1
    cp_mode: str = "ulysses"

    def __post_init__(self) -> None:
        if self.sequence_parallel and self.tp_size == 1:
            self.sequence_parallel = False  # nothing to shard; keeps the single-process path plain

    @property
    def partial(self) -> bool:
        """True when private channels exist (``partial_sync < 1`` at ``tp > 1``)."""
        return self.tp_size > 1 and self.partial_sync < 1.0


def context_group(grid: Any, cp: int) -> Any:
    """This rank's context-parallel process group in a grid whose data axis holds ``dp * cp``
    ranks (module docstring); ``None`` at ``cp = 1``. Collective: every rank creates every group,
    in the same order (``torch.distributed.new_group``)."""
    import torch.distributed as dist
    import vitp.deepspeed_adapter as ds

    ds.import_deepspeed()
    from deepspeed.runtime.pipe.topology import ProcessTopology

    if cp == 1:
        return None
    tp, pp, data = (grid.get_slice_parallel_world_size(), grid.pipe_parallel_size,
                    grid.get_data_parallel_world_size())
    if data % cp:
        raise ValueError(f"parallel.cp={cp} does not divide the {data} data-parallel ranks of the grid")
    topo = ProcessTopology(axes=["pipe", "data", "context", "model"], dims=[pp, data // cp, cp, tp])
    mine = None
    for ranks in topo.get_axis_comm_lists("context"):
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def from_grid(grid: Any, sequence_parallel: bool = False, defer_grad_sync: bool = False, partial_sync: float = 1.0,
              partial_sync_scale: str = "sqrt_tp", cp: int = 1, cp_mode: str = "ulysses") -> ParallelState:
    """:class:`ParallelState` of a DeepSpeed ``PipelineParallelGrid`` (e.g.
    :func:`vitp.deepspeed_adapter.pipeline_grid` of a ``PipelineModule``) whose data axis holds
    ``dp * cp`` ranks (module docstring). With ``cp > 1`` it creates the context-parallel groups
    (collective)."""
    data_rank, data = grid.get_data_parallel_rank(), grid.get_data_parallel_world_size()
    return ParallelState(
        tp_group=grid.get_slice_parallel_group(),
        tp_rank=grid.get_slice_parallel_rank(),
        tp_size=grid.get_slice_parallel_world_size(),
        dp_rank=data_rank // cp,
        dp_size=data // cp,
        pp_rank=grid.get_stage_id(),
        pp_size=grid.pipe_parallel_size,
        sequence_parallel=sequence_parallel,
        defer_grad_sync=defer_grad_sync,
        partial_sync=float(partial_sync),
        partial_sync_scale=partial_sync_scale,
        cp_group=context_group(grid, cp),
        cp_rank=data_rank % cp,
        cp_size=cp,
        cp_mode=cp_mode,
    )


def _layouts(world: int) -> List[str]:
    return [f"tp={t} pp={p} dp={world // (t * p)}" for t in range(1, world + 1) if world % t == 0
            for p in range(1, world // t + 1) if (world // t) % p == 0]


def make_state(tp: int = 1, pp: int = 1, dp: int = 1, sequence_parallel: bool = False, cp: int = 1,
               cp_mode: str = "ulysses") -> ParallelState:
    """Build the DeepSpeed grid for ``tp x cp x pp x dp`` and return this rank's state.

    Requires ``torch.distributed`` to be initialised (e.g. by
    :func:`vitp.parallel.distributed.init_distributed`). Every rank must call it (it creates
    process groups).

    Raises
    ------
    RuntimeError
        If ``torch.distributed`` is not initialised.
    ValueError
        If ``tp * pp * dp`` differs from the world size (the message lists the valid layouts).
    """
    import torch.distributed as dist
    import vitp.deepspeed_adapter as ds

    ds.import_deepspeed()
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, PipelineParallelGrid

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("make_state needs torch.distributed initialised (vitp.parallel.distributed.init_distributed)")
    world = dist.get_world_size()
    if min(tp, pp, dp, cp) < 1 or tp * pp * dp * cp != world:
        raise ValueError(f"parallel layout tp={tp} x cp={cp} x pp={pp} x dp={dp} = {tp * pp * dp * cp} does not match "
                         f"the world size {world}; valid layouts at cp={cp}: "
                         f"{', '.join(_layouts(world // cp)) if world % cp == 0 else 'none'}")
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp * cp)
    return from_grid(PipelineParallelGrid(topology=topo), sequence_parallel, cp=cp, cp_mode=cp_mode)


def _sizes_of_module(model: nn.Module) -> List[tuple]:
    """``(option, value)`` pairs that must be divisible by tp, from timm layers in ``model``."""
    from timm.layers import Attention, GluMlp, Mlp, SwiGLU

    out = []
    for name, m in model.named_modules():
        if isinstance(m, Attention):
            out.append((f"{name}.num_heads", m.num_heads))
        elif isinstance(m, SwiGLU):
            out.append((f"{name} hidden units", m.fc1_x.out_features))
        elif isinstance(m, GluMlp):
            out.append((f"{name} hidden units", m.fc1.out_features // 2))
        elif isinstance(m, Mlp):
            out.append((f"{name} hidden units", m.fc1.out_features))
    return out


def validate_tp(model: nn.Module, tp: int) -> None:
    """Check that the attention heads and MLP hidden units of the timm layers in ``model`` split
    evenly over ``tp`` ranks (for a run config, :func:`vitp.config.validate_layout` does this
    before any process group exists).

    Raises
    ------
    ValueError
        Naming the offending module and listing the valid tp degrees.
    """
    sizes = _sizes_of_module(model)
    if tp < 1:
        raise ValueError(f"parallel.tp={tp} must be >= 1")
    g = 0
    for _, v in sizes:
        g = math.gcd(g, int(v))
    for option, value in sizes:
        if int(value) % tp:
            raise ValueError(f"parallel.tp={tp} does not divide {option}={value}; valid tp degrees for this "
                             f"model: {divisors(g) if g else [1]}")


__all__ = ["ParallelState", "context_group", "from_grid", "make_state", "validate_tp"]
