"""Where vitp-export and vitp-train write, on two tiny Wan runs (2 steps, one process, seconds):
every file of a run and of its exports has the mode a plain ``open()`` gives (safetensors wrote
0600)."""
from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers import make_tiny_wan

UMASK = 0o027  # not the usual 022: a mode fixed at 0644 would show


def _train(run: Path, init: Path, tmp: Path, *extra: str) -> Path:
    from vitp.config import compose
    from vitp.train import train

    train(compose(["experiment=wan_smoke", f"trainer.init_from={init}", "trainer.max_steps=2", "eval.enabled=false",
                   f"data.text_embeddings={tmp / 'captions'}", *extra]), run)
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A full fine-tune of the pipeline ``base`` and a LoRA run of ``base/transformer``, trained and
    exported under :data:`UMASK` (restored after)."""
    from vitp.cli.export import run as export

    tmp = tmp_path_factory.mktemp("outputs")
    mask = os.umask(UMASK)
    try:
        base = make_tiny_wan().write_pipeline(tmp / "base", sharded=True, vae=False)
        full = _train(tmp / "run", base, tmp)
        lora = _train(tmp / "lora_run", base / "transformer", tmp, "trainer.lora.enabled=true", "trainer.lora.rank=4")
        exports = {"diffusers": export([str(full), "--format", "diffusers", "-o", str(tmp / "full_export")]),
                   "merged": export([str(lora), "--format", "diffusers", "--merge", "-o", str(tmp / "merged")]),
                   "lora_folder": export([str(lora), "--format", "lora", "-o", str(tmp / "lora_folder")]),
                   "comfyui": export([str(lora), "--format", "lora", "--lora-format", "comfyui", "-o", str(tmp / "c")])}
    finally:
        os.umask(mask)
    return SimpleNamespace(tmp=tmp, base=base, full=full, lora=lora, exports=exports)


def test_every_file_of_a_run_and_of_its_exports_has_the_usual_mode(runs):
    """Under umask 027 every file is 0640 (0666 & ~umask, as open() makes it), also the safetensors
    files (RUN/diffusers, RUN/lora, the exports), which safetensors creates 0600."""
    want = 0o666 & ~UMASK
    roots = [runs.full, runs.lora, *(p.parent if p.name == "transformer" else p for p in runs.exports.values())]
    files = [f for r in roots for f in ([r] if r.is_file() else r.rglob("*")) if f.is_file() and not f.is_symlink()]
    assert {f.suffix for f in files} >= {".safetensors", ".json"} and runs.tmp / "c.safetensors" in files
    assert any("diffusers/transformer" in str(f) for f in files) and (runs.lora / "lora" / "lora.safetensors") in files
    bad = {str(f): oct(f.stat().st_mode & 0o777) for f in files if f.stat().st_mode & 0o777 != want}
    assert not bad, bad

