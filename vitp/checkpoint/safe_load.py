"""DeepSpeed checkpoint loading without unpickling arbitrary objects.

DeepSpeed's torch checkpoint engine calls ``torch.load(weights_only=False)``, which runs any code
a crafted file carries. :func:`install_safe_loading` swaps in an engine whose loads use
``torch.load(weights_only=True)`` with DeepSpeed's three plain data classes allow-listed.
"""
from __future__ import annotations

from typing import Any

import torch


def _deepspeed_safe_globals() -> list:
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def install_safe_loading(engine: Any) -> None:
    """Make ``engine.load_checkpoint`` read every file with ``torch.load(weights_only=True)``
    (DeepSpeed's own engine uses ``weights_only=False``), naming the file on failure."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class SafeCheckpointEngine(TorchCheckpointEngine):
        """DeepSpeed's torch checkpoint engine with ``weights_only=True`` loads."""

        def load(self, path: str, map_location=None):
            try:
                with torch.serialization.safe_globals(_deepspeed_safe_globals()):
                    return torch.load(path, map_location=map_location, weights_only=True)
            except Exception as e:
                raise ValueError(f"checkpoint file {path} could not be loaded (truncated, corrupt, or holding "
                                 f"objects other than tensors): {type(e).__name__}: {str(e)[:300]}") from e

    if type(engine.checkpoint_engine) is not TorchCheckpointEngine:
        raise ValueError(f"unexpected DeepSpeed checkpoint engine {type(engine.checkpoint_engine).__name__}; "
                         f"vitp needs the default torch engine")
    safe = SafeCheckpointEngine.__new__(SafeCheckpointEngine)
    safe.__dict__.update(engine.checkpoint_engine.__dict__)
    engine.checkpoint_engine = safe
