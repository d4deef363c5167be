"""``parallel=auto``: the layout the planner ranks first for a run config on N devices.

:func:`choose_layout` runs :func:`vitp.plan.plan` over every valid ``(tp, cp, pp, dp, sp, AC,
micro-batch)`` of the config and returns the fastest layout that fits (:class:`AutoChoice`),
holding constant the keys of :data:`AUTO_KEYS` the user fixed. Pure: the caller supplies the
device profile (:mod:`vitp.train.autolayout` detects it on rank 0 and broadcasts the choice), so
the same config, world size and profile give the same layout on every call.
"""
from __future__ import annotations

import math
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
        ``vitp-train`` overrides that reproduce it. The line says what the predictions count, as
        they are not what the run measures: the memory is the planner's model state and
        activations, not the process's RSS (or the CUDA allocator's peak, which adds buffers and
        the framework's own); the step time is compute and communication only (no data loading, no
        first-step warm-up); the MFU is the planner's at that step time (the run logs perf/mfu)."""
        p, lay = self.best, self.best.layout
        fixed = f", fixed {' '.join(f'{k}={v}' for k, v in self.fixed.items())}" if self.fixed else ""
        return (f"parallel=auto on {lay.world} x {self.profile.name} ({format_bytes(p.limit_bytes)} per rank{fixed}): "
                f"tp={lay.tp} cp={lay.cp}{' (ring)' if lay.cp > 1 and lay.cp_mode == 'ring' else ''} pp={lay.pp} "
                f"dp={lay.dp} sp={'on' if lay.sp else 'off'} ac={lay.ac} micro={lay.micro} "
                f"x {lay.accum} per step, first of {self.candidates} valid layouts ({self.fitting} fit); predicted "
                f"per rank: {format_bytes(p.peak.total)} peak of parameters, gradients, optimizer state and "
                f"activations (not the process's RSS), {p.time['step_s']:.4g} s/step of compute and communication "
                f"(no data loading or warm-up), MFU {p.mfu:.2g} at that step time; "
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


_DEGREES = ("parallel.tp", "parallel.cp", "parallel.pp")


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _fixed_text(want: Dict[str, Any], keys: Iterable[str]) -> str:
    return " ".join(f"{k}={_show(want[k])}" for k in keys)


def _drop(want: Dict[str, Any], keys: Sequence[str]) -> str:
    return f"drop {_fixed_text(want, keys)} (parallel=auto then chooses {'it' if len(keys) == 1 else 'them'})"


def _splits(world_size: int, want: Dict[str, Any]) -> List[Dict[str, int]]:
    """Every ``{tp, cp, pp, dp}`` of ``world_size`` processes that keeps the fixed degrees of ``want``."""
    from vitp.utils import divisors

    out = []
    for cp in divisors(world_size):
        for tp in divisors(world_size // cp):
            for pp in divisors(world_size // (cp * tp)):
                d = {"parallel.tp": tp, "parallel.cp": cp, "parallel.pp": pp}
                if all(int(want[k]) == v for k, v in d.items() if k in want):
                    out.append({**d, "dp": world_size // (cp * tp * pp)})
    return out


def _degree_problem(want: Dict[str, Any], world_size: int, planner: bool = False) -> Optional[str]:
    """Why the fixed tp, cp and pp (of ``want``) cannot split ``world_size`` processes, or ``None``
    (``planner``: said of ``vitp-plan --gpus``, not of a launch)."""
    keys = [k for k in _DEGREES if k in want]
    total = math.prod(int(want[k]) for k in keys)
    if world_size % total == 0:
        return None
    named = " x ".join(f"{k}={want[k]}" for k in keys) + (f" = {total}" if len(keys) > 1 else "")
    if planner:
        fix = f"plan {total} devices or a multiple (--gpus {total}), or drop {_fixed_text(want, keys)}"
        has = f"--gpus is {world_size}"
    else:
        fix = (f"launch {total} processes or a multiple (e.g. torchrun --nproc_per_node {total} -m vitp.train ...; "
               f"docs/launching.md), or {_drop(want, keys)}")
        has = f"this run has {world_size}"
    if total > world_size:
        return f"{named} needs at least {total} {'devices' if planner else 'processes'} and {has}: {fix}"
    return f"{named} does not divide the {world_size} {'devices' if planner else 'processes'}: {fix}"


def _model_problems(cfg: Any, want: Dict[str, Any]) -> List[str]:
    """What each fixed degree breaks in the model on its own: tp against the heads and MLP hidden
    units, pp against the depth, cp against the token counts (:mod:`vitp.config`'s messages)."""
    from vitp.config import _check_model_splits, check_context_parallel

    from omegaconf import OmegaConf

    tp, cp, pp = (int(want.get(k, 1)) for k in _DEGREES)
    modes = [want["parallel.cp_mode"]] if "parallel.cp_mode" in want else ["ulysses", "ring"]
    checks = {"parallel.tp": [lambda: _check_model_splits(cfg, tp, 1)],
              "parallel.pp": [lambda: _check_model_splits(cfg, 1, pp)],  # a cp fails if it fails in every mode
              "parallel.cp": [lambda m=m: check_context_parallel(OmegaConf.merge(cfg, {"parallel": {"cp_mode": m}}),
                                                                 cp, tp) for m in modes]}
    out = []
    for key in (k for k in _DEGREES if k in want):
        errors = []
        for check in checks[key]:
            try:
                check()
            except ValueError as e:
                errors.append(str(e))
        out += errors[-1:] if len(errors) == len(checks[key]) else []  # ring: the more permissive mode
    return out


def _split_problems(cfg: Any, world_size: int, want: Dict[str, Any]) -> List[str]:
    """Fixed sequence parallelism without a tp > 1, or a fixed micro-batch size that splits the
    global batch over none of the data-parallel degrees left, among the splits of the world."""
    from vitp.utils import divisors

    splits, out = _splits(world_size, want), []
    if want.get("parallel.sequence_parallel") and splits and max(s["parallel.tp"] for s in splits) == 1:
        keys = [k for k in _DEGREES if k in want]
        on = f" with {_fixed_text(want, keys)}" if keys else ""
        out.append(f"parallel.sequence_parallel=true splits tokens over tensor-parallel ranks, and on {world_size} "
                   f"process{'es' if world_size > 1 else ''}{on} tp is 1: launch more processes (tp > 1), or "
                   f"{_drop(want, ['parallel.sequence_parallel'])}")
    micro, glob = want.get("trainer.micro_batch_size"), int(cfg.trainer.global_batch_size)
    dps = sorted({s["dp"] for s in splits})
    if micro is not None and dps and all(glob % (int(micro) * dp) for dp in dps):
        ok = sorted({m for dp in dps if glob % dp == 0 for m in divisors(glob // dp)})
        out.append(f"trainer.micro_batch_size={micro} x dp divides trainer.global_batch_size={glob} for no "
                   f"data-parallel degree of this run (dp in {dps}): use trainer.micro_batch_size in {ok}, or "
                   f"{_drop(want, ['trainer.micro_batch_size'])}")
    return out


def _layout_errors(cfg: Any, world_size: int, want: Dict[str, Any], device_type: str) -> List[str]:
    """The distinct refusals (:func:`vitp.config.validate_layout`) of the layouts that keep ``want``:
    each split of the world (:func:`_splits`), the other fixed keys as given, the micro-batch fixed
    or the whole share of a data-parallel rank."""
    from omegaconf import OmegaConf

    from .layout import layout_of

    glob, out = int(cfg.trainer.global_batch_size), []
    for split in _splits(world_size, want):
        dp = split.pop("dp")
        c = OmegaConf.merge(cfg, {})
        for key, value in {**split, "trainer.micro_batch_size": max(1, glob // dp), **want}.items():
            OmegaConf.update(c, key, value, merge=False)
        try:
            layout_of(c, world_size, device_type)
        except ValueError as e:
            out += [] if str(e) in out else [str(e)]
    return out


def why_no_layout(cfg: Any, world_size: int, want: Dict[str, Any], device_type: str = "cpu",
                  planner: bool = False) -> List[str]:
    """Why no layout of ``cfg`` on ``world_size`` devices keeps the fixed values ``want`` (``{key:
    value}`` of :data:`AUTO_KEYS`): each fixed value and the rule it fails, with the fix (the
    degrees against the process count; tp, pp and cp against the model; sequence parallelism
    without tp; the micro-batch size against the global batch), else the refusals of the layouts
    that keep them (at most 3). Empty when none is found. ``planner``: the fixes name ``vitp-plan
    --gpus`` instead of a launcher."""
    degrees = _degree_problem(want, world_size, planner)
    out = ([degrees] if degrees else []) + _model_problems(cfg, want)
    out += [] if degrees else _split_problems(cfg, world_size, want)
    return out or _layout_errors(cfg, world_size, want, device_type)[:3]


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
    fixed_text = f" with {', '.join(f'{k}={_show(v)}' for k, v in want.items())}" if want else ""
    if not preds:
        devices = f"{world_size} device{'s' if world_size > 1 else ''}"
        why = "; ".join(why_no_layout(cfg, world_size, want, prof.kind)) or (
            "check heads, MLP hidden units, depth and trainer.global_batch_size against the device count")
        raise ValueError(f"parallel.auto: no valid layout of this config on {devices}{fixed_text}: {why}")
    fitting = sum(p.fits for p in preds)
    if not fitting:
        small = preds[0]  # the unfit rows are ordered by peak memory
        raise ValueError(f"parallel.auto: none of the {len(preds)} valid layouts{fixed_text} fits {world_size} x "
                         f"{prof.name} ({format_bytes(small.limit_bytes)} per rank); the smallest, "
                         f"{' '.join(small.layout.overrides())}, needs {format_bytes(small.peak.total)}. Use more "
                         f"devices, a smaller model or trainer.global_batch_size, or set parallel.auto_memory_gib")
    return AutoChoice(preds[0], len(preds), fitting, prof, want)


__all__ = ["AUTO_KEYS", "AutoChoice", "choose_layout", "fixed_keys", "plan_fixed", "why_no_layout"]
