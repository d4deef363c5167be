"""Checkpoints and weight files: crash-safe training checkpoints (:mod:`.training`) in which
every rank saves and loads only its own pieces (:mod:`.sharded`, :mod:`.train_state`), written
in the background (:mod:`.saver`) and resumed exactly at the same or another layout (the earlier
full-tensor format: :mod:`.reshard`); the export layout loadable at any layout and by timm
(:mod:`.export`), starting from existing weights (:mod:`.initialize`, :mod:`.timm`), RNG state
(:mod:`.rng`) and node-local checkpoint folders (:mod:`.storage`)."""
from .export import (
    ARCH_KEYS,
    FORMAT,
    RESUME_KEYS,
    check_model_matches,
    generator_from_state,
    load_generator,
    read_export,
    save_export,
    save_weights,
)
from .timm import load_timm_state, timm_block_state
from .training import (
    ABANDONED,
    KILL_HOOK,
    LATEST,
    META,
    check_resumable,
    find_checkpoint,
    latest_meta,
    layout_text,
    load_rng,
    published_tags,
    resolve_weights,
    restart_advice,
    run_of_checkpoint,
    write_checkpoint,
    tag_name,
    tag_problem,
    truncate_log,
    verify_checkpoint,
)

__all__ = [
    "ABANDONED", "ARCH_KEYS", "FORMAT", "KILL_HOOK", "LATEST", "META", "RESUME_KEYS", "check_model_matches", "check_resumable",
    "find_checkpoint", "generator_from_state", "resolve_weights", "restart_advice", "run_of_checkpoint", "load_generator", "latest_meta",
    "layout_text",
    "load_timm_state", "load_rng", "published_tags", "read_export", "save_export",
    "save_weights", "write_checkpoint", "tag_name", "tag_problem",
    "timm_block_state", "truncate_log", "verify_checkpoint",
]
