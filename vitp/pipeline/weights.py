"""Full (unsharded, generator-keyed) weights to and from the shards of a pipeline.

Each rank of a ``tp x pp x dp`` layout holds its stage's layers, with TP-sharded tensors cut to
its slice. :func:`load_full_state` slices full tensors into this rank's parameters (nothing
gathers the whole model on one rank: checkpoints write each rank's share,
:mod:`vitp.checkpoint.sharded`, and sampling runs in the training layout, :mod:`vitp.eval.inference`). Keys follow :mod:`vitp.models.keys`.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from vitp.models import generator_key
from vitp.parallel import ParallelState, shard_like


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
