"""``vitp-pack``: pack a data set into WebDataset tar shards that ``data=shards`` trains on.

``vitp-pack OUT [--samples-per-shard N] [--workers N] [--quiet] [key=value ...]``. The overrides
choose the data set as for ``vitp-train`` (``data=image_folder data.root=DIR``, ``data=video_folder
...``, the digits by default; ``data.captions=...`` packs captions; ``data.text_embeddings=DIR``
copies the caption store, encoding it first when ``data.text_encoder`` is set and it is missing).
Layout and reader: :mod:`vitp.data.shards`; writer: :mod:`vitp.data.pack`. Run it again with the
same arguments after an interruption (complete shards are kept) or on a damaged pack (it is
repaired: intact shards are kept, the damaged files written again).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from vitp.cli import log_to_stderr, run_cli

USAGE = ("vitp-pack OUT [--samples-per-shard N] [--workers N] [--encode-batch N] [--device auto|cpu|cuda] [--quiet] "
         "[key=value ...]")


def main(argv: Optional[List[str]] = None) -> None:
    """Console entry point; bad input exits with a one-line message (status 2)."""
    run_cli("vitp-pack", run, argv)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """``OUT``, the flags and the ``key=value`` overrides; raises ``ValueError`` for a
    non-positive shard size or worker count."""
    p = argparse.ArgumentParser(prog="vitp-pack", usage=USAGE, description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path,
                   help="output folder (new or empty, or an interrupted or damaged pack of the same data)")
    p.add_argument("--samples-per-shard", type=int, default=1000,
                   help="samples per tar shard (default 1000; aim for shards of 100 MB to 1 GB)")
    p.add_argument("--workers", type=int, default=1, help="processes writing shards (default 1)")
    p.add_argument("--encode-batch", type=int, default=8,
                   help="with data.vae: items per VAE call when encoding latents (default 8)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="with data.vae: where the VAE encodes (auto: the GPUs if any; shard k on GPU k mod count)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("overrides", nargs="*", default=[],
                   help="Hydra-style key=value choosing the data set, e.g. data=image_folder data.root=DIR")
    a = p.parse_intermixed_args(argv)
    if "=" in str(a.out):
        raise ValueError(f"the first argument is the output folder, got the override {a.out}; "
                         f"usage: {USAGE}")
    for flag in ("samples_per_shard", "workers", "encode_batch"):
        if getattr(a, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(a, flag)}: use a positive number")
    return a


# settings of the packed data the trainer reads as for the folder (crop size, clip windows)
CARRIED = ("resolution", "channels", "num_frames", "frame_stride", "fps", "clip_step", "random_crop", "hflip")


def train_overrides(meta: Dict[str, Any]) -> List[str]:
    """``data.*`` overrides that make ``data=shards`` read the pack as its source config read the
    folder: ``num_classes`` and the :data:`CARRIED` settings that differ from the schema's defaults."""
    from vitp.cli.overrides import hydra_override
    from vitp.config import schema_default

    src = meta.get("source", {})
    out = [f"data.num_classes={len(meta['classes'])}"]
    if meta.get("kind") == "latent":  # the trainer reads the shapes and the VAE from the manifest
        return out
    for k in CARRIED:
        if k in src and src[k] != schema_default(f"data.{k}"):
            out.append(hydra_override(f"data.{k}", src[k]))
    return out


def summary(manifest: Dict[str, Any], out: Path, seconds: float, carried: List[str] = ()) -> List[str]:
    """The lines printed at the end: counts, shards, skips, split, and the overrides to train with
    (``carried``: the pack command's overrides of other groups than ``data``, e.g. an experiment's
    model settings, repeated for the training command)."""
    from vitp.cli.overrides import hydra_override, override_key

    m = manifest["vitp"]
    shards = manifest["shardlist"]
    lines = [f"packed {m['num_samples']} {m['kind']} samples of {len(m['classes'])} classes into {len(shards)} "
             f"shard{'s' if len(shards) != 1 else ''}, {m['bytes'] / 1e6:.1f} MB, in {seconds:.1f} s",
             _split_line(m)]
    if m["skipped"]:
        first = m["skipped"][0]
        lines.append(f"skipped {len(m['skipped'])} unreadable / unusable files (listed in index.json), e.g. "
                     f"{first['file']}: {first['reason']}")
    if not m["num_heldout"] and not m.get("heldout_tails"):
        lines.append("no held-out sample (eval.json has no held-out loss): raise data.holdout_fraction or give "
                     "data.heldout_root")
    if m["captions"]:
        lines.append("captions packed" + (f"; caption store in {out / m['text_embeddings']}"
                                          if m["text_embeddings"] else ""))
    train = [*carried, "data=shards", hydra_override("data.shards", str(out.absolute())), *train_overrides(m)]
    if m["text_embeddings"]:
        from vitp.text.store import read_index

        store = out / m["text_embeddings"]
        train.append(hydra_override("data.text_embeddings", str(store.absolute())))
        if not any(override_key(o) == "model.text_dim" for o in carried):  # training refuses the run without it
            train.append(f"model.text_dim={read_index(store)['encoder']['hidden_size']}")
    lines += [f"manifest: {(out / 'index.json').absolute()}", f"train with: {' '.join(train)}"]
    return lines


def _split_line(m: Dict[str, Any]) -> str:
    """The summary's split line. A video pack's samples are files (whole files held out, and a
    one-file class's tail): named files, so that a count of files is not read as clips."""
    def n(k: int, what: str) -> str:
        return f"{k} {what}{'' if k == 1 else 's'}"

    if m["holdout"].get("unit") != "file":
        return f"held out: {n(m['num_heldout'], 'sample')}; training: {n(m['num_train'], 'sample')}"
    tails = m.get("heldout_tails")
    return (f"held out: {n(m['num_heldout'], 'whole file')}"
            + (f" and the last {m['holdout']['fraction']:g} of the clip windows (at least one) of "
               f"{n(tails, 'file')} (classes of one file)" if tails else "")
            + f"; training: {n(m['num_train'], 'file')}" + (" (with the clips before those tails)" if tails else ""))


@contextlib.contextmanager
def _resumable_on_interrupt():
    """Ctrl-C: one line saying how to resume (complete shards are kept), exit status 130."""
    try:
        yield
    except KeyboardInterrupt:
        print("vitp-pack: interrupted; run the same command again to resume (complete shards are kept)",
              file=sys.stderr)
        raise SystemExit(130) from None


def run(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    """Pack the data set of the overrides into ``OUT`` (see the module docstring); returns the manifest.

    Raises ``ValueError`` for bad flags or overrides and data without anything to pack,
    ``FileExistsError`` for an output folder that is not new, empty, the same pack in progress or
    a damaged pack of the same config (repaired), and what building the data set raises
    (``FileNotFoundError`` for a missing folder)."""
    from vitp.cli.overrides import compose_checked, override_key
    from vitp.data.build import ensure_text_embeddings
    from vitp.data.pack import pack

    a = parse_args(argv)
    cfg = compose_checked(a.overrides)
    start = time.perf_counter()
    with log_to_stderr("vitp", "vitp-pack"), _resumable_on_interrupt():  # notes: skipped files, resuming
        store = cfg.data.text_embeddings
        if store is not None:
            ensure_text_embeddings(cfg)  # encodes when data.text_encoder is set and the store is missing
            if not (Path(store) / "index.json").is_file():
                raise FileNotFoundError(f"data.text_embeddings={store} holds no caption store; write it with "
                                        f"vitp-encode-captions first, or unset data.text_embeddings")
        manifest = pack(cfg.data, a.out, seed=int(cfg.seed), samples_per_shard=a.samples_per_shard,
                        workers=a.workers, progress=not a.quiet, text_store=store, encode_batch=a.encode_batch,
                        device=a.device)
    carried = [o for o in a.overrides if override_key(o).split(".")[0].split("/")[0].lstrip("+~") not in ("data", "hydra")]
    print("\n".join(summary(manifest, a.out, time.perf_counter() - start, carried)))
    return manifest


if __name__ == "__main__":
    main()
