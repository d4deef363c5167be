"""Communication of one training step per rank: tensor-parallel collectives, pipeline sends and
data-parallel gradient reduction.

Tensor parallelism (Shoeybi et al. 2019, §3; Korthikanti et al. 2022, §4.2.2), per block and
micro-batch, with ``T`` the bytes of one ``(b, N, D)`` activation: two all-reduces of ``T`` forward
(after ``proj`` and ``fc2``) and two backward (the inputs of ``qkv`` and ``fc1``); sequence
parallelism turns each into an all-gather plus a reduce-scatter of the same logical tensor
(``N`` padded to a multiple of tp), re-gathers the inputs of ``qkv`` and ``fc1`` in backward
(Megatron: two more all-gathers of ``T``), and the token scatter/gather around the stage's
embedding/final layer. The adaLN modulation is column-parallel: its ``(b, 6D)`` output (final
layer ``(b, 2D)``) is all-gathered in forward and, under SP, its gradient reduce-scattered;
``c``'s partial gradient is all-reduced once per micro-batch where it leaves the embedding (twice
on the first stage of a pipeline, which also receives ``c``'s gradient from the next stage).
Replicated parameters that see only local tokens (row-parallel biases, LayerScale under SP;
q/k-norm weights always) have their gradients summed in one flat all-reduce per step. With
``parallel.partial_sync < 1`` see :func:`_partial_block_collectives`. Activation
checkpointing runs the forward collectives of every checkpointed layer again. :func:`tp_collectives` lists them as
:class:`vitp.parallel.CommRecorder` records them (logical tensor bytes, direction, tag).

Wire bytes per rank use ring algorithms (Patarasuk & Yuan 2009): all-reduce ``2 (p-1)/p n``,
all-gather / reduce-scatter ``(p-1)/p n``. Pipeline (DeepSpeed ``PipelineEngine``): per
micro-batch a stage sends its outputs ``(tokens, c)`` forward and the gradients of its inputs
backward (same shapes). Data parallelism: DeepSpeed's ZeRO-1 reduces each gradient to the rank
owning its partition and all-gathers the updated parameters, together the volume of one ring
all-reduce of the stage's parameters, ``2 (dp-1)/dp P`` elements in the model dtype (Rajbhandari
et al. 2020, §7: ZeRO stage 1 communicates as much as plain data parallelism).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Tuple

from .layout import LayoutSpec, gathered_tokens, local_tokens
from .memory import ACT_BYTES
from .shapes import ModelShape, layer_params_per_rank, stage_layer_ranges


@dataclass(frozen=True)
class Collective:
    """``count`` collectives of ``nbytes`` logical bytes each (as :class:`vitp.parallel.CommRecord`)."""

    kind: str  # all_reduce | all_gather | reduce_scatter
    direction: str  # fwd | bwd
    tag: str  # tp | cond | sp_boundary | param_grad | head
    nbytes: float
    count: int = 1
    per_step: bool = False  # once per optimizer step, not per micro-batch

    def wire_bytes(self, group: int) -> float:
        """Bytes one rank sends for these collectives with ring algorithms in a group of ``group``."""
        factor = 2 if self.kind == "all_reduce" else 1
        return self.count * factor * self.nbytes * (group - 1) / group


def _block_collectives(shape: ModelShape, lay: LayoutSpec) -> Tuple[List[Collective], List[Collective], int]:
    """``(forward, backward)`` collectives of one block for one micro-batch, and the elements of
    its replicated parameters whose gradient the TP group sums (once per step)."""
    a, D, hd = ACT_BYTES[lay.precision], shape.width, shape.width // shape.heads
    T = lay.micro * gathered_tokens(shape.tokens, lay.tp, lay.sp) * D * a
    mod = Collective("all_gather", "fwd", "cond", lay.micro * 6 * D * a)
    partial = 4 * hd if shape.qk_norm else 0  # q_norm / k_norm weight and bias: each rank has its heads
    if lay.sp:
        partial += 2 * D + (2 * D if shape.layer_scale else 0)  # proj.bias, fc2.bias (+ LayerScale gammas)
        fwd = [Collective("all_gather", "fwd", "tp", T, 2), Collective("reduce_scatter", "fwd", "tp", T, 2), mod]
        bwd = [Collective("all_gather", "bwd", "tp", T, 4), Collective("reduce_scatter", "bwd", "tp", T, 2),
               Collective("reduce_scatter", "bwd", "cond", lay.micro * 6 * D * a)]
    else:
        fwd = [Collective("all_reduce", "fwd", "tp", T, 2), mod]
        bwd = [Collective("all_reduce", "bwd", "tp", T, 2)]
    return fwd, bwd, partial


def _partial_block_collectives(shape: ModelShape, lay: LayoutSpec
                               ) -> Tuple[List[Collective], List[Collective], int]:
    """:func:`_block_collectives` with ``parallel.partial_sync = p < 1``
    (:mod:`vitp.parallel.partial_sync`): after ``proj`` and ``fc2`` only ``k = int(p D)``
    channels are summed, forward and backward (all-reduce, or with SP a reduce-scatter plus an
    all-gather over tokens padded to a multiple of tp); the column inputs need no collective; the
    modulation's gradient is reduce-scattered; row biases and LayerScale get TP-partial gradients."""
    a, D, hd = ACT_BYTES[lay.precision], shape.width, shape.width // shape.heads
    k = int(D * lay.partial_sync)
    n = gathered_tokens(shape.tokens, lay.tp, lay.partial_sp)
    Tk = lay.micro * n * k * a
    if not k:
        sync = []
    elif lay.partial_sp:
        sync = [("reduce_scatter", Tk), ("all_gather", Tk)]
    else:
        sync = [("all_reduce", Tk)]
    mod = lay.micro * 6 * D * a
    fwd = [Collective(kind, "fwd", "tp", nb, 2) for kind, nb in sync] + [Collective("all_gather", "fwd", "cond", mod)]
    bwd = [Collective(kind, "bwd", "tp", nb, 2) for kind, nb in sync] + [Collective("reduce_scatter", "bwd", "cond",
                                                                                     mod)]
    partial = (4 * hd if shape.qk_norm else 0) + 2 * D + (2 * D if shape.layer_scale else 0)
    return fwd, bwd, partial


def _partial_stage_extras(shape: ModelShape, lay: LayoutSpec, first: int, end: int) -> Tuple[List[Collective], int]:
    """Outside the blocks at ``p < 1``: the head's mean over the TP group and the final
    modulation's reduce-scattered gradient (last stage); TP-partial gradient elements of the patch
    embedding (first stage) and the head's linear (last stage)."""
    a, D, pv = ACT_BYTES[lay.precision], shape.width, shape.patch_values
    out, partial = [], 0
    if first == 0:
        partial += pv * D + D
    if end == shape.depth + 2:
        redo = 2 if lay.ac else 1
        out += [Collective("all_reduce", "fwd", "head", lay.micro * shape.pixels * a, redo),
                Collective("reduce_scatter", "bwd", "cond", lay.micro * 2 * D * a)]
        partial += pv * D + pv
    return out, partial


def tp_collectives(model: Any, lay: LayoutSpec, stage: int) -> List[Collective]:
    """Tensor-parallel collectives of one micro-batch on a rank of pipeline stage ``stage``, plus
    those marked ``per_step`` that run once per optimizer step (empty when ``tp == 1``)."""
    if lay.tp == 1:
        return []
    shape = ModelShape.from_config(model)
    first, end = stage_layer_ranges(shape.depth, lay.pp)[stage]
    blocks = sum(1 for i in range(first, end) if 0 < i <= shape.depth)
    fwd, bwd, partial = (_partial_block_collectives if lay.partial_sync < 1 else _block_collectives)(shape, lay)
    partial *= blocks
    redo = 2 if lay.ac else 1
    a, D = ACT_BYTES[lay.precision], shape.width
    out = [Collective(c.kind, c.direction, c.tag, c.nbytes, c.count * blocks * redo) for c in fwd]
    out += [Collective(c.kind, c.direction, c.tag, c.nbytes, c.count * blocks) for c in bwd]
    if end == shape.depth + 2:  # the final layer's modulation
        out.append(Collective("all_gather", "fwd", "cond", lay.micro * 2 * D * a, redo))
    if first == 0:  # c's gradient where it leaves the embedding (+ the one received from stage 1)
        out.append(Collective("all_reduce", "bwd", "cond", lay.micro * D * a, 2 if lay.pp > 1 else 1))
    if lay.partial_sync < 1:
        extra, more = _partial_stage_extras(shape, lay, first, end)
        out, partial = out + extra, partial + more
    if partial:
        out.append(Collective("all_reduce", "bwd", "param_grad", partial * a, per_step=True))
    if lay.sp:
        T = lay.micro * gathered_tokens(shape.tokens, lay.tp, True) * shape.width * ACT_BYTES[lay.precision]
        if first == 0:  # scatter after the embedding: its gradient is all-gathered
            out.append(Collective("all_gather", "bwd", "sp_boundary", T))
        if end == shape.depth + 2:  # gather before the final layer (again when it is recomputed)
            out.append(Collective("all_gather", "fwd", "sp_boundary", T, 2 if lay.ac else 1))
    return out


@dataclass(frozen=True)
class StageComm:
    """Bytes one rank of pipeline stage ``stage`` sends per optimizer step (ring wire bytes for
    the collectives, plain bytes for pipeline sends), the number of TP collectives and of
    pipeline tensor sends (DeepSpeed sends each tensor of ``(tokens, c)`` on its own)."""

    stage: int
    tp_bytes: float
    tp_count: int
    pp_bytes: float
    pp_sends: int
    dp_bytes: float


def pp_send_bytes(model: Any, lay: LayoutSpec) -> float:
    """Bytes of one pipeline send per micro-batch: ``(tokens, c)`` forward, or their gradients."""
    shape = ModelShape.from_config(model)
    return lay.micro * (local_tokens(shape.tokens, lay.tp, lay.sp) + 1) * shape.width * ACT_BYTES[lay.precision]


def step_comm(model: Any, lay: LayoutSpec, adaln_sharded: bool = True) -> List[StageComm]:
    """Per-stage communication of one optimizer step (``lay.accum`` micro-batches) per rank."""
    shape = ModelShape.from_config(model)
    per_layer = layer_params_per_rank(model, lay.tp, adaln_sharded)
    send = pp_send_bytes(model, lay)
    out = []
    for s, (first, end) in enumerate(stage_layer_ranges(shape.depth, lay.pp)):
        colls = tp_collectives(model, lay, s)
        sends = (s < lay.pp - 1) + (s > 0)  # forward to the next stage, gradients to the previous one
        params = sum(per_layer[first:end])
        dp = 2 * (lay.dp - 1) / lay.dp * params * ACT_BYTES[lay.precision]
        per = [1 if c.per_step else lay.accum for c in colls]  # per-micro-batch collectives x accumulation
        out.append(StageComm(stage=s, tp_bytes=sum(k * c.wire_bytes(lay.tp) for k, c in zip(per, colls)),
                             tp_count=sum(k * c.count for k, c in zip(per, colls)), pp_bytes=lay.accum * sends * send,
                             pp_sends=lay.accum * sends * 2, dp_bytes=dp))  # tokens and c: two tensor sends
    return out
