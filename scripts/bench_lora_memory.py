"""Per-rank memory and bytes of a LoRA run on a ~30M-parameter Wan base (issue 52's memory criterion).

    python scripts/bench_lora_memory.py [--out lora_memory.json] [--world 8 --tp 2 --pp 2] [--rank 8]
        [--steps 3] [--compress auto|none] [--width 512 --heads 4 --ffn 1536 --layers 8]

Writes a random Wan text-to-video folder with ``scripts/make_tiny_wan.py`` (its tiny config with
``--width`` = heads x head channels, ``--ffn``, ``--layers`` replaced: the defaults give 31.6M
parameters, 29.5M of them in the blocks; text 32 channels, the demo caption encoder's), then
``vitp-train experiment=wan_smoke trainer.init_from=FOLDER trainer.lora.enabled=true
trainer.lora.rank=R parallel.tp=.. parallel.pp=..`` (dp = world / (tp pp): ZeRO-1, fp32) for
``--steps`` steps on ``--world`` local ranks (gloo, CPU; default targets: both attentions' q, k, v,
out). Each rank reports:

- ``adapters``: adapter parameters it holds (every trainable parameter of its stage, all
  ``*.lora_A`` / ``*.lora_B``; the factor replicated over tp, A of a column- and B of a
  row-parallel linear, counts on every tp rank) and ``base``: frozen parameters it holds;
- ``partition``: elements of its ZeRO-1 partition (DeepSpeed's fp32 master fragments, its share
  of the adapters over dp, padding included) and ``optimizer_bytes``: the fp32 master partition +
  AdamW's ``exp_avg`` + ``exp_avg_sq`` (+ its step counters) read from the DeepSpeed optimizer after
  the run; ``bytes_per_share``: optimizer bytes / (``adapters`` / dp);
- ``peak_mib``: its resident-memory peak (VmHWM, reset to the current RSS at the start as
  tests/distributed/parallel/wan_workers.py ``train_measured`` does) and ``above_start_mib``;
- ``written``: bytes of the checkpoint files it wrote (``__<rank>_*.distcp``, its RNG file).

And for the last checkpoint folder: every file's bytes, the tensor bytes DCP's metadata lists
per kind, the stored pieces (``pieces``: boxes of the full tensors, each a ``torch.save`` record
in its ``.distcp`` file) and the ``.distcp`` bytes beyond the tensor data (``framing``, and per
piece), the number of adapter parameters of the whole model (tp = 1 shapes) and the folder
against ``16 x`` that (fp32 weights, EMA, exp_avg, exp_avg_sq), and any tensor not an adapter
(``base_tensors``, must be empty). Prints a table and one JSON object (also to ``--out``). Peak
memory depends on what else runs on the machine: report ``uptime`` with it.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

SIZES = dict(width=512, heads=4, ffn=1536, layers=8)  # 31.6M parameters (module docstring)


def _status_bytes(key: str) -> int:
    line = next(x for x in open("/proc/self/status") if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024


def _make_tiny_wan():
    spec = importlib.util.spec_from_file_location("make_tiny_wan", Path(__file__).parent / "make_tiny_wan.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_base(out: Path, width: int, heads: int, ffn: int, layers: int) -> Path:
    """A Wan pipeline folder (transformer and scheduler, no VAE) of the given sizes at ``out``."""
    mk = _make_tiny_wan()
    model = mk.tiny_transformer(0, num_attention_heads=heads, attention_head_dim=width // heads, ffn_dim=ffn,
                                num_layers=layers)
    return mk.write_pipeline(out, vae=False, transformer=model)


def optimizer_bytes(optimizer) -> dict:
    """``{"master", "moments", "partition"}`` of a DeepSpeed ZeRO-1 optimizer (``DeepSpeedZeroOptimizer``):
    bytes of its fp32 master partitions, bytes of the wrapped AdamW's state (``exp_avg``,
    ``exp_avg_sq``, ``step``) and the partitions' elements. Raises ``TypeError`` for another optimizer."""
    import torch

    masters = getattr(optimizer, "single_partition_of_fp32_groups", None)
    if masters is None:
        raise TypeError(f"{type(optimizer).__name__} is not DeepSpeed's ZeRO-1/2 optimizer (dp must be > 1)")
    moments = [t for st in optimizer.optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
    return {"master": sum(t.numel() * t.element_size() for t in masters),
            "moments": sum(t.numel() * t.element_size() for t in moments),
            "partition": sum(t.numel() for t in masters)}


def _rank(rank: int, over: list, run: str) -> dict:
    from vitp.config import compose
    from vitp.parallel.lora import is_lora_key
    from vitp.train import Trainer

    with open("/proc/self/clear_refs", "w") as f:  # VmHWM := current RSS
        f.write("5")
    start = _status_bytes("VmRSS")
    tr = Trainer(compose(over), run)
    res = tr.fit()
    peak = _status_bytes("VmHWM")
    named = list(tr.engine.module.named_parameters())
    trained = [n for n, p in named if p.requires_grad]
    if not trained or not all(is_lora_key(n) for n in trained):
        raise AssertionError(f"rank {rank}: trainable parameters other than adapters: "
                             f"{[n for n in trained if not is_lora_key(n)][:5]}")
    st = tr.state
    tag = max((Path(run) / "checkpoints").glob("step_*"))
    mine = [p for p in tag.iterdir() if p.name.startswith(f"__{rank}_") or p.name == f"rng_rank{rank:05d}.pt"]
    return {"rank": rank, "tp": st.tp_rank, "pp": st.pp_rank, "dp": st.dp_rank,
            "adapters": sum(p.numel() for n, p in named if p.requires_grad),
            "base": sum(p.numel() for n, p in named if not p.requires_grad),
            **optimizer_bytes(tr.engine.optimizer), "peak": peak, "start": start,
            "written": sum(p.stat().st_size for p in mine), "losses": res["losses"]}


def checkpoint_report(tag: Path) -> dict:
    """The checkpoint folder ``tag``: ``{"files": {name: bytes}, "bytes", "tensor_bytes": {kind:
    bytes}, "adapter_params" (tp = 1 count, from the ``model`` kind), "ratio_16" (folder bytes / (16
    x adapter_params)), "base_tensors": [keys that are not adapters]}``."""
    import torch

    from vitp.checkpoint.sharded import tensor_shapes
    from vitp.parallel.lora import is_lora_key

    from vitp.checkpoint.sharded import read_metadata

    files = {p.name: p.stat().st_size for p in sorted(tag.iterdir()) if p.is_file()}
    pieces = len(read_metadata(tag).storage_data)  # stored pieces (boxes), each a torch.save record in a .distcp
    kinds = {k: tensor_shapes(tag, k) for k in ("model", "ema", "exp_avg", "exp_avg_sq")}
    size = {k: sum(math.prod(s) * torch.empty((), dtype=d).element_size() for s, d in sh.values())
            for k, sh in kinds.items()}
    n = sum(math.prod(s) for s, _ in kinds["model"].values())
    total = sum(files.values())
    framing = sum(v for k, v in files.items() if k.endswith(".distcp")) - sum(size.values())
    return {"files": files, "bytes": total, "tensor_bytes": size, "tensors": sum(len(sh) for sh in kinds.values()),
            "pieces": pieces, "framing": framing, "framing_per_piece": framing / pieces,
            "adapter_params": n, "ratio_16": total / (16 * n),
            "base_tensors": sorted(k for sh in kinds.values() for k in sh if not is_lora_key(k))}


def run(a, tmp: Path) -> dict:
    from safetensors import safe_open

    from vitp.config import compose, validate_config
    from vitp.data.build import ensure_text_embeddings
    from vitp.parallel.local_group import run_local_group

    folder = write_base(tmp / "base", a.width, a.heads, a.ffn, a.layers)
    over = ["experiment=wan_smoke", f"trainer.init_from={folder}", f"data.text_embeddings={tmp / 'captions'}",
            f"parallel.tp={a.tp}", f"parallel.pp={a.pp}", "trainer.lora.enabled=true", f"trainer.lora.rank={a.rank}",
            f"trainer.max_steps={a.steps}", "eval.enabled=false", f"trainer.checkpoint_compress={a.compress}"]
    cfg = compose(over)
    validate_config(cfg)
    ensure_text_embeddings(cfg)
    run_dir = tmp / "run"
    ranks = run_local_group(a.world, _rank, over, str(run_dir), timeout=1800)
    dp = a.world // (a.tp * a.pp)
    base_params = 0
    for f in (folder / "transformer").glob("*.safetensors"):  # shapes from the headers
        with safe_open(str(f), "pt") as fh:
            base_params += sum(math.prod(fh.get_slice(k).get_shape()) for k in fh.keys())
    for r in ranks:
        r["optimizer_bytes"] = r["master"] + r["moments"]
        r["bytes_per_share"] = r["optimizer_bytes"] / (r["adapters"] / dp)
        r["peak_mib"], r["above_start_mib"] = r["peak"] / 2**20, (r["peak"] - r["start"]) / 2**20
    peaks = [r["peak"] for r in ranks]
    ck = checkpoint_report(max((run_dir / "checkpoints").glob("step_*")))
    return {"base_params": base_params, "sizes": {k: getattr(a, k) for k in SIZES}, "lora_rank": a.rank,
            "layout": {"world": a.world, "tp": a.tp, "pp": a.pp, "dp": dp}, "steps": a.steps, "ranks": ranks,
            "peak_over_median": max(peaks) / statistics.median(peaks), "checkpoint": ck}


def table(out: dict) -> str:
    rows = [f"base {out['base_params'] / 1e6:.2f}M params, LoRA rank {out['lora_rank']}, {out['layout']}",
            "rank tp pp dp  adapters  partition  opt_bytes  B/share  peak_MiB  +start_MiB  written"]
    for r in out["ranks"]:
        rows.append(f"{r['rank']:4d} {r['tp']:2d} {r['pp']:2d} {r['dp']:2d} {r['adapters']:9d} {r['partition']:10d} "
                    f"{r['optimizer_bytes']:10d} {r['bytes_per_share']:8.2f} {r['peak_mib']:9.1f} "
                    f"{r['above_start_mib']:11.1f} {r['written']:8d}")
    ck = out["checkpoint"]
    rows.append(f"peak / median {out['peak_over_median']:.3f}; checkpoint {ck['bytes']} B = {ck['ratio_16']:.3f} x "
                f"16 x {ck['adapter_params']} adapter params; tensors {ck['tensor_bytes']}; base tensors "
                f"{len(ck['base_tensors'])}; {ck['pieces']} pieces, .distcp framing {ck['framing']} B "
                f"({ck['framing_per_piece']:.0f} B a piece)")
    rows.append("files: " + ", ".join(f"{k} {v}" for k, v in ck["files"].items()))
    return "\n".join(rows)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--compress", default="auto", choices=["auto", "zstd", "none"],
                    help="trainer.checkpoint_compress (auto: zstd, a LoRA run)")
    for k, v in SIZES.items():
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    with tempfile.TemporaryDirectory() as tmp:
        out = run(a, Path(tmp))
    print(table(out))
    print(json.dumps(out))
    if a.out:
        a.out.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
