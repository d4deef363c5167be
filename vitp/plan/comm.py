"""Communication of one training step per rank: tensor- and context-parallel collectives, pipeline
sends and data-parallel gradient reduction.

Tensor parallelism: the collectives are those the generator's plan declares
(:data:`vitp.models.GENERATOR_PLAN`; each style of :mod:`vitp.parallel.styles` states what one
micro-batch issues through the module it parallelises), summed over the rows that match the
stage's layers (:func:`vitp.plan.shapes.plan_report`), as :class:`vitp.parallel.CommRecorder`
records them (logical tensor bytes, direction, tag). Per block and micro-batch with ``T`` the
bytes of one ``(b, N, D)`` activation that is two all-reduces of ``T`` forward and two backward
(Shoeybi et al. 2019, §3); sequence parallelism turns each into an all-gather plus a
reduce-scatter of the same logical tensor and re-gathers the column inputs in backward
(Korthikanti et al. 2022, §4.2.2). Activation checkpointing runs every forward collective again.

Context parallelism (:mod:`vitp.parallel.context`): the plan's cp rows list the attention
exchanges of every block (Ulysses / temporal all-to-alls, ring K/V steps; none for spatial
blocks) and the all-gather of the prediction over the cp group (tags ``cp`` and
``cp_boundary``), counted over ``cp`` ranks and reported apart from the TP bytes.

Wire bytes per rank use ring algorithms (Patarasuk & Yuan 2009): all-reduce ``2 (p-1)/p n``,
all-gather / reduce-scatter ``(p-1)/p n``. Pipeline (DeepSpeed ``PipelineEngine``): per
micro-batch a stage sends its outputs ``(tokens, c)`` forward and the gradients of its inputs
backward (same shapes). Data parallelism: DeepSpeed's ZeRO-1 reduces each gradient to the rank
owning its partition and all-gathers the updated parameters, together the volume of one ring
all-reduce of the stage's parameters, ``2 (e-1)/e P`` elements in the model dtype over the
engine's ``e = dp * cp`` data-parallel ranks (a sample's token shards are summed there too) (Rajbhandari
et al. 2020, §7: ZeRO stage 1 communicates as much as plain data parallelism).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

from vitp.parallel.styles import Collective, StepShape, mode_of

from .layout import LayoutSpec
from .memory import ACT_BYTES
from .shapes import ModelShape, layer_params_per_rank, model_cache, stage_layer_ranges, stage_report

CP_TAGS = ("cp", "cp_boundary")  # collectives over the context-parallel group (vitp.parallel.styles)


def plan_mode_of(lay: LayoutSpec) -> str:
    """The plan mode of a layout: ``partial`` (``partial_sync < 1`` at tp > 1), ``sp`` or ``tp``."""
    return mode_of(lay.tp, lay.sp or lay.partial_sp, lay.partial_sync)


def step_shape(model: Any, lay: LayoutSpec) -> StepShape:
    """The sizes the plan's collectives of one micro-batch depend on, for ``lay``."""
    shape = ModelShape.from_config(model)
    return StepShape(micro=lay.micro, tokens=shape.tokens, width=shape.width, act_bytes=ACT_BYTES[lay.precision],
                     tp=lay.tp, sequence_parallel=lay.sp or lay.partial_sp, partial_sync=lay.partial_sync,
                     pixels=shape.pixels, redo=2 if lay.ac else 1, pp=lay.pp, cp=lay.cp, cp_mode=lay.cp_mode,
                     text_tokens=shape.text_tokens)


def plan_collectives(model: Any, lay: LayoutSpec, stage: int) -> List[Collective]:
    """Every collective of the plan on a rank of pipeline stage ``stage``: those of one
    micro-batch, plus those marked ``per_step`` that run once per optimizer step; the TP and the
    context-parallel ones (tags :data:`CP_TAGS`) together, as
    :meth:`vitp.parallel.PlanReport.collectives` lists them (empty at tp = cp = 1)."""
    if lay.tp == 1 and lay.cp == 1:
        return []
    first, end = stage_layer_ranges(ModelShape.from_config(model).depth, lay.pp)[stage]
    return _stage_collectives(model, plan_mode_of(lay), first, end, min(lay.tp, 2), min(lay.cp, 2),
                              step_shape(model, lay))


_COLLECTIVES: Dict[tuple, List[Collective]] = {}  # (report signature, StepShape) -> collectives


def _stage_collectives(model: Any, mode: str, first: int, end: int, tp: int, cp: int, shape: StepShape
                       ) -> List[Collective]:
    """:func:`plan_collectives` of the layers ``[first, end)`` (the plan report depends on the
    degrees only through which are above 1: :func:`vitp.plan.shapes.plan_report`), remembered by what
    :meth:`vitp.parallel.PlanReport.collectives` reads (:func:`_signature`): stages holding equal
    layers (the middle stages of a pipeline) share one computation."""
    key = (_signature(model, mode, first, end, tp, cp), shape)
    out = _COLLECTIVES.get(key)
    if out is None:
        if len(_COLLECTIVES) >= 65536:
            _COLLECTIVES.clear()
        out = _COLLECTIVES[key] = stage_report(model, mode, first, end, tp, cp).collectives(shape)
    return list(out)


_SIGNATURES: Dict[tuple, int] = {}  # signature -> its number (a small key, hashed once)


@model_cache(16384)
def _signature(model: Any, mode: str, first: int, end: int, tp: int, cp: int) -> int:
    """The number of everything :meth:`vitp.parallel.PlanReport.collectives` reads of a stage's
    report besides the step shape: its equal ``(style, sizes)`` groups with their counts and the
    partial-gradient elements (styles by value: frozen dataclasses). Equal signatures get one
    number, so the caches keyed by it hash an integer per stage, not the styles."""
    report = stage_report(model, mode, first, end, tp, cp)
    sig = (report.plan, report.partial_grad_elements,
           tuple((style, tuple(sizes.items()), n) for style, sizes, n in report._groups()))
    return _SIGNATURES.setdefault(sig, len(_SIGNATURES))


def tp_collectives(model: Any, lay: LayoutSpec, stage: int) -> List[Collective]:
    """Tensor-parallel collectives (over the TP group) of one micro-batch on a rank of pipeline
    stage ``stage``, plus those marked ``per_step`` that run once per optimizer step (empty when
    ``tp == 1``): the plan's own list (:func:`plan_collectives`) without the context-parallel ones."""
    return [c for c in plan_collectives(model, lay, stage) if c.tag not in CP_TAGS]


def cp_collectives(model: Any, lay: LayoutSpec, stage: int) -> List[Collective]:
    """Context-parallel collectives (tags :data:`CP_TAGS`, over the cp group) of one micro-batch
    on a rank of pipeline stage ``stage`` (empty when ``cp == 1``)."""
    return [c for c in plan_collectives(model, lay, stage) if c.tag in CP_TAGS]


@dataclass(frozen=True)
class StageComm:
    """Bytes one rank of pipeline stage ``stage`` sends per optimizer step (ring wire bytes for
    the collectives, plain bytes for pipeline sends), the number of TP collectives, of
    context-parallel collectives (ring steps counted one each) and of pipeline tensor sends
    (DeepSpeed sends each tensor of ``(tokens, c)`` on its own)."""

    stage: int
    tp_bytes: float
    tp_count: int
    pp_bytes: float
    pp_sends: int
    dp_bytes: float
    cp_bytes: float = 0.0
    cp_count: int = 0


def pp_send_bytes(model: Any, lay: LayoutSpec) -> float:
    """Bytes of one pipeline send per micro-batch: ``(tokens, c)`` forward, or their gradients
    (this rank's ``N / cp`` tokens, ``ceil(N / cp / tp)`` under SP); Wan's stages send
    ``(tokens, temb, mod, ctx, cos, sin)`` (:func:`vitp.plan.memory.stage_output_bytes`)."""
    from .memory import stage_output_bytes

    return stage_output_bytes(ModelShape.from_config(model), lay)


def _per_step(colls: List[Collective], accum: int, group: int) -> Tuple[float, int]:
    """``(wire bytes, count)`` per optimizer step of ``colls`` over ``group`` ranks."""
    per = [1 if c.per_step else accum for c in colls]  # per-micro-batch collectives x accumulation
    return sum(k * c.wire_bytes(group) for k, c in zip(per, colls)), sum(k * c.count for k, c in zip(per, colls))


_TRAFFIC: Dict[tuple, Dict[int, Tuple[float, int, float, int]]] = {}  # (StepShape, accum, tp, cp) -> by signature


def _layout_traffic(model: Any, lay: LayoutSpec) -> List[Tuple[float, int, float, int]]:
    """``(TP wire bytes, TP count, cp wire bytes, cp count)`` per step of a rank of each stage
    (:func:`_per_step` of :func:`plan_collectives`), remembered like :func:`_stage_collectives`:
    the step shape is hashed once per layout, each stage looks up its signature's number."""
    ranges = stage_layer_ranges(ModelShape.from_config(model).depth, lay.pp)
    if lay.tp == 1 and lay.cp == 1:
        return [(0, 0, 0, 0)] * len(ranges)
    mode, tp, cp, shape = plan_mode_of(lay), min(lay.tp, 2), min(lay.cp, 2), step_shape(model, lay)
    outer = (shape, lay.accum, lay.tp, lay.cp)
    known = _TRAFFIC.get(outer)
    if known is None:
        if len(_TRAFFIC) >= 16384:
            _TRAFFIC.clear()
        known = _TRAFFIC[outer] = {}
    out = []
    for first, end in ranges:
        sig = _signature(model, mode, first, end, tp, cp)
        t = known.get(sig)
        if t is None:
            colls = _stage_collectives(model, mode, first, end, tp, cp, shape)
            t = known[sig] = (*_per_step([c for c in colls if c.tag not in CP_TAGS], lay.accum, lay.tp),
                              *_per_step([c for c in colls if c.tag in CP_TAGS], lay.accum, lay.cp))
        out.append(t)
    return out


def step_comm(model: Any, lay: LayoutSpec, adaln_sharded: bool = True, lora: Any = None) -> List[StageComm]:
    """Per-stage communication of one optimizer step (``lay.accum`` micro-batches) per rank; with
    ``lora`` (a :class:`vitp.plan.lora.LoraPlan`) the gradients reduced are the adapters' only.
    Remembered per model and arguments."""
    return _step_comm(model, lay, adaln_sharded, lora)


@model_cache(16384)
def _step_comm(model: Any, lay: LayoutSpec, adaln_sharded: bool, lora: Any) -> List[StageComm]:
    from .lora import lora_layer_costs

    shape = ModelShape.from_config(model)
    per_layer = lora_layer_costs(model, lora, lay)[0] if lora else layer_params_per_rank(model, lay.tp, adaln_sharded)
    send = pp_send_bytes(model, lay)
    e = lay.engine_dp  # the gradient reduction spans dp x cp ranks
    out = []
    traffic = _layout_traffic(model, lay)
    for s, (first, end) in enumerate(stage_layer_ranges(shape.depth, lay.pp)):
        tp_b, tp_n, cp_b, cp_n = traffic[s]
        sends = (s < lay.pp - 1) + (s > 0)  # forward to the next stage, gradients to the previous one
        dp = 2 * (e - 1) / e * sum(per_layer[first:end]) * ACT_BYTES[lay.precision]
        out.append(StageComm(stage=s, tp_bytes=tp_b, tp_count=tp_n, pp_bytes=lay.accum * sends * send,
                             pp_sends=lay.accum * sends * (6 if shape.is_wan else 2), dp_bytes=dp,  # tokens and c: two tensor sends
                             cp_bytes=cp_b, cp_count=cp_n))
    return out
