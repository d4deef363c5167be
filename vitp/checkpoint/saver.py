"""Writing sharded checkpoints, in the background: training goes on once every rank's pieces
are copied to host memory.

:meth:`CheckpointWriter.save` (collective) takes the staged pieces (:func:`.train_state.stage`:
CPU copies, the bounded host buffer: one checkpoint's share of this rank) and writes them as a
DCP checkpoint under ``step_NNNNNNN.partial/`` on a worker thread, over a gloo process group of
its own (torchtitan's ``async`` mode; ``dcp.async_save`` does the same after its own copy). The
completion record (``vitp_meta.json``), the rename and ``latest`` follow only once every rank's
files are durable in every folder that loads them (node-local folders: :mod:`.storage`), so a
crash or ``kill -9`` during the background write leaves the previous checkpoint as the latest.
At most one save is in flight: the next save, a stop and the end of the run wait for it
(:meth:`CheckpointWriter.wait`). ``trainer.checkpoint_async=false`` writes in the foreground.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from vitp.parallel import distributed as dist

from .storage import StorageGroups

log = logging.getLogger("vitp")


class CheckpointWriter:
    """Saves checkpoints of one checkpoints folder, at most one in flight.

    ``stats`` holds, per save, ``blocked_s`` (the training stall: waiting for the previous save,
    staging, submitting) and ``write_s`` (the background phase, until published)."""

    def __init__(self, ckpt_dir: Path, storage: StorageGroups, keep: int, asynchronous: bool = True,
                 compress: bool = False):
        self.dir, self.storage, self.keep, self.asynchronous = ckpt_dir, storage, keep, asynchronous
        self.compress = compress
        self.abandon_after: Optional[int] = None  # the step the run resumed from, until its first save
        self.group = None
        self._pending: Optional[Future] = None
        self.stats: List[Dict[str, float]] = []

    def _ensure_group(self) -> None:
        """A gloo group of every rank for the background collectives (collective: the first save
        makes it on every rank, in the main thread)."""
        if self.group is None and dist.world_size() > 1:
            self.group = torch.distributed.new_group(backend="gloo")

    def save(self, step: int, stage: Any, rng: Dict[str, Any], record: Dict[str, Any], t0: float,
             final: bool = False) -> None:
        """Write checkpoint ``step`` (collective). ``stage()`` returns this rank's staged pieces
        (called after the previous save finished, so one host buffer is alive at a time);
        ``record`` is the completion record's content; ``t0`` when the step's save began (for
        ``blocked_s``); ``final``: written in the foreground, and with node-local folders every
        data file also reaches rank 0's folder (the run's weights are written from there)."""
        from .training import write_checkpoint

        self.wait()
        self._ensure_group()
        staged = stage()
        args = dict(ckpt_dir=self.dir, step=step, staged=staged, rng=rng, record=record, storage=self.storage,
                    group=self.group, keep=self.keep, to_first=final and not self.storage.shared,
                    compress=self.compress, abandon_after=self.abandon_after)
        stat = {"step": step}

        def write():
            write_checkpoint(**args)
            self.abandon_after = None  # moved once the first new checkpoint is complete

        if final or not self.asynchronous:
            write()
            stat["blocked_s"] = time.perf_counter() - t0
            stat["write_s"] = 0.0
            self.stats.append(stat)
            if dist.is_main():
                log.info("checkpoint step %d published: training waited %.2f s (written in the foreground)", step,
                         stat["blocked_s"])
            return
        start = time.perf_counter()
        stat["blocked_s"] = start - t0

        def run():
            write()
            stat["write_s"] = time.perf_counter() - start
            if dist.is_main():
                log.info("checkpoint step %d published: training waited %.2f s (staging), written in %.2f s in the "
                         "background", step, stat["blocked_s"], stat["write_s"])

        self._pending, self._thread = _start_daemon(run, f"vitp-ckpt-{step}")
        self.stats.append(stat)

    def wait(self) -> None:
        """Block until the save in flight (if any) is published; re-raises its error."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            try:
                pending.result()
            finally:
                self._thread.join()  # gone before the interpreter exits: torch aborts on a live one

    def close(self, timeout: float = 120.0) -> None:
        """At the end of a run, also after an error: wait up to ``timeout`` seconds for a save still
        in flight (the process would abort on exit with its thread alive); one that does not finish
        (a rank died) is left to die with the process, its ``step_N.partial`` unpublished."""
        if self._pending is None:
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("checkpoint save still running after %.0f s at exit: left unpublished", timeout)
            return
        try:
            self.wait()
        except Exception as e:  # the run is ending on another error: report this one, raise that
            log.warning("the checkpoint in flight failed: %s", e)


def _start_daemon(fn, name: str) -> Tuple[Future, threading.Thread]:
    """Run ``fn()`` on a new daemon thread (it does not hold the process open after an error, as a
    pool's worker would); returns the future of its result or error, and the thread."""
    fut: Future = Future()

    def body():
        try:
            fut.set_result(fn())
        except BaseException as e:  # re-raised by wait() on the main thread
            fut.set_exception(e)

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    return fut, thread
