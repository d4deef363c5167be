"""Exact (non-causal) ring attention over a context-parallel group.

Each rank of the group holds a contiguous shard of the token sequence. The K/V blocks travel
once around the ring (rank ``r`` sends to ``(r+1) % cp`` and receives from ``(r-1) % cp``) while
every rank attends its local queries to the block it currently holds; partial outputs are merged
with their log-sum-exps, so the result equals softmax attention over the whole sequence
(Liu et al. 2023, "Ring Attention with Blockwise Transformers", arXiv 2310.01889; the merge and
the block backward as in FlashAttention-2, arXiv 2307.08691, and the public reference
github.com/zhuzilin/ring-flash-attention, ``ring_flash_attn/ring_flash_attn.py``).

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


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Attention of ``q`` (B, H, n, hd) over one block ``k``, ``v`` (B, H, m, hd), all in the
    accumulation dtype: ``(out (B, H, n, hd), lse (B, H, n))``."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    return torch.matmul(p, v) / l, (m + torch.log(l)).squeeze(-1)


def _merge(out, lse, block_out, block_lse):
    """Stable merge of two partial softmax attentions over disjoint key sets."""
    new_lse = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - new_lse).unsqueeze(-1) + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1)
    return out, new_lse


def _block_backward(q, k, v, do, lse, delta, scale: float):
    """FlashAttention-2 backward of one block (accumulation dtype): ``(dq, dk, dv)`` of shapes
    of ``q``, ``k``, ``v``; ``lse``, ``delta`` (B, H, n) are the full-row log-sum-exp and
    ``rowsum(dO * O)``."""
    p = torch.exp(torch.matmul(q, k.transpose(-1, -2)) * scale - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), do)
    ds = p * (torch.matmul(do, v.transpose(-1, -2)) - delta.unsqueeze(-1))
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale, dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, tag):
        with torch.autocast(q.device.type, enabled=False):  # keep the block math in the accumulation dtype
            return _RingAttention._forward(ctx, q, k, v, group, scale, tag)

    @staticmethod
    def _forward(ctx, q, k, v, group, scale, tag):
        ring, acc = _Ring(group, tag), _acc_dtype(q.dtype)
        kv = torch.stack([k, v])  # one buffer per step: (2, B, H, n, hd), input dtype
        qa = q.to(acc)
        out = lse = None
        for step in range(ring.cp):
            works = None
            if step < ring.cp - 1:  # the last block goes nowhere
                works, kv_next = ring.shift(kv, "fwd")
            bo, bl = _block_forward(qa, kv[0].to(acc), kv[1].to(acc), scale)  # overlaps the transfer
            out, lse = (bo, bl) if out is None else _merge(out, lse, bo, bl)
            if works is not None:
                _wait(works)
                kv = kv_next
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale = ring, scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        with torch.autocast(dout.device.type, enabled=False):
            return _RingAttention._backward(ctx, dout)

    @staticmethod
    def _backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale, acc = ctx.ring, ctx.scale, _acc_dtype(q.dtype)
        qa, do = q.to(acc), dout.to(acc)
        delta = (do * out.to(acc)).sum(dim=-1)
        dq = torch.zeros_like(qa)
        kv = torch.stack([k, v])
        dkv = dkv_works = None
        for step in range(ring.cp):
            kv_works = None
            if step < ring.cp - 1:
                kv_works, kv_next = ring.shift(kv, "bwd")
            bdq, bdk, bdv = _block_backward(qa, kv[0].to(acc), kv[1].to(acc), do, lse, delta, scale)
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

    Block math is plain matmuls accumulated in fp32 (fp64 for fp64 inputs), on any device (gloo
    or NCCL); a flash kernel per block is the later optimisation. A group of size 1 calls
    ``F.scaled_dot_product_attention``. Traffic: module docstring and :func:`ring_traffic`.
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
