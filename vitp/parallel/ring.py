"""Exact (non-causal) ring attention over a context-parallel group.

Each rank of the group holds a contiguous shard of the token sequence. The K/V blocks travel
once around the ring (rank ``r`` sends to ``(r+1) % cp`` and receives from ``(r-1) % cp``) while
every rank attends its local queries to the block it currently holds; partial outputs are merged
with their log-sum-exps, so the result equals softmax attention over the whole sequence
(Liu et al. 2023, "Ring Attention with Blockwise Transformers", arXiv 2310.01889; the merge and
the block backward as in FlashAttention-2, arXiv 2307.08691, and the public reference
github.com/zhuzilin/ring-flash-attention, ``ring_flash_attn/ring_flash_attn.py``). Per block
torch's fused SDPA kernels that return the log-sum-exp run, as in torch's ``context_parallel``
(torch/distributed/tensor/experimental/_context_parallel/_attention.py); the backward of each
block takes the merged output and log-sum-exp, which makes it that block's exact share of dq,
dk, dv.

Backward scheme (that of ring-flash-attention): K/V travel the ring again, and the dK/dV
accumulator of each block travels one hop behind with it: at step ``s`` rank ``r`` holds block
``(r - s) % cp``, adds its queries' contribution to the accumulator received from ``r - 1`` and
passes it on; after the last step the accumulator of block ``r`` has visited every rank and
arrives home with one more hop.

Traffic per call, per rank, with ``N = B*H*n*hd`` (one ``send_recv`` record per transfer, tag
``tag``; ``s`` the input element size, ``a`` that of the accumulation dtype: 4 for
fp16/bf16/fp32, 8 for fp64):

- forward: ``cp - 1`` records of ``2N`` elements (K and V), ``2N (cp-1) s`` bytes;
- backward: ``cp - 1`` records of ``2N`` elements (K and V) and ``cp`` records of ``2N``
  elements (dK and dV in the accumulation dtype), ``2N (cp-1) s + 2N cp a`` bytes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from . import comm

__all__ = ["ring_attention", "ring_traffic"]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64; every other float accumulates in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def ring_traffic(B: int, H: int, n: int, hd: int, cp: int, dtype: torch.dtype) -> dict:
    """Bytes one rank sends in one :func:`ring_attention` call: ``{"fwd": ..., "bwd": ...}``
    (formula in the module docstring); ``0`` for ``cp == 1``."""
    if cp <= 1:
        return {"fwd": 0, "bwd": 0}
    N, s, a = B * H * n * hd, dtype.itemsize, _acc_dtype(dtype).itemsize
    return {"fwd": 2 * N * (cp - 1) * s, "bwd": 2 * N * (cp - 1) * s + 2 * N * cp * a}


class _Ring:
    """Neighbours of this rank in ``group`` and one ring step (send to next, receive from previous)."""

    def __init__(self, group, tag: str) -> None:
        group = dist.group.WORLD if group is None else group
        self.group, self.tag = group, tag
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.cp)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.cp)

    def shift(self, buf: torch.Tensor, direction: str):
        """Start sending ``buf`` to the next rank and receiving the previous rank's into a new
        buffer; returns ``(pending, received)``: :func:`_wait` on ``pending`` before reading
        ``received`` (``pending`` also keeps ``buf`` alive while it is sent)."""
        recv = torch.empty_like(buf)
        comm.record("send_recv", self.group, buf.numel(), buf.shape, buf.dtype, direction, self.tag)
        ops = [dist.P2POp(dist.isend, buf, self.next, self.group),
               dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return (dist.batch_isend_irecv(ops), buf), recv


def _wait(pending) -> None:
    for w in pending[0]:
        w.wait()


# Per-block kernels. ``_USE_FUSED = False`` forces the math path everywhere (tests keep it covered).
_USE_FUSED = True
_aten = torch.ops.aten


def _block_kernel(q: torch.Tensor) -> str:
    """Kernel for the blocks of one call, chosen by device and dtype: ``"cpu_flash"`` (CPU, any
    float), ``"cuda_flash"`` / ``"cuda_efficient"`` where torch's own SDPA checks accept ``q``
    (flash: fp16/bf16, head dim limits, GPU arch; efficient: also fp32), else ``"math"``."""
    if not _USE_FUSED:
        return "math"
    if q.device.type == "cpu":
        return "cpu_flash"
    if q.device.type == "cuda" and q.dtype != torch.float64:
        params = torch.backends.cuda.SDPAParams(q, q, q, None, 0.0, False, False)
        if torch.backends.cuda.can_use_flash_attention(params):
            return "cuda_flash"
        if torch.backends.cuda.can_use_efficient_attention(params):
            return "cuda_efficient"
    return "math"


def _block_forward_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Attention of ``q`` (B, H, n, hd) over one block ``k``, ``v`` (B, H, m, hd), all in the
    accumulation dtype, with plain matmuls (materialises the (n, m) scores):
    ``(out (B, H, n, hd), lse (B, H, n))``."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    return torch.matmul(p, v) / l, (m + torch.log(l)).squeeze(-1)


def _block_forward(kernel: str, q, k, v, scale: float):
    """One block's attention ``(out, lse, extra)``: ``q``, ``k``, ``v`` (B, H, n, hd) in the input
    dtype; ``out`` (B, H, n, hd) and ``lse`` (B, H, n) in the accumulation dtype; ``extra`` what the
    matching fused backward needs (None for math and CPU). The fused ops are those torch's
    ``context_parallel`` calls per block (torch/distributed/tensor/experimental/_context_parallel)."""
    acc = _acc_dtype(q.dtype)
    if kernel == "math":
        return (*_block_forward_math(q.to(acc), k.to(acc), v.to(acc), scale), None)
    if kernel == "cpu_flash":
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)
        return out.to(acc), lse.to(acc), None
    if kernel == "cuda_flash":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = _aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, False, False, scale=scale)
        return out.to(acc), lse, (cum_q, cum_k, max_q, max_k, seed, offset)
    # cuda_efficient: its lse is (B, H, n padded to a multiple of 32); keep the n real rows
    out, lse, seed, offset = _aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False,
                                                                         scale=scale)
    return out.to(acc), lse[..., :q.shape[2]], (seed, offset, lse.shape[-1])


def _merge(out, lse, block_out, block_lse):
    """Stable merge of two partial softmax attentions over disjoint key sets."""
    new_lse = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - new_lse).unsqueeze(-1) + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1)
    return out, new_lse


def _block_backward_math(q, k, v, do, lse, delta, scale: float):
    """FlashAttention-2 backward of one block (accumulation dtype): ``(dq, dk, dv)`` of shapes
    of ``q``, ``k``, ``v``; ``lse``, ``delta`` (B, H, n) are the full-row log-sum-exp and
    ``rowsum(dO * O)``."""
    p = torch.exp(torch.matmul(q, k.transpose(-1, -2)) * scale - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), do)
    ds = p * (torch.matmul(do, v.transpose(-1, -2)) - delta.unsqueeze(-1))
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale, dv


def _block_backward(kernel: str, q, k, v, do, out, lse, scale: float, extra, delta=None):
    """This block's share of ``(dq, dk, dv)`` (accumulation dtype). ``q``, ``k``, ``v``, ``do``,
    ``out`` (B, H, n, hd) in the input dtype, ``out`` and ``lse`` (B, H, n) the MERGED ones over
    all blocks: with them the block backward yields exactly this block's term of the full
    gradient (P_block = exp(S_block - lse), D = rowsum(dO * O) of the whole row; FlashAttention-2
    backward, arXiv 2307.08691). ``delta`` (math path only) is ``rowsum(dO * O)``."""
    acc = _acc_dtype(q.dtype)
    if kernel == "math":
        return _block_backward_math(q.to(acc), k.to(acc), v.to(acc), do.to(acc), lse, delta, scale)
    if kernel == "cpu_flash":
        grads = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse, 0.0, False, scale=scale)
    elif kernel == "cuda_flash":
        cum_q, cum_k, max_q, max_k, seed, offset = extra
        grads = _aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, False, seed, offset, scale=scale)
    else:  # cuda_efficient: the kernel wants the padded lse layout of its forward
        seed, offset, padded = extra
        lse_p = lse.new_zeros(*lse.shape[:-1], padded)
        lse_p[..., :lse.shape[-1]] = lse
        grads = _aten._scaled_dot_product_efficient_attention_backward(
            do, q, k, v, None, out, lse_p, seed, offset, 0.0, [True, True, True, False], False, scale=scale)
    return tuple(g.to(acc) for g in grads[:3])


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, tag):
        with torch.autocast(q.device.type, enabled=False):  # keep the block math in the accumulation dtype
            return _RingAttention._forward(ctx, q, k, v, group, scale, tag)

    @staticmethod
    def _forward(ctx, q, k, v, group, scale, tag):
        ring, kernel = _Ring(group, tag), _block_kernel(q)
        kv = torch.stack([k, v])  # one buffer per step: (2, B, H, n, hd), input dtype
        out = lse = extra = None
        for step in range(ring.cp):
            works = None
            if step < ring.cp - 1:  # the last block goes nowhere
                works, kv_next = ring.shift(kv, "fwd")
            bo, bl, bx = _block_forward(kernel, q, kv[0], kv[1], scale)  # overlaps the transfer
            extra = bx if extra is None else extra  # equal shapes: the same for every block
            out, lse = (bo, bl) if out is None else _merge(out, lse, bo, bl)
            if works is not None:
                _wait(works)
                kv = kv_next
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale, ctx.kernel, ctx.extra = ring, scale, kernel, extra
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        with torch.autocast(dout.device.type, enabled=False):
            return _RingAttention._backward(ctx, dout)

    @staticmethod
    def _backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale, acc, kernel = ctx.ring, ctx.scale, _acc_dtype(q.dtype), ctx.kernel
        do = dout.contiguous()
        delta = (do.to(acc) * out.to(acc)).sum(dim=-1) if kernel == "math" else None
        dq = torch.zeros_like(q, dtype=acc)
        kv = torch.stack([k, v])
        dkv = dkv_works = None
        for step in range(ring.cp):
            kv_works = None
            if step < ring.cp - 1:
                kv_works, kv_next = ring.shift(kv, "bwd")
            bdq, bdk, bdv = _block_backward(kernel, q, kv[0], kv[1], do, out, lse, scale, ctx.extra, delta)
            dq += bdq
            block_dkv = torch.stack([bdk, bdv])
            if dkv_works is not None:  # accumulator of this block, from the previous rank
                _wait(dkv_works)
                block_dkv += dkv
            dkv_works, dkv = ring.shift(block_dkv, "bwd")
            if kv_works is not None:
                _wait(kv_works)
                kv = kv_next
        _wait(dkv_works)  # our own block's accumulator, home after cp hops
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q, k, v, group, scale: float, *, dropout_p: float = 0.0, tag: str = "cp") -> torch.Tensor:
    """Exact softmax attention of this rank's queries over the whole context-parallel sequence.

    Parameters
    ----------
    q, k, v : torch.Tensor
        ``(B, H, n, hd)``: this rank's contiguous token shard (rank ``r`` of ``group`` holds
        tokens ``[r*n, (r+1)*n)`` of the full sequence of ``cp*n`` tokens); every rank passes
        equal shapes and dtype.
    group : ProcessGroup
        The context-parallel group (``cp`` ranks); ``None`` is the default group.
    scale : float
        Multiplies the scores ``q k^T`` (usually ``hd ** -0.5``).
    dropout_p : float
        Must be 0.
    tag : str
        Tag of the ``send_recv`` records (:func:`vitp.parallel.comm.record`).

    Returns
    -------
    torch.Tensor
        ``(B, H, n, hd)`` in the dtype of ``q``: the rows of ``softmax(q K^T * scale) V`` over
        all ``cp*n`` keys for this rank's queries, equal to ``F.scaled_dot_product_attention``
        on the gathered sequence. Differentiable in ``q``, ``k``, ``v``.

    Each block runs a fused kernel that returns its log-sum-exp, chosen per call by device and
    dtype (:func:`_block_kernel`): CPU ``_scaled_dot_product_flash_attention_for_cpu``; CUDA flash
    (fp16/bf16) or memory-efficient attention where torch's SDPA checks accept the inputs; else
    the math blocks (plain matmuls, e.g. fp64 on CUDA). Blocks take the input dtype; the merge,
    dq and the travelling dK/dV accumulate in fp32 (fp64 for fp64), cast back at the end. Saved
    for backward: local q, k, v, out and lse ``(B, H, n)`` (accumulation dtype). A group of size
    1 calls ``F.scaled_dot_product_attention``. Traffic: module docstring and :func:`ring_traffic`.
    Source: Liu et al. 2023 (arXiv 2310.01889); github.com/zhuzilin/ring-flash-attention.

    Raises
    ------
    ValueError
        ``dropout_p > 0`` (attention dropout would need the same mask on every rank's block);
        ``q``, ``k``, ``v`` not 4-D or of different shapes or dtypes.
    """
    if dropout_p > 0:
        raise ValueError(f"attention dropout (p={dropout_p}) is not supported with cp_mode=ring; "
                         "use model.attn_drop=0 or cp_mode=ulysses")
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape or not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"ring_attention: q, k, v must be (B, H, n, hd) of one shape and dtype, got "
                         f"{tuple(q.shape)} {q.dtype}, {tuple(k.shape)} {k.dtype}, {tuple(v.shape)} {v.dtype}")
    if comm.group_size(group) == 1:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    return _RingAttention.apply(q, k, v, group, scale, tag)
