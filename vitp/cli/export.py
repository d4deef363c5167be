"""``vitp-export``: one consolidated safetensors file from a vitp run or checkpoint.

The file holds full (unsharded) fp32 tensors, the ViT blocks under timm's names and layouts and
the model config (metadata + ``.json`` sidecar); see :mod:`vitp.checkpoint.export`. It loads into
any ``(tp, pp)`` with ``trainer.init_from=FILE``, samples with ``vitp-sample FILE``, and its blocks
load into a stock timm ViT.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import List, Optional

from omegaconf import OmegaConf

from vitp import checkpoint as ckpt
from vitp.cli import run_cli


def run(argv: Optional[List[str]] = None) -> Path:
    """``vitp-export SOURCE [-o OUT.safetensors] [--weights ema|raw]``; returns the written path."""
    p = argparse.ArgumentParser(prog="vitp-export", description=__doc__.splitlines()[0])
    p.add_argument("source", type=Path, help="run directory (its latest checkpoint), checkpoints folder, "
                                             "checkpoint tag folder, or a vitp .safetensors file")
    p.add_argument("-o", "--out", type=Path, default=None,
                   help="output file (default: <run dir>/export/<step>_<weights>.safetensors)")
    p.add_argument("--weights", choices=["ema", "raw"], default="ema", help="EMA (for sampling) or raw weights")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    a = p.parse_args(argv)
    src, step, run_dir = ckpt.resolve_weights(a.source, a.weights)
    state, meta = ckpt.read_export(src)
    if step is None:
        step = int(meta.get("step", -1))
    out = a.out or run_dir / "export" / f"{ckpt.tag_name(max(step, 0))}_{a.weights}.safetensors"
    if out.suffix != ".safetensors":
        p.error(f"--out {out}: use a .safetensors file name")
    if out.resolve() == src.resolve():
        p.error(f"--out {out} is the source file; choose another name")
    if out.exists() and not a.force:
        p.error(f"{out} exists; choose another --out or pass --force to replace it")
    cfg = OmegaConf.create(json.loads(meta["vitp_config"]))
    ckpt.save_export(out, state, cfg, step=step, weights=a.weights)
    n = sum(v.numel() for v in state.values())
    print(f"wrote {out} ({len(state)} tensors, {n / 1e6:.3f}M parameters, step {step}, {a.weights} weights) "
          f"and {out.with_suffix('.json')}")
    ps = ckpt.export.partial_sync_of(cfg.get("parallel"))
    if ps["p"] < 1:
        print(f"note: parallel.partial_sync={ps['p']} at tp={ps['tp']} ({ps['scale']}): "
              f"{ckpt.export.PARTIAL_SYNC_NOTE}")
    return out


def main(argv: Optional[List[str]] = None) -> None:
    """Console entry point; bad input exits with a one-line message (status 2)."""
    run_cli("vitp-export", run, argv)


if __name__ == "__main__":
    main()
