"""SageMaker training-job entry: hyperparameters and channels -> Hydra overrides.

SageMaker runs the entry script under torchrun on every host when the estimator has
``distribution={"torch_distributed": {"enabled": True}}``. Hyperparameters arrive as JSON in
``SM_HPS`` (and duplicated as ``--key value`` argv pairs, which we ignore inside a job). Paths:
``/opt/ml/checkpoints`` is the run directory (synced to ``checkpoint_s3_uri``, so a restarted
job finds it), TensorBoard events go to ``/opt/ml/output/tensorboard``, final weights and
``eval.json`` are copied to ``SM_MODEL_DIR``, and the ``train`` channel becomes ``data.root``.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Dict, List, Mapping


def _value(v) -> str:
    return json.dumps(v) if isinstance(v, (list, dict, bool)) or v is None else str(v)


def sagemaker_overrides(env: Mapping[str, str]) -> List[str]:
    """Hydra overrides for a SageMaker job described by ``env`` (``os.environ``).

    ``SM_HPS='{"experiment": "img256", "trainer.max_steps": 1000}'`` -> ``["experiment=img256",
    "trainer.max_steps=1000", ...]`` plus the job's paths. Raises ``ValueError`` on malformed
    ``SM_HPS``.
    """
    try:
        hps: Dict = json.loads(env.get("SM_HPS", "{}") or "{}")
    except json.JSONDecodeError as e:
        raise ValueError(f"SM_HPS is not valid JSON ({e}); pass hyperparameters as a dict of strings/numbers") from e
    out = [f"{k}={_value(v)}" for k, v in hps.items()]
    keys = set(hps)
    defaults = {
        "hydra.run.dir": env.get("VITP_SM_RUN_DIR", "/opt/ml/checkpoints/run"),
        "trainer.tensorboard_dir": env.get("VITP_SM_TENSORBOARD_DIR", "/opt/ml/output/tensorboard"),
        "trainer.export_dir": env.get("SM_MODEL_DIR", "/opt/ml/model"),
    }
    if "SM_CHANNEL_TRAIN" in env:
        defaults["data.root"] = env["SM_CHANNEL_TRAIN"]
    out += [f"{k}={v}" for k, v in defaults.items() if k not in keys]
    return out


def main() -> None:
    """Entry point ``vitp-sagemaker`` (use it as the estimator's entry script)."""
    from vitp.cli.train import main as train_main

    argv = sys.argv[:1] if "SM_TRAINING_ENV" in os.environ else list(sys.argv)
    sys.argv = argv + sagemaker_overrides(os.environ)
    train_main()


if __name__ == "__main__":
    main()
