"""Starting a run from existing weights, at any layout: ``trainer.init_from`` (a vitp export)
and ``trainer.init_from_timm`` (the blocks of a timm ViT)."""
from __future__ import annotations

import logging
import re
from typing import Dict, List

import torch
from omegaconf import DictConfig

from vitp.models import Generator, generator_key
from vitp.parallel import ParallelState
from vitp.parallel import distributed as dist
from vitp.pipeline import load_full_state

from .export import (
    ARCH_KEYS,
    check_model_matches,
    check_partial_sync_layout,
    file_model,
    file_partial_sync,
    read_export,
    read_export_shards,
)
from .sharded import place_of
from .timm import load_timm_state, timm_block_state

log = logging.getLogger("vitp")


def init_from_export(module: torch.nn.Module, cfg: DictConfig, state: ParallelState) -> None:
    """Load every tensor of this rank's shard from ``trainer.init_from`` (strict; the file's
    model must match ``model.*`` in every key that shapes parameters).

    Raises ``FileNotFoundError`` / ``ValueError`` naming the file and the fix.
    """
    path = cfg.trainer.init_from
    _, meta = read_export(path, keys=[])
    check_model_matches(file_model(meta), cfg.model, ARCH_KEYS, path,
                        "set those model.* keys to the file's values (see its .json sidecar)")
    check_partial_sync_layout(file_partial_sync(meta), state.tp_size, state.partial_sync, path)
    named = list(module.named_parameters())
    places = {generator_key(n, cfg.model.depth): place_of(p, state) for n, p in named}
    shards, _ = read_export_shards(path, places)  # this rank's TP shards of its stage, nothing more
    with torch.no_grad():
        for n, p in named:
            p.copy_(shards[generator_key(n, cfg.model.depth)].view(p.shape))
    if dist.is_main():
        log.info("initialised all %d tensors of this stage from %s (step %s, %s weights)", len(shards), path,
                 meta.get("step", "?"), meta.get("weights", "?"))


def _expected_shapes(cfg: DictConfig) -> Dict[str, tuple]:
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in Generator.from_config(cfg.model).state_dict().items()}


def _warn_depth(timm_sd: Dict[str, torch.Tensor], depth: int, path: str) -> None:
    timm_depth = 1 + max(int(m.group(1)) for k in timm_sd if (m := re.match(r"^blocks\.(\d+)\.", k)))
    if timm_depth != depth and dist.is_main():
        log.warning("init_from_timm: %s has %d blocks, the model %d: %s", path, timm_depth, depth,
                    f"its blocks {depth}..{timm_depth - 1} are ignored" if timm_depth > depth
                    else f"model blocks {timm_depth}..{depth - 1} keep their initialisation")


def init_from_timm(module: torch.nn.Module, cfg: DictConfig, state: ParallelState) -> None:
    """Load the ViT blocks of ``trainer.init_from_timm`` into this rank's shard, logging what was
    loaded, what is missing (kept at initialisation) and what was ignored.

    Raises ``FileNotFoundError`` / ``ValueError`` naming the file, and on a shape mismatch the
    key and both shapes.
    """
    path, depth = cfg.trainer.init_from_timm, cfg.model.depth
    timm_sd = load_timm_state(path)
    blocks, unused = timm_block_state(timm_sd, depth, path)
    _warn_depth(timm_sd, depth, path)
    expected = _expected_shapes(cfg)
    unexpected: List[str] = unused + [k for k in blocks if k not in expected]
    loaded = {k: v for k, v in blocks.items() if k in expected}
    for k in expected:  # in model order, so the first mismatch is reported
        if k in loaded and tuple(loaded[k].shape) != expected[k]:
            raise ValueError(f"{path}: {k} has shape {tuple(loaded[k].shape)} but the model expects {expected[k]}")
    if not loaded:
        raise ValueError(f"{path}: no tensor matches a generator block parameter; check model.width/depth")
    load_full_state(module, loaded, state, depth, source=path, strict=False)
    if dist.is_main():
        missing = [k for k in expected if k not in loaded]
        log.info("init_from_timm %s: loaded %d tensors (%s ...); missing, kept at initialisation: %d (%s ...); "
                 "unexpected, ignored: %d (%s ...)", path, len(loaded), ", ".join(list(loaded)[:3]),
                 len(missing), ", ".join(missing[:3]), len(unexpected), ", ".join(unexpected[:3]))


def initialize_weights(module: torch.nn.Module, cfg: DictConfig, state: ParallelState) -> None:
    """``trainer.init_from`` or ``trainer.init_from_timm`` (whichever is set) into ``module``."""
    if cfg.trainer.init_from:
        init_from_export(module, cfg, state)
    elif cfg.trainer.init_from_timm:
        init_from_timm(module, cfg, state)



