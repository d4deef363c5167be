"""``python -m vitp.train`` (what ``torchrun -m`` and ``deepspeed --module`` run): ``vitp-train``."""
from vitp.cli.entry import train

if __name__ == "__main__":
    train()  # vitp.interrupt is installed by vitp/__init__.py for -m vitp.train
