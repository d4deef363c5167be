"""``parallel=auto``: the layout the planner ranks first for a run config on N devices.

:func:`choose_layout` runs :func:`vitp.plan.plan` over every valid ``(tp, cp, pp, dp, sp, AC,
micro-batch)`` of the config and returns the fastest layout that fits (:class:`AutoChoice`),
holding constant the keys of :data:`AUTO_KEYS` the user fixed. Pure: the caller supplies the
device profile (:mod:`vitp.train.autolayout` detects it on rank 0 and broadcasts the choice), so
the same config, world size and profile give the same layout on every call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence

from .devices import DeviceProfile
from .memory import MemoryOptions
from .planner import Prediction, plan
from .units import format_bytes

# the keys parallel=auto chooses -> the LayoutSpec field each one sets
AUTO_KEYS: Dict[str, str] = {"parallel.tp": "tp", "parallel.cp": "cp", "parallel.cp_mode": "cp_mode",
                             "parallel.pp": "pp", "parallel.sequence_parallel": "sp",
                             "parallel.activation_checkpoint_interval": "ac", "trainer.micro_batch_size": "micro"}


def fixed_keys(overrides: Iterable[str]) -> List[str]:
    """The keys of :data:`AUTO_KEYS` that Hydra ``overrides`` set (``"parallel.tp=2"``,
    ``"+trainer.micro_batch_size=4"``), in :data:`AUTO_KEYS` order: what ``parallel=auto`` keeps."""
    named = {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}
    return [k for k in AUTO_KEYS if k in named]


def _select(cfg: Any, key: str) -> Any:
    section, name = key.split(".")
    return cfg[section][name]


@dataclass(frozen=True)
class AutoChoice:
    """The chosen layout (``best``, the planner's first row among the candidates), how many valid
    candidates there were and how many fit, the profile they were ranked on and the fixed keys."""

    best: Prediction
    candidates: int
    fitting: int
    profile: DeviceProfile
    fixed: Dict[str, Any]

    def values(self) -> Dict[str, Any]:
        """``{config key: value}`` of :data:`AUTO_KEYS` that select the chosen layout."""
        lay = self.best.layout
        kinds = {"sp": bool, "cp_mode": str}
        return {key: kinds.get(f, int)(getattr(lay, f)) for key, f in AUTO_KEYS.items()}

    def summary(self) -> str:
        """One log line: the layout, its predicted peak memory, step time and MFU, and the
        ``vitp-train`` overrides that reproduce it."""
        p, lay = self.best, self.best.layout
        fixed = f", fixed {' '.join(f'{k}={v}' for k, v in self.fixed.items())}" if self.fixed else ""
        return (f"parallel=auto on {lay.world} x {self.profile.name} ({format_bytes(p.limit_bytes)} per rank{fixed}): "
                f"tp={lay.tp} cp={lay.cp}{' (ring)' if lay.cp > 1 and lay.cp_mode == 'ring' else ''} pp={lay.pp} "
                f"dp={lay.dp} sp={'on' if lay.sp else 'off'} ac={lay.ac} micro={lay.micro} "
                f"x {lay.accum} per step, first of {self.candidates} valid layouts ({self.fitting} fit); predicted "
                f"{format_bytes(p.peak.total)} peak per rank, {p.time['step_s']:.4g} s/step, MFU {p.mfu:.1%}; "
                f"reproduce with: {' '.join(lay.overrides())}")

    def as_dict(self) -> dict:
        return {"values": self.values(), "prediction": self.best.as_dict(), "candidates": self.candidates,
                "fitting": self.fitting, "profile": self.profile.as_dict(), "fixed": dict(self.fixed)}


def plan_fixed(cfg: Any, world_size: int, prof: DeviceProfile, want: Dict[str, Any],
               opts: Optional[MemoryOptions] = None, ac_options: Sequence[int] = (0, 1),
               micro_options: Optional[Sequence[int]] = None) -> List[Prediction]:
    """:func:`vitp.plan.plan`'s predictions whose :data:`AUTO_KEYS` in ``want`` (``{key: value}``)
    have those values: a fixed activation-checkpoint interval or micro-batch size replaces
    ``ac_options`` / ``micro_options``, a fixed ``cp_mode`` is the only mode tried at cp > 1."""
    if "parallel.activation_checkpoint_interval" in want:
        ac_options = (int(want["parallel.activation_checkpoint_interval"]),)
    if "trainer.micro_batch_size" in want:
        micro_options = (int(want["trainer.micro_batch_size"]),)
    modes = (str(want["parallel.cp_mode"]),) if "parallel.cp_mode" in want else None
    return [p for p in plan(cfg, world_size, prof, opts, ac_options, micro_options, modes)
            if all(getattr(p.layout, AUTO_KEYS[k]) == v for k, v in want.items())]


def choose_layout(cfg: Any, world_size: int, prof: DeviceProfile, fixed: Sequence[str] = (),
                  ac_options: Sequence[int] = (0, 1), micro_options: Optional[Sequence[int]] = None,
                  opts: Optional[MemoryOptions] = None) -> AutoChoice:
    """The layout ``parallel=auto`` trains ``cfg`` with on ``world_size`` devices of ``prof``: the
    first of :func:`vitp.plan.plan` (fitting layouts, fastest first; ties keep the planner's
    enumeration order) among those whose ``fixed`` keys (of :data:`AUTO_KEYS`) equal ``cfg``'s.
    A fixed activation-checkpoint interval or micro-batch size replaces ``ac_options`` /
    ``micro_options``; a fixed ``parallel.sequence_parallel=true`` leaves only tp > 1; a fixed
    ``parallel.cp_mode`` is the only mode tried at cp > 1 (else ``ring`` only where Ulysses
    cannot split the heads, :func:`vitp.plan.candidate_layouts`). Context parallelism wins where
    a sample's activations do not fit otherwise: the memory model divides them by cp.

    Raises ``ValueError`` when the config is invalid, when no valid layout has the fixed values,
    or when none fits the device memory (naming the smallest one and what it needs).
    """
    unknown = [k for k in fixed if k not in AUTO_KEYS]
    if unknown:
        raise ValueError(f"parallel.auto cannot fix {unknown}; it chooses {list(AUTO_KEYS)}")
    want = {k: _select(cfg, k) for k in fixed}
    preds = plan_fixed(cfg, world_size, prof, want, opts, ac_options, micro_options)
    fixed_text = f" with {', '.join(f'{k}={v}' for k, v in want.items())}" if want else ""
    if not preds:
        devices = f"{world_size} device{'s' if world_size > 1 else ''}"
        raise ValueError(f"parallel.auto: no valid layout of this config on {devices}{fixed_text} (check "
                         f"heads, MLP hidden units, depth and trainer.global_batch_size against the device count)")
    fitting = sum(p.fits for p in preds)
    if not fitting:
        small = preds[0]  # the unfit rows are ordered by peak memory
        raise ValueError(f"parallel.auto: none of the {len(preds)} valid layouts{fixed_text} fits {world_size} x "
                         f"{prof.name} ({format_bytes(small.limit_bytes)} per rank); the smallest, "
                         f"{' '.join(small.layout.overrides())}, needs {format_bytes(small.peak.total)}. Use more "
                         f"devices, a smaller model or trainer.global_batch_size, or set parallel.auto_memory_gib")
    return AutoChoice(preds[0], len(preds), fitting, prof, want)


__all__ = ["AUTO_KEYS", "AutoChoice", "choose_layout", "fixed_keys", "plan_fixed"]
