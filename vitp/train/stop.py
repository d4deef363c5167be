"""Stopping a run cleanly on SIGTERM / SIGINT (schedulers, SageMaker spot interruptions, Ctrl-C)."""
from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Optional

import torch

from vitp import interrupt
from vitp.parallel import distributed as dist

log = logging.getLogger("vitp")


class StopSignal:
    """SIGTERM / SIGINT -> finish the current step, save a checkpoint, exit ``128 + signal``
    (130 for SIGINT, 143 for SIGTERM: :func:`exit_status`; 0 under ``vitp-sagemaker``).

    Schedulers and SageMaker send SIGTERM before killing a job. A second signal, more than
    :attr:`REPEAT_S` seconds after the first, aborts at once (``KeyboardInterrupt``). A SIGINT
    during start-up stops the command before this is made (:mod:`vitp.interrupt`; raised here if
    a library swallowed its ``KeyboardInterrupt``).
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
        self.agreed: Optional[str] = None  # the signal any rank got, as :meth:`requested` last found it
        self.doing = "finishing this step, then saving a checkpoint"  # what a signal does now (the trainer sets it)
        self.final_saved = False  # the final checkpoint and weights are written: a second signal loses nothing
        interrupt.raise_if_swallowed()  # a Ctrl-C during start-up that a library's bare except caught
        interrupt.training_started()
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self.previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.flag is None:
            self.flag, self.t_flag = name, time.monotonic()
            log.warning("%s received: %s (a second signal, %.0f s or more later, %s)", name, self.doing, self.REPEAT_S,
                        "stops at once" if self.final_saved else "aborts without one")
        elif time.monotonic() - self.t_flag >= self.REPEAT_S:
            raise KeyboardInterrupt(f"second signal ({name}): stopping without a checkpoint")

    def requested(self, local: bool = False) -> bool:
        """True on every rank when any rank got a signal or passes ``local=True``; sets
        :attr:`agreed` to the name of a signal any rank got (SIGTERM over SIGINT), else ``None``."""
        mine = float(signal.Signals[self.flag]) if self.flag is not None else 0.5 if local else 0.0
        if dist.world_size() > 1:
            t = torch.tensor([mine], device=self.device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            mine = float(t.item())
        self.agreed = signal.Signals(int(mine)).name if mine >= 1 else None
        return mine > 0

    def restore(self) -> None:
        """Put back the signal handlers that were installed before."""
        for s, h in self.previous.items():
            signal.signal(s, h)


def exit_status(signal_name: Optional[str]) -> int:
    """The exit status of a run a signal stopped (after its checkpoint): ``128 + signal number`` by
    the shell's convention (130 for SIGINT, 143 for SIGTERM), so ``vitp-train ... && next`` does not
    go on with an unfinished run; 0 without a signal (finished, or ``trainer.exit_at_step`` /
    ``trainer.exit_after_minutes``: stops on purpose)."""
    return 128 + int(signal.Signals[signal_name]) if signal_name else 0
