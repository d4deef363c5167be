"""Regional compilation (``trainer.compile=blocks``, :mod:`vitp.models.compiled`) in one process:
one compiled graph serves every block of a stack, and the compiled generator's output and
gradients equal eager's."""
from __future__ import annotations

import copy

import pytest
import torch

from vitp.models import Generator
from vitp.models.compiled import CACHE_ENV, compile_blocks, compile_cache_dir, compile_stats

TINY = dict(in_channels=1, image_size=8, num_frames=1, num_classes=10, patch_size=2, tubelet_size=1, width=32,
            depth=4, num_heads=2)


def test_one_graph_for_the_whole_stack_and_eager_parity():
    torch.manual_seed(0)
    eager = Generator(seed=0, **TINY)
    for p in eager.parameters():  # non-zero adaLN gates, so attention and MLP matter
        p.data.add_(0.05 * torch.randn_like(p))
    compiled = copy.deepcopy(eager)
    assert compile_blocks(compiled, "blocks", compile_cache_dir(None)) == TINY["depth"]
    z, t, y = torch.randn(4, 1, 1, 8, 8), torch.rand(4), torch.randint(0, 10, (4,))
    before = compile_stats()
    outs = []
    for m in (eager, compiled):
        out = m(z, t, y)
        out.square().mean().backward()
        outs.append((out, [p.grad for p in m.parameters()]))
    after = compile_stats()
    assert after["graphs"] - before["graphs"] == 1  # depth 4, one graph: compile time does not grow with depth
    assert after["compile_s"] > before["compile_s"]
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(outs[1][1], outs[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_off_compiles_nothing_and_unknown_modes_are_refused(tmp_path, monkeypatch):
    m = Generator(**TINY)
    assert compile_blocks(m, "off") == 0
    assert all(getattr(b, "_compiled_call_impl", None) is None for b in m.blocks)
    with pytest.raises(ValueError, match="trainer.compile='full'"):
        compile_blocks(m, "full")
    monkeypatch.delenv(CACHE_ENV, raising=False)
    assert compile_cache_dir(tmp_path) == tmp_path / "compile_cache"  # a restart of the run reuses its kernels
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "shared"))
    assert compile_cache_dir(tmp_path) == tmp_path / "shared"
