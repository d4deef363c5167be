"""``vitp-train``: Hydra config -> :func:`vitp.train.train`, under any launcher.

``vitp-train [overrides]`` (one process), ``torchrun --nproc_per_node N -m vitp.train [overrides]``,
``deepspeed --num_gpus N --module vitp.train [overrides]`` (its ``--local_rank`` is stripped),
``mpirun -np N python -m vitp.train [overrides]`` / ``srun`` (ranks from the launcher's variables,
:func:`vitp.parallel.distributed.launcher_env`), or SageMaker (:mod:`vitp.cli.sagemaker`). Every
rank uses the run directory rank 0 chose.
"""
from __future__ import annotations

import datetime
import logging
import os
import sys

import torch

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")  # albumentations checks PyPI at import otherwise
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed would warn and probe for accelerators

from omegaconf import DictConfig  # noqa: E402

from vitp.cli import run_cli  # noqa: E402
from vitp.config import register_configs  # noqa: E402
from vitp.parallel import distributed as dist  # noqa: E402
from vitp.train import train  # noqa: E402

log = logging.getLogger("vitp")


def default_run_dir(output_root: str = "outputs") -> str:
    """``<output_root>/<date>/<time>`` as chosen on rank 0 (every rank gets the same folder)."""
    return dist.broadcast_object(datetime.datetime.now().strftime(f"{output_root}/%Y-%m-%d/%H-%M-%S"))


def _hydra_entry() -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig

    register_configs()

    @hydra.main(version_base="1.3", config_path=_config_path(), config_name="config")
    def _main(cfg: DictConfig) -> None:
        hc = HydraConfig.get()  # returns normally after a SIGTERM save: exit 0
        run_cli("vitp-train", train, cfg, hc.runtime.output_dir, list(hc.overrides.task), log=log)

    _main()


def _config_path() -> str:
    """Absolute path of the shipped ``conf/`` folder (installed as the ``vitp.conf`` package)."""
    import importlib.resources

    return str(importlib.resources.files("vitp.conf"))


def prepare_argv(argv: list) -> list:
    """Launcher-independent argv for Hydra.

    Strips ``--local_rank``; takes the ranks of an MPI or srun launch from its variables; under a
    multi-process launcher it initialises the process group, pins one run directory for all ranks
    (chosen on rank 0) and keeps non-zero ranks from writing ``.hydra/`` and log files.
    Raises ``ValueError`` on an MPI launch across hosts without ``MASTER_ADDR``.
    """
    argv = dist.strip_launcher_args(argv)
    dist.adopt_launcher_env()  # before world_size(): an mpirun rank would otherwise train alone
    ours = []  # put before the user's arguments, so Hydra flags like --cfg job / --info stay last
    if not any(a.startswith("hydra.output_subdir=") for a in argv):
        ours.append("hydra.output_subdir=null")  # train() writes .hydra/ itself, after its checks pass
    if dist.world_size() > 1:
        device_arg = next((a.split("=", 1)[1] for a in argv if a.startswith("trainer.device=")), "auto")
        dist.init_distributed(dist.resolve_device(device_arg))
        if not any(a.startswith("hydra.run.dir=") for a in argv):
            root = next((a.split("=", 1)[1] for a in argv if a.startswith("paths.output_root=")), "outputs")
            ours.append(f"hydra.run.dir={default_run_dir(root)}")
        if not dist.is_main():
            ours.append("hydra/job_logging=stdout")
    return argv[:1] + ours + argv[1:]


def main() -> None:
    """Console entry point ``vitp-train``."""
    sys.argv = run_cli("vitp-train", prepare_argv, sys.argv)
    _hydra_entry()


if __name__ == "__main__":
    main()
