"""Rank-side checks of context parallelism (``vitp.parallel.context``) in float64: the
generator sharded over ``tp x cp`` (with and without sequence parallelism, Ulysses and ring)
equals the unsharded model in output, loss and every gradient.

A cp rank's parameter gradients come from its own tokens (times cp, see
:func:`vitp.parallel.mappings.gather_from_context_region`); training sums them over dp x cp and
divides by dp x cp, which :func:`reduce_over_cp` does here.
"""
from __future__ import annotations

import copy

import torch

from .tp_workers import build, compare

# (tp, cp, sequence_parallel, cp_mode) per process group
MODELS = ("default", "cp_video_full", "cp_video_factorized", "text", "cp_video_text")
CP2_LAYOUTS = [(1, 2, False, "ulysses"), (1, 2, False, "ring")]
CP4_LAYOUTS = [(1, 4, False, "ulysses"), (1, 4, False, "ring"), (2, 2, False, "ulysses"), (2, 2, False, "ring"),
               (2, 2, True, "ulysses"), (2, 2, True, "ring")]


def cp_key(model: str, tp: int, cp: int, sp: bool, mode: str) -> str:
    return f"cp/{model}/tp={tp}/cp={cp}/sp={sp}/{mode}"


def reduce_over_cp(state):
    """Sum every gradient over the cp group and divide by cp (the dp x cp reduction at dp = 1)."""
    def run(model):
        for p in model.parameters():
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad, group=state.cp_group)
                p.grad /= state.cp_size
    return run


def cp_parity(cfgs: dict, layouts) -> dict:
    """``{cp_key: compare(...)}`` for every model of :data:`MODELS` at every layout."""
    from vitp.models import parallelize_generator, token_grid
    from vitp.parallel import make_state

    out = {}
    world = torch.distributed.get_world_size()
    for tp, cp, sp, mode in layouts:
        state = make_state(tp=tp, cp=cp, dp=world // (tp * cp), sequence_parallel=sp, cp_mode=mode)
        for name in MODELS:
            cfg = cfgs[name]
            model, inputs, w = build("gen", cfg)
            ref = copy.deepcopy(model)
            grid = token_grid(cfg["image_size"], cfg["num_frames"], cfg["patch_size"], cfg["tubelet_size"])
            parallelize_generator(model, state, grid=grid)
            out[cp_key(name, tp, cp, sp, mode)] = compare(ref, model, state, inputs, w,
                                                          after_backward=reduce_over_cp(state))
    return out
