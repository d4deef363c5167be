"""Console entry points that stop on Ctrl-C during start-up in one line (:mod:`vitp.interrupt`).

The command's module (torch, DeepSpeed, Hydra: seconds of imports) is imported after SIGINT is
handled, so a Ctrl-C at any moment before the first training step ends the command with
``<prog>: stopped by SIGINT during start-up, before the first step: nothing was trained`` on
stderr and exit status 130 (the shell's 128 + SIGINT), no traceback. From the first step on,
``vitp-train`` stops at the end of the step with a checkpoint (:mod:`vitp.train.stop`).
"""
from __future__ import annotations

import importlib
import signal
import sys

from vitp import interrupt

EXIT_SIGINT = 128 + signal.SIGINT  # the shell's status for a command Ctrl-C stopped


def run(prog: str, module: str) -> None:
    """Install the start-up SIGINT handler, then run ``module.main()``; a ``KeyboardInterrupt``
    that reaches here is reported in one line and exits 130."""
    interrupt.install(prog)
    try:
        importlib.import_module(module).main()
    except KeyboardInterrupt as e:
        interrupt.clear()
        print(interrupt.line(prog, e), file=sys.stderr, flush=True)
        raise SystemExit(EXIT_SIGINT) from None
    except SystemExit:
        _close_process_group()
        raise


def _close_process_group() -> None:
    """Take down a process group a refused launch leaves before the interpreter exits: torn down
    by the interpreter's own exit, rank 0's store could abort the process ("terminate called without
    an active exception", exit -6 instead of 2) while another rank still held a connection."""
    torch_dist = sys.modules.get("torch.distributed")
    if torch_dist is not None and torch_dist.is_available() and torch_dist.is_initialized():
        try:
            torch_dist.destroy_process_group()
        except Exception:  # exiting anyway: the exit status says what happened
            pass


def train() -> None:
    """``vitp-train`` (:mod:`vitp.cli.train`)."""
    run("vitp-train", "vitp.cli.train")
