"""Training: :class:`Trainer` (build, ``train_step``, ``fit``) and its components: the DeepSpeed
engine set-up (:mod:`.engine`), checkpoints (:mod:`.checkpointer`), EMA (:mod:`.ema`), metrics and
TensorBoard (:mod:`.logger`), clean stops on signals (:mod:`.stop`).

``python -m vitp.train`` (or ``vitp-train``) is the command-line entry (:mod:`vitp.cli.train`).
"""
from .trainer import Trainer, check_config, train, write_run_config

__all__ = ["Trainer", "check_config", "train", "write_run_config"]
