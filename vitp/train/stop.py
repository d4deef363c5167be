"""Stopping a run cleanly on SIGTERM / SIGINT (schedulers, SageMaker spot interruptions, Ctrl-C)."""
from __future__ import annotations

import logging
import signal
import threading
import time

import torch

from vitp.parallel import distributed as dist

log = logging.getLogger("vitp")


class StopSignal:
    """SIGTERM / SIGINT -> finish the current step, save a checkpoint, exit 0.

    Schedulers and SageMaker send SIGTERM before killing a job. A second signal, more than
    :attr:`REPEAT_S` seconds after the first, aborts at once (``KeyboardInterrupt``).
    :meth:`requested` is collective (one all-reduce), so every rank stops at the same step even
    when only some of them got the signal. DataLoader workers ignore both signals
    (:func:`vitp.data.loader.ignore_stop_signals`), so a signal to the whole process group
    reaches only this handler.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    # Ctrl-C or a signal to the process group reaches each rank, and torchrun / the deepspeed
    # launcher then forward their own copy to it within milliseconds: one request, not two.
    REPEAT_S = 2.0

    def __init__(self, device: torch.device):
        self.device, self.flag, self.previous, self.t_flag = device, None, {}, 0.0
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self.previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.flag is None:
            self.flag, self.t_flag = name, time.monotonic()
            log.warning("%s received: finishing this step, then saving a checkpoint (a second signal, %.0f s or more "
                        "later, aborts without one)", name, self.REPEAT_S)
        elif time.monotonic() - self.t_flag >= self.REPEAT_S:
            raise KeyboardInterrupt(f"second signal ({name}): stopping without a checkpoint")

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
