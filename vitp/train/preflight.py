"""The start-up check: the layout planner's prediction for the run about to start, before its
data is read and before step 1.

:func:`vitp.plan.predict` gives the peak memory per rank and the step time of the layout the run
trains (with ``data.buckets``: of every bucket, at its size, frames and batch). Then:

- more memory than a rank has (a GPU's memory; on CPU the machine's RAM, shared by the run's
  processes) is refused: ``ValueError`` (``vitp-train: error: ...``, exit 2) with the predicted
  and available memory and the keys that shrink the run (:func:`fix_keys`: with ``data.buckets``
  the bucket that does not fit and its own keys), and where a larger ``model.patch_size`` fits,
  one that does;
- a step predicted to take over :data:`STEP_WARN_S` seconds gets one warning line on rank 0, with
  the predicted time and the same keys.

Cheap by construction: the planner is arithmetic on the config, and the device profile is read,
never measured (:func:`startup_profile`): a GPU's datasheet preset (:func:`vitp.plan.cuda_preset`;
A100 numbers for a GPU without one) with the memory the device reports; on CPU the profile
``vitp-plan --device cpu`` or ``parallel=auto`` measured and cached for this process count, else
:func:`vitp.plan.default_cpu_profile` (assumed numbers, slower than most CPUs) with the machine's
RAM. ``parallel.auto_device`` and ``parallel.auto_memory_gib`` name the profile and the memory per
device here as for ``parallel=auto`` (``parallel.auto_memory_gib`` is also the way past a refusal
when the device holds more than it reports). Rank 0 decides and broadcasts: every rank refuses
alike, and a failure of the prediction itself only skips the check, with a warning.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, List, Optional, Tuple

import torch

from vitp.parallel import distributed as dist

log = logging.getLogger("vitp")

STEP_WARN_S = 60.0  # a predicted step longer than this is worth a warning before step 1
PARALLEL_FIX = ("parallel.* (parallel.tp / parallel.cp / parallel.pp over more devices, "
                "parallel.activation_checkpoint_interval=1)")
FIX_KEYS = ("model.patch_size (larger: fewer tokens per sample), data.resolution (smaller), "
            f"trainer.micro_batch_size / trainer.global_batch_size (smaller), or {PARALLEL_FIX}")


def fix_keys(cfg: Any, label: str = "", memory: bool = True) -> str:
    """What shrinks the run (``memory``) or its step time: :data:`FIX_KEYS`, or for ``label`` a
    bucket of :func:`shape_predictions` (``"bucket HxW[xT]"``) that bucket's own keys. A bucket
    trains at its ``resolution`` and micro-batch (its ``batch_size / (micro-batches per step x
    dp)``), not at ``data.resolution`` and ``trainer.micro_batch_size``: the text names it, its
    index in ``data.buckets`` and its batch. More micro-batches per step lower its memory, not its
    step time."""
    from vitp.data.buckets import buckets_of

    found = [(i, b) for i, b in enumerate(buckets_of(cfg.data)) if f"bucket {b.name}" == label] if label else []
    if not found:
        return FIX_KEYS
    i, b = found[0]
    rest = f"model.patch_size (larger: fewer tokens per sample), or {PARALLEL_FIX}"
    if not memory:
        return (f"bucket {b.name} (data.buckets.{i}: drop it from data.buckets, or a smaller data.buckets.{i}.resolution "
                f"or data.buckets.{i}.batch_size={b.batch_size}), {rest}")
    return (f"bucket {b.name} (data.buckets.{i}: drop it from data.buckets, or a smaller data.buckets.{i}.resolution), "
            f"its micro-batch (a smaller data.buckets.{i}.batch_size={b.batch_size}, or more micro-batches per step: "
            f"a smaller trainer.micro_batch_size={cfg.trainer.micro_batch_size} against trainer.global_batch_size="
            f"{cfg.trainer.global_batch_size}), {rest}")


def startup_profile(cfg: Any, device: torch.device, world: int):
    """The :class:`vitp.plan.DeviceProfile` the check predicts with (module doc); reads, never
    measures. Raises ``ValueError`` for an unknown ``parallel.auto_device``."""
    from vitp.plan import PRESETS, cached_cpu_profile, cuda_preset, default_cpu_profile

    par, threads = cfg.parallel, torch.get_num_threads()
    name = str(par.auto_device).lower() if par.auto_device else None
    if name == "cpu" or (name is None and device.type != "cuda"):
        prof = (cached_cpu_profile(threads=threads, links=world > 1, procs=world)
                or default_cpu_profile(threads=threads))
    elif name is not None:
        if name not in PRESETS:
            raise ValueError(f"parallel.auto_device={par.auto_device}: use one of {sorted(PRESETS) + ['cpu']}")
        prof = PRESETS[name]
    else:
        gpu = torch.cuda.get_device_name(device)
        prof = cuda_preset(gpu) or replace(PRESETS["a100"], name=f"{gpu} (A100 numbers assumed)")
        prof = replace(prof, memory_gib=torch.cuda.get_device_properties(device).total_memory / 2**30)
    return prof if par.auto_memory_gib is None else replace(prof, memory_gib=float(par.auto_memory_gib))


def shape_predictions(cfg: Any, lay: Any, prof: Any, model: Optional[dict] = None) -> List[Tuple[str, dict, Any]]:
    """``[(label, model, Prediction)]`` of the run config ``cfg`` in the layout ``lay``
    (:class:`vitp.plan.LayoutSpec`) on ``prof``: one per ``data.buckets`` entry (label ``bucket
    HxW[xT]``, the model at its size and frames, its micro-batch ``batch_size / (accumulation x
    dp)``), else one (label ``""``). ``model`` (a resolved dict) replaces ``cfg.model``."""
    from vitp.plan import predict
    from vitp.utils import to_dict

    model = model or to_dict(cfg.model)
    if not cfg.data.buckets:
        return [("", model, predict(model, lay, prof))]
    from vitp.data.buckets import buckets_of

    out = []
    for b in buckets_of(cfg.data):
        shaped = {**model, "image_size": list(b.size), "num_frames": b.frames}
        micro = max(1, b.batch_size // (lay.accum * lay.dp))
        out.append((f"bucket {b.name}", shaped, predict(shaped, replace(lay, micro=micro), prof)))
    return out


def _describe(label: str, model: dict, pred: Any) -> str:
    from vitp.plan import ModelShape

    lay, tokens = pred.layout, ModelShape.from_config(model).tokens
    where = f"{label}: " if label else ""
    return (f"{where}{tokens} tokens per sample (model.patch_size={model['patch_size']}), micro-batch {lay.micro} x "
            f"{lay.accum}, layout tp={lay.tp}{f' cp={lay.cp}' if lay.cp > 1 else ''} pp={lay.pp} dp={lay.dp}")


def _larger_patch(cfg: Any, lay: Any, prof: Any, model: dict) -> Optional[str]:
    """``"model.patch_size=P fits (..., ... s per step)"`` for the smallest larger patch size (2x, 4x,
    8x, dividing the image) that fits in memory and steps within :data:`STEP_WARN_S`, else the
    smallest that fits; ``None`` when none does (and with ``data.buckets``)."""
    from vitp.config import parse_resolution
    from vitp.plan import format_bytes

    if cfg.data.buckets:
        return None
    h, w = parse_resolution(model["image_size"], "model.image_size")
    fitting = []
    for k in (2, 4, 8):
        p = model["patch_size"] * k
        if h % p or w % p:
            break
        (_, _, pred), = shape_predictions(cfg, lay, prof, {**model, "patch_size": p})
        if pred.peak.total <= pred.limit_bytes:
            fitting.append(f"model.patch_size={p} fits ({format_bytes(pred.peak.total)}, "
                           f"{pred.time['step_s']:.3g} s per step)")
            if pred.time["step_s"] <= STEP_WARN_S:
                break
    return fitting[-1] if fitting else None


def check_predictions(cfg: Any, device: torch.device, world: int) -> Optional[str]:
    """Rank 0's verdict (module doc): ``None`` when the run fits and is fast enough, else the
    warning line for a slow step. Raises ``ValueError`` (naming :func:`fix_keys`) when the
    predicted peak memory per rank exceeds what a rank has."""
    from vitp.plan import format_bytes, layout_of
    from vitp.utils import to_dict

    prof = startup_profile(cfg, device, world)
    lay = layout_of(cfg, world, device.type)
    model = to_dict(cfg.model)
    preds = shape_predictions(cfg, lay, prof, model)
    on = f"{world} x {prof.name} ({prof.source or 'datasheet'})"
    # on CPU the planner counts ZeRO-1's buckets only as far as gradients fill them (vitp/plan/memory.py)
    label, shaped, big = max(preds, key=lambda p: p[2].peak.total)
    if big.peak.total > big.limit_bytes:
        patch = _larger_patch(cfg, lay, prof, model)
        raise ValueError(f"predicted peak memory {format_bytes(big.peak.total)} per rank "
                         f"({_describe(label, shaped, big)}) exceeds the {format_bytes(big.limit_bytes)} a rank of {on} has (layout planner, as "
                         f"vitp-plan); shrink the run: {fix_keys(cfg, label)}{'; e.g. ' + patch if patch else ''}; "
                         f"parallel.auto_memory_gib=GIB sets the memory per device this check assumes")
    if str(cfg.model.get("family", "vit")) != "wan":  # a Wan run neither samples nor evaluates (vitp.models.wan_run)
        _check_phases(cfg, preds, prof, on)
    label, shaped, slow = max(preds, key=lambda p: p[2].time["step_s"])
    if slow.time["step_s"] > STEP_WARN_S:
        return (f"predicted {slow.time['step_s']:.4g} s per step ({_describe(label, shaped, slow)}) on {on}, over "
                f"{STEP_WARN_S:g} s (layout planner, as vitp-plan); to train faster change {fix_keys(cfg, label, memory=False)}")
    return None


def _check_phases(cfg: Any, preds: List[Tuple[str, dict, Any]], prof: Any, on: str) -> None:
    """Refuse (``ValueError``) a run whose sampling or evaluation would not fit a rank, naming the key
    that shrinks it; keep rank 0's predictions for :func:`log_phase_times`."""
    from vitp.plan import format_bytes, phase_costs_of

    costs = [phase_costs_of(cfg, pred, shaped, prof) for _, shaped, pred in preds]
    for (label, _, pred), phases in zip(preds, costs):
        for c in phases:
            if c.memory_bytes > pred.limit_bytes:
                fix = ("trainer.micro_batch_size (its forwards run one training micro-batch at a time)"
                       if c.name == "held-out loss" else f"sampler.batch_size={cfg.sampler.batch_size} (smaller: "
                       "fewer samples integrated at once on each replica)" +
                       (f" or eval.fid.batch_size={cfg.eval.fid.batch_size} (images per Inception forward)"
                        if c.name == "FID" else ""))
                raise ValueError(f"{c.name}: predicted peak memory {format_bytes(c.memory_bytes)} per rank"
                                 f"{' (' + label + ')' if label else ''} exceeds the {format_bytes(pred.limit_bytes)} "
                                 f"a rank of {on} has (layout planner, as vitp-plan); lower {fix}")
    _PHASES.update(cfg=cfg, pred=preds[0][2], shaped=preds[0][1], prof=prof)  # logged once the data is known


_PHASES: dict = {}  # rank 0's predictions of the last check_predictions, for log_phase_times


def log_phase_times(heldout_items: int) -> None:
    """Log (rank 0, after :func:`preflight` and the data set's build) the predicted time and memory
    per rank of the sample grid, the held-out loss over the run's ``heldout_items`` held-out items
    (left out when there are none) and the final samples / FID / FVD. Before the data is built the
    planner can only assume a size (1000), which put "held-out loss 45 s" on the start-up line of a
    run whose 12 items took 0.7 s."""
    from vitp.plan import format_bytes, phase_costs_of

    if not _PHASES:  # not rank 0, or a Wan run (no sampling or evaluation)
        return
    p = _PHASES
    costs = phase_costs_of(p["cfg"], p["pred"], p["shaped"], p["prof"], max(1, heldout_items))
    log.info("sampling and evaluation per rank (planner): %s", "; ".join(
        f"{c.name}{f' ({heldout_items} items)' if c.name == 'held-out loss' else ''} {c.seconds:.3g} s, "
        f"{format_bytes(c.memory_bytes)}" for c in costs if heldout_items or c.name != "held-out loss"))
    _PHASES.clear()


def with_text_len(cfg: Any, text_len: int) -> Any:
    """``cfg`` with ``model.text_len=text_len`` (the caption store's tokens per caption) when the
    model is text-conditional and its ``model.text_len`` is unset (0), so the planner counts the
    caption tokens (a copy; the run config stays as given); else ``cfg`` itself."""
    if not text_len or not cfg.model.text_dim or cfg.model.text_len:
        return cfg
    from omegaconf import OmegaConf

    return OmegaConf.merge(cfg, {"model": {"text_len": int(text_len)}})


def preflight(cfg: Any, device: torch.device) -> Optional[str]:
    """The start-up check of the module doc, on every rank (collective once the process group
    exists: rank 0 decides, every rank gets its verdict). Logs the slow-step warning on rank 0 and
    returns it (``None`` when there is none).

    Raises ``ValueError`` on every rank when the predicted memory does not fit.
    """
    verdict: dict = {}
    if dist.is_main():
        try:
            verdict = {"warning": check_predictions(cfg, device, dist.world_size())}
        except ValueError as e:
            verdict = {"error": str(e)}
        except Exception as e:  # noqa: BLE001 - a prediction that fails must not stop a valid run
            verdict = {"skipped": f"{type(e).__name__}: {e}"}
    verdict = dist.broadcast_object(verdict)
    if "error" in verdict:
        raise ValueError(verdict["error"])
    if dist.is_main() and "skipped" in verdict:
        log.warning("start-up check skipped: the planner failed (%s)", verdict["skipped"])
    if dist.is_main() and verdict.get("warning"):
        log.warning(verdict["warning"])
    return verdict.get("warning")
