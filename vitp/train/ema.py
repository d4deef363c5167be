"""Exponential moving average of the weights, used for samples and evaluation."""
from __future__ import annotations

from typing import Dict

import torch


class EMA:
    """Exponential moving average of parameters, kept in fp32: ``ema = d * ema + (1 - d) * p``.

    The decay warms up as ``d_n = min(decay, (1 + n) / (10 + n))`` after ``n`` updates (as timm's
    ``ModelEmaV3(use_warmup=True)``), so early samples do not show the zero-initialised model.
    Keys are the module's ``named_parameters`` names (a pipeline stage's own shard).
    """

    def __init__(self, module: torch.nn.Module, decay: float):
        self.decay, self.updates = decay, 0
        self.params = {n: p.detach().float().clone() for n, p in module.named_parameters()}

    @torch.no_grad()
    def update(self, module: torch.nn.Module) -> None:
        """One EMA step towards ``module``'s current parameters (same names as at construction)."""
        d = min(self.decay, (1 + self.updates) / (10 + self.updates))
        self.updates += 1
        ema, live = zip(*((self.params[n], p.detach().float()) for n, p in module.named_parameters()))
        torch._foreach_lerp_(list(ema), list(live), 1 - d)

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """``{parameter name: fp32 EMA tensor}`` (this stage's shard)."""
        return dict(self.params)
