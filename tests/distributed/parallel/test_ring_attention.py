"""Ring attention (vitp.parallel.ring) equals full SDPA on the gathered sequence (CPU gloo).

One 4-rank spawn (:func:`worker_ring`) runs every case: cp=4 (the default group), cp=2 (two
sub-groups) and cp=1 (one group per rank), in fp64 (within 1e-10), fp32 (1e-5) and bf16, once
with the default block kernel (CPU: the fused flash op) and once with the math fallback
forced (``ring._USE_FUSED = False``), recording which kernel every block used; it
compares the output and dq, dk, dv (from a random upstream gradient) with
``F.scaled_dot_product_attention`` on the full sequence, built from one seed on every rank, and
the recorded traffic with the formula of the module docstring. The parent asserts per case.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers import run_ranks

SCALE = 0.7  # not hd ** -0.5: the scale must reach every block
SHAPES = {"n=5": (2, 3, 5, 4), "n=1": (2, 3, 1, 4)}
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}
TOL = {"fp64": 1e-10, "fp32": 1e-5, "bf16": 2e-2}
# cp=1 only at n=5: over a single key dq and dk are zero
CASES = [(d, cp, s) for d in ("fp64", "fp32") for cp in (4, 2) for s in SHAPES] + \
        [(d, 1, "n=5") for d in ("fp64", "fp32")] + [("bf16", cp, "n=5") for cp in (4, 2)]


PATHS = ("fused", "math")  # default kernel selection / math fallback forced
ALL = [(p, *c) for p in PATHS for c in CASES]


def _key(path: str, dtype: str, cp: int, shape: str) -> str:
    return f"{path}/{dtype}/cp={cp}/{shape}"


def _spy_kernels(ring, used: set) -> None:
    """Wrap the block functions of ``ring`` so that ``used`` collects ``(direction, kernel)``."""
    fwd, bwd = ring._block_forward, ring._block_backward

    def spy_fwd(kernel, *a, **kw):
        used.add(("fwd", kernel))
        return fwd(kernel, *a, **kw)

    def spy_bwd(kernel, *a, **kw):
        used.add(("bwd", kernel))
        return bwd(kernel, *a, **kw)

    ring._block_forward, ring._block_backward = spy_fwd, spy_bwd


def _one_case(group, cp: int, idx: int, shape, dtype, used: set) -> dict:
    """Ring attention on shard ``idx`` of a ``cp``-way split vs SDPA on the full sequence (fp64,
    on the inputs rounded to ``dtype``); max abs errors, the reference's scale and the traffic."""
    import torch.nn.functional as F

    from vitp.parallel import comm
    from vitp.parallel.ring import ring_attention

    B, H, n, hd = shape
    g = torch.Generator().manual_seed(10 * cp + n)
    full = [torch.randn(B, H, cp * n, hd, generator=g, dtype=torch.float64).to(dtype) for _ in range(3)]
    dout = torch.randn(B, H, cp * n, hd, generator=g, dtype=torch.float64).to(dtype)
    ref_in = [t.detach().double().clone().requires_grad_() for t in full]
    ref = F.scaled_dot_product_attention(*ref_in, scale=SCALE)
    ref.backward(dout.double())
    rows = slice(idx * n, (idx + 1) * n)
    shard = [t[:, :, rows].clone().requires_grad_() for t in full]  # full: no grad
    used.clear()
    with comm.CommRecorder() as rec:
        out = ring_attention(*shard, group, SCALE)
        out.backward(dout[:, :, rows])
    res_kernels = sorted(used)
    err = lambda a, b: (a.double() - b[:, :, rows]).abs().max().item()  # noqa: E731
    res = {"out": err(out, ref.detach()), "dtype_out": str(out.dtype), "kernels": res_kernels}
    for name, s, r in zip("qkv", shard, ref_in):
        res["d" + name] = err(s.grad, r.grad)
    res["ref_scale"] = min(r.grad.abs().max().item() for r in ref_in)  # every gradient non-trivial
    res["traffic"] = {d: [(r.kind, r.nbytes, r.tag) for r in rec.records if r.direction == d] for d in ("fwd", "bwd")}
    return res


def worker_ring(rank: int) -> dict:
    """Every case of :data:`CASES` on this rank of a 4-rank gloo world."""
    import torch.distributed as dist

    from vitp.parallel import ring

    used: set = set()
    _spy_kernels(ring, used)
    dist.init_process_group("gloo")
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    singles = [dist.new_group([r]) for r in range(4)]
    groups = {4: (None, rank), 2: (pairs[rank // 2], rank % 2), 1: (singles[rank], 0)}
    res = {}
    for path, dname, cp, sname in ALL:
        group, idx = groups[cp]
        ring._USE_FUSED = path == "fused"
        res[_key(path, dname, cp, sname)] = _one_case(group, cp, idx, SHAPES[sname], DTYPES[dname], used)
    dist.destroy_process_group()
    return res


@pytest.fixture(scope="module")
def ring4():
    return run_ranks(4, worker_ring)


@pytest.mark.parametrize("case", ALL, ids=[_key(*c) for c in ALL])
def test_ring_attention_matches_full_sdpa(ring4, case):
    """Both block paths match full SDPA, and each call used the path asked for: on CPU the fused
    flash op by default (every dtype), the math blocks when forced; cp=1 calls SDPA, no blocks."""
    path, dname, cp, sname = case
    key = _key(*case)
    kernel = "cpu_flash" if path == "fused" else "math"
    for rank, res in enumerate(ring4):
        r = res[key]
        msg = f"{key} rank {rank}: {r}"
        assert r["kernels"] == ([("bwd", kernel), ("fwd", kernel)] if cp > 1 else []), msg
        assert r["dtype_out"] == str(DTYPES[dname]), msg
        assert r["ref_scale"] > 1e-2, msg
        assert max(r["out"], r["dq"], r["dk"], r["dv"]) < TOL[dname], msg


@pytest.mark.parametrize("case", ALL, ids=[_key(*c) for c in ALL])
def test_ring_traffic_matches_formula(ring4, case):
    """Forward: cp-1 sends of K and V (2N elements, input dtype); backward: cp-1 sends of K and V
    plus cp sends of dK and dV (2N elements, accumulation dtype); nothing at cp=1."""
    from vitp.parallel.ring import ring_traffic

    _, dname, cp, sname = case
    B, H, n, hd = SHAPES[sname]
    N, s = B * H * n * hd, DTYPES[dname].itemsize
    a = 8 if dname == "fp64" else 4
    kv, dkv = [("send_recv", 2 * N * s, "cp")], [("send_recv", 2 * N * a, "cp")]
    want_fwd = kv * (cp - 1)
    want_bwd = sorted(kv * (cp - 1) + dkv * cp) if cp > 1 else []
    for res in ring4:
        t = res[_key(*case)]["traffic"]
        assert t["fwd"] == want_fwd and sorted(t["bwd"]) == want_bwd, t
        got = {d: sum(b for _, b, _ in t[d]) for d in t}
        assert got == ring_traffic(B, H, n, hd, cp, DTYPES[dname])
    if cp > 1:
        assert got == {"fwd": 2 * N * (cp - 1) * s, "bwd": 2 * N * (cp - 1) * s + 2 * N * cp * a}


def test_ring_attention_refuses_dropout_and_bad_shapes():
    from vitp.parallel.ring import ring_attention

    x = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="not supported with cp_mode=ring.*attn_drop=0.*ulysses"):
        ring_attention(x, x, x, None, 0.5, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"\(B, H, n, hd\)"):
        ring_attention(x, x[:, :, :2], x, None, 0.5)


@pytest.mark.parametrize("dname", list(DTYPES))
def test_block_kernel_defaults_to_cpu_flash(dname, monkeypatch):
    """On CPU every float dtype takes the fused flash op unless the math path is forced."""
    from vitp.parallel import ring

    q = torch.zeros(1, 2, 3, 4, dtype=DTYPES[dname])
    assert ring._block_kernel(q) == "cpu_flash"
    monkeypatch.setattr(ring, "_USE_FUSED", False)
    assert ring._block_kernel(q) == "math"
