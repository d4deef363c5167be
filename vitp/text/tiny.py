"""A tiny, randomly initialised T5 text encoder saved to a local folder, for tests and CPU demos.

The architecture is T5 v1.1's encoder (gated-GELU feed-forward; Raffel et al. 2020,
https://github.com/google-research/text-to-text-transfer-transformer) at toy size, with ByT5's
byte-level tokenizer (Xue et al. 2022), which needs no vocabulary file: 256 bytes + 3 special
tokens + 125 sentinels = 384 token ids. Nothing is downloaded.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

BYT5_VOCAB = 384  # ByT5Tokenizer: 3 special tokens, 256 bytes, 125 extra ids


def make_tiny_encoder(path: Any, seed: int = 0, d_model: int = 32, num_layers: int = 2, num_heads: int = 4,
                      d_ff: int = 64) -> Path:
    """Save a random T5 encoder (``T5EncoderModel``, ``T5Config(feed_forward_proj="gated-gelu")``,
    ``d_kv = d_model // num_heads``) and ``ByT5Tokenizer()`` with ``save_pretrained`` into ``path``;
    return ``path``. The weights come from ``seed`` alone (torch's global RNG is restored after),
    so two calls with the same arguments write the same files (same config and weight hashes).

    Raises ``ValueError`` when ``num_heads`` does not divide ``d_model``."""
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    if d_model % num_heads:
        raise ValueError(f"num_heads={num_heads} does not divide d_model={d_model}")
    path = Path(path)
    config = T5Config(vocab_size=BYT5_VOCAB, d_model=d_model, d_kv=d_model // num_heads, d_ff=d_ff,
                      num_layers=num_layers, num_heads=num_heads, feed_forward_proj="gated-gelu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = T5EncoderModel(config)
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a "Writing model shards" bar for 100 kB
    try:
        model.save_pretrained(str(path))
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    ByT5Tokenizer().save_pretrained(str(path))
    return path


DEMO_ENCODER = "tiny"  # data.text_encoder=tiny: the CPU demos' encoder (experiment=digits_text)


def local_encoder(path: Any) -> Path:
    """``path`` as a folder; ``"tiny"`` names the demo encoder, :func:`make_tiny_encoder` with its
    defaults (seed 0, 32 channels), built on first use in ``$VITP_CACHE_DIR/text-encoders/tiny-t5``
    (default ``~/.cache/vitp``) and the same on every machine. A random encoder: it tells the
    digits' phrasings apart by their bytes but knows no language; real runs give a local T5,
    umT5 or CLIP folder."""
    import os
    import tempfile

    if str(path) != DEMO_ENCODER:
        return Path(path).expanduser()
    root = Path(os.environ.get("VITP_CACHE_DIR") or Path.home() / ".cache" / "vitp") / "text-encoders"
    folder = root / "tiny-t5"
    if not (folder / "config.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tiny-t5-"))
        make_tiny_encoder(tmp)
        from vitp.utils import default_mode

        for f in [tmp, *tmp.rglob("*")]:  # mkdtemp's 0700 and safetensors' 0600: every user of the machine reads it
            default_mode(f)
        try:
            tmp.rename(folder)  # atomic: concurrent ranks build their own and one wins
        except OSError:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return folder
