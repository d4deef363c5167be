"""Rank the layouts of a run config on a number of devices: memory per rank, communication and
step time for every valid ``(tp, cp, pp, dp, sp, AC, micro-batch)``; the ones that fit first,
fastest first."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from .comm import StageComm, step_comm
from .devices import DeviceProfile
from .layout import LayoutSpec, candidate_layouts
from .memory import MemoryOptions, StageMemory, stage_memory
from .shapes import ModelShape, ResolvedModel
from .steptime import predicted_mfu, saved_per_micro, step_time
from .units import GIB, format_bytes

D2H_BW = 20e9  # bytes/s a GPU copies to pageable host memory (assumption; pinned PCIe 5 reaches ~50e9)
STORAGE_BW = 1e9  # bytes/s one rank writes to checkpoint storage (assumption: a node's NVMe over 8 ranks)
_DEFAULT_OPTS = MemoryOptions()


@dataclass(frozen=True)
class Prediction:
    """Everything predicted for one layout: per-stage memory and communication, the step time
    parts, and whether the fullest rank fits the device (``limit_bytes`` per rank)."""

    layout: LayoutSpec
    memory: List[StageMemory]
    comm: List[StageComm]
    time: Dict[str, float]
    tokens_per_s: float
    mfu: float
    limit_bytes: float
    mem_bw: float = 1e11

    @property
    def peak(self) -> StageMemory:
        """The stage whose ranks need the most memory."""
        return max(self.memory, key=lambda m: m.total)

    @property
    def fits(self) -> bool:
        return self.peak.total <= self.limit_bytes

    def as_dict(self) -> dict:
        """JSON-able: the layout, ``memory_bytes`` of the fullest stage (exact) and ``memory_gib``
        (the same in GiB, four significant digits), ``limit_bytes`` / ``limit_gib`` per rank, the
        bytes per rank per step, the step time parts (seconds), tokens/s and MFU."""
        pk = self.peak
        mem = {k: int(getattr(pk, k)) for k in ("weights", "grads", "optimizer", "ema", "activations", "recompute",
                                                "pipe_buffers", "zero_buckets", "workspace", "total")}
        return {**self.layout.as_dict(), "fits": self.fits, "peak_stage": pk.stage, "memory_bytes": mem,
                "memory_gib": {k: _sig4(v / GIB) for k, v in mem.items()},
                "limit_bytes": int(self.limit_bytes), "limit_gib": _sig4(self.limit_bytes / GIB),
                "comm_bytes_per_step": {k: max(getattr(c, k) for c in self.comm)
                                        for k in ("tp_bytes", "cp_bytes", "pp_bytes", "dp_bytes")},
                "time": {k: round(v, 6) for k, v in self.time.items()}, "tokens_per_s": round(self.tokens_per_s, 1),
                "mfu": round(self.mfu, 4), "checkpoint": self.checkpoint}

    @property
    def checkpoint(self) -> dict:
        """Per rank and checkpoint (the busiest stage): ``host_bytes`` staged in host memory (training
        waits for this copy: ``blocking_s``), ``write_bytes`` written in the background
        (``background_s``), at the assumed bandwidths :data:`D2H_BW` (GPU) or half the memory
        bandwidth (CPU) and :data:`STORAGE_BW`."""
        host = max(m.ckpt_host for m in self.memory)
        write = max(m.ckpt_write for m in self.memory)
        copy_bw = D2H_BW if self.layout.device == "cuda" else self.mem_bw / 2
        return {"host_bytes": int(host), "write_bytes": int(write), "blocking_s": round(host / copy_bw, 4),
                "background_s": round(write / STORAGE_BW, 3)}


def rank_limit_bytes(prof: DeviceProfile, world: int) -> float:
    """Bytes one rank may use: the device's memory less its reserve (a CPU's memory is shared by
    all ``world`` processes)."""
    mem = prof.memory_gib / world if prof.kind == "cpu" else prof.memory_gib
    return max(0.0, mem - prof.reserve_gib) * GIB


def predict(model: Any, lay: LayoutSpec, prof: DeviceProfile, opts: Optional[MemoryOptions] = None) -> Prediction:
    """:class:`Prediction` of ``model`` (a config section) in layout ``lay`` on ``prof`` devices."""
    opts = opts or MemoryOptions()
    model = ResolvedModel.of(model)  # resolve once (plan() resolves once for every layout)
    memory = stage_memory(model, lay, opts)
    if not lay.ac and opts == _DEFAULT_OPTS:  # the step time reads these bytes: computed once, not twice
        saved_per_micro.put([m.activations / m.in_flight for m in memory], model, lay)
    t = step_time(model, lay, prof, opts.adaln_sharded, opts.lora)
    tokens = lay.global_batch * ModelShape.from_config(model).tokens
    return Prediction(lay, memory, step_comm(model, lay, opts.adaln_sharded, opts.lora), t,
                      tokens / t["step_s"], predicted_mfu(model, lay, prof, t["step_s"]),
                      rank_limit_bytes(prof, lay.world), prof.mem_bw)


def plan(cfg: Any, world_size: int, prof: DeviceProfile, opts: Optional[MemoryOptions] = None,
         ac_options: Sequence[int] = (0, 1), micro_options: Optional[Sequence[int]] = None,
         cp_modes: Optional[Sequence[str]] = None) -> List[Prediction]:
    """Predictions for every valid layout (:func:`vitp.plan.candidate_layouts`; ``cp_modes`` as
    there) of the run config ``cfg`` on ``world_size`` devices of ``prof``: the layouts that fit
    by step time, then the rest by peak memory.

    Raises ``ValueError`` when the config itself is invalid (:func:`vitp.config.validate_config`).
    """
    from vitp.config import validate_config

    validate_config(cfg)
    model = ResolvedModel.of(cfg.model)  # resolved once: OmegaConf interpolations are slow to read
    preds = [predict(model, lay, prof, opts)
             for lay in candidate_layouts(cfg, world_size, prof.kind, ac_options, micro_options, cp_modes)]
    return sorted(preds, key=lambda p: (not p.fits, p.time["step_s"] if p.fits else p.peak.total))


def format_table(preds: List[Prediction], top: Optional[int] = None) -> str:
    """A ranked text table: memory of the fullest stage and bytes per rank per step, each with three
    significant digits in a fitting unit (:func:`vitp.plan.units.format_bytes`). Column ``cp``: the
    context-parallel degree, ``r`` appended for ``cp_mode=ring`` (``2r``); ``CP/step``: bytes of
    its collectives (attention exchanges and the gathered prediction); ``ckpt/rank`` and ``host``:
    bytes one rank writes per checkpoint and stages in host memory for it (:attr:`Prediction.checkpoint`)."""
    b = format_bytes
    head = (f"{'#':>3} {'tp':>3} {'cp':>3} {'pp':>3} {'dp':>3} {'sp':>3} {'ac':>3} {'mb':>4} {'acc':>4} | "
            f"{'weights':>9} {'grads':>9} {'opt+ema':>9} {'activ':>9} {'work':>9} {'total':>9} | "
            f"{'TP/step':>9} {'CP/step':>9} {'PP/step':>9} {'DP/step':>9} | {'step s':>9} {'tok/s':>10} {'MFU':>6} | "
            f"{'ckpt/rank':>9} {'host':>9} fits")
    rows = [head, "-" * len(head)]
    for i, p in enumerate(preds[:top] if top else preds, 1):
        lay, pk = p.layout, p.peak
        comm = {k: max(getattr(c, k) for c in p.comm) for k in ("tp_bytes", "cp_bytes", "pp_bytes", "dp_bytes")}
        act = pk.activations + pk.recompute + pk.pipe_buffers
        cp = f"{lay.cp}{'r' if lay.cp > 1 and lay.cp_mode == 'ring' else ''}"
        rows.append(
            f"{i:>3} {lay.tp:>3} {cp:>3} {lay.pp:>3} {lay.dp:>3} {'y' if lay.sp else '-':>3} {lay.ac:>3} "
            f"{lay.micro:>4} {lay.accum:>4} | {b(pk.weights):>9} {b(pk.grads):>9} {b(pk.optimizer + pk.ema):>9} "
            f"{b(act):>9} {b(pk.zero_buckets + pk.workspace):>9} {b(pk.total):>9} | "
            f"{b(comm['tp_bytes']):>9} {b(comm['cp_bytes']):>9} {b(comm['pp_bytes']):>9} {b(comm['dp_bytes']):>9} | "
            f"{p.time['step_s']:>9.4g} {p.tokens_per_s:>10.4g} {p.mfu:>6.1%} | "
            f"{b(p.checkpoint['write_bytes']):>9} {b(p.checkpoint['host_bytes']):>9} {'yes' if p.fits else 'NO'}")
    return "\n".join(rows)


def _sig4(x: float) -> float:
    """``x`` rounded to four significant digits (JSON sizes in GiB that stay readable for any model)."""
    return float(f"{x:.4g}")
