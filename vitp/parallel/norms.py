"""Norms over a feature width that tensor parallelism splits.

A norm whose statistic spans every head (Wan's q/k ``RMSNorm`` over the whole inner width ``D``,
``qk_norm="rms_norm_across_heads"`` in diffusers) cannot run on one rank's heads alone: each rank
holds the ``D / tp`` channels of its heads. :class:`TPRMSNorm` sums the per-token sum of squares
over the TP group (one all-reduce of ``(..., 1)``, forward and backward) and normalises its own
channels with the total, which is exactly the unsplit norm (the column-parallel split of
Megatron-LM, Shoeybi et al. 2019, leaves each rank whole heads, i.e. contiguous channels).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from .layers import _mark_sharded, shard_tensor
from .mappings import NoDeepcopy, sum_over_tp_region
from .state import ParallelState


class TPRMSNorm(NoDeepcopy, nn.Module):
    """``nn.RMSNorm`` over a width ``D`` split contiguously over the TP group: rank ``r`` holds
    channels ``[r D / tp, (r + 1) D / tp)`` (its heads' channels when heads are split) and the
    matching slice of the weight (sharded: ``tensor_model_parallel``, ``partition_dim`` 0, stride
    1; each weight channel meets only this rank's channel, so its gradient is complete here and
    needs no all-reduce).

    ``forward(x (..., D / tp)) -> (..., D / tp)``:
    ``x * rsqrt(all_reduce(sum(x^2, -1)) / D + eps) * weight``, computed as ``torch``'s
    ``rms_norm`` does (fp32 for fp16/bf16 inputs, cast back; ``eps=None`` is the computation
    dtype's machine epsilon). The all-reduce (:func:`vitp.parallel.mappings.sum_over_tp_region`,
    tag ``tp``) carries ``(..., 1)`` in the computation dtype; its backward all-reduces the
    gradient of the sum, which every rank's channels contributed to. Use :meth:`from_rmsnorm`.
    """

    def __init__(self, weight: Optional[nn.Parameter], width: int, eps: Optional[float], state: ParallelState):
        super().__init__()
        self.width, self.eps, self.group = int(width), eps, state.tp_group
        self.weight = weight
        self._local = False  # tests only: normalise over this rank's channels alone (the wrong, per-rank norm)

    @classmethod
    def from_rmsnorm(cls, norm: nn.RMSNorm, state: ParallelState) -> "TPRMSNorm":
        """This rank's part of a full ``nn.RMSNorm`` (identical on all TP ranks).

        Raises ``TypeError`` for another module, ``ValueError`` for a multi-dimensional
        ``normalized_shape`` or a width that tp does not divide.
        """
        if not isinstance(norm, nn.RMSNorm):
            raise TypeError(f"expected torch.nn.RMSNorm, got {type(norm).__name__}")
        if len(norm.normalized_shape) != 1:
            raise ValueError(f"TPRMSNorm normalises one dimension, got normalized_shape={norm.normalized_shape}")
        width = norm.normalized_shape[0]
        if width % state.tp_size:
            raise ValueError(f"parallel.tp={state.tp_size} does not divide the norm width {width}")
        weight = None
        if norm.weight is not None:
            part = shard_tensor(norm.weight, 0, 1, state.tp_size, state.tp_rank)
            weight = nn.Parameter(part.detach().clone(), requires_grad=norm.weight.requires_grad)
            if state.tp_size > 1:
                _mark_sharded(weight, 0, 1)
        return cls(weight, width, norm.eps, state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        xf = x.to(dtype)
        ss = xf.pow(2).sum(-1, keepdim=True)  # (..., 1)
        width = x.shape[-1] if self._local else self.width
        if not self._local:
            ss = sum_over_tp_region(ss, self.group, "tp")
        eps = torch.finfo(dtype).eps if self.eps is None else self.eps
        y = xf * torch.rsqrt(ss / width + eps)
        if self.weight is not None:
            y = y * self.weight
        return y.type_as(x)

    def extra_repr(self) -> str:
        local = self.weight.shape[0] if self.weight is not None else "?"
        return f"width={self.width} (local {local}), eps={self.eps}"
