"""``vitp-encode-captions``: encode a data set's captions once into a text-embedding store.

``vitp-encode-captions --encoder PATH [--out DIR] [--captions FILE] [--batch-size N] [--dtype D]
[--device D] [--max-length L] [--shard-size K] [--overwrite] [key=value ...]``. The encoder is a
local ``transformers`` folder (T5, umT5, mT5, CLIP; :mod:`vitp.text.encoder`), never downloaded.
The captions are those of ``--captions FILE`` (``.txt``: one per line; ``.jsonl``: a ``caption``
field per line), else those of the data set the overrides compose (``data=image_folder
data.root=... data.captions=sidecar``; read by ``dataset_captions`` in vitp/data/build.py).
The store's layout is in :mod:`vitp.text.store`; train on it with ``data.text_embeddings=DIR``.
An interrupted run resumes where it stopped when run again with the same arguments.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from vitp.cli import log_to_stderr, run_cli

USAGE = ("vitp-encode-captions --encoder PATH [--out DIR] [--captions FILE] [--batch-size N] [--dtype float32|bfloat16] "
         "[--device auto|cpu|cuda] [--max-length L] [--shard-size K] [--overwrite] [key=value ...]")


def main(argv: Optional[List[str]] = None) -> None:
    """Console entry point; bad input exits with a one-line message (status 2)."""
    run_cli("vitp-encode-captions", run, argv)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The flags and the ``key=value`` overrides (``.overrides``) of a command line; raises
    ``ValueError`` for a non-positive batch, shard or length."""
    p = argparse.ArgumentParser(prog="vitp-encode-captions", usage=USAGE, description=__doc__.splitlines()[0])
    p.add_argument("--encoder", type=Path, required=True,
                   help="local folder of a transformers text encoder (config.json, weights, tokenizer), or 'tiny' (the "
                        "CPU demos' random T5, built in $VITP_CACHE_DIR/text-encoders)")
    p.add_argument("--out", type=Path, default=None, help="store folder (default: the data config's data.text_embeddings)")
    p.add_argument("--captions", type=Path, default=None,
                   help="encode these captions instead of the data set's: .txt (one per line) or .jsonl "
                        "(a \"caption\" field per line)")
    p.add_argument("--batch-size", type=int, default=64, help="captions per encoder call (default 64)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="encoder and stored dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda or cuda:N (default auto)")
    p.add_argument("--max-length", type=int, default=None,
                   help="tokens per caption, padded / truncated (default: the overrides' model.text_len when set, else 120 "
                        "for T5 / umT5, 77 for CLIP)")
    p.add_argument("--shard-size", type=int, default=4096, help="captions per shard file (default 4096)")
    p.add_argument("--overwrite", action="store_true", help="replace a store of other captions or settings in --out")
    p.add_argument("overrides", nargs="*", default=[],
                   help="Hydra-style key=value choosing the data set, e.g. data=image_folder data.root=DIR "
                        "data.captions=sidecar")
    a = p.parse_intermixed_args(argv)
    for flag in ("batch_size", "shard_size", "max_length"):
        value = getattr(a, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {value}: use a positive number")
    return a


def read_caption_file(path: Path) -> List[str]:
    """The captions of ``path``: ``.txt``, one per line (stripped); ``.jsonl``, the ``"caption"``
    string of each non-blank line's object. Raises ``FileNotFoundError``, or ``ValueError`` naming
    ``file:line`` for a malformed line and listing the accepted extensions for another one."""
    if path.suffix.lower() not in (".txt", ".jsonl"):
        raise ValueError(f"--captions {path}: use a .txt file (one caption per line) or a .jsonl file "
                         f"(a \"caption\" field per line)")
    if not path.is_file():
        raise FileNotFoundError(f"--captions {path} not found")
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix.lower() == ".txt":
        return [line.strip() for line in lines]
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("caption"), str):
            raise ValueError(f"{path}:{n}: expected an object with a string \"caption\" field")
        out.append(row["caption"])
    return out


def captions_and_out(a: argparse.Namespace) -> Tuple[List[str], Path, str]:
    """``(captions, store folder, where the captions came from)``: ``--captions`` or the data set
    of the overrides; ``--out`` or its ``data.text_embeddings``; without ``--max-length``, the
    overrides' ``model.text_len`` when set. Raises ``ValueError`` when
    neither names the output folder, or a ``--captions`` file holds no caption."""
    cfg = None
    if a.captions is None or a.out is None:
        from omegaconf import OmegaConf

        from vitp.cli.overrides import compose_checked

        cfg = compose_checked(a.overrides)
        out = a.out or OmegaConf.select(cfg, "data.text_embeddings", default=None)
        if a.max_length is None and OmegaConf.select(cfg, "model.text_len", default=0):
            a.max_length = int(cfg.model.text_len)  # the run's caption length (experiment=digits_text: 32)
        if out is None:
            raise ValueError("no output folder: pass --out DIR or set data.text_embeddings=DIR")
    if a.captions is not None:
        captions = read_caption_file(a.captions)
        if not any(c.strip() for c in captions):  # a store of the null caption alone trains nothing
            raise ValueError(f"--captions {a.captions} holds no caption (empty, or blank lines only); give a file "
                             "with one caption per line (.txt) or a \"caption\" field per line (.jsonl)")
        return captions, Path(a.out or out), str(a.captions)
    from vitp.data.build import dataset_captions

    return dataset_captions(cfg.data), Path(out), f"data.name={cfg.data.name}"


def summary(index: Dict[str, Any], given: int, source: str, out: Path, seconds: float, encoded: int) -> List[str]:
    """The lines printed at the end: counts, size, what this run encoded (``encoded`` captions in
    ``seconds``; fewer than stored when it resumed, none when the store was complete), the folder
    and the override to train with."""
    from vitp.cli.overrides import hydra_override

    size = sum(s["bytes"] for s in index["shards"])
    shards = len(index["shards"])
    what = (f"encoded {encoded} captions in {seconds:.1f} s" if encoded else
            "nothing to encode: the store was already complete")
    return [f"{given} captions from {source}: {index['num_captions'] - 1} unique + the empty caption (id 0) = "
            f"{index['num_captions']} stored; {index['num_truncated']} truncated at {index['max_length']} tokens",
            f"{shards} shard{'s' if shards != 1 else ''}, {size} bytes = {size / 1e6:.2f} MB ({index['dtype']}, "
            f"{index['encoder']['hidden_size']} channels, encoder {index['encoder']['name']}); {what}",
            f"store: {out.absolute()}",
            f"train with: {hydra_override('data.text_embeddings', str(out.absolute()))}"]


def run(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    """Encode the captions into the store (see the module docstring); returns its index.

    Raises ``FileNotFoundError`` for a missing encoder folder or captions file, ``ValueError`` for
    an unsupported encoder, a bad flag or override, an output folder holding a store of other
    captions or another encoder (without ``--overwrite``)."""
    from vitp.text import TextEncoder, write_store
    from vitp.text.encoder import encoder_record, resolve_device

    a = parse_args(argv)
    encoder_record(a.encoder)  # a missing or unsupported encoder fails before the data is read
    captions, out, source = captions_and_out(a)
    device = resolve_device(a.device)
    dtype = a.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    start = time.perf_counter()
    encoder = TextEncoder(a.encoder, device=str(device), dtype=dtype, max_length=a.max_length)
    with log_to_stderr("vitp.text", "vitp-encode-captions"):  # write_store's notes (resuming, already complete)
        index = write_store(out, captions, encoder, batch_size=a.batch_size, shard_size=a.shard_size,
                            overwrite=a.overwrite, dtype=dtype)
    print("\n".join(summary(index, len(captions), source, out, time.perf_counter() - start, encoder.encoded)))
    return index


if __name__ == "__main__":
    main()
