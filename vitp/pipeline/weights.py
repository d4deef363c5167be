"""Full (unsharded, generator-keyed) weights to and from the shards of a pipeline.

Each rank of a ``tp x pp x dp`` layout holds its stage's layers, with TP-sharded tensors cut to
its slice. :func:`gather_full_state` rebuilds the whole model's tensors on rank 0 (TP all-gather
per stage, then the stages' pieces to rank 0); :func:`load_full_state` slices full tensors into
this rank's parameters. Keys follow :mod:`vitp.models.keys`.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from vitp.models import generator_key, pipeline_to_generator
from vitp.parallel import ParallelState, full_weight, shard_like
from vitp.parallel import distributed as dist


def gather_full_state(module: torch.nn.Module, tensors: Dict[str, torch.Tensor], state: ParallelState,
                      depth: int) -> Dict[str, torch.Tensor]:
    """Full generator-keyed CPU tensors of ``tensors`` (pipeline names of ``module``'s parameters,
    laid out like them, e.g. the parameters themselves or their EMA) on rank 0; ``{}`` elsewhere.

    Collective: every rank calls it (TP all-gather, then a gather of the stages to rank 0).
    """
    named = dict(module.named_parameters())
    local = {n: full_weight(named[n], state, tensor=v).cpu() for n, v in tensors.items()}
    if state.pp_size > 1:
        parts = [None] * dist.world_size() if dist.is_main() else None
        send = local if state.tp_rank == 0 and state.dp_rank == 0 and state.cp_rank == 0 else {}
        torch.distributed.gather_object(send, parts, dst=0)
        local = {k: v for part in (parts or []) for k, v in part.items()}
    return pipeline_to_generator(local, depth) if dist.is_main() else {}


def full_shape(param: torch.Tensor, state: ParallelState) -> Tuple[int, ...]:
    """Shape of the full (unsharded) tensor of a possibly TP-sharded parameter."""
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False) and state.tp_size > 1:
        shape[param.partition_dim] *= state.tp_size
    return tuple(shape)


def load_full_state(module: torch.nn.Module, full: Dict[str, torch.Tensor], state: ParallelState, depth: int, *,
                    source: str, strict: bool = True) -> Dict[str, List[str]]:
    """Copy generator-keyed full tensors into this rank's (stage, TP shard) parameters.

    Returns ``{"loaded": [...], "missing": [...]}`` (generator keys of this rank's parameters).
    Raises ``ValueError`` naming ``source``, the key and both shapes on a shape mismatch, and,
    with ``strict``, naming the missing keys.
    """
    loaded, missing = [], []
    with torch.no_grad():
        for name, p in module.named_parameters():
            key = generator_key(name, depth)
            if key not in full:
                missing.append(key)
                continue
            want = full_shape(p, state)
            if tuple(full[key].shape) != want:
                raise ValueError(f"{source}: {key} has shape {tuple(full[key].shape)} but the model expects {want}")
            p.copy_(shard_like(p, full[key].to(p.dtype), state))
            loaded.append(key)
    if strict and missing:
        raise ValueError(f"{source} lacks {len(missing)} tensors of this model, e.g. {missing[:4]}: "
                         f"it was written for another model config")
    return {"loaded": loaded, "missing": missing}
