"""``vitp-export``: consolidated safetensors weights from a vitp run or checkpoint (a Wan run's
as a diffusers folder: ``--format diffusers``, :func:`run_diffusers`).

The file holds full (unsharded) fp32 tensors, the ViT blocks under timm's names and layouts and
the model config (metadata + ``.json`` sidecar); see :mod:`vitp.checkpoint.export`. It loads into
any ``(tp, pp)`` with ``trainer.init_from=FILE``, samples with ``vitp-sample FILE``, and its blocks
load into a stock timm ViT. From a training checkpoint (a torch distributed checkpoint) a model
larger than ``--max-shard-size`` comes out sharded as Hugging Face transformers shards its
checkpoints: ``<stem>-00001-of-0000N.safetensors`` ... plus ``<OUT name>.index.json``, read by the
same commands given ``OUT`` or the index.
"""
from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import List, Optional, Tuple

from omegaconf import OmegaConf

from vitp import checkpoint as ckpt
from vitp.checkpoint import export as ex
from vitp.cli import run_cli

UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """Bytes of a size: ``5GB``, ``500MB``, ``1.5GiB``, ``123`` (bytes). Decimal units are powers
    of 10 and ``KiB``/``MiB``/``GiB`` powers of 2, as transformers' ``convert_file_size_to_int``
    reads ``max_shard_size``. Raises ``argparse.ArgumentTypeError`` for anything else or <= 0."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    n = int(float(m.group(1)) * UNITS[(m.group(2) or "B").upper()]) if m else 0
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size > 0 (e.g. 5GB, 500MB, 1GiB, or bytes)")
    return n


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vitp-export", description="Consolidated weights of a vitp run or checkpoint: "
                                "vitp safetensors, a Wan run's diffusers folder, or a LoRA run's adapters "
                                "(docs/checkpoints.md, docs/finetuning.md).")
    p.add_argument("source", type=Path, help="run directory (its latest checkpoint), checkpoints folder, "
                                             "checkpoint tag folder, or vitp weights (.safetensors or a sharded "
                                             "export's .index.json)")
    p.add_argument("-o", "--out", type=Path, default=None,
                   help="output file (default: <run dir>/export/<step>_<weights>.safetensors)")
    p.add_argument("--weights", choices=["ema", "raw"], default="ema", help="EMA (for sampling) or raw weights")
    p.add_argument("--max-shard-size", type=parse_size, default="5GB", metavar="SIZE",
                   help="from a checkpoint: larger weights are written as shards of at most SIZE (5GB = 5*10^9 "
                        "bytes, 5GiB = 5*2^30, or bytes; default 5GB) plus OUT.index.json")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--format", choices=["vitp", "diffusers", "lora"], default="vitp",
                   help="vitp: the export file above; diffusers: a Wan run's (model.family=wan) checkpoint as a "
                        "diffusers folder OUT (a transformer folder, or a whole pipeline when the run started from "
                        "one: OUT/transformer and the source's other components linked); lora: a LoRA run's "
                        "adapters as one LoRA file (docs/finetuning.md#lora-files)")
    p.add_argument("--lora-format", choices=["diffusers", "comfyui"], default=None,
                   help="--format lora of a Wan run: diffusers (OUT/pytorch_lora_weights.safetensors, or OUT "
                        "itself when it ends in .safetensors; WanPipeline.load_lora_weights(OUT) reads either) or "
                        "comfyui (OUT.safetensors, diffusion_model.* keys); default diffusers")
    p.add_argument("--merge", action="store_true",
                   help="a LoRA run: the base (trainer.init_from) with the adapters merged; a Wan run's with --format "
                        "diffusers as a diffusers transformer folder OUT, a generator run's as a vitp export OUT "
                        "(.safetensors)")
    return p


def run_diffusers(a: argparse.Namespace) -> Path:
    """``--format diffusers``: the checkpoint of a Wan run as a diffusers folder
    (:func:`vitp.train.wan.export_checkpoint_diffusers`); returns the transformer folder written."""
    from vitp.models.wan_run import is_wan
    from vitp.train.wan import export_checkpoint_diffusers

    src, step, run_dir = ckpt.resolve_weights(a.source, a.weights)
    tag = src.parent
    if not (tag / ex.DCP_METADATA).is_file():
        raise ValueError(f"{a.source}: --format diffusers reads a training checkpoint of a model.family=wan run (a run "
                         "directory, its checkpoints folder or a checkpoint tag folder)")
    record = ex.checkpoint_record(tag)
    cfg = OmegaConf.create(record["config"])
    if record.get("lora"):
        raise ValueError(f"{a.source} is a LoRA run (trainer.lora.enabled=true): its checkpoints hold the "
                         "adapters, not the base; export them with --format lora [--lora-format comfyui], or the "
                         "base with them merged with --format diffusers --merge")
    if not is_wan(cfg):
        raise ValueError(f"{a.source} is a run of vitp's generator (model.family={cfg.model.get('family', 'vit')}); "
                         "--format diffusers exports Wan runs; leave --format out for the vitp export")
    step = record.get("step", -1) if step is None else step
    out = a.out or run_dir / "export" / f"{ckpt.tag_name(max(step, 0))}_{a.weights}_diffusers"
    check_out(out, cfg, run_dir, wan_folder=True)
    if out.exists() and any(out.iterdir()) and not a.force:
        raise ValueError(f"{out} exists and is not empty; choose another --out or pass --force to write into it")
    kind = ex.CHECKPOINT_KINDS[src.name]
    written = export_checkpoint_diffusers(tag, out, cfg, kind=kind, max_shard_bytes=a.max_shard_size)
    print(f"wrote {written} (diffusers WanTransformer3DModel, step {step}, {a.weights} weights)"
          + (f" in the pipeline {out}" if written != out else ""))
    return written


def check_out(out: Path, cfg, run_dir: Path, wan_folder: bool = False) -> None:
    """Refuse (``ValueError``, before anything is written) an output ``out`` on the run's base or
    over the run's own files (:func:`vitp.checkpoint.outputs.check_export_out`), or where this
    process may not write (:func:`check_writable`); ``wan_folder``: ``out`` is a Wan diffusers
    folder, written also through its transformer folder and ``model_index.json``."""
    from vitp.checkpoint.outputs import check_export_out, wan_targets

    check_export_out(out, wan_targets(out, cfg) if wan_folder else [out], cfg, run_dir)
    check_writable(out)


def check_writable(out: Path) -> None:
    """Refuse (``ValueError``, one line) an output ``out`` whose nearest existing folder (``out``
    itself when it is one) this process may not write: a read-only run folder failed with
    ``OSError: [Errno 30]`` making ``RUN/export`` after the weights were read."""
    from vitp.utils import unwritable

    out = Path(out).absolute()
    folder = next(p for p in (out, *out.parents) if p.is_dir())
    why = unwritable(folder)
    if why:
        raise ValueError(f"cannot write {out}: {folder} is {why}; pass -o PATH to write the export elsewhere")


def _full_lora_state(tag: Path, cfg, kind: str):
    """``(adapters, config)`` of a LoRA run's checkpoint ``tag``: the tp=1 adapter state in vitp's
    convention (:mod:`vitp.models.lora_files`) and its LoRA record (:func:`vitp.train.lora.full_lora_state`)."""
    from vitp.train.lora import full_lora_state

    return full_lora_state(tag, kind=kind)


def write_lora_export(out: Path, adapters, config, cfg, lora_format: str = "diffusers", merge: bool = False,
                      step: Optional[int] = None, weights: str = "ema") -> Path:
    """Write a LoRA run's adapters (vitp's convention) to ``out``: with ``merge``, the base
    ``cfg.trainer.init_from`` with them merged (:func:`vitp.models.lora_files.merge_lora`): a Wan
    run's as a diffusers transformer folder, the generator's as a vitp export file (``out``,
    ``.safetensors``, ``step`` and ``weights`` in its metadata; ``vitp-sample`` and
    ``trainer.init_from`` read it); else a Wan run's diffusers file
    (``out/pytorch_lora_weights.safetensors``, or ``out`` itself when named ``.safetensors``:
    :func:`lora_file`) or ComfyUI file (``out``, ``.safetensors``), or the generator's vitp LoRA
    file (``out``, or ``out/lora.safetensors`` for a folder). Returns the path written. Raises ``ValueError`` for
    ``lora_format=comfyui`` on a generator run, ``FileNotFoundError`` / ``ValueError`` when the
    base is gone or does not fit the adapters."""
    from vitp.models import lora_files as lf
    from vitp.models.wan_run import is_wan

    if not is_wan(cfg):
        if lora_format != "diffusers":
            raise ValueError("a generator run's LoRA exports as vitp's own file (--format lora, no --lora-format)")
        if not merge:  # a folder gets lora.safetensors: diffusers' file name would promise diffusers' keys
            return lf.save_lora_file(out if out.suffix else out / lf.STATE, *lf.to_vitp_lora(adapters, config))
        base, _ = ex.read_export(cfg.trainer.init_from)
        merged_cfg = OmegaConf.merge(cfg, {"trainer": {"lora": {"enabled": False, "init_from": None}}})
        return ckpt.save_export(out, lf.merge_lora(base, adapters, config), merged_cfg, step=step, weights=weights)
    if merge:  # the trained expert's transformer (A14B: transformer_2 for model.expert=low), its pipeline around it
        from vitp.models.wan_run import wan_source
        from vitp.train.wan import diffusers_weights, link_pipeline

        source, _ = wan_source(cfg)
        written = lf.merge_into_folder(source, adapters, config, diffusers_weights(Path(out), source))
        link_pipeline(Path(out), source)
        return written
    from vitp.models.wan_keys import read_config, transformer_folder

    wan = read_config(transformer_folder(cfg.trainer.init_from, "transformer"))
    writer = lf.to_comfyui_lora if lora_format == "comfyui" else lf.to_diffusers_lora
    return lf.save_lora_file(lora_file(out, lora_format), *writer(adapters, config, wan))


def lora_file(out: Path, lora_format: str = "diffusers") -> Path:
    """The file a Wan run's ``--format lora`` export to ``out`` writes: ``out`` itself for ComfyUI
    or a ``.safetensors`` name (diffusers' ``load_lora_weights`` takes a file path), else
    ``out/pytorch_lora_weights.safetensors``, the folder ``save_lora_weights`` writes and
    ``load_lora_weights(out)`` finds."""
    from vitp.models.lora_files import WEIGHT_NAME

    out = Path(out)
    return out if lora_format == "comfyui" or out.suffix == ".safetensors" else out / WEIGHT_NAME


def _check_base(lora: dict) -> None:
    """``--merge``: the base the run recorded (``{"base": {"folder", "hash"}}``) must still be what
    its folder holds (:func:`vitp.models.lora.base_hash`), else the merge would give another model."""
    from vitp.models.lora import base_hash

    base = lora.get("base") or {}
    folder, want = base.get("folder"), base.get("hash")
    if folder and want and Path(folder).exists():
        got = base_hash(folder)
        if got != want:
            raise ValueError(f"{folder} no longer holds the base these adapters were trained on (weights hash "
                             f"{got}, the run recorded {want}): merging would give another model; restore that "
                             "base's files there")


def not_lora_advice(source: Path, wan: bool, merge: bool) -> str:
    """The refusal of ``--format lora`` / ``--merge`` for a run without LoRA, naming only the
    export that works for it: ``--format diffusers`` for a Wan run, no ``--format`` for the generator."""
    works = "--format diffusers -o OUT" if wan else "no --format (the vitp export)"
    if merge:
        return (f"{source} is not a LoRA run (trainer.lora.enabled=false): --merge merges a LoRA run's adapters; "
                f"drop --merge and export it with {works}")
    return f"{source} is not a LoRA run (trainer.lora.enabled=false): it has no adapters; export it with {works}"


def run_lora(a: argparse.Namespace) -> Path:
    """``--format lora`` / ``--merge``: a LoRA run's checkpoint through :func:`_full_lora_state`
    and :func:`write_lora_export`; returns the path written."""
    src, step, run_dir = ckpt.resolve_weights(a.source, a.weights)
    tag = src.parent
    if not (tag / ex.DCP_METADATA).is_file():
        raise ValueError(f"{a.source}: --format lora / --merge read a LoRA run's training checkpoint (a run "
                         "directory, its checkpoints folder or a checkpoint tag folder)")
    record = ex.checkpoint_record(tag)
    cfg = OmegaConf.create(record["config"])
    wan = str(cfg.model.get("family", "vit")) == "wan"
    if not record.get("lora"):
        raise ValueError(not_lora_advice(a.source, wan, a.merge))
    if a.merge and a.format != ("diffusers" if wan else "vitp"):
        raise ValueError("--merge writes a Wan run's base as a diffusers folder (pass --format diffusers) and a "
                         "generator run's as a vitp export file (leave --format out)")
    if a.merge:
        _check_base(record["lora"])
    step = record.get("step", -1) if step is None else step
    suffix = ("merged_diffusers" if wan else "merged.safetensors") if a.merge else \
        f"lora_{a.lora_format}" if wan else "lora_vitp.safetensors"
    out = a.out or run_dir / "export" / f"{ckpt.tag_name(max(step, 0))}_{a.weights}_{suffix}"
    if a.merge and not wan and out.suffix != ".safetensors":
        raise ValueError(f"--out {out}: the merged generator is a vitp export; use a .safetensors file name")
    if a.lora_format == "comfyui" and not a.merge and out.suffix != ".safetensors":
        out = out.with_name(out.name + ".safetensors")
    check_out(out, cfg, run_dir, wan_folder=wan and a.merge)
    if out.exists() and not a.force:
        raise ValueError(f"{out} exists; choose another --out or pass --force to replace it")
    adapters, config = _full_lora_state(tag, cfg, ex.CHECKPOINT_KINDS[src.name])
    written = write_lora_export(out, adapters, config, cfg, a.lora_format, a.merge, step, a.weights)
    print(f"wrote {written} (LoRA rank {config['rank']}, step {step}, {a.weights} weights"
          + (", merged into the base)" if a.merge else f", {a.lora_format if wan else 'vitp'} keys)"))
    return written


def run(argv: Optional[List[str]] = None) -> Path:
    """``vitp-export SOURCE [-o OUT.safetensors] [--weights ema|raw] [--max-shard-size SIZE]
    [--format vitp|diffusers]``; returns the written path (the index file when sharded; with
    ``--format diffusers`` the transformer folder)."""
    p = _parser()
    a = p.parse_args(argv)
    if a.lora_format is not None and a.format != "lora":  # it was ignored silently by the other formats
        raise ValueError(f"--lora-format {a.lora_format} is the file format of --format lora (a LoRA run's adapters), "
                         f"not of --format {a.format}: pass --format lora, or drop --lora-format")
    a.lora_format = a.lora_format or "diffusers"
    if a.format == "lora" or a.merge:
        return run_lora(a)
    if a.format == "diffusers":
        return run_diffusers(a)
    src, step, run_dir = ckpt.resolve_weights(a.source, a.weights)
    dcp_tag = src.parent if not src.is_file() and not Path(f"{src}{ex.INDEX_SUFFIX}").is_file() else None
    if dcp_tag is not None:  # a torch distributed checkpoint: written shard by shard, without the full state
        from vitp.checkpoint.sharded import tensor_shapes

        if src.name not in ex.CHECKPOINT_KINDS:
            raise FileNotFoundError(f"weights file {src} does not exist")
        kind, record = ex.CHECKPOINT_KINDS[src.name], ex.checkpoint_record(dcp_tag)
        shapes = tensor_shapes(dcp_tag, kind)
        cfg_dict, counts = record["config"], (len(shapes), sum(math.prod(s) for s, _ in shapes.values()))
        step = record.get("step", -1) if step is None else step
    else:
        state, meta = ckpt.read_export(src)
        cfg_dict, counts = json.loads(meta["vitp_config"]), (len(state), sum(v.numel() for v in state.values()))
        step = int(meta.get("step", -1)) if step is None else step
    out = a.out or run_dir / "export" / f"{ckpt.tag_name(max(step, 0))}_{a.weights}.safetensors"
    if out.suffix != ".safetensors":
        raise ValueError(f"--out {out}: use a .safetensors file name")
    if out.resolve() in (src.resolve(), Path(f"{src}{ex.INDEX_SUFFIX}").resolve()):
        raise ValueError(f"--out {out} is the source file; choose another name")
    index = out.with_name(out.name + ex.INDEX_SUFFIX)
    cfg = OmegaConf.create(cfg_dict)
    check_out(out, cfg, run_dir)
    if (out.exists() or index.exists()) and not a.force:
        raise ValueError(f"{out if out.exists() else index} exists; choose another --out or pass --force to replace it")
    if str(cfg.get("model", {}).get("family", "vit")) == "wan" and OmegaConf.select(cfg, "trainer.lora.enabled"):
        raise ValueError(f"{a.source} is a Wan LoRA run: export its adapters with --format lora -o OUT "
                         "[--lora-format comfyui], or the base with them merged with --format diffusers --merge -o OUT")
    if str(cfg.get("model", {}).get("family", "vit")) == "wan":
        raise ValueError(f"{a.source} is a Wan run (model.family=wan): export it with --format diffusers -o OUT")
    if dcp_tag is not None:
        written = ex.export_checkpoint(dcp_tag, out, cfg, kind=kind, step=step,
                                       max_shard_bytes=a.max_shard_size)
    else:
        written = ckpt.save_export(out, state, cfg, step=step, weights=a.weights)
    _report(written, counts, step, a.weights)
    ps = ex.partial_sync_of(cfg.get("parallel"))
    if ps["p"] < 1:
        print(f"note: parallel.partial_sync={ps['p']} at tp={ps['tp']} ({ps['scale']}): {ex.PARTIAL_SYNC_NOTE}")
    return written


def _report(written: Path, counts: Tuple[int, int], step: int, weights: str) -> None:
    """Print the files written (the export file, or its shards and index, and the sidecar) and
    ``counts``: (generator tensors, parameters)."""
    what = (f"{counts[0]} generator tensors (and the blocks' identity norm1/norm2 timm expects), "
            f"{counts[1] / 1e6:.3f}M parameters, step {step}, {weights} weights")
    if not written.name.endswith(ex.INDEX_SUFFIX):
        print(f"wrote {written} ({what}) and {written.with_suffix('.json')}")
        return
    shards = sorted(set(json.loads(written.read_text())["weight_map"].values()))
    out = written.with_name(written.name[: -len(ex.INDEX_SUFFIX)])
    print(f"wrote {len(shards)} shards ({what}):")
    for name in shards:
        print(f"  {written.parent / name}")
    print(f"and {written} and {out.with_suffix('.json')}")


def main(argv: Optional[List[str]] = None) -> None:
    """Console entry point; bad input exits with a one-line message (status 2)."""
    run_cli("vitp-export", run, argv)


if __name__ == "__main__":
    main()
