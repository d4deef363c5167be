"""Device profiles: peak FLOP/s, memory and link bandwidths of one accelerator (or one CPU process).

GPU presets come from NVIDIA's datasheets (dense tensor-core peaks, i.e. without the 2:4
sparsity factor; SXM form factor; per-direction NVLink bandwidth is half the quoted
bidirectional figure; inter-node bandwidth is one 400 Gb/s (H100/H200, ConnectX-7 in DGX H100 /
H200) or 200 Gb/s (A100, HDR InfiniBand in DGX A100) NIC per GPU):

- H100 SXM5 80GB (NVIDIA H100 Tensor Core GPU datasheet): BF16 989 TFLOP/s, FP32 67 TFLOP/s,
  80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s.
- H200 SXM 141GB (NVIDIA H200 Tensor Core GPU datasheet): BF16 989 TFLOP/s, FP32 67 TFLOP/s,
  141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s.
- A100 SXM4 80GB (NVIDIA A100 Tensor Core GPU datasheet): BF16 312 TFLOP/s, FP32 19.5 TFLOP/s,
  80 GB HBM2e at 2,039 GB/s, NVLink 600 GB/s.

FP32 uses the non-tensor-core peak (PyTorch leaves TF32 matmuls off by default). The
``efficiency``, latency, per-layer overhead and reserve values are assumptions, stated per field.
The ``cpu`` profile is measured on this machine (:func:`measure_cpu_profile`) and cached; where
nothing may be measured, :func:`default_cpu_profile` assumes a slow core (its numbers are stated
at :data:`CPU_DEFAULT_FLOPS_PER_THREAD`).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Dict, Optional

from vitp.utils import atomic_write_text

GB = 1e9


@dataclass(frozen=True)
class DeviceProfile:
    """One device (GPU, or one CPU process of a multi-process run).

    ``peak_flops`` dense FLOP/s per precision; ``memory_gib`` capacity; ``mem_bw`` bytes/s of its
    memory; ``intra_bw`` / ``inter_bw`` bytes/s one device sends per direction inside a node /
    across nodes; ``efficiency`` the fraction of peak that training matmuls reach (assumption);
    ``latency_s`` per collective or send (``latency_by_group``: measured per group size);
    ``layer_overhead_s`` fixed time per layer and
    micro-batch for forward + backward (kernel launches, Python dispatch); ``reserve_gib`` memory
    the planner keeps free (CUDA context, allocator fragmentation); ``cores`` CPU cores shared by
    all processes (0 = one device per process, as on GPUs).
    """

    name: str
    kind: str  # "cuda" | "cpu"
    peak_flops: Dict[str, float]
    memory_gib: float
    mem_bw: float
    intra_bw: float
    inter_bw: float
    devices_per_node: int = 8
    efficiency: float = 0.6
    latency_s: float = 2e-5
    layer_overhead_s: float = 1e-4
    reserve_gib: float = 3.0
    cores: int = 0
    source: str = ""
    latency_by_group: Dict[int, float] = field(default_factory=dict)

    def latency(self, group: int) -> float:
        """Seconds per collective in a group of ``group`` ranks: the measured value of that size;
        above the largest measured size g (the ``cpu`` profile measures groups of 2 to
        :func:`link_processes`), g's latency times ``(group - 1) / (g - 1)``, the steps of a ring
        all-reduce (gloo's); else ``latency_s``."""
        if group in self.latency_by_group:
            return self.latency_by_group[group]
        top = max(self.latency_by_group, default=0)
        if group > top >= 2:
            return self.latency_by_group[top] * (group - 1) / (top - 1)
        return self.latency_s

    def peak(self, precision: str) -> float:
        """Peak FLOP/s for ``precision`` (fp32 | bf16)."""
        return self.peak_flops[precision]

    def as_dict(self) -> dict:
        return asdict(self)


# efficiency 0.6: Megatron-LM reports 41-57 % model FLOPs utilisation for whole training steps
# (Narayanan et al. 2021; Korthikanti et al. 2022); matmuls alone run somewhat closer to peak.
PRESETS: Dict[str, DeviceProfile] = {
    "h100": DeviceProfile("h100", "cuda", {"bf16": 989e12, "fp32": 67e12}, 80.0, 3.35e12, 450 * GB, 50 * GB,
                          source="NVIDIA H100 Tensor Core GPU datasheet (SXM5)"),
    "h200": DeviceProfile("h200", "cuda", {"bf16": 989e12, "fp32": 67e12}, 141.0, 4.8e12, 450 * GB, 50 * GB,
                          source="NVIDIA H200 Tensor Core GPU datasheet (SXM)"),
    "a100": DeviceProfile("a100", "cuda", {"bf16": 312e12, "fp32": 19.5e12}, 80.0, 2.039e12, 300 * GB, 25 * GB,
                          source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB)"),
}


def cuda_preset(device_name: str) -> Optional[DeviceProfile]:
    """The preset whose name appears in a CUDA device name (``"NVIDIA H100 80GB HBM3"`` -> h100)."""
    low = device_name.lower()
    return next((p for key, p in PRESETS.items() if key in low), None)


def _matmul_flops(dtype, size: int = 512, seconds: float = 0.3) -> float:
    """FLOP/s of repeated ``size^3`` matmuls in this process's threads (no RNG is drawn)."""
    import torch

    a = torch.linspace(-1, 1, size * size).reshape(size, size).to(dtype)
    b = a.t().contiguous()
    torch.mm(a, b)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        n += 1
    return 2.0 * size ** 3 * n / (time.perf_counter() - start)


def _layer_overhead(seconds: float = 0.3) -> float:
    """Seconds of forward + backward of a tiny block (8 wide, 1 token): dispatch, not arithmetic."""
    import torch

    from vitp.models import Block

    blk = Block(8, 2, grid=(1, 1, 1))
    x = torch.zeros(1, 1, 8, requires_grad=True)
    c = torch.zeros(1, 8, requires_grad=True)
    blk(x, c).sum().backward()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        blk(x, c).sum().backward()
        n += 1
    return (time.perf_counter() - start) / n


def _memcpy_bw(nbytes: int = 64 * 2**20) -> float:
    import torch

    a = torch.zeros(nbytes // 4)
    b = torch.empty_like(a)
    b.copy_(a)
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < 0.2:
        b.copy_(a)
        n += 1
    return 2.0 * nbytes * n / (time.perf_counter() - start)  # read + write


def _gloo_worker() -> None:
    """One process of :func:`_gloo_links` (``RANK``, ``WORLD_SIZE``, ``PORT`` in the environment):
    for each group size g from 2 to the world, the ranks of the ``world // g`` whole groups of g
    consecutive ranks all-reduce at once (the ``world % g`` last ranks wait at the barrier); prints,
    as JSON, the seconds per small (16 fp32) all-reduce for each g this rank took part in, and per
    4 MiB one for g = 2."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['PORT']}", rank=rank, world_size=world)
    out: Dict[str, object] = {"small": {}}
    for g in range(2, world + 1):
        groups = [dist.new_group(list(range(r, r + g))) for r in range(0, world - g + 1, g)]  # every rank, same order
        member = rank < len(groups) * g
        for label, numel, reps in (("small", 16, 100), ("large", 2**20, 10 if g == 2 else 0)):
            x = torch.zeros(numel)
            dist.barrier()
            if not (member and reps):
                continue
            start = time.perf_counter()
            for _ in range(reps):
                dist.all_reduce(x, group=groups[rank // g])
            if label == "small":
                out["small"][str(g)] = (time.perf_counter() - start) / reps
            else:
                out["large"] = (time.perf_counter() - start) / reps
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(out))


# Processes the ``cpu`` profile's link measurement starts at most (:func:`link_processes`): groups
# of 2 (the bandwidth, two pairs at once; pipeline sends), 3 (odd worlds) and 4. More would cost
# an interpreter each and, past the cores, measure mostly the scheduler. Larger groups' latency is
# scaled from the largest measured one (:meth:`DeviceProfile.latency`): on the 2-core VM here, 8
# processes measured 0.8, 9.8 and 25.9 ms per small all-reduce in groups of 2, 4 and 8; the 8-group
# scaled from the 4-group, 9.8 x 7 / 3 = 22.9 ms (short: the crowding of 8 processes on 2 cores
# is not in a 4-process measurement; 24 % short under a load average of 9).
LINK_PROCS_MAX = 4


def link_processes(procs: int) -> int:
    """Processes the link measurement starts for a run of ``procs`` processes: ``procs`` clamped
    to 2 .. :data:`LINK_PROCS_MAX` (a 1024-process plan does not start 1024 interpreters)."""
    return min(max(2, int(procs)), LINK_PROCS_MAX)


def _gloo_links(procs: int = 2) -> Dict[str, object]:
    """Latency (s, per group size 2 .. ``procs``) and bandwidth (bytes/s one rank sends, from 4 MiB
    all-reduces in pairs) of gloo all-reduces among ``procs`` (at least 2) local single-thread
    processes, all groups of a size at once (so with more processes than cores the latency includes
    waiting for descheduled peers, as in an oversubscribed run); medians over the ranks measured.
    Starts exactly ``procs`` processes: callers cap them (:func:`link_processes`).

    Raises ``RuntimeError`` when a worker fails.
    """
    import statistics
    import subprocess
    import sys

    from vitp.utils import free_port

    port = free_port()
    procs = max(2, procs)
    code = "from vitp.plan.devices import _gloo_worker; _gloo_worker()"
    workers = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(procs), PORT=str(port),
                                                    OMP_NUM_THREADS="1"))
               for r in range(procs)]
    results = [w.communicate(timeout=900) for w in workers]
    if any(w.returncode for w in workers):
        raise RuntimeError(f"gloo link measurement failed: {results[0][1][-2000:]}")
    outs = [json.loads(r[0].strip().splitlines()[-1]) for r in results]
    sizes = sorted({g for o in outs for g in o["small"]}, key=int)  # reported by its members, not the world % g last
    lat = {int(g): statistics.median(o["small"][g] for o in outs if g in o["small"]) for g in sizes}
    large = statistics.median(o["large"] for o in outs if "large" in o)
    return {"latency_s": lat[2], "latency_by_group": lat, "bw": 4 * 2**20 / max(large - lat[2], 1e-9)}


def measure_cpu_profile(threads: int = 1, links: bool = True, procs: int = 2) -> DeviceProfile:
    """Measure this machine as a ``cpu`` profile for processes of ``threads`` threads each (the
    launchers here give every rank one thread): fp32/bf16 matmul FLOP/s, memory copy bandwidth,
    per-layer dispatch time and, with ``links``, gloo all-reduce latency (s, groups of 2 ..
    :func:`link_processes` ``(procs)``) and bandwidth (bytes/s, pairs) among that many processes
    for a run of ``procs`` (a few seconds: fresh interpreters). Draws no random numbers.
    Raises ``RuntimeError`` when a link-measuring process fails."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        peak = {"fp32": _matmul_flops(torch.float32), "bf16": _matmul_flops(torch.bfloat16)}
        mem_bw, overhead = _memcpy_bw(), _layer_overhead()
    finally:
        torch.set_num_threads(before)
    link = _gloo_links(link_processes(procs)) if links else {"latency_s": 1e-4, "latency_by_group": {}, "bw": 1 * GB}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return DeviceProfile("cpu", "cpu", peak, round(memory, 1), mem_bw, link["bw"], link["bw"], devices_per_node=1024,
                         efficiency=1.0, latency_s=link["latency_s"], latency_by_group=link["latency_by_group"],
                         layer_overhead_s=overhead, reserve_gib=0.0, cores=cores,
                         source=_cpu_source(threads, links, procs))


def _cpu_source(threads: int, links: bool, procs: int) -> str:
    """How a ``cpu`` profile was measured: the processes the links were measured between
    (:func:`link_processes` of the run's ``procs``) only where links were (a single-process run
    measures none: "2 thread(s) per process", not "2 processes")."""
    return f"measured here ({threads} thread(s) per process" + (
        f", links between {link_processes(procs)} processes)" if links else ")")


def _cache_path() -> Path:
    root = os.environ.get("VITP_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "vitp")
    return Path(root) / "cpu_profile.json"


def _cache_key(threads: int, links: bool, procs: int) -> str:
    import socket

    import torch

    measured = link_processes(procs) if links else 0  # what is measured: runs of 4 and of 1024 processes share it
    return f"{socket.gethostname()}|{os.cpu_count()}|{torch.__version__}|{threads}|{int(links)}|{measured}"


def _read_cache() -> dict:
    path = _cache_path()
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):  # unreadable or not JSON: measured again (and rewritten) when asked
        return {}


def cached_cpu_profile(threads: int = 1, links: bool = True, procs: int = 2) -> Optional[DeviceProfile]:
    """The ``cpu`` profile :func:`cpu_profile` measured earlier for this key (host, core count,
    torch version, threads, processes measured: :func:`link_processes` of ``procs``), or ``None``:
    reads the cache, never measures."""
    entry = _read_cache().get(_cache_key(threads, links, procs))
    if entry is None:
        return None
    entry = dict(entry)
    entry["latency_by_group"] = {int(g): v for g, v in entry.get("latency_by_group", {}).items()}  # JSON keys
    entry["source"] = _cpu_source(threads, links, procs)  # caches written before it said "2 processes" always
    return DeviceProfile(**entry)


# The ``cpu`` profile assumed where none was measured (the start-up check, vitp.train.preflight,
# measures nothing): 50 GFLOP/s of fp32 (and bf16) matmul per thread, about what one AVX2 core with
# two FMA units sustains at 2.5-3 GHz (2 x 8 lanes x 2 FLOPs per cycle, less overhead); 10 GB/s of
# memory bandwidth per process; 1 ms of dispatch per layer; gloo at 1 GB/s and 0.1 ms. Slower than
# most machines measure (this 2-core VM: 80-170 GFLOP/s per thread), so a prediction made with it
# errs on the long side.
CPU_DEFAULT_FLOPS_PER_THREAD = 50e9


def default_cpu_profile(threads: int = 1) -> DeviceProfile:
    """The assumed ``cpu`` profile (see :data:`CPU_DEFAULT_FLOPS_PER_THREAD`) for processes of
    ``threads`` threads, with this machine's RAM and cores (read from the OS, nothing measured)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    flops = CPU_DEFAULT_FLOPS_PER_THREAD * max(1, threads)
    return DeviceProfile("cpu", "cpu", {"fp32": flops, "bf16": flops}, round(memory, 1), 10 * GB, 1 * GB, 1 * GB,
                         devices_per_node=1024, efficiency=1.0, latency_s=1e-4, layer_overhead_s=1e-3,
                         reserve_gib=0.0, cores=cores,
                         source=f"assumed, not measured ({threads} thread(s) per process; vitp-plan --device cpu "
                                f"measures this machine)")


def _measure_notice(threads: int, links: bool, procs: int) -> str:
    """The line said while :func:`cpu_profile` measures: what (for a run of ``procs`` processes),
    that it happens once, and the cache file."""
    link = ""
    if links:
        scaled = f"; groups over {LINK_PROCS_MAX} ranks scaled from them" if procs > LINK_PROCS_MAX else ""
        link = f"gloo links between {link_processes(procs)} processes{scaled}, "
    return (f"measuring this machine once ({link}matmul, memory copy and layer dispatch with {threads} thread(s) "
            f"per process; a few seconds), cached in {_cache_path()}")


def cpu_profile(threads: int = 1, remeasure: bool = False, links: bool = True, procs: int = 2,
                notify: Optional[Callable[[str], None]] = None) -> DeviceProfile:
    """The measured ``cpu`` profile, cached in ``$VITP_CACHE_DIR`` (or ``~/.cache/vitp``)
    ``/cpu_profile.json`` per host, core count, torch version, thread count and processes measured
    (:func:`link_processes` of the run's ``procs``). ``notify`` is called with
    :func:`_measure_notice` before a measurement (not on a cache hit). Raises ``RuntimeError``
    when a link-measuring process fails."""
    cached = None if remeasure else cached_cpu_profile(threads, links, procs)
    if cached is not None:
        return cached
    key, path, cache = _cache_key(threads, links, procs), _cache_path(), _read_cache()
    if notify is not None:
        notify(_measure_notice(threads, links, procs))
    prof = measure_cpu_profile(threads, links, procs)
    cache[key] = prof.as_dict()
    try:
        atomic_write_text(path, json.dumps(cache, indent=1))  # ranks measuring at once never see half a file
    except OSError:
        pass  # a read-only home: measure again next time
    return prof


def get_profile(name: str, memory_gib: Optional[float] = None, **cpu_kw) -> DeviceProfile:
    """A preset (``h100``, ``h200``, ``a100``) or the measured ``cpu`` profile, optionally with
    another memory capacity. Raises ``ValueError`` for an unknown name."""
    name = name.lower()
    if name == "cpu":
        prof = cpu_profile(**cpu_kw)
    elif name in PRESETS:
        prof = PRESETS[name]
    else:
        raise ValueError(f"unknown device profile {name!r}; use one of {sorted(PRESETS) + ['cpu']}")
    return prof if memory_gib is None else replace(prof, memory_gib=float(memory_gib))
