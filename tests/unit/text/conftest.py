"""Fixtures of the text tests: one tiny random T5 encoder folder (vitp/text/tiny.py) and its loaded
:class:`vitp.text.TextEncoder`, made once per session; nothing is downloaded."""
from __future__ import annotations

import pytest

from vitp.text import TextEncoder, make_tiny_encoder

MAX_LENGTH = 16  # tokens per caption in these tests (ByT5: one token per byte + </s>)


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    return make_tiny_encoder(tmp_path_factory.mktemp("text") / "tiny-t5", seed=0)


@pytest.fixture(scope="session")
def tiny(tiny_path):
    return TextEncoder(tiny_path, device="cpu", dtype="float32", max_length=MAX_LENGTH)
