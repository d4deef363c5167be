"""DeepSpeed checkpoint loading without unpickling arbitrary objects.

DeepSpeed's torch checkpoint engine calls ``torch.load(weights_only=False)``, which runs any code
a crafted file carries. :func:`install_safe_loading` makes the engine load with
``torch.load(weights_only=True)``, DeepSpeed's three plain data classes allow-listed
(:func:`vitp.deepspeed_adapter.checkpoint_safe_globals`).
"""
from __future__ import annotations

from typing import Any

import torch

import vitp.deepspeed_adapter as ds


def safe_load(path: str, map_location=None) -> Any:
    """``torch.load(path, weights_only=True)`` with DeepSpeed's checkpoint classes allowed.

    Raises ``ValueError`` naming the file when it is truncated, corrupt or holds other objects.
    """
    try:
        with torch.serialization.safe_globals(ds.checkpoint_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise ValueError(f"checkpoint file {path} could not be loaded (truncated, corrupt, or holding "
                         f"objects other than tensors): {type(e).__name__}: {str(e)[:300]}") from e


def install_safe_loading(engine: Any) -> None:
    """Make ``engine.load_checkpoint`` read every file with :func:`safe_load` (DeepSpeed's own
    engine uses ``weights_only=False``). Raises ``ValueError`` when the engine does not use
    DeepSpeed's default torch checkpoint engine."""
    ds.replace_checkpoint_load(engine, safe_load)
