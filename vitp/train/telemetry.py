"""Performance metrics of a run, logged with the training scalars (``metrics.jsonl``, TensorBoard).

Per logged step, over the steps since the previous log:

- ``perf/tokens_per_s``: the tokens of those steps / wall time, each step counted at its own
  shape and global batch (``data.resolution`` and ``trainer.global_batch_size``, or with
  ``data.buckets`` the bucket the step drew: its grid, frames and ``batch_size``);
- ``perf/tflops``: achieved model TFLOP/s per device (:func:`vitp.plan.model_flops_per_step` of
  each step's shape and batch, recomputation not counted) = model FLOPs / time / world size;
- ``perf/mfu``: ``perf/tflops`` over the device profile's peak for the run's precision (a CUDA
  device named like a preset, :data:`vitp.plan.PRESETS`; on CPU the matmul rate measured here
  with the rank's threads, :func:`vitp.plan.cpu_profile`, so CPU MFU is relative to that
  measurement); absent when no profile matches. Never above 1: when a step achieves more than
  that peak (a CPU profile measured, or cached, while another job loaded the machine), the CPU
  peak is measured again and the peak becomes the larger of that and the achieved rate, with a
  warning, and from then on ``perf/mfu_peak_raised`` = 1 flags the rows;
- ``perf/peak_mem_gib``: the largest peak over ranks: ``torch.cuda.max_memory_allocated`` on
  CUDA, the process's maximum resident set size (``ru_maxrss``, everything the process holds) on CPU;
- ``perf/data_wait_frac``: time spent waiting for the next batch / wall time (largest over ranks;
  only the first and last pipeline stages read data);
- ``data/skipped_samples``: training samples skipped so far because they failed to decode, by the
  loader of this run's process and its DataLoader workers (largest over ranks; each skip is also a
  warning naming the sample, :class:`vitp.data.base.FileDataset`);
- ``comm/tp_bytes``: ring bytes per step one rank sent in TP collectives, counted as they run
  (:class:`vitp.parallel.CommCounter`; largest over ranks);
- ``comm/cp_bytes``: the same for the context-parallel collectives (tags ``cp`` and
  ``cp_boundary``: attention all-to-alls or ring steps, the gathered prediction; 0 at cp = 1),
  which :func:`vitp.plan.step_comm` predicts as ``cp_bytes``;
- ``comm/pp_bytes``, ``comm/dp_bytes``: bytes per step the busiest rank sends between pipeline
  stages (activations and their gradients; with buckets the mean over the logged steps' shapes
  and micro-batch sizes) and in ZeRO-1's gradient reduction + parameter all-gather (ring volume),
  from the layout (:func:`vitp.plan.step_comm`).

Nothing here draws random numbers or adds a device synchronisation: the step already ends with
``loss.item()``; the one all-reduce runs on logged steps only, next to the loss-per-t reduction.
"""
from __future__ import annotations

import contextlib
import logging
import resource
import time
from dataclasses import dataclass, replace
from typing import Any, Dict, Iterator, Optional

import torch

from vitp.parallel import CommCounter
from vitp.parallel import distributed as dist
from vitp.plan.comm import CP_TAGS  # over the context-parallel group

log = logging.getLogger("vitp")

TP_TAGS = ("tp", "cond", "sp_boundary", "param_grad", "head")  # training collectives (not "export")


class TimedIterator:
    """Wraps an iterator and adds the seconds spent in ``next`` to :attr:`wait_s`."""

    def __init__(self, it: Iterator):
        self.it, self.wait_s = it, 0.0

    def __iter__(self) -> "TimedIterator":
        return self

    def __next__(self):
        start = time.perf_counter()
        try:
            return next(self.it)
        finally:
            self.wait_s += time.perf_counter() - start


def _profile(device: torch.device, precision: str):
    """The device profile's peak FLOP/s for ``precision`` and its name, or ``(None, reason)``."""
    from vitp.plan import cpu_profile, cuda_preset

    if device.type == "cuda":
        prof = cuda_preset(torch.cuda.get_device_name(device))
        return (prof.peak(precision), prof.name) if prof else (None, "no preset for this GPU")
    if not dist.is_main():
        return None, ""
    with torch.random.fork_rng(devices=[]):  # the measurement builds a layer: keep the run's RNG as it was
        prof = cpu_profile(threads=torch.get_num_threads(), links=False)
    return prof.peak(precision), f"cpu, {prof.source}"


def peak_memory_gib(device: torch.device) -> float:
    """This process's peak memory in GiB (2**30 bytes): the CUDA allocator peak on CUDA, the max
    resident set size (everything the process holds) on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


@dataclass(frozen=True)
class StepCount:
    """What one optimizer step of one shape counts: ``tokens`` (global batch x tokens per sample),
    model ``flops`` (:func:`vitp.plan.model_flops_per_step`) and ``pp_bytes`` (pipeline bytes of
    the busiest rank, :func:`vitp.plan.step_comm`)."""

    tokens: float
    flops: float
    pp_bytes: float


def step_counts(cfg: Any, lay: Any) -> Dict[Optional[int], StepCount]:
    """:class:`StepCount` of a step at ``data.resolution`` with ``trainer.global_batch_size`` (key
    ``None``) and, with ``data.buckets``, of a step drawn in bucket ``i`` (key ``i``: the bucket's
    (H, W), frames and global batch, micro-batches of ``batch_size / (accumulation x dp)``).
    ``lay`` is the run's :class:`vitp.plan.LayoutSpec`."""
    from vitp.config import format_resolution
    from vitp.data.buckets import buckets_of
    from vitp.plan import model_flops_per_step, step_comm
    from vitp.plan.shapes import ModelShape
    from vitp.utils import to_dict

    def count(model: dict, shape_lay: Any) -> StepCount:
        batch = shape_lay.global_batch
        return StepCount(batch * ModelShape.from_config(model).tokens, model_flops_per_step(model, batch),
                         max(c.pp_bytes for c in step_comm(model, shape_lay)))

    model = to_dict(cfg.model)
    out: Dict[Optional[int], StepCount] = {None: count(model, lay)}
    for i, b in enumerate(buckets_of(cfg.data) if cfg.data.buckets else []):
        micro = b.batch_size // (lay.accum * lay.dp)
        shape = {"image_size": format_resolution(b.size), "num_frames": b.frames}  # "HxW": hashable for the caches
        out[i] = count({**model, **shape}, replace(lay, micro=micro))
    return out


class Telemetry:
    """Counts what :mod:`this module <vitp.train.telemetry>` reports; :meth:`count_step` after every
    optimizer step, :meth:`metrics` on every rank at each logged step (collective)."""

    def __init__(self, cfg: Any, layout: Any, device: torch.device):
        from vitp.data.buckets import buckets_of
        from vitp.plan import layout_of, step_comm
        from vitp.utils import to_dict

        lay = layout_of(cfg, layout.tp * layout.cp * layout.pp * layout.dp, device.type)
        self.device, self.world = device, lay.world
        self.counts = step_counts(cfg, lay)
        self.flops_per_step, self.tokens_per_step = self.counts[None].flops, self.counts[None].tokens
        self.dp_bytes = max(c.dp_bytes for c in step_comm(to_dict(cfg.model), lay))
        self._steps, self._tokens, self._flops, self._pp = 0, 0.0, 0.0, 0.0
        self.peak_flops, source = _profile(device, lay.precision)
        self.precision, self.peak_raised = lay.precision, False
        self.counter, self.cp_counter = CommCounter(TP_TAGS), CommCounter(CP_TAGS)
        self.data: Optional[TimedIterator] = None
        self.skipped: Any = None  # shared counter of undecodable samples (vitp.data.base.attach_skip_counter)
        if dist.is_main():
            names = [b.name for b in buckets_of(cfg.data)] if cfg.data.buckets else []
            per = ", ".join(f"{self.counts[k].flops / 1e12:.4g} model TFLOP and {self.counts[k].tokens:.0f} tokens "
                            f"per step" + (f" ({names[k]})" if k is not None else "")
                            for k in [k for k in self.counts if k is not None] or [None])
            log.info("telemetry: %s; MFU against %s; peak memory = %s", per,
                     f"{self.peak_flops / 1e12:.4g} TFLOP/s ({source})" if self.peak_flops else f"nothing ({source})",
                     "CUDA max_memory_allocated" if device.type == "cuda" else "process max RSS")

    def _raise_peak(self, achieved: float) -> None:
        """A step achieved more FLOP/s than the peak MFU is taken against (a CPU profile measured
        while another job loaded the machine, or cached from then): on CPU measure the peak again;
        the new peak is the larger of that and ``achieved``, so MFU stays <= 1; says so once per raise."""
        from vitp.plan import cpu_profile

        old, again = self.peak_flops, None
        if self.device.type == "cpu":
            with torch.random.fork_rng(devices=[]):
                again = cpu_profile(threads=torch.get_num_threads(), remeasure=True, links=False).peak(self.precision)
        self.peak_flops, self.peak_raised = max(achieved, again or 0.0), True
        if dist.is_main():
            measured = f"measured again: {again / 1e12:.4g} TFLOP/s" if again else "not measurable here"
            log.warning("perf/mfu: the steps achieved %.4g TFLOP/s per device, above the peak MFU was taken against "
                        "(%.4g TFLOP/s: a profile measured while the machine was busy, or a wrong preset); %s; MFU "
                        "is now relative to %.4g TFLOP/s, and metrics.jsonl flags it (perf/mfu_peak_raised=1)",
                        achieved / 1e12, old / 1e12, measured, self.peak_flops / 1e12)

    def timed(self, it: Optional[Iterator]) -> Optional[TimedIterator]:
        """``it`` wrapped to time the waits for data (``None`` stays ``None``)."""
        self.data = TimedIterator(it) if it is not None else None
        return self.data

    def start(self) -> None:
        """Start counting TP and context-parallel collectives (until :meth:`stop`)."""
        self.counter.__enter__()
        self.cp_counter.__enter__()
        self.counting = True

    def stop(self) -> None:
        self.cp_counter.__exit__(None, None, None)
        self.counter.__exit__(None, None, None)
        self.counting = False

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Sampling and evaluation between steps: their collectives are not a step's, so they are
        not counted in ``comm/*``."""
        was = getattr(self, "counting", False)
        if was:
            self.stop()
        try:
            yield
        finally:
            if was:
                self.start()

    def count_step(self, bucket: Optional[int] = None) -> None:
        """Count one optimizer step of bucket ``bucket`` (``None``: ``data.resolution`` and
        ``trainer.global_batch_size``). Raises ``KeyError`` for a bucket the config lacks."""
        c = self.counts[bucket]
        self._steps += 1
        self._tokens += c.tokens
        self._flops += c.flops
        self._pp += c.pp_bytes

    def metrics(self, steps: int, elapsed_s: float) -> Dict[str, float]:
        """The ``perf/*`` and ``comm/*`` values of the ``steps`` steps of the last ``elapsed_s``
        seconds (those not counted by :meth:`count_step` count at ``data.resolution``); resets the
        counters. Collective (an all-reduce over all ranks)."""
        wait = self.data.wait_s if self.data is not None else 0.0
        skipped = self.skipped.value if self.skipped is not None else 0
        local = torch.tensor([peak_memory_gib(self.device), wait / elapsed_s, self.counter.wire / steps,
                              self.cp_counter.wire / steps, skipped], dtype=torch.float64, device=self.device)
        if dist.world_size() > 1:
            torch.distributed.all_reduce(local, op=torch.distributed.ReduceOp.MAX)
        mem, wait_frac, tp, cp, skipped = local.tolist()
        rest, base = max(0, steps - self._steps), self.counts[None]
        tokens, flops = self._tokens + rest * base.tokens, self._flops + rest * base.flops
        tflops = flops / elapsed_s / self.world / 1e12
        out = {"perf/tokens_per_s": tokens / elapsed_s, "perf/tflops": tflops,
               "perf/peak_mem_gib": mem, "perf/data_wait_frac": wait_frac, "comm/tp_bytes": tp,
               "comm/cp_bytes": cp,
               "comm/pp_bytes": (self._pp + rest * base.pp_bytes) / max(steps, self._steps, 1),
               "comm/dp_bytes": self.dp_bytes, "data/skipped_samples": skipped}
        if self.peak_flops:
            if tflops * 1e12 > self.peak_flops:  # the peak was measured too low: never log a utilisation above 1
                self._raise_peak(tflops * 1e12)
            out["perf/mfu"] = tflops * 1e12 / self.peak_flops
            if self.peak_raised:
                out["perf/mfu_peak_raised"] = 1.0
        self.counter.reset()
        self.cp_counter.reset()
        self._steps, self._tokens, self._flops, self._pp = 0, 0.0, 0.0, 0.0
        if self.data is not None:
            self.data.wait_s = 0.0
        return out
