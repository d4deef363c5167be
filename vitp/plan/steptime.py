"""Step time of a layout from a device profile: compute plus the communication this code does not
overlap with it.

Per micro-batch and stage (a rank's view): hardware FLOPs (model FLOPs of the stage's layers,
the block linears and attention divided over tp, embedding / final layer / adaLN replicated,
plus one more forward with activation checkpointing) at ``peak x efficiency``; element-wise
work (norms, modulation, activations, residuals) as memory traffic, ~3 x the bytes the stage
saves for backward (written once, read in the forward and the backward) at ``mem_bw``; a fixed
``layer_overhead_s`` per layer; and the TP and context-parallel collectives and pipeline sends (bytes / link
bandwidth + latency; they run between the kernels, not under them). The 1F1B pipeline takes
``(m - 1) max_s t_s + sum_s t_s`` for ``m`` micro-batches (fill and drain of every stage, then the
slowest stage sets the pace: the bubble of Narayanan et al. 2021, §2.2.1); the data-parallel
gradient reduction and the optimizer step (memory-bound: ~``28/dp + 2 b`` bytes per parameter
move, ``dp`` counting the ``dp cp`` ranks ZeRO partitions over, plus the trainer's fp32 EMA
update: ~12 bytes, 20 in bf16) follow. On a CPU profile with fewer cores than processes the step takes at least the
processes' total busy time divided by the cores.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, List

from .comm import step_comm
from .devices import DeviceProfile
from .flops import block_forward_flops, embed_forward_flops, final_forward_flops, model_flops_per_step
from .layout import LayoutSpec
from .memory import ACT_BYTES, stage_memory
from .shapes import ModelShape, layer_params_per_rank, model_cache, stage_layer_ranges


def stage_forward_flops(model: Any, lay: LayoutSpec, first: int, end: int, adaln_sharded: bool = True) -> float:
    """Forward FLOPs one rank computes per sample for the layers ``[first, end)``: block linears
    and attention over ``1 / (tp cp)`` (heads over tp; tokens, or Ulysses' heads, over cp), the
    adaLN modulation over tp (every cp rank computes it for the sample), the embedding whole (it
    runs before the cp split) and the output linear over ``N / cp`` tokens. Remembered per model,
    degrees and layers."""
    return _stage_forward_flops(model, lay.tp, lay.cp, first, end, adaln_sharded)


@model_cache(16384)
def _stage_forward_flops(model: Any, tp: int, cp: int, first: int, end: int, adaln_sharded: bool) -> float:
    shape = ModelShape.from_config(model)
    total = 0.0
    D = shape.width
    for i in range(first, end):
        if i == 0:
            total += embed_forward_flops(shape)
        elif i == shape.depth + 1:
            head = 2.0 * shape.tokens * D * shape.patch_values  # the token-wise part of final_forward_flops
            total += final_forward_flops(shape) - head + head / cp
        else:
            f = block_forward_flops(shape, shape.block_kind(i - 1))
            total += (f["linear"] + f["attention"]) / (tp * cp) + f["per_sample"] / (tp if adaln_sharded else 1)
    return total


@dataclass(frozen=True)
class StageTime:
    """Seconds one rank of ``stage`` spends per micro-batch (compute, TP and context-parallel
    collectives, pipeline sends) and per step (data-parallel reduction, optimizer)."""

    stage: int
    compute_s: float
    tp_s: float
    pp_s: float
    dp_s: float
    optimizer_s: float
    cp_s: float = 0.0

    @property
    def micro_s(self) -> float:
        return self.compute_s + self.tp_s + self.cp_s + self.pp_s


def _bw(prof: DeviceProfile, group_span: int) -> float:
    """Link bandwidth of a group whose ranks span ``group_span`` consecutive ranks."""
    return prof.intra_bw if group_span <= prof.devices_per_node else prof.inter_bw


def stage_times(model: Any, lay: LayoutSpec, prof: DeviceProfile, adaln_sharded: bool = True,
                lora: Any = None) -> List[StageTime]:
    """:class:`StageTime` of every pipeline stage. Ranks are ordered tp, cp, dp, pp
    (:mod:`vitp.parallel.state`): TP groups are consecutive ranks, cp groups stride tp (spanning
    ``tp cp`` ranks: NVLink when they fit a node, like TP), DP groups stride ``tp cp``, stages
    stride ``tp cp dp``. The gradient reduction and ZeRO's partitions span ``dp cp`` ranks. With
    ``lora`` (:class:`vitp.plan.lora.LoraPlan`) the reduction and the optimizer step cover the
    adapters only; the compute is still counted as full fine-tuning's (the frozen base's weight
    gradients are not subtracted)."""
    from .lora import lora_layer_costs

    shape = ModelShape.from_config(model)
    per_layer = lora_layer_costs(model, lora, lay)[0] if lora else layer_params_per_rank(model, lay.tp, adaln_sharded)
    rate = prof.peak(lay.precision) * prof.efficiency
    passes = 4.0 if lay.ac else 3.0  # forward + backward (2x), plus the recomputed forward
    saved = saved_per_micro(model, replace(lay, ac=0) if lay.ac else lay)
    b, e, m = ACT_BYTES[lay.precision], lay.engine_dp, lay.accum
    out = []
    comms = step_comm(model, lay, lora=lora)
    for s, ((first, end), comm) in enumerate(zip(stage_layer_ranges(shape.depth, lay.pp), comms)):
        flops = passes * lay.micro * stage_forward_flops(model, lay, first, end, adaln_sharded)
        compute = (flops / rate + passes * saved[s] / prof.mem_bw
                   + (end - first) * prof.layer_overhead_s * passes / 3.0)
        tp = comm.tp_bytes / m / _bw(prof, lay.tp) + comm.tp_count / m * prof.latency(lay.tp)
        cp = comm.cp_bytes / m / _bw(prof, lay.tp * lay.cp) + comm.cp_count / m * prof.latency(lay.cp)
        pp = comm.pp_bytes / m / _bw(prof, lay.world) + comm.pp_sends / m * prof.latency(2)
        dp = (comm.dp_bytes / _bw(prof, lay.tp * e) + prof.latency(e)) if e > 1 else 0.0
        P = sum(per_layer[first:end])
        opt = P * (28.0 / e + 2 * b + (12 if b == 4 else 20)) / prof.mem_bw
        out.append(StageTime(s, compute, tp, pp, dp, opt, cp))
    return out


@model_cache(16384)
def saved_per_micro(model: Any, lay: LayoutSpec) -> List[float]:
    """Bytes each stage saves per micro-batch without checkpointing (default memory options), remembered
    (:func:`vitp.plan.predict` stores the ones of the layouts it predicts without checkpointing)."""
    return [(m.activations / m.in_flight) for m in stage_memory(model, lay)]


def step_time(model: Any, lay: LayoutSpec, prof: DeviceProfile, adaln_sharded: bool = True,
              lora: Any = None) -> Dict[str, float]:
    """Predicted seconds per optimizer step and its parts: ``{"step_s", "pipeline_s", "dp_s",
    "optimizer_s", "compute_s", "tp_s", "cp_s", "pp_s", "bubble"}`` (per-step totals of the slowest
    stage; ``bubble`` = idle fraction of the pipeline)."""
    st = stage_times(model, lay, prof, adaln_sharded, lora)
    m = lay.accum
    slow = max(st, key=lambda t: t.micro_s)
    pipeline = (m - 1) * slow.micro_s + sum(t.micro_s for t in st)
    tail = max(t.dp_s for t in st) + max(t.optimizer_s for t in st)
    step = pipeline + tail
    if prof.cores:  # CPU processes share cores: the step lasts at least the total work / cores
        busy = sum(lay.tp * lay.cp * lay.dp * (m * t.micro_s + t.dp_s + t.optimizer_s) for t in st)
        step = max(step, busy / prof.cores)
    return {"step_s": step, "pipeline_s": pipeline, "dp_s": tail - max(t.optimizer_s for t in st),
            "optimizer_s": max(t.optimizer_s for t in st), "compute_s": m * slow.compute_s, "tp_s": m * slow.tp_s,
            "cp_s": m * slow.cp_s, "pp_s": m * slow.pp_s, "bubble": 1.0 - m * slow.micro_s / pipeline}


def predicted_mfu(model: Any, lay: LayoutSpec, prof: DeviceProfile, step_s: float) -> float:
    """Model FLOPs utilisation of a step of ``step_s`` seconds against ``prof``'s peak."""
    return model_flops_per_step(model, lay.global_batch) / (step_s * lay.world * prof.peak(lay.precision))
