"""Stopping a run cleanly on SIGTERM / SIGINT (schedulers, SageMaker spot interruptions, Ctrl-C)."""
from __future__ import annotations

import logging
import signal
import threading

import torch

from vitp.parallel import distributed as dist

log = logging.getLogger("vitp")


class StopSignal:
    """SIGTERM / SIGINT -> finish the current step, save a checkpoint, exit 0.

    Schedulers and SageMaker send SIGTERM before killing a job. A second signal aborts at once.
    :meth:`requested` is collective (one all-reduce), so every rank stops at the same step even
    when only some of them got the signal.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, device: torch.device):
        self.device, self.flag, self.previous = device, None, {}
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self.previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.flag is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping without a checkpoint")
        self.flag = signal.Signals(signum).name
        log.warning("%s received: finishing this step, then saving a checkpoint", self.flag)

    def requested(self, local: bool = False) -> bool:
        """True on every rank when any rank got a signal or passes ``local=True``."""
        mine = self.flag is not None or local
        if dist.world_size() == 1:
            return mine
        t = torch.tensor([1.0 if mine else 0.0], device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item())

    def restore(self) -> None:
        """Put back the signal handlers that were installed before."""
        for s, h in self.previous.items():
            signal.signal(s, h)
