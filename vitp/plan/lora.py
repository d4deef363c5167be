"""What LoRA (``trainer.lora.enabled``) changes in a plan: adapter parameters per rank and layer,
and the activations they add (planner side; files: :mod:`vitp.models.lora_files`).

The base is frozen: its weights stay (in the training precision) without gradients, optimizer
state, EMA or checkpoint bytes; the adapters get the trainer's state (:data:`vitp.plan.memory.STATE_BYTES`:
model-dtype weights and gradients, fp32 master and AdamW moments split over ``dp x cp`` by ZeRO-1).

A targeted linear ``W (out, in)`` of ``P`` stacked pieces, ``n`` of them targeted, rank ``r``, holds
``A (n r, in)`` and ``B (n out / P, r)`` (LoRA, arXiv:2106.09685). Under tensor parallelism the
adapter follows its base (design invariant 15): column-parallel, A whole and B split over tp;
row-parallel, A split and B whole; replicated linears (embeddings, the output head) whole.

Activations (an estimate, not measured; the base rows of :func:`vitp.plan.memory.wan_block_saved`
are kept as in full fine-tuning, although a frozen linear saves its input only where another
consumer needs it): per targeted linear the ``n r`` intermediate ``x A^T`` per token (over the
gathered tokens in the blocks, the caption's ``L`` for ``cross_attn.kv``, one per sample for the
timestep MLPs, ``N / cp`` for the output head), and with ``dropout > 0`` the dropped input copy
(``in`` values per token, ``in / tp`` on a row-parallel linear) and its byte mask.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from .layout import LayoutSpec, gathered_tokens
from .shapes import ModelShape, _frozen, _meta_layers, plan_report

BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class LoraPlan:
    """The LoRA options the planner reads (``trainer.lora``): rank, targets, the frozen base's
    dtype (``auto``: the training precision) and the adapters' dropout."""

    rank: int
    targets: Tuple[str, ...]
    base_dtype: str = "auto"
    dropout: float = 0.0

    def base_bytes(self, precision: str) -> int:
        """Bytes per frozen base parameter at training ``precision``."""
        return BYTES[precision if self.base_dtype == "auto" else self.base_dtype]


def lora_plan_of(cfg: Any) -> Optional[LoraPlan]:
    """:class:`LoraPlan` of a run config's ``trainer.lora`` (``None`` without
    ``trainer.lora.enabled``: full fine-tuning); no targets = the family's defaults
    (:data:`vitp.models.lora.DEFAULT_TARGETS`); the frozen base is held in the training precision."""
    from vitp.models.lora import DEFAULT_RANK, DEFAULT_TARGETS

    lo = getattr(cfg.trainer, "lora", None)
    if lo is None or not bool(lo.get("enabled", False)):
        return None
    from vitp.models.lora import check_targets

    family = "wan" if str(cfg.model.get("family", "vit")) == "wan" else "vit"
    targets = tuple(str(t) for t in lo.targets) or DEFAULT_TARGETS[family]
    check_targets(family, int(cfg.model.depth), targets)  # as vitp-train refuses a target that adapts nothing
    return LoraPlan(int(DEFAULT_RANK if lo.rank is None else lo.rank), targets, "auto", float(lo.dropout))


def _pieces_of(name: str, wan: bool, stride: int) -> Tuple[str, ...]:
    """Names of the pieces a vitp linear stacks: Wan's diffusers modules (:func:`vitp.models.wan_keys.key_map`),
    else the linear itself ``stride`` times."""
    if wan:
        from vitp.models.wan_keys import _LINEARS, _TOP

        m = re.match(r"^(blocks\.\d+\.)(.+)$", name)
        table = dict(_LINEARS) if m else {v: (d,) for v, d in _TOP}
        if m and m.group(2) in table:
            return tuple(m.group(1) + d for d in table[m.group(2)])
        if name in table:
            return table[name]
    return (name,) * stride


@functools.lru_cache(maxsize=64)
def _linears(frozen: Tuple) -> Tuple[Tuple[Tuple[str, int, int, Tuple[str, ...], str], ...], ...]:
    """Per layer: ``(full name, out, in, piece names, role col|row|rep)`` of every linear."""
    import torch.nn as nn

    model = dict(frozen)
    wan, depth = str(model.get("family", "vit")) == "wan", int(model["depth"])
    roles = plan_report(model).params
    out = []
    for i, layer in enumerate(_meta_layers(frozen).children()):
        lname = "embed" if i == 0 else "final" if i == depth + 1 else f"blocks.{i - 1}"
        rows = []
        for ln, mod in layer.named_modules():
            if not isinstance(mod, nn.Linear):
                continue
            name = f"{lname}.{ln}"
            role = re.match(r"sharded\(dim=(\d), stride=(\d+)\)", roles.get(f"{name}.weight", ""))
            kind = "rep" if not role else "col" if role.group(1) == "0" else "row"
            stride = int(role.group(2)) if role and kind == "col" else 1
            rows.append((name, mod.out_features, mod.in_features, _pieces_of(name, wan, stride), kind))
        out.append(tuple(rows))
    return tuple(out)


def _tokens(name: str, shape: ModelShape, lay: LayoutSpec) -> int:
    """Tokens per sample the linear ``name`` sees on one rank (see the module docstring)."""
    if "cross_attn.kv" in name or "y_embedder" in name:
        return shape.text_tokens
    if "t_embedder" in name or "time_proj" in name:
        return 1
    if name.startswith("final."):
        return shape.tokens // lay.cp
    return gathered_tokens(shape.tokens, lay.tp, lay.sp, lay.cp)


def lora_layer_costs(model: Any, lora: LoraPlan, lay: LayoutSpec) -> Tuple[List[int], List[float]]:
    """``(adapter parameters per rank, saved bytes per sample)`` per layer (Embed, blocks, Final)
    of ``model`` (a config section) in ``lay``."""
    from vitp.models.lora_files import target_pieces

    shape, r, act = ModelShape.from_config(model), lora.rank, BYTES[lay.precision]
    params, saved = [], []
    for rows in _linears(_frozen(model)):
        p = s = 0.0
        for name, out, inp, pieces, kind in rows:
            n = len(target_pieces(name, pieces, lora.targets))
            if not n:
                continue
            a, b = n * r * inp, n * out // len(pieces) * r
            p += a + b / lay.tp if kind == "col" else a / lay.tp + b if kind == "row" else a + b
            t = _tokens(name, shape, lay)
            s += t * n * r * act
            if lora.dropout > 0:
                s += t * (inp / lay.tp if kind == "row" else inp) * (act + 1)
        params.append(int(p))
        saved.append(s)
    return params, saved


def lora_params(model: Any, targets: Any, rank: int) -> int:
    """Adapter parameters of the whole model (tp = 1) with ``targets`` at ``rank``: what peft
    counts on the same linears (``tests/unit/test_plan_wan.py`` holds them equal for Wan)."""
    lay = LayoutSpec(tp=1, cp=1, pp=1, dp=1, sp=False, ac=0, micro=1, accum=1, precision="fp32")
    return sum(lora_layer_costs(model, LoraPlan(rank, tuple(targets)), lay)[0])
