"""Random-number rules for tensor and sequence parallelism.

- Dropout / drop-path on **replicated** activations (and drop-path in sequence-parallel regions,
  which drops whole samples) must draw the same mask on every TP rank: they use the default
  torch generator, seeded identically on the ranks of a TP group.
- Dropout on **sharded** activations (attention probabilities of local heads, hidden units of a
  column-parallel MLP, tokens of a sequence-parallel region) must differ per TP rank: it runs
  inside :meth:`RNGStatesTracker.fork`, which swaps in a separate generator state seeded by
  ``(seed, tp_rank, dp_rank, pp_rank)``.
- Every stream differs across DP ranks (and pipeline stages).

Modelled on Megatron-Core ``tensor_parallel/random.py`` (``CudaRNGStatesTracker``,
``model_parallel_cuda_manual_seed``), extended to CPU: the state swapped is the CPU generator's
for CPU tensors and the CUDA generator's of that device for CUDA tensors.

Activation checkpointing must replay the forked stream on recomputation (torch's own checkpoint
restores only the default generators): :func:`checkpoint_activations` does, so dropout on sharded
activations draws the same masks in the forward pass and in the recompute.
"""
from __future__ import annotations

import contextlib
import hashlib
import random as _pyrandom
from typing import Dict, Iterator, Optional

import numpy as np
import torch

TP_RNG = "tensor-parallel-rng"


def _mix(*parts) -> int:
    """Deterministic 63-bit seed from the given parts (no accidental overlaps like ``seed + rank``)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _device_key(device: Optional[torch.device]) -> str:
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    if device.type != "cpu":
        raise ValueError(f"RNG tracker supports cpu and cuda tensors, not {device.type}")
    return "cpu"


def _get_state(key: str) -> torch.Tensor:
    return torch.get_rng_state() if key == "cpu" else torch.cuda.get_rng_state(key)


def _set_state(key: str, state: torch.Tensor) -> None:
    if key == "cpu":
        torch.set_rng_state(state)
    else:
        torch.cuda.set_rng_state(state, key)


def _fresh_state(key: str, seed: int) -> torch.Tensor:
    return torch.Generator(device=key).manual_seed(seed).get_state()


class RNGStatesTracker:
    """Named RNG streams that can be swapped in for the default generator.

    Each name has a seed; its state per device (``"cpu"``, ``"cuda:0"``, ...) is created lazily
    on the first :meth:`fork` on that device.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every stream."""
        self.seeds: Dict[str, int] = {}
        self.states: Dict[str, Dict[str, torch.Tensor]] = {}

    def add(self, name: str, seed: int) -> None:
        """Register stream ``name``. Raises ``ValueError`` if the name or the seed is taken."""
        if name in self.seeds:
            raise ValueError(f"RNG stream {name!r} already exists")
        if seed in self.seeds.values():
            raise ValueError(f"seed {seed} already used by another RNG stream")
        self.seeds[name], self.states[name] = seed, {}

    def get_states(self) -> Dict[str, Dict[str, torch.Tensor]]:
        """Copy of all stream states (for checkpointing / recomputation)."""
        return {n: {k: s.clone() for k, s in d.items()} for n, d in self.states.items()}

    def set_states(self, states: Dict[str, Dict[str, torch.Tensor]]) -> None:
        """Restore stream states taken by :meth:`get_states`."""
        self.states = {n: {k: s.clone() for k, s in d.items()} for n, d in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = TP_RNG, device: Optional[torch.device] = None) -> Iterator[None]:
        """Run the body with stream ``name`` as the default generator of ``device`` (CPU if None).

        Raises ``KeyError`` if ``name`` was never added (call :func:`model_parallel_seed`).
        """
        if name not in self.seeds:
            raise KeyError(f"RNG stream {name!r} is not set; call vitp.parallel.model_parallel_seed(seed, state)")
        key = _device_key(device)
        states = self.states[name]
        if key not in states:
            states[key] = _fresh_state(key, self.seeds[name])
        saved = _get_state(key)
        _set_state(key, states[key])
        try:
            yield
        finally:
            states[key] = _get_state(key)
            _set_state(key, saved)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker used by :mod:`vitp.parallel` layers."""
    return _TRACKER


def sharded_fork(p: float, training: bool, device: torch.device, tp_size: int):
    """Context for dropout with probability ``p`` on TP-sharded activations: the TP stream when
    it will draw random numbers on a TP group of more than one rank, else a no-op (so eval and
    ``p == 0`` touch no RNG state).

    Raises ``KeyError`` (on entering) if :func:`model_parallel_seed` was not called.
    """
    if p > 0 and training and tp_size > 1:
        return _TRACKER.fork(TP_RNG, device)
    return contextlib.nullcontext()


def model_parallel_seed(seed: int, state) -> Dict[str, int]:
    """Seed the default generators (python, numpy, torch CPU and CUDA) by ``(seed, dp, pp)`` and
    the tracker's TP stream by ``(seed, dp, pp, tp)``.

    Call **after** building the model (initialisation uses its own per-layer seeds). Returns the
    seeds used: ``{"default": ..., "tensor_parallel": ...}``.
    """
    default = _mix("default", int(seed), state.dp_rank, state.pp_rank)
    tp_seed = _mix("tensor-parallel", int(seed), state.dp_rank, state.pp_rank, state.tp_rank)
    _pyrandom.seed(default)
    np.random.seed(default % 2**32)
    torch.manual_seed(default)
    _TRACKER.reset()
    _TRACKER.add(TP_RNG, tp_seed)
    return {"default": default, "tensor_parallel": tp_seed}


def checkpoint_activations(function, *args):
    """Non-reentrant activation checkpoint of ``function(*args)`` that also replays the TP RNG
    stream on recomputation (torch restores only the default generators), so dropout inside
    the tensor-parallel region draws the same masks in the forward pass and in the recompute
    (Megatron-Core ``tensor_parallel/random.py`` ``CheckpointFunction`` does the same with its
    CUDA RNG tracker). Non-reentrant, so stages whose inputs need no grad still work.
    """
    import torch.utils.checkpoint

    snapshot = _TRACKER.get_states()
    calls = [0]

    def run(*a):
        calls[0] += 1
        if calls[0] == 1:
            return function(*a)
        current = _TRACKER.get_states()
        _TRACKER.set_states(snapshot)
        try:
            return function(*a)
        finally:
            _TRACKER.set_states(current)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)
