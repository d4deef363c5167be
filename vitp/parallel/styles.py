"""Parallel styles: what a row of a :class:`~vitp.parallel.plan.ParallelPlan` does to the modules
its pattern matches (torchtitan's ``ColwiseParallel`` / ``RowwiseParallel`` /
``SequenceParallel`` / ``PrepareModuleInput``, pytorch/torchtitan
``torchtitan/models/llama3/infra/parallelize.py``; the semantics are Megatron-Core's,
``megatron/core/tensor_parallel/layers.py`` and ``mappings.py``).

Every style answers three questions about one matched module, so that the plan applied to a
model and the plan read by the planner (:mod:`vitp.plan`) are the same object:

- :meth:`ParallelStyle.apply`: change the module in place or return its replacement;
- :meth:`ParallelStyle.roles`: which of its parameters end up sharded (``tensor_model_parallel``,
  ``partition_dim``, ``partition_stride``) and which stay replicated with a per-rank partial
  gradient summed over the TP group (attribute ``sequence_parallel`` or ``tp_partial_grad``);
- :meth:`ParallelStyle.collectives`: the collectives one micro-batch issues through it, as
  :class:`vitp.parallel.CommRecorder` records them (logical bytes, direction, tag).

A plan runs in one of three modes (:func:`plan_mode`): ``tp`` (exact tensor parallelism),
``sp`` (with sequence parallelism: tokens sharded over the TP group outside attention/MLP) and
``partial`` (partially synchronized activations, :mod:`vitp.parallel.partial_sync`). A row's
``axis`` says which parallel degree it serves: ``tp`` rows apply at tp > 1, ``cp`` rows
(context parallelism, :mod:`vitp.parallel.context`) at cp > 1, in any of their modes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from .wire import wire_bytes

if TYPE_CHECKING:  # torch is imported where a style is applied: the planner reads styles without it
    import torch.nn as nn

    from .state import ParallelState

MODES = ("tp", "sp", "partial")
AXES = ("tp", "cp")


def mode_of(tp: int, sequence_parallel: bool, partial_sync: float) -> str:
    """``"partial"`` (``partial_sync < 1`` at tp > 1), else ``"sp"`` with sequence parallelism, else ``"tp"``."""
    return "partial" if tp > 1 and partial_sync < 1 else "sp" if sequence_parallel else "tp"


def plan_mode(state: ParallelState) -> str:
    """The plan mode (:func:`mode_of`) of this rank's :class:`ParallelState`."""
    return mode_of(state.tp_size, state.sequence_parallel, state.partial_sync)


@dataclass(frozen=True)
class Collective:
    """``count`` collectives of ``nbytes`` logical bytes each (as :class:`vitp.parallel.CommRecord`)."""

    kind: str  # all_reduce | all_gather | reduce_scatter | all_to_all | send_recv
    direction: str  # fwd | bwd
    tag: str  # tp | cond | sp_boundary | param_grad | head | cp | cp_boundary
    nbytes: float
    count: int = 1
    per_step: bool = False  # once per optimizer step, not per micro-batch
    redo: bool = True  # a forward one runs again when activation checkpointing recomputes the layer

    def wire_bytes(self, group: int) -> float:
        """Bytes one rank sends for these collectives over ``group`` ranks
        (:func:`wire_bytes`)."""
        return self.count * wire_bytes(self.kind, self.nbytes, group)


@dataclass(frozen=True)
class StepShape:
    """Sizes the collectives of one micro-batch on one rank depend on.

    ``micro`` samples of ``tokens`` tokens of ``width`` channels, ``act_bytes`` bytes per
    element; ``pixels`` values per sample (C*T*H*W); ``redo`` = 2 when activation checkpointing
    runs every forward again; ``pp`` pipeline stages; ``text_tokens`` caption tokens ``L``.
    """

    micro: int
    tokens: int
    width: int
    act_bytes: int
    tp: int
    sequence_parallel: bool = False
    partial_sync: float = 1.0
    pixels: int = 0
    redo: int = 1
    pp: int = 1
    cp: int = 1
    cp_mode: str = "ulysses"
    text_tokens: int = 0  # caption tokens L of a text-conditional model (0: class labels)

    @property
    def mode(self) -> str:
        """The plan mode (:func:`plan_mode`) of this shape's layout."""
        return mode_of(self.tp, self.sequence_parallel, self.partial_sync)

    @property
    def local_tokens(self) -> int:
        """Tokens of one context-parallel shard, ``N / cp``."""
        return self.tokens // self.cp

    def token_bytes(self, sp: bool, channels: Optional[int] = None) -> int:
        """Bytes of one ``(micro, N / cp, channels)`` activation, ``N / cp`` padded to a multiple
        of tp when ``sp``."""
        n = -(-self.local_tokens // self.tp) * self.tp if sp else self.local_tokens
        return self.micro * n * (self.width if channels is None else channels) * self.act_bytes


@dataclass
class PlanContext:
    """What styles need when applied: this rank's :class:`ParallelState`, the true token count
    of this rank (``N / cp``) and the full token grid ``(gt, gh, gw)`` (context parallelism)."""

    state: ParallelState
    seq_len: Optional[int] = None
    grid: Optional[Tuple[int, int, int]] = None


def _sharded(dim: int, stride: int = 1) -> str:
    return f"sharded(dim={dim}, stride={stride})"


def _partial(attr: str) -> str:
    return f"partial_grad({attr})"


def _partial_attr(mode: str) -> str:
    return "tp_partial_grad" if mode == "partial" else "sequence_parallel"


class ParallelStyle:
    """A row's action on one module (see the module docstring). Subclasses are frozen dataclasses."""

    def apply(self, module: nn.Module, ctx: PlanContext) -> Optional[nn.Module]:
        """Parallelise ``module`` (holding full weights) in place, or return its replacement."""
        raise NotImplementedError

    def roles(self, module: nn.Module, mode: str) -> Dict[str, str]:
        """``{parameter name relative to module: role}`` of the parameters this style shards or
        gives partial gradients, read off the full (not yet parallelised) ``module``."""
        return {}

    def sizes(self, module: nn.Module) -> Dict[str, int]:
        """The sizes of ``module`` that :meth:`collectives` needs (kept instead of the module)."""
        return {}

    def collectives(self, sizes: Dict[str, int], shape: StepShape) -> List[Collective]:
        """Per micro-batch collectives through a module of ``sizes`` (:meth:`sizes`; forward
        ones once: the plan multiplies them by ``shape.redo``)."""
        return []


def _linear_pair(shape: StepShape, partial: bool, out_features: int) -> List[Collective]:
    """A column-parallel input and a row-parallel output around a TP region (attention or MLP).

    Exact: one all-reduce forward (row output) and one backward (column input). SP: all-gather
    + reduce-scatter forward; backward the input re-gather, the reduce-scatter's transpose (an
    all-gather) and the input gradient's reduce-scatter (Korthikanti et al. 2022, §4.2.2).
    Partial: the first ``int(p D)`` channels summed forward and backward (all-reduce, or
    reduce-scatter + all-gather over tokens with SP)."""
    if partial:
        k = int(out_features * shape.partial_sync)
        if not k:
            return []
        nb = shape.token_bytes(shape.sequence_parallel, k)
        kinds = ("reduce_scatter", "all_gather") if shape.sequence_parallel else ("all_reduce",)
        return [Collective(kind, d, "tp", nb) for d in ("fwd", "bwd") for kind in kinds]
    if shape.mode == "sp":
        T = shape.token_bytes(True)
        return [Collective("all_gather", "fwd", "tp", T), Collective("reduce_scatter", "fwd", "tp", T),
                Collective("all_gather", "bwd", "tp", T, 2), Collective("reduce_scatter", "bwd", "tp", T)]
    T = shape.token_bytes(False)
    return [Collective("all_reduce", "fwd", "tp", T), Collective("all_reduce", "bwd", "tp", T)]


def _row_bias_role(prefix: str, linear: nn.Linear, mode: str) -> Dict[str, str]:
    return {f"{prefix}.bias": _partial(_partial_attr(mode))} if linear.bias is not None and mode != "tp" else {}


@dataclass(frozen=True)
class _TPRegion(ParallelStyle):
    """A module whose input enters the TP region through column-parallel layers and whose
    output leaves it through the row-parallel layer named :attr:`row` (:func:`_linear_pair`).
    ``partial``: the partial-sync variant (:mod:`vitp.parallel.partial_sync`)."""

    partial: bool = False
    row = ""

    def roles(self, module, mode):
        row = getattr(module, self.row)
        return {f"{self.row}.weight": _sharded(1), **_row_bias_role(self.row, row, mode), **self.column_roles(module)}

    def column_roles(self, module) -> Dict[str, str]:
        """Roles of the column-parallel (and other) parameters."""
        raise NotImplementedError

    def sizes(self, module):
        return {"out": getattr(module, self.row).out_features}

    def collectives(self, sizes, shape):
        return _linear_pair(shape, self.partial, sizes["out"])


@dataclass(frozen=True)
class HeadParallelAttention(_TPRegion):
    """timm ``Attention`` -> :class:`~vitp.parallel.TPAttention`: ``qkv`` column-parallel with a
    per-head stride of 3 (timm packs ``[Q all heads | K all heads | V all heads]``), ``proj``
    row-parallel (bias replicated, partial gradient under SP / partial sync), q/k-norm weights
    replicated with partial gradients. ``partial``: the partial-sync variant."""

    row = "proj"

    def apply(self, module, ctx):
        from .timm_tp import TPAttention

        return TPAttention.from_timm(module, ctx.state, ctx.seq_len, self.partial)

    def column_roles(self, module):
        out = {n: _sharded(0, 3) for n, _ in module.qkv.named_parameters(prefix="qkv")}
        for norm in ("q_norm", "k_norm"):
            out.update({n: _partial("tp_partial_grad") for n, _ in getattr(module, norm).named_parameters(prefix=norm)})
        return out


@dataclass(frozen=True)
class HeadParallelCrossAttention(_TPRegion):
    """A block's cross-attention (:class:`vitp.models.CrossAttention`) ->
    :class:`~vitp.parallel.TPCrossAttention`: ``q`` and ``kv`` (stride 2, ``[K | V]``)
    column-parallel by heads, ``proj`` row-parallel, q/k-norm weights replicated with partial
    gradients. The tokens cross the TP region as in attention (one all-reduce each way, or SP's
    all-gather / reduce-scatter); the caption entered it once at the embedding
    (:class:`TPRegionEnter` on ``ctx``). ``partial``: the partial-sync variant."""

    row = "proj"

    def apply(self, module, ctx):
        from .timm_tp import TPCrossAttention

        return TPCrossAttention(module, ctx.state, self.partial)

    def column_roles(self, module):
        out = {n: _sharded(0) for n, _ in module.q.named_parameters(prefix="q")}
        out.update({n: _sharded(0, 2) for n, _ in module.kv.named_parameters(prefix="kv")})
        for norm in ("q_norm", "k_norm"):
            out.update({n: _partial("tp_partial_grad") for n, _ in getattr(module, norm).named_parameters(prefix=norm)})
        return out


@dataclass(frozen=True)
class HiddenParallelMlp(_TPRegion):
    """timm ``Mlp`` / ``SwiGLU`` / ``GluMlp`` -> :class:`~vitp.parallel.TPMlp`: ``fc1`` (``fc1_g``,
    ``fc1_x``; a packed GLU ``fc1`` with stride 2) column-parallel, ``fc2`` row-parallel.
    ``partial``: the partial-sync variant."""

    row = "fc2"

    def apply(self, module, ctx):
        from .timm_tp import TPMlp

        return TPMlp.from_timm(module, ctx.state, self.partial)

    def column_roles(self, module):
        from timm.layers import GluMlp

        stride = 2 if isinstance(module, GluMlp) else 1
        import torch.nn as nn

        fcs = [fc for fc in ("fc1", "fc1_g", "fc1_x") if isinstance(getattr(module, fc, None), nn.Linear)]
        return {n: _sharded(0, stride) for fc in fcs for n, _ in getattr(module, fc).named_parameters(prefix=fc)}


@dataclass(frozen=True)
class GatheredColumnParallel(ParallelStyle):
    """``nn.Linear`` -> :class:`~vitp.parallel.ColumnParallelLinear` with its (small) output
    all-gathered and its input gradient left a per-rank partial sum (the caller sums it once,
    e.g. where the conditioning enters the TP region). Backward splits the output gradient, or
    reduce-scatters it with ``partial_output_grad`` (the output feeds a token shard or a
    rank's own stream). Used for the adaLN modulation ``Linear(D, k D)``."""

    partial_output_grad: bool = False
    tag: str = "cond"

    def apply(self, module, ctx):
        from .layers import ColumnParallelLinear

        return ColumnParallelLinear.from_linear(module, ctx.state, input_comm=False, gather_output=True,
                                                partial_output_grad=self.partial_output_grad, tag=self.tag)

    def roles(self, module, mode):
        return {n: _sharded(0) for n, _ in module.named_parameters()}

    def sizes(self, module):
        return {"out": module.out_features}

    def collectives(self, sizes, shape):
        nb = shape.micro * sizes["out"] * shape.act_bytes
        out = [Collective("all_gather", "fwd", self.tag, nb)]
        return out + ([Collective("reduce_scatter", "bwd", self.tag, nb)] if self.partial_output_grad else [])


@dataclass(frozen=True)
class PartialGradient(ParallelStyle):
    """Replicated parameters whose gradient is a per-rank partial sum (they see only this rank's
    tokens under SP, or its own stream under partial sync): summed over the TP group
    (:func:`vitp.parallel.register_grad_allreduce`, marked ``attr``). ``skip``: child modules
    left to other rows."""

    attr: str = "sequence_parallel"
    skip: Tuple[str, ...] = ()

    def _params(self, module):
        return [(n, p) for n, p in module.named_parameters() if n.split(".")[0] not in self.skip]

    def apply(self, module, ctx):
        from .layers import register_grad_allreduce

        for _, p in self._params(module):
            register_grad_allreduce(p, ctx.state, self.attr)

    def roles(self, module, mode):
        return {n: _partial(self.attr) for n, _ in self._params(module)}


def _replace_item(args: tuple, index: int, fn: Callable) -> tuple:
    """``args`` with ``args[index]`` replaced by ``fn(args[index])``; a single tuple argument (a
    pipeline layer's ``layer((x, c))``) is entered."""
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        return (_replace_item(tuple(args[0]), index, fn),)
    return args[:index] + (fn(args[index]),) + args[index + 1:]


@dataclass(frozen=True)
class SequenceEnter(ParallelStyle):
    """Tokens ``(B, N, D)`` at output ``output`` of the module enter the sequence-parallel region:
    padded to a multiple of tp and split over the TP group (:func:`vitp.parallel.sequence_parallel_enter`;
    backward all-gathers the gradient)."""

    output: int = 0

    def apply(self, module, ctx):
        from .timm_tp import sequence_parallel_enter

        state = ctx.state
        module.register_forward_hook(
            lambda _m, _a, out: _replace_item(tuple(out), self.output, lambda x: sequence_parallel_enter(x, state)))

    def collectives(self, sizes, shape):
        return [Collective("all_gather", "bwd", "sp_boundary", shape.token_bytes(True))]


@dataclass(frozen=True)
class SequenceExit(ParallelStyle):
    """Input ``input`` of the module (token shards ``(B, N_pad / tp, D)``) leaves the
    sequence-parallel region: all-gathered and cut to ``seq_len(module)`` tokens
    (:func:`vitp.parallel.sequence_parallel_exit`; backward keeps this rank's slice)."""

    input: int = 0
    seq_len: Callable[[nn.Module], int] = field(default=lambda m: None, repr=False,
                                                metadata={"apply_only": True})  # the planner keeps no callable

    def apply(self, module, ctx):
        from .timm_tp import sequence_parallel_exit

        state = ctx.state
        # seq_len(m) counts the whole sequence; a context-parallel rank holds N / cp of it
        module.register_forward_pre_hook(lambda m, args: _replace_item(
            args, self.input, lambda x: sequence_parallel_exit(x, state, self.seq_len(m) // state.cp_size)))

    def collectives(self, sizes, shape):
        return [Collective("all_gather", "fwd", "sp_boundary", shape.token_bytes(True))]


@dataclass(frozen=True)
class TPRegionEnter(ParallelStyle):
    """Output ``output`` ``(B, D)`` of the module enters the TP region (Megatron ``f``: identity
    forward, all-reduce of the gradient backward), so the per-rank partial gradients of all its
    consumers are summed once here. With ``pp > 1`` this runs twice per micro-batch on the
    first stage: DeepSpeed's ``PipelineEngine._exec_backward_pass`` calls ``backward`` once per
    output tensor of a stage (``tokens``, then ``c``), and both reach this node. ``caption``:
    the output is the caption tokens ``(B, L, D)`` of a text-conditional model (absent from a
    class-conditional one's outputs, then nothing is done)."""

    output: int = 1
    tag: str = "cond"
    caption: bool = False

    def apply(self, module, ctx):
        from .mappings import copy_to_tp_region

        group = ctx.state.tp_group

        def hook(_m, _a, out):
            if self.output >= len(out):  # a class-conditional model has no caption output
                return out
            return _replace_item(tuple(out), self.output, lambda c: copy_to_tp_region(c, group, self.tag))

        module.register_forward_hook(hook)

    def collectives(self, sizes, shape):
        if self.caption and not shape.text_tokens:
            return []
        nb = shape.micro * shape.width * shape.act_bytes * (shape.text_tokens if self.caption else 1)
        return [Collective("all_reduce", "bwd", self.tag, nb, 2 if shape.pp > 1 else 1)]


@dataclass(frozen=True)
class MeanOverTP(ParallelStyle):
    """The module's output becomes the mean over the TP group (:func:`vitp.parallel.partial_sync.mean_over_tp`):
    partial sync's prediction, identical on every rank."""

    tag: str = "head"

    def apply(self, module, ctx):
        from .partial_sync import mean_over_tp

        group = ctx.state.tp_group
        module.register_forward_hook(lambda _m, _a, out: mean_over_tp(out, group, self.tag))

    def collectives(self, sizes, shape):
        return [Collective("all_reduce", "fwd", self.tag, shape.micro * shape.pixels * shape.act_bytes)]


# --- context parallelism (vitp.parallel.context) ------------------------------------------------


@dataclass(frozen=True)
class ContextEnter(ParallelStyle):
    """Tokens ``(B, N, D)`` at output ``output`` of the module enter the context-parallel region:
    each cp rank keeps its contiguous ``N / cp`` (:func:`vitp.parallel.mappings.split_to_context_region`;
    backward zero-pads, no communication). Applied before the sequence-parallel split."""

    output: int = 0

    def apply(self, module, ctx):
        from .mappings import split_to_context_region

        group = ctx.state.cp_group
        module.register_forward_hook(
            lambda _m, _a, out: _replace_item(tuple(out), self.output, lambda x: split_to_context_region(x, group)))


@dataclass(frozen=True)
class ContextParallelAttention(ParallelStyle):
    """A block's attention (``module.attn``) attends over its cp group's token shards
    (:class:`vitp.parallel.context.ContextAttention`, Ulysses or ring per ``state.cp_mode``). A
    timm ``Attention`` (tp = 1) first becomes a :class:`~vitp.parallel.TPAttention` over the
    one-rank TP group (same parameters, nothing sharded). Matches the block, whose
    ``token_groups`` say the attention kind (full, spatial or temporal)."""

    def apply(self, module, ctx):
        from .context import ContextAttention
        from .timm_tp import TPAttention

        state, attn = ctx.state, module.attn
        if not isinstance(attn, TPAttention):
            attn = TPAttention.from_timm(attn, state, ctx.seq_len)
            module.attn = attn
        attn.set_context(ContextAttention(state.cp_group, state.cp_size, state.cp_mode, ctx.grid))

    def sizes(self, module):
        groups = getattr(module, "token_groups", None)
        return {"kind": groups.kind if groups is not None else "full"}

    def collectives(self, sizes, shape):
        return context_collectives(shape, sizes["kind"])


def context_collectives(shape: StepShape, kind: str) -> List[Collective]:
    """The cp collectives of one attention block (kind ``full``, ``spatial`` or ``temporal``) and
    micro-batch, as :mod:`vitp.parallel.context` issues them: per rank
    ``T = micro (N / cp) (H / tp) hd e`` bytes of each of q, k, v and the output."""
    T = shape.micro * shape.local_tokens * (shape.width // shape.tp) * shape.act_bytes
    if kind == "spatial" or shape.cp == 1:
        return []
    if kind == "temporal" or shape.cp_mode == "ulysses":
        return [Collective("all_to_all", d, "cp", nb) for d in ("fwd", "bwd") for nb in (3 * T, T)]
    # ring (vitp.parallel.ring.ring_attention): K and V forward (cp - 1 steps); backward K and V
    # again plus the dK, dV accumulators in fp32 (fp64 for fp64), which travel cp steps
    acc = T // shape.act_bytes * max(4, shape.act_bytes)
    return [Collective("send_recv", "fwd", "cp", 2 * T, shape.cp - 1),
            Collective("send_recv", "bwd", "cp", 2 * T, shape.cp - 1), Collective("send_recv", "bwd", "cp", 2 * acc, shape.cp)]


@dataclass(frozen=True)
class ContextExit(ParallelStyle):
    """The module's output ``(B, N / cp, F)`` is all-gathered over the cp group for the loss,
    which every cp rank then computes whole (:func:`vitp.parallel.mappings.gather_from_context_region`;
    backward keeps this rank's chunk, times cp)."""

    def apply(self, module, ctx):
        from .mappings import gather_from_context_region

        group = ctx.state.cp_group
        module.register_forward_hook(lambda _m, _a, out: gather_from_context_region(out, group))

    def sizes(self, module):
        return {"out": module.out_features}

    def collectives(self, sizes, shape):
        # gathered after the last tensor the final layer saves: torch's non-reentrant checkpoint
        # stops recomputing once every saved tensor is rebuilt, so it never runs twice (measured)
        nb = shape.micro * shape.tokens * sizes["out"] * shape.act_bytes
        return [Collective("all_gather", "fwd", "cp_boundary", nb, redo=False)]


def token_count(grid: Any) -> int:
    """``gt * gh * gw`` of a token grid."""
    return math.prod(int(g) for g in grid)
