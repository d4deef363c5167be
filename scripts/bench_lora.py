"""A LoRA training step against a full fine-tuning step of the same Wan model in one process
(forward, backward, AdamW step), interleaved repetitions, median and spread of each.

    python scripts/bench_lora.py [--rank 32] [--reps 15] [--width 512 --heads 4 --ffn 1536 --layers 8]
    python scripts/bench_lora.py --folder WAN_TRANSFORMER_FOLDER

Default model: ``scripts/make_tiny_wan.py``'s Wan (built in memory) widened to ``--width`` 512 (4
heads of 128), ``--ffn`` 1536, ``--layers`` 8: 31.6M parameters, the base of
``scripts/bench_lora_memory.py``. Why not the tiny folder itself (width 32, 2 layers, 38.8k
parameters): there rank-32 adapters on its linears (45.1k parameters) outnumber the base's, and a
step is mostly per-operation overhead, so LoRA is not cheaper (one round: 0.96x wall). At width
512 the adapters (3.1M) are 11 % of the weights they adapt and the matmuls dominate, as in a real
fine-tuning. Refuses (``AssertionError``) a LoRA step that leaves a gradient on a frozen base
weight. Inputs shaped as ``experiment=wan_smoke``'s (2 samples of 3 latent frames of 8 x 8, 512
caption tokens). Adapters (rank ``--rank``, alpha = rank) on both attentions' q, k, v,
out and the MLP's two linears. Prints one JSON line: ``{"lora_s": [median, min, max], "full_s":
[...], "ratio": median ratio, "ratio_spread": [min, max] of the per-round ratios, "trainable"}``,
and the same of this process's CPU time (``lora_cpu_s``, ``cpu_ratio``, ...: a loaded machine
stretches wall times by waits, not CPU times; use ``OMP_NUM_THREADS=1`` for it to mean work).
Timings depend on the machine's load: run it when it is quiet and report the load seen.
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


SIZES = dict(width=512, heads=4, ffn=1536, layers=8)  # 31.6M parameters (module docstring)


def _tiny_wan(width: int, heads: int, ffn: int, layers: int):
    spec = importlib.util.spec_from_file_location("make_tiny_wan", Path(__file__).parent / "make_tiny_wan.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.tiny_transformer(0, num_attention_heads=heads, attention_head_dim=width // heads, ffn_dim=ffn,
                                num_layers=layers)


def _model(folder, lora_rank: int, sizes: dict):
    """A vitp WanModel of the folder (or :func:`_tiny_wan` of ``sizes``), with rank-``lora_rank``
    adapters on every linear of its blocks (0: none, every weight trained)."""
    import tempfile

    from vitp.models.lora import LoraSpec, apply_lora
    from vitp.models.wan_keys import from_pretrained

    if folder is None:
        with tempfile.TemporaryDirectory() as tmp:
            _tiny_wan(**sizes).save_pretrained(tmp)
            model = from_pretrained(tmp, subfolder=None)
    else:
        model = from_pretrained(folder, subfolder=None)
    if lora_rank:
        targets = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")
        apply_lora(model, LoraSpec(rank=lora_rank, alpha=float(lora_rank), targets=targets))
    return model.train()


def _step(model, opt, inputs, target) -> tuple:
    """One training step: ``(wall seconds, this process's CPU seconds)``."""
    t0, c0 = time.perf_counter(), time.process_time()
    opt.zero_grad(set_to_none=True)
    F.mse_loss(model(*inputs), target).backward()
    opt.step()
    dt = (time.perf_counter() - t0, time.process_time() - c0)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    assert not frozen, f"frozen base weights got gradients: {frozen[:3]}"
    return dt


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--folder", default=None, help="a Wan transformer folder (default: one of the sizes below, "
                    "in memory)")
    for k, v in SIZES.items():
        ap.add_argument(f"--{k}", type=int, default=v)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    sizes = {k: getattr(a, k) for k in SIZES}
    models = {"full": _model(a.folder, 0, sizes), "lora": _model(a.folder, a.rank, sizes)}
    opts = {k: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4) for k, m in models.items()}
    c = models["full"].config
    x = torch.randn(2, c.in_channels, 3, 8, 8)
    inputs = (x, torch.rand(2) * 1000, torch.randn(2, 512, c.text_dim))
    times = {k: [] for k in models}
    for i in range(a.reps + 2):  # interleaved, the order alternating; the first two rounds warm up
        for k in (list(models) if i % 2 else list(models)[::-1]):
            dt = _step(models[k], opts[k], inputs, torch.randn_like(x))
            if i >= 2:
                times[k].append(dt)
    out = {}
    for j, clock in enumerate(("", "cpu_")):  # wall clock, then this process's CPU time
        for k, v in times.items():
            t = [d[j] for d in v]
            out[f"{k}_{clock}s"] = [statistics.median(t), min(t), max(t)]
        rounds = [lo[j] / fu[j] for lo, fu in zip(times["lora"], times["full"])]
        out[f"{clock}ratio"] = out[f"lora_{clock}s"][0] / out[f"full_{clock}s"][0]
        out[f"{clock}ratio_spread"] = [min(rounds), max(rounds)]
    out.update(rank=a.rank, reps=a.reps, sizes=None if a.folder else sizes,
               params=sum(p.numel() for p in models["full"].parameters()),
               trainable={k: sum(p.numel() for p in m.parameters() if p.requires_grad) for k, m in models.items()})
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
