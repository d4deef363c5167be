"""Process groups for every launcher: none (single process), torchrun, deepspeed, SageMaker,
MPI (``mpirun`` of OpenMPI, MPICH or Intel MPI; SageMaker's MPI distribution) and Slurm ``srun``.

- ``deepspeed`` (and ``torch.distributed.launch``) append ``--local_rank=N`` to argv, which
  Hydra rejects: :func:`strip_launcher_args` removes it and exports ``LOCAL_RANK``.
- MPI launchers and ``srun`` name the rank in their own variables (``OMPI_COMM_WORLD_RANK``,
  ``PMI_RANK``, ``SLURM_PROCID``): :func:`adopt_launcher_env` maps them to torch's ``env://``
  variables before anything reads the world size, so no rank mistakes itself for a 1-process run.
- Without a launcher we fill in a 1-rank environment on 127.0.0.1 so DeepSpeed does not try
  MPI discovery.
- On CPU, DeepSpeed's communication backend JIT-compiles a shared-memory op (~50 s) that only
  inference collectives use; we mark it unavailable so start-up takes well under a second.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import zlib
from pathlib import Path
from typing import Dict, List, Mapping, NamedTuple, Optional, Tuple

import torch

from vitp.utils import free_port

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


class _Launcher(NamedTuple):
    name: str
    rank: str  # the variables that hold the global rank, world size, local rank, local world size
    size: str
    local_rank: str
    local_size: Optional[str]
    job: Tuple[Tuple[str, ...], ...]  # alternatives, each variables that together name the launch


# First full match wins. SLURM_STEP_NUM_TASKS is set by srun only, not in an sbatch script (whose
# SLURM_NTASKS would make a lone process wait for ranks that never start). Job ids come from the
# launcher itself only: under mpirun in a Slurm job, SLURM_STEP_ID differs between the ranks
# mpirun started itself and those its srun-started daemons did.
_LAUNCHERS = (
    _Launcher("OpenMPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
              "OMPI_COMM_WORLD_LOCAL_SIZE", (("OMPI_MCA_ess_base_jobid",), ("PMIX_NAMESPACE",))),
    _Launcher("MPICH/Intel MPI (PMI)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", ()),
    _Launcher("Slurm srun", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", None,
              (("SLURM_JOB_ID", "SLURM_STEP_ID"),)),
)
DEFAULT_PORT = 29500  # torch's default; a launch with a job id uses 29500 + crc32(id) % 1000


def _int_var(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"environment variable {name}={env[name]!r} is not an integer") from None


def _local_size(env: Mapping[str, str], launcher: _Launcher, world: int) -> Optional[int]:
    """Ranks on this host, ``None`` when unknown. srun: all of them on one node, else the count of
    a uniform ``SLURM_STEP_TASKS_PER_NODE`` such as ``4(x2)``."""
    if launcher.local_size:
        return _int_var(env, launcher.local_size) if launcher.local_size in env else None
    if env.get("SLURM_STEP_NUM_NODES") == "1":
        return world
    m = re.fullmatch(r"(\d+)(?:\(x\d+\))?", env.get("SLURM_STEP_TASKS_PER_NODE", ""))
    return int(m.group(1)) if m else None


def _master_addr(env: Mapping[str, str], launcher: str, world: int, local_size: Optional[int]) -> str:
    """``MASTER_ADDR`` as given; 127.0.0.1 when every rank is on this host; SageMaker's first
    host (where its ``mpirun`` places rank 0). Raises ``ValueError`` for other multi-host launches."""
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    if world == 1 or local_size == world:
        return "127.0.0.1"
    if env.get("SM_MASTER_ADDR"):
        return env["SM_MASTER_ADDR"]
    try:
        hosts = json.loads(env.get("SM_HOSTS") or "[]")
    except json.JSONDecodeError:
        raise ValueError(f"SM_HOSTS={env['SM_HOSTS']!r} is not a JSON list of host names") from None
    if hosts:
        return hosts[0]  # sagemaker-training's master host is hosts[0]; mpirun fills hosts in order
    on_host = "an unknown number" if local_size is None else str(local_size)
    raise ValueError(
        f"launched by {launcher} with {world} ranks, {on_host} of them on this host, but MASTER_ADDR is not set: "
        f"an MPI launch has no rendezvous address. Give every rank the host of rank 0, e.g. mpirun -x "
        f"MASTER_ADDR=<first host> -x MASTER_PORT={DEFAULT_PORT} ... (Slurm: export "
        f"MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1))")


def _master_port(env: Mapping[str, str], launcher: _Launcher) -> str:
    if env.get("MASTER_PORT"):
        return env["MASTER_PORT"]
    for names in launcher.job:  # ORTE-based mpirun sets OMPI_MCA_ess_base_jobid, PMIx-based PMIX_NAMESPACE
        if all(env.get(k) for k in names):
            job = ".".join(env[k] for k in names)
            return str(DEFAULT_PORT + zlib.crc32(job.encode()) % 1000)
    return str(DEFAULT_PORT)


def _find_launcher(env: Mapping[str, str]) -> Optional[_Launcher]:
    """The first launcher whose rank, world size and local rank (or ``LOCAL_RANK``) are all set.
    Raises ``ValueError`` when one names rank and world size but no local rank."""
    partial = None
    for launcher in _LAUNCHERS:
        if launcher.rank in env and launcher.size in env:
            if launcher.local_rank in env or "LOCAL_RANK" in env:
                return launcher
            partial = partial or launcher
    if partial:
        raise ValueError(f"launched by {partial.name} ({partial.rank}={env[partial.rank]}) but "
                         f"{partial.local_rank} is not set: export LOCAL_RANK (the rank on this host)")
    return None


def launcher_env(env: Mapping[str, str]) -> Dict[str, str]:
    """The ``env://`` variables an MPI or srun launch implies (pure: reads ``env`` only).

    Returns ``{}`` when ``env`` already has ``RANK`` and ``WORLD_SIZE`` (torchrun, deepspeed,
    SageMaker's torch_distributed) or names no launcher; else ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``, ``LOCAL_WORLD_SIZE`` when known, and ``MASTER_PORT`` when
    ``WORLD_SIZE > 1``: as given, else 29500, or 29500 + (crc32 of the launch's job id) % 1000
    when the launcher names one (MPI has no rendezvous: ranks must agree without talking).
    ``MASTER_ADDR``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` already in ``env`` are kept.

    Sources, first match wins: OpenMPI ``OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}``;
    MPICH / Intel MPI ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``;
    Slurm ``srun`` ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``.

    Raises ``ValueError`` on non-integer or out-of-range values, a missing local rank, and a
    multi-host launch without ``MASTER_ADDR`` (outside SageMaker, whose host list names rank 0's).
    """
    if "RANK" in env and "WORLD_SIZE" in env:
        return {}
    launcher = _find_launcher(env)
    if launcher is None:
        return {}
    rank, world = _int_var(env, launcher.rank), _int_var(env, launcher.size)
    local = _int_var(env, "LOCAL_RANK" if "LOCAL_RANK" in env else launcher.local_rank)
    local_size = _local_size(env, launcher, world)
    if not (0 <= rank < world and 0 <= local < (local_size or world)):
        raise ValueError(f"launched by {launcher.name} as rank {rank} (local {local}) of {world} ranks "
                         f"({'?' if local_size is None else local_size} on this host): out of range")
    out = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
           "MASTER_ADDR": _master_addr(env, launcher.name, world, local_size)}
    if local_size is not None:
        out["LOCAL_WORLD_SIZE"] = env.get("LOCAL_WORLD_SIZE", str(local_size))
    if world > 1:
        out["MASTER_PORT"] = _master_port(env, launcher)
    return out


def adopt_launcher_env() -> Dict[str, str]:
    """Apply :func:`launcher_env` to ``os.environ`` (idempotent); returns what it set.

    Call before reading the world size: an MPI rank without it would train alone as dp=1.
    """
    found = launcher_env(os.environ)
    os.environ.update(found)
    return found


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


def _group_env() -> None:
    """The environment ``env://`` initialisation reads: the launcher's (mpirun / srun mapped by
    :func:`adopt_launcher_env`), else a 1-rank group on a free local port."""
    adopt_launcher_env()  # mpirun / srun ranks, if called without prepare_argv
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if os.environ["WORLD_SIZE"] == "1":
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's agent hosts the store on its MASTER_PORT
            os.environ.setdefault("MASTER_PORT", str(free_port()))
        else:  # this process hosts its own 1-rank store: any free port. An inherited MASTER_PORT may be
            # busy (SageMaker's PyTorch container sets 7777 for every job, a restarted one included)
            os.environ["MASTER_PORT"] = str(free_port())
    os.environ.setdefault("LOCAL_RANK", "0")


def init_distributed(device: Optional[torch.device] = None, timeout_s: int = 1800) -> None:
    """Initialise ``torch.distributed`` through DeepSpeed (gloo on CPU, NCCL on CUDA), a rank
    waiting at most ``timeout_s`` in a collective (:func:`timeout_of` of a run config).

    Idempotent. Works without a launcher (a 1-rank group on a free local port, also when the
    environment holds a ``MASTER_PORT`` that may be busy, unless torchrun's agent hosts the store)
    and under MPI or srun (:func:`adopt_launcher_env`). Raises ``ValueError`` as :func:`launcher_env` does.
    """
    import vitp.deepspeed_adapter as ds

    deepspeed = ds.import_deepspeed()

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    device = device or resolve_device("auto")
    _group_env()
    if device.type == "cpu":
        ds.disable_shm_comm_op()  # training does not use it; its first build takes ~50 s
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


def init_process_group(device: torch.device, timeout_s: int = 1800) -> None:
    """A bare ``torch.distributed`` group of the launched ranks (gloo on CPU, NCCL on CUDA; the
    launcher's ``MASTER_ADDR`` / ``MASTER_PORT``, :func:`adopt_launcher_env`), without DeepSpeed's
    import or its communication layer: for ranks whose only collectives are plain torch ones (the
    data-parallel replicas of :func:`vitp.eval.launch.build_replica`); a 1-rank group without a
    launcher, as :func:`init_distributed` makes it. On CPU without
    ``OMP_NUM_THREADS`` each rank takes its share of the cores, as :func:`init_distributed` does.
    Idempotent."""
    if torch.distributed.is_initialized():
        return
    _group_env()
    if device.type == "cpu":
        if "OMP_NUM_THREADS" not in os.environ:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))
    else:
        torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                         timeout=datetime.timedelta(seconds=timeout_s))


def timeout_of(cfg) -> int:
    """Seconds of the process group's timeout for a run config: ``trainer.dist_timeout_minutes``.
    Raises ``ValueError`` when it is not positive."""
    minutes = float(cfg.trainer.dist_timeout_minutes)
    if not minutes > 0:
        raise ValueError(f"trainer.dist_timeout_minutes={minutes} must be > 0 (how long a rank waits in a collective "
                         "before the job fails; default 30)")
    return int(round(minutes * 60))


def rank() -> int:
    """Global rank (0 when torch.distributed is not initialised)."""
    d = torch.distributed
    return d.get_rank() if d.is_available() and d.is_initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    """World size (from the environment before initialisation)."""
    d = torch.distributed
    return d.get_world_size() if d.is_available() and d.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def broadcast_object(obj, group=None):
    """Rank 0's ``obj`` on every rank (of ``group``, one spanning every rank)."""
    if world_size() == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0, group=group)
    return box[0]


def gather_objects(obj, group=None) -> list:
    """Every rank's ``obj``, in rank order, on every rank (of ``group``, one spanning every rank)."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    torch.distributed.all_gather_object(out, obj, group=group)
    return out


def is_main() -> bool:
    """True on global rank 0, the only rank that writes logs and files."""
    return rank() == 0


def p2p_device(group=None) -> torch.device:
    """Where tensors for point-to-point calls of ``group`` (default: the default process group)
    must live: the current CUDA device under NCCL, else the CPU (gloo)."""
    if torch.distributed.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


FILE_CHUNK = 64 << 20  # bytes per message of send_file / recv_file


def send_file(path: Path, dst: int, size: int, chunk: int = FILE_CHUNK, group=None) -> None:
    """Send the first ``size`` bytes of ``path`` to rank ``dst`` (which calls :func:`recv_file`
    with the same ``size``), as uint8 tensors of at most ``chunk`` bytes on :func:`p2p_device`.
    Raises ``ValueError`` naming the file when it holds fewer than ``size`` bytes."""
    device = p2p_device(group)
    with open(path, "rb") as f:
        left = size
        while left:
            data = f.read(min(chunk, left))
            if not data:
                raise ValueError(f"{path} holds {size - left} bytes, {size} expected: it changed while being sent")
            torch.distributed.send(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device), dst,
                                   group=group)
            left -= len(data)


def recv_file(path: Path, src: int, size: int, chunk: int = FILE_CHUNK, group=None) -> None:
    """Receive ``size`` bytes from rank ``src`` (:func:`send_file`) into ``path``: written under
    ``<path>.recv``, flushed to disk, then renamed, so ``path`` is never half a file."""
    device = p2p_device(group)
    tmp = Path(f"{path}.recv")
    with open(tmp, "wb") as f:
        left = size
        while left:
            buf = torch.empty(min(chunk, left), dtype=torch.uint8, device=device)
            torch.distributed.recv(buf, src, group=group)
            f.write(buf.cpu().numpy().tobytes())
            left -= buf.numel()
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def barrier(group=None) -> None:
    """Wait for every rank (of ``group``; nothing without an initialised process group)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier(group=group)
