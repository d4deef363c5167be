"""Exponential moving average of the weights, used for samples and evaluation."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

import vitp.deepspeed_adapter as ds

CHUNK = 1 << 24  # elements per fused update: bounds the fp32 copies of bf16 weights an update makes


class EMA:
    """Exponential moving average of parameters, kept in fp32: ``ema = d * ema + (1 - d) * p``.

    The decay warms up as ``d_n = min(decay, (1 + n) / (10 + n))`` after ``n`` updates (as timm's
    ``ModelEmaV3(use_warmup=True)``), so early samples do not show the zero-initialised model.
    Keys are the module's ``named_parameters`` names (a pipeline stage's own shard) of the
    parameters that require a gradient (a LoRA run's adapters: the frozen base has no EMA). Sharded like
    the optimizer (ZeRO-1): ``fragments`` gives, per parameter, the flat range ``(start, numel)``
    of its shard this rank keeps (:func:`vitp.checkpoint.train_state.fragments`; default the
    whole parameter), so the EMA costs ``4 / (dp cp)`` bytes per parameter of the shard; each
    update copies at most :data:`CHUNK` elements to fp32 at once.
    """

    def __init__(self, module: torch.nn.Module, decay: float, fragments: Optional[Dict[str, Tuple[int, int]]] = None):
        self.decay, self.updates = decay, 0
        named = {n: p for n, p in module.named_parameters() if p.requires_grad}  # LoRA: the adapters
        self.sharded = fragments is not None
        self.fragments = fragments if self.sharded else {n: (0, p.numel()) for n, p in named.items()}
        self.params = {n: self._live(p, n).float().clone() for n, p in named.items()}

    def _live(self, p: torch.Tensor, name: str) -> torch.Tensor:
        start, n = self.fragments[name]
        return p.detach().reshape(-1).narrow(0, start, n)

    @torch.no_grad()
    def update(self, module: torch.nn.Module) -> None:
        """One EMA step towards ``module``'s current parameters (same names as at construction)."""
        d = min(self.decay, (1 + self.updates) / (10 + self.updates))
        self.updates += 1
        ema, live, size = [], [], 0
        for n, p in module.named_parameters():
            if n not in self.params:  # frozen (a LoRA run's base)
                continue
            ema.append(self.params[n])
            live.append(self._live(p, n).float())
            size += ema[-1].numel()
            if size >= CHUNK:
                torch._foreach_lerp_(ema, live, 1 - d)
                ema, live, size = [], [], 0
        if ema:
            torch._foreach_lerp_(ema, live, 1 - d)

    def full(self, name: str, p: torch.Tensor) -> torch.Tensor:
        """The fp32 EMA of parameter ``name`` shaped like ``p``: sharded, this rank's fragment
        summed over the parameter's data-parallel partition group (collective over that group)."""
        if not self.sharded:
            return self.params[name].view(p.shape)
        start, k = self.fragments[name]
        out = torch.zeros(p.numel(), dtype=torch.float32, device=self.params[name].device)
        out.narrow(0, start, k).copy_(self.params[name])
        torch.distributed.all_reduce(out, group=ds.partition_group(p))
        return out.view(p.shape)
