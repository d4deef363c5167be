"""What the planner knows about a model: sizes, parameter counts per layer, TP sharding, stages.

Parameter counts are exact: every layer of :func:`vitp.models.layer_specs` is built on PyTorch's
``meta`` device (shapes, no memory) and its parameters are counted by name. Which parameters a
TP rank holds a ``1/tp`` slice of is one rule (:data:`TP_SHARDED`, :func:`is_tp_sharded`)
mirroring :mod:`vitp.parallel.timm_tp`: column-parallel ``qkv`` / ``fc1`` (weight and bias),
row-parallel ``proj`` / ``fc2`` weights, and (``adaln_sharded``, the default, as
:mod:`vitp.models.parallelize` does) the adaLN modulation of every block and of the final layer;
row-parallel biases, norms and embeddings are replicated.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

from vitp.config import mlp_hidden_units
from vitp.models import token_grid
from vitp.utils import to_dict

# name fragments (of a block's parameters) that TP shards; everything else is replicated
TP_SHARDED = ("attn.qkv.", "attn.proj.weight", "mlp.fc1.", "mlp.fc1_g.", "mlp.fc1_x.", "mlp.fc2.weight")
ADALN = "adaLN_modulation."


def is_tp_sharded(name: str, adaln_sharded: bool = False) -> bool:
    """True when TP ranks hold ``1/tp`` of the block parameter ``name`` (e.g. ``attn.qkv.weight``)."""
    return any(f in name for f in TP_SHARDED) or (adaln_sharded and name.startswith(ADALN))


@dataclass(frozen=True)
class ModelShape:
    """The sizes the memory, FLOP and communication formulas use (from a ``model`` config section).

    ``tokens`` N = gt*gh*gw per sample; ``pixels`` values per sample C*T*H*W = N * ``patch_values``
    (pt*p*p*C); ``hidden`` MLP hidden units (SwiGLU: 2/3 of ``mlp_ratio * width``).
    """

    grid: Tuple[int, int, int]
    width: int
    depth: int
    heads: int
    hidden: int
    mlp: str
    qk_norm: bool
    attention: str
    patch_values: int
    layer_scale: bool

    @property
    def tokens(self) -> int:
        return math.prod(self.grid)

    @property
    def pixels(self) -> int:
        return self.tokens * self.patch_values

    @classmethod
    def from_config(cls, model: Any) -> "ModelShape":
        """Shape of a ``model`` config section (DictConfig, dataclass or mapping)."""
        m = to_dict(model)
        grid = token_grid(m["image_size"], m["num_frames"], m["patch_size"], m["tubelet_size"])  # any (H, W)
        return cls(grid=grid, width=m["width"], depth=m["depth"], heads=m["num_heads"],
                   hidden=mlp_hidden_units(m["width"], m["mlp_ratio"], str(m["mlp"])), mlp=str(m["mlp"]),
                   qk_norm=bool(m["qk_norm"]), attention=str(m["attention"]),
                   patch_values=m["tubelet_size"] * m["patch_size"] ** 2 * m["in_channels"],
                   layer_scale=bool(m.get("layer_scale_init")))

    def block_kind(self, i: int) -> str:
        """Attention of block ``i``: ``full``, or ``spatial`` (even) / ``temporal`` (odd) when factorized."""
        if self.attention == "full":
            return "full"
        return "spatial" if i % 2 == 0 else "temporal"

    def attention_span(self, kind: str) -> int:
        """Keys each query attends to: N (full), gh*gw (spatial), gt (temporal)."""
        gt, gh, gw = self.grid
        return {"full": self.tokens, "spatial": gh * gw, "temporal": gt}[kind]


def _frozen(model: Any) -> Tuple:
    def leaf(v: Any) -> Any:  # hashable; a list (image_size [H, W]) stays a sequence, not its str
        if isinstance(v, (list, tuple)):
            return tuple(v)
        return v if isinstance(v, (int, float, bool, type(None))) else str(v)

    return tuple(sorted((k, leaf(v)) for k, v in to_dict(model).items()))


@functools.lru_cache(maxsize=64)
def _layer_params(frozen: Tuple) -> Tuple[Tuple[Tuple[str, int], ...], ...]:
    import torch

    from vitp.models import layer_specs

    kw = dict(frozen)
    for key in ("mlp", "attention"):
        kw[key] = str(kw[key])
    out = []
    with torch.device("meta"):  # shapes only: a 1B-parameter model costs nothing
        for cls, spec in layer_specs(**kw):
            out.append(tuple((n, p.numel()) for n, p in cls(**spec).named_parameters()))
    return tuple(out)


def layer_params(model: Any) -> List[Dict[str, int]]:
    """``[{param name: numel}]`` per layer: Embed, depth x Block, FinalLayer (full, unsharded)."""
    return [dict(layer) for layer in _layer_params(_frozen(model))]


def layer_params_per_rank(model: Any, tp: int, adaln_sharded: bool = True) -> List[int]:
    """Parameters a TP rank holds per layer (sharded block tensors, and the blocks' and final
    layer's adaLN modulation when ``adaln_sharded``, divided by ``tp``)."""
    out, depth = [], to_dict(model)["depth"]
    for i, layer in enumerate(layer_params(model)):
        is_block, is_final = 0 < i <= depth, i == depth + 1
        out.append(sum(n // tp if (is_block and is_tp_sharded(k, adaln_sharded))
                       or (is_final and adaln_sharded and k.startswith(ADALN)) else n for k, n in layer.items()))
    return out


@functools.lru_cache(maxsize=256)
def stage_layer_ranges(depth: int, pp: int) -> List[Tuple[int, int]]:
    """``[(first, end)]`` layer indices (of Embed, blocks, Final) per pipeline stage, as DeepSpeed's
    ``type:BlockPipe`` partition cuts them (:func:`vitp.pipeline.stage_blocks`).

    Raises ``ValueError`` when ``depth < pp``.
    """
    from vitp.pipeline import stage_blocks

    counts = stage_blocks(depth, pp)
    ranges, start = [], 0
    for s, n in enumerate(counts):
        end = start + n + (1 if s == 0 else 0) + (1 if s == pp - 1 else 0)
        ranges.append((start, end))
        start = end
    return ranges
