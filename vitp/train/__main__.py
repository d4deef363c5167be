"""``python -m vitp.train`` (what ``torchrun -m`` and ``deepspeed --module`` run): ``vitp-train``."""
from vitp.cli.train import main

if __name__ == "__main__":
    main()
