"""``parallel=auto`` at launch: detect the device profile, choose the layout, put it in the config.

Rank 0 decides and broadcasts (so every rank trains the same layout, whatever its own clock, cache
or memory reading says): the layout recorded in the run directory's ``.hydra/config.yaml`` by an
earlier launch with ``parallel.auto`` (a resume, or a relaunch of a failed start: the same layout
again, never a new plan), else :func:`vitp.plan.choose_layout` on this world size and device.
The chosen values are written into the run config, which the trainer then validates, trains and
records as usual; the keys the user set on the command line (:func:`vitp.plan.fixed_keys`) stay.

Device profile (:func:`detect_profile`): ``parallel.auto_device`` if set, else the GPU's preset by
name (:func:`vitp.plan.cuda_preset`) with the memory the device reports, or on CPU the profile
measured here (:func:`vitp.plan.cpu_profile`, cached: matmul rate with the rank's threads, gloo
latency and bandwidth among ``world`` processes, at most :data:`vitp.plan.devices.LINK_PROCS_MAX`,
the machine's RAM shared by the ranks);
``parallel.auto_memory_gib`` replaces the memory.
"""
from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from vitp.parallel import distributed as dist
from vitp.utils import RankZeroError, load_run_yaml

from .preflight import with_text_len

log = logging.getLogger("vitp")


def detect_profile(cfg: DictConfig, device: torch.device, world: int):
    """The :class:`vitp.plan.DeviceProfile` ``parallel=auto`` plans with (see the module doc).

    Raises ``ValueError`` for an unknown ``parallel.auto_device`` or a GPU without a preset.
    """
    from vitp.plan import cpu_profile, cuda_preset, get_profile

    par = cfg.parallel
    if par.auto_device:
        prof = get_profile(str(par.auto_device), threads=torch.get_num_threads(), links=world > 1, procs=world,
                           notify=log.info)
    elif device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        prof = cuda_preset(name)
        if prof is None:
            raise ValueError(f"parallel.auto: no device profile for the GPU {name!r}; set parallel.auto_device to "
                             f"the nearest of h100, h200, a100 (and parallel.auto_memory_gib)")
        prof = replace(prof, memory_gib=torch.cuda.get_device_properties(device).total_memory / 2**30)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 0))
        prof = replace(prof, devices_per_node=local) if local else prof
    else:
        with torch.random.fork_rng(devices=[]):  # the measurement builds a layer: keep the run's RNG
            prof = cpu_profile(threads=torch.get_num_threads(), links=world > 1, procs=world, notify=log.info)
    return prof if par.auto_memory_gib is None else replace(prof, memory_gib=float(par.auto_memory_gib))


def recorded_layout(run_dir: Path) -> Optional[Dict[str, Any]]:
    """``{key: value}`` of :data:`vitp.plan.AUTO_KEYS` recorded in ``run_dir/.hydra/config.yaml`` by
    an earlier launch with ``parallel.auto``, or ``None`` (no such file, or not an auto run)."""
    from vitp.plan import AUTO_KEYS

    path = Path(run_dir) / ".hydra" / "config.yaml"
    if not path.is_file():
        return None
    saved = load_run_yaml(path)
    if not OmegaConf.select(saved, "parallel.auto", default=False):
        return None
    return {key: OmegaConf.select(saved, key) for key in AUTO_KEYS}


def world_change(run_dir: Path, world: int) -> Optional[str]:
    """``"the latest checkpoint ... was written at tp=2 pp=2 dp=2 (8 ranks), this job has 4"`` when
    the run directory's latest checkpoint was written at another world size, else ``None``."""
    from vitp.checkpoint import latest_meta, layout_text

    meta = latest_meta(Path(run_dir) / "checkpoints")
    if meta is None or meta["tp"] * meta.get("cp", 1) * meta["pp"] * meta["dp"] == world:
        return None
    return (f"the latest checkpoint (step {meta.get('step')}) was written at {layout_text(meta)}, this job has "
            f"{world}")


def _decide(cfg: DictConfig, run_dir: Path, device: torch.device, world: int, fixed: list) -> Dict[str, Any]:
    """Rank 0's decision: ``{"source", "values", "summary", "choice"}`` (see :func:`apply_auto_layout`)."""
    from vitp.plan import choose_layout

    recorded = recorded_layout(run_dir)
    moved = world_change(run_dir, world) if recorded is not None else None
    if moved:  # the job came back with another world size: plan again for this one
        choice = choose_layout(cfg, world, detect_profile(cfg, device, world), fixed=fixed)
        return {"source": "replanned", "values": choice.values(), "choice": choice.as_dict(),
                "summary": f"parallel=auto: {moved}: re-planned for {world} rank{'' if world == 1 else 's'}; {choice.summary()}"}
    if recorded is not None:
        values = {**recorded, **{k: OmegaConf.select(cfg, k) for k in fixed}}
        text = " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items())
        return {"source": "recorded", "values": values, "choice": None,
                "summary": f"parallel=auto: the layout recorded in {run_dir / '.hydra' / 'config.yaml'} (planned at "
                           f"the first launch): {text}"}
    choice = choose_layout(cfg, world, detect_profile(cfg, device, world), fixed=fixed)
    return {"source": "planned", "values": choice.values(), "summary": choice.summary(), "choice": choice.as_dict()}


def apply_auto_layout(cfg: DictConfig, run_dir: Path, device: torch.device, overrides: Optional[list] = None,
                      text_len: int = 0) -> Dict[str, Any]:
    """Choose the layout of a ``parallel.auto`` run and write it into ``cfg`` (collective: starts
    the process group; rank 0 decides, every rank gets its decision). Keys of
    :data:`vitp.plan.AUTO_KEYS` named in ``overrides`` (the Hydra command line) stay fixed.
    ``text_len``: the caption store's tokens per caption, planned when ``model.text_len`` is unset
    (:func:`vitp.train.preflight.with_text_len`).

    Returns ``{"source": "planned" | "recorded" | "replanned" (the world size changed since the
    latest checkpoint), "values": {key: value}, "summary": the log line,
    "choice": AutoChoice.as_dict() when planned}``, the same on every rank. Raises ``ValueError``
    when no layout fits or the device has no profile: on rank 0, which explains it, and on the
    other ranks as :class:`vitp.utils.RankZeroError` with rank 0's message (printed once).
    """
    from vitp.plan import fixed_keys

    dist.init_distributed(device, dist.timeout_of(cfg))
    decision: Dict[str, Any] = {}
    if dist.is_main():
        try:
            decision = _decide(with_text_len(cfg, text_len), Path(run_dir), device, dist.world_size(),
                               fixed_keys(overrides or []))
        except Exception as e:  # every rank must hear of it, or the others wait in the broadcast
            dist.broadcast_object({"error": str(e), "bad_input": isinstance(e, ValueError)})
            raise
    decision = dist.broadcast_object(decision)
    if "error" in decision:  # rank 0 raised it and reports it; this rank stops with the same message
        raise (RankZeroError if decision["bad_input"] else RuntimeError)(f"rank 0: {decision['error']}")
    for key, value in decision["values"].items():
        OmegaConf.update(cfg, key, value, merge=False)
    if dist.is_main():
        log.info(decision["summary"])
    return decision
