"""SageMaker entry script: ``entry_point="sagemaker_entry.py"`` in a source dir that also holds
``requirements.txt`` (a copy of ``scripts/sagemaker_requirements.txt``) and the vitp wheel.

The training toolkit installs the requirements, then runs this file (under torchrun on every host
with ``torch_distributed``); :func:`vitp.cli.sagemaker.main` maps the job's hyperparameters,
paths and channels to ``vitp-train`` overrides (see that module).
"""
from vitp.cli.sagemaker import main

if __name__ == "__main__":
    main()
