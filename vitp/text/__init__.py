"""Text conditioning: captions encoded once by a local ``transformers`` text encoder into a
versioned store of per-token embeddings and masks, read during training.

:mod:`.encoder` (:class:`TextEncoder`, :func:`encoder_record`), :mod:`.store` (:func:`write_store`,
:class:`TextEmbeddings`, the on-disk format), :mod:`.captions` (:func:`read_captions`: captions of
data files from sidecar ``.txt`` files or a ``.jsonl`` / ``.csv`` manifest), :mod:`.tiny`
(:func:`make_tiny_encoder`, a random T5 for tests). The command ``vitp-encode-captions``
(:mod:`vitp.cli.encode_captions`) writes a store.
"""
from vitp.text.captions import read_captions
from vitp.text.encoder import TextEncoder, encoder_record
from vitp.text.store import FORMAT, VERSION, TextEmbeddings, read_index, unique_captions, write_store
from vitp.text.tiny import make_tiny_encoder

__all__ = ["FORMAT", "VERSION", "TextEmbeddings", "TextEncoder", "encoder_record", "make_tiny_encoder",
           "read_captions", "read_index", "unique_captions", "write_store"]
