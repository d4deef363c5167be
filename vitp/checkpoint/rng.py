"""Every RNG stream of a process as tensors and plain containers (loadable with ``weights_only``)."""
from __future__ import annotations

import random
from typing import Any, Dict

import numpy as np
import torch

from vitp.parallel import get_rng_tracker


def rng_state() -> Dict[str, Any]:
    """Every RNG stream of this process as tensors / plain containers (``weights_only``-loadable)."""
    py = random.getstate()
    np_state = np.random.get_state()
    out = {
        "torch": torch.get_rng_state(),
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]), int(np_state[3]),
                  float(np_state[4])],
        "tracker": get_rng_tracker().get_states(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_state(s: Dict[str, Any]) -> None:
    """Inverse of :func:`rng_state`."""
    torch.set_rng_state(s["torch"])
    random.setstate((s["python"][0], tuple(s["python"][1]), s["python"][2]))
    n = s["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), n[2], n[3], n[4]))
    get_rng_tracker().set_states(s["tracker"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state(s["cuda"])
