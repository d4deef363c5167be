"""Process groups for every launcher: none (single process), torchrun, deepspeed, SageMaker.

- ``deepspeed`` (and ``torch.distributed.launch``) append ``--local_rank=N`` to argv, which
  Hydra rejects: :func:`strip_launcher_args` removes it and exports ``LOCAL_RANK``.
- Without a launcher we fill in a 1-rank environment on 127.0.0.1 so DeepSpeed does not try
  MPI discovery.
- On CPU, DeepSpeed's communication backend JIT-compiles a shared-memory op (~50 s) that only
  inference collectives use; we mark it unavailable so start-up takes well under a second.
"""
from __future__ import annotations

import datetime
import os
import re
import socket
from typing import List, Optional

import torch

_LOCAL_RANK = re.compile(r"^--local[_-]rank(?:=(\d+))?$")


def strip_launcher_args(argv: List[str]) -> List[str]:
    """Remove ``--local_rank=N`` / ``--local-rank N`` from ``argv``, exporting ``LOCAL_RANK``.

    Returns the new argv (``argv[0]`` kept).
    """
    out, i = [argv[0]], 1
    while i < len(argv):
        m = _LOCAL_RANK.match(argv[i])
        if m:
            value = m.group(1)
            if value is None and i + 1 < len(argv) and argv[i + 1].isdigit():
                value, i = argv[i + 1], i + 1
            if value is not None:
                os.environ.setdefault("LOCAL_RANK", value)
        else:
            out.append(argv[i])
        i += 1
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` -> ``cuda:LOCAL_RANK`` when CUDA is available, else CPU.

    Raises ``ValueError`` when ``cuda`` is requested but unavailable.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device cuda requested (trainer.device / --device) but CUDA is not available; use auto or cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if device != "cpu":
        raise ValueError(f"trainer.device={device!r}; use auto, cpu or cuda")
    return torch.device("cpu")


def init_distributed(device: Optional[torch.device] = None, timeout_s: int = 1800) -> None:
    """Initialise ``torch.distributed`` through DeepSpeed (gloo on CPU, NCCL on CUDA).

    Idempotent. Works without a launcher (a 1-rank group on a free local port).
    """
    import deepspeed
    import deepspeed.ops

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    device = device or resolve_device("auto")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("LOCAL_RANK", "0")
    if device.type == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        if "OMP_NUM_THREADS" not in os.environ:
            # N ranks on one host each spinning up all cores' threads run many times slower
            local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))
    else:
        torch.cuda.set_device(device)
    deepspeed.init_distributed(
        dist_backend="nccl" if device.type == "cuda" else "gloo",
        auto_mpi_discovery=False,
        verbose=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def rank() -> int:
    """Global rank (0 when torch.distributed is not initialised)."""
    d = torch.distributed
    return d.get_rank() if d.is_available() and d.is_initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    """World size (from the environment before initialisation)."""
    d = torch.distributed
    return d.get_world_size() if d.is_available() and d.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def broadcast_object(obj):
    """Rank 0's ``obj`` on every rank."""
    if world_size() == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def is_main() -> bool:
    """True on global rank 0, the only rank that writes logs and files."""
    return rank() == 0
