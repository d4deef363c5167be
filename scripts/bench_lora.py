"""A LoRA training step against a full fine-tuning step of the same Wan model in one process
(forward, backward, AdamW step), interleaved repetitions, median and spread of each.

    python scripts/bench_lora.py [--rank 32] [--reps 15] [--folder TINY_WAN_TRANSFORMER]

Default model: the tiny Wan of ``scripts/make_tiny_wan.py`` (built in memory), inputs shaped as
``experiment=wan_smoke``'s (2 samples of 3 latent frames of 8 x 8, 512 caption tokens). Prints one
JSON line: ``{"lora_s": [median, min, max], "full_s": [...], "ratio": median ratio}``. Timings
depend on the machine's load: run it when it is quiet and report the load seen.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def _tiny_wan():
    spec = importlib.util.spec_from_file_location("make_tiny_wan", Path(__file__).parent / "make_tiny_wan.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.tiny_transformer(0)


def _model(folder, lora_rank: int):
    """A vitp WanModel of the folder (or the tiny one), with rank-``lora_rank`` adapters on every
    linear of its blocks (0: none, every weight trained)."""
    import tempfile

    from vitp.models.lora import LoraSpec, apply_lora
    from vitp.models.wan_keys import from_pretrained

    if folder is None:
        with tempfile.TemporaryDirectory() as tmp:
            _tiny_wan().save_pretrained(tmp)
            model = from_pretrained(tmp, subfolder=None)
    else:
        model = from_pretrained(folder, subfolder=None)
    if lora_rank:
        targets = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")
        apply_lora(model, LoraSpec(rank=lora_rank, alpha=float(lora_rank), targets=targets))
    return model.train()


def _step(model, opt, inputs, target) -> float:
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    F.mse_loss(model(*inputs), target).backward()
    opt.step()
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--folder", default=None, help="a Wan transformer folder (default: the tiny one, in memory)")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    models = {"full": _model(a.folder, 0), "lora": _model(a.folder, a.rank)}
    opts = {k: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4) for k, m in models.items()}
    c = models["full"].config
    x = torch.randn(2, c.in_channels, 3, 8, 8)
    inputs = (x, torch.rand(2) * 1000, torch.randn(2, 512, c.text_dim))
    times = {k: [] for k in models}
    for i in range(a.reps + 2):  # interleaved; the first two rounds warm up
        for k in models:
            dt = _step(models[k], opts[k], inputs, torch.randn_like(x))
            if i >= 2:
                times[k].append(dt)
    out = {f"{k}_s": [statistics.median(v), min(v), max(v)] for k, v in times.items()}
    out["ratio"] = out["lora_s"][0] / out["full_s"][0]
    out.update(rank=a.rank, reps=a.reps, trainable={k: sum(p.numel() for p in m.parameters() if p.requires_grad)
                                                    for k, m in models.items()})
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
