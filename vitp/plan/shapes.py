"""What the planner knows about a model: sizes, parameter counts per layer, TP sharding, stages.

Parameter counts are exact: every layer of :func:`vitp.models.layer_specs` is built on PyTorch's
``meta`` device (shapes, no memory) and its parameters are counted by name. Which parameters a
TP rank holds a ``1/tp`` slice of, which get partial gradients and which collectives a stage
issues is read from the generator's plan itself (:data:`vitp.models.GENERATOR_PLAN`, described on
the meta layers by :func:`vitp.parallel.describe_plan`: :func:`plan_report`), so the planner and
training cannot disagree. ``adaln_sharded=False`` asks what replicating the adaLN modulation
(which the plan shards) would cost.

A Wan model (``model.family=wan``, :mod:`vitp.models.wan`) is counted the same way from its own
layers (``WanEmbed``, ``WanBlock``, ``WanFinal`` on the meta device, :func:`vitp.plan.wan.wan_layer_kwargs`)
and its own plan (:data:`vitp.models.parallelize_wan.WAN_PLAN`), so its counts equal diffusers'
``WanTransformer3DModel`` (``tests/unit/test_plan_wan.py``).

For vitp's generator, what the planner reads of these (parameter counts, each stage's report, the
stage partition) is computed by arithmetic instead (:mod:`vitp.plan.arith`, equal to the meta
layers' facts: ``tests/unit/test_plan_arith.py``), so planning it imports no torch, timm or
DeepSpeed; ``VITP_PLAN_FACTS=meta`` reads them off the meta layers. What is read is kept on disk
(:mod:`vitp.plan.facts`): a Wan model planned before is planned again without DeepSpeed, with the
same numbers (``tests/unit/test_plan_facts.py``).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from vitp.config import mlp_hidden_units
from vitp.models import token_grid
from vitp.utils import to_dict

ADALN = "adaLN_modulation."


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
    text_tokens: int = 0  # caption tokens L of a text-conditional model (model.text_len; 0: class labels)
    text_dim: int = 0  # caption embedding channels Dc (model.text_dim)
    family: str = "vit"  # "vit" (vitp's generator) or "wan" (diffusers' WanTransformer3DModel, vitp.models.wan)

    @property
    def is_wan(self) -> bool:
        return self.family == "wan"

    @functools.cached_property
    def tokens(self) -> int:  # kept: the planner reads it about 90 times per layout
        return math.prod(self.grid)

    @functools.cached_property
    def pixels(self) -> int:
        return self.tokens * self.patch_values

    @classmethod
    def from_config(cls, model: Any) -> "ModelShape":
        """Shape of a ``model`` config section (DictConfig, dataclass or mapping); remembered per
        model (:func:`model_cache`; a :class:`ResolvedModel` keeps its own: the planner asks
        about 20 times per layout)."""
        if isinstance(model, ResolvedModel):
            if model.shape is None:
                model.shape = _shape_of(model)
            return model.shape
        return _shape_of(model)

    @classmethod
    def _from_config(cls, model: Any) -> "ModelShape":
        m = to_dict(model)
        grid = token_grid(m["image_size"], m["num_frames"], m["patch_size"], m["tubelet_size"])  # any (H, W)
        if str(m.get("family", "vit")) == "wan":  # Wan: FFN of ffn_dim, q/k RMSNorm, 512 caption tokens
            from .wan import wan_config_of_model

            w = wan_config_of_model(m)
            return cls(grid=grid, width=m["width"], depth=m["depth"], heads=m["num_heads"], hidden=w["ffn_dim"],
                       mlp="gelu", qk_norm=True, attention="full", layer_scale=False,
                       patch_values=m["tubelet_size"] * m["patch_size"] ** 2 * m["in_channels"],
                       text_tokens=int(m["text_len"]), text_dim=int(m["text_dim"]), family="wan")
        return cls(grid=grid, width=m["width"], depth=m["depth"], heads=m["num_heads"],
                   hidden=mlp_hidden_units(m["width"], m["mlp_ratio"], str(m["mlp"])), mlp=str(m["mlp"]),
                   qk_norm=bool(m["qk_norm"]), attention=str(m["attention"]),
                   patch_values=m["tubelet_size"] * m["patch_size"] ** 2 * m["in_channels"],
                   layer_scale=bool(m.get("layer_scale_init")),
                   text_tokens=int(m.get("text_len") or 0) if m.get("text_dim") else 0, text_dim=int(m.get("text_dim") or 0))

    def block_kind(self, i: int) -> str:
        """Attention of block ``i``: ``full``, or ``spatial`` (even) / ``temporal`` (odd) when factorized."""
        if self.attention == "full":
            return "full"
        return "spatial" if i % 2 == 0 else "temporal"

    def attention_span(self, kind: str) -> int:
        """Keys each query attends to: N (full), gh*gw (spatial), gt (temporal)."""
        gt, gh, gw = self.grid
        return {"full": self.tokens, "spatial": gh * gw, "temporal": gt}[kind]


class ResolvedModel(dict):
    """A ``model`` config section resolved once into a plain dict (``mlp`` and ``attention`` as
    strings) that remembers its :func:`_frozen` key: the planner's formulas take it many times per
    layout (issue 54 item 2). Read-only by convention: the key is not recomputed."""

    key: Tuple = ()
    shape: Optional["ModelShape"] = None  # ModelShape.from_config's answer, kept here

    @classmethod
    def of(cls, model: Any) -> "ResolvedModel":
        """``model`` itself when already resolved, else its resolved copy."""
        if isinstance(model, cls):
            return model
        out = cls({k: str(v) if k in ("mlp", "attention") else v for k, v in to_dict(model).items()})
        out.key = _frozen(dict(out))
        return out


def model_cache(maxsize: int = 4096):
    """Decorator: remember ``fn(model, *args, **kwargs)`` by the model's :func:`_frozen` key and the
    other arguments (hashable), as :func:`functools.lru_cache` would (cleared when full). A list
    result is returned as a new list of the same items (frozen dataclasses: shared, never changed).
    ``fn.put(value, model, *args, **kwargs)`` stores a result computed elsewhere."""
    def decorate(fn):
        cache: Dict[Tuple, Any] = {}

        @functools.wraps(fn)
        def wrapper(model: Any, *args: Any, **kwargs: Any) -> Any:
            key = (_frozen(model), args, tuple(sorted(kwargs.items())) if kwargs else ())
            out = cache.get(key)
            if out is None:
                if len(cache) >= maxsize:
                    cache.clear()
                out = cache[key] = fn(model, *args, **kwargs)
            return list(out) if isinstance(out, list) else out

        def put(value: Any, model: Any, *args: Any, **kwargs: Any) -> None:
            """Remember ``value`` as ``fn(model, *args, **kwargs)`` (a caller that has computed it)."""
            if len(cache) >= maxsize:
                cache.clear()
            cache[(_frozen(model), args, tuple(sorted(kwargs.items())) if kwargs else ())] = value

        wrapper.cache_clear = cache.clear
        wrapper.put = put
        return wrapper
    return decorate


def _frozen(model: Any) -> Tuple:
    if isinstance(model, ResolvedModel) and model.key:
        return model.key

    def leaf(v: Any) -> Any:  # hashable; a list (image_size [H, W]) stays a sequence, not its str
        if isinstance(v, (list, tuple)):
            return tuple(v)
        return v if isinstance(v, (int, float, bool, type(None))) else str(v)

    return tuple(sorted((k, leaf(v)) for k, v in to_dict(model).items()))


def _meta_layers(frozen: Tuple, first: int = 0, end: Optional[int] = None):
    """Layers ``first..end`` of the model on the meta device, in a container named like a
    pipeline stage (``"<layer index>"``). The layers are built once per model (:func:`_meta_model`)
    and shared by every container: read them, never change them."""
    import torch.nn as nn

    full = _meta_model(frozen)[0]
    stage = nn.Module()
    for i in range(first, len(full) if end is None else end):
        stage.add_module(str(i), full[i])
    return stage


@functools.lru_cache(maxsize=16)
def _meta_model(frozen: Tuple) -> Tuple[List[Any], Dict]:
    """``(layers, memo)``: every layer of the model built once on the meta device, and the memo
    :func:`vitp.parallel.describe_plan` keeps for them (keyed by their ids: it lives as long as they do)."""
    return list(_build_meta_layers(frozen).children()), {}


def _build_meta_layers(frozen: Tuple):
    """Every layer of the model, built on the meta device, in a container (:func:`_meta_layers`)."""
    import torch
    import torch.nn as nn

    from vitp.models import layer_specs

    kw = dict(frozen)
    if str(kw.get("family", "vit")) == "wan":
        return _wan_meta_layers(kw)
    for key in ("mlp", "attention"):
        kw[key] = str(kw[key])
    stage = nn.Module()
    with torch.device("meta"):  # shapes only: a 1B-parameter model costs nothing
        for i, (cls, spec) in enumerate(layer_specs(**kw)):
            stage.add_module(str(i), cls(**spec))
    return stage


def _wan_meta_layers(model: Dict[str, Any], first: int = 0, end: Optional[int] = None):
    """Layers ``first..end`` of a Wan model config (embed, blocks, final; :func:`_meta_layers`)."""
    import torch
    import torch.nn as nn

    from vitp.models.wan import WanBlock, WanEmbed, WanFinal

    from .wan import wan_layer_kwargs

    embed, block, final = wan_layer_kwargs(model)
    depth = int(model["depth"])
    stage = nn.Module()
    with torch.device("meta"):
        for i in range(first, depth + 2 if end is None else end):
            cls, kw = (WanEmbed, embed) if i == 0 else (WanFinal, final) if i == depth + 1 else (WanBlock, block)
            stage.add_module(str(i), cls(**kw))
    return stage


@functools.lru_cache(maxsize=64)
def _layer_params(frozen: Tuple) -> Tuple[Tuple[Tuple[str, int], ...], ...]:
    from .facts import facts_of

    def count():
        from . import arith

        if arith.covers(dict(frozen)):  # vitp's generator: by arithmetic, no torch
            return [[[n, c] for n, c in layer] for layer in arith.layer_params(dict(frozen))]
        return [[[n, p.numel()] for n, p in layer.named_parameters()] for layer in _meta_model(frozen)[0]]

    return facts_of(frozen).get("layer_params", count,
                                lambda layers: tuple(tuple((str(n), int(c)) for n, c in layer) for layer in layers))


def layer_params(model: Any) -> List[Dict[str, int]]:
    """``[{param name: numel}]`` per layer: Embed, depth x Block, FinalLayer (full, unsharded)."""
    return [dict(layer) for layer in _layer_params(_frozen(model))]


@functools.lru_cache(maxsize=4096)
def _plan_report(frozen: Tuple, first: int, end: Optional[int], mode: str, tp: int, cp: int):
    from vitp.models import GENERATOR_PLAN
    from vitp.parallel import describe_plan

    plan = GENERATOR_PLAN
    if str(dict(frozen).get("family", "vit")) == "wan":
        from vitp.models.parallelize_wan import WAN_PLAN as plan
    return describe_plan(_meta_layers(frozen, first, end), plan, mode, tp, cp, memo=_meta_model(frozen)[1])


def plan_report(model: Any, mode: str = "tp", first: int = 0, end: Optional[int] = None, tp: int = 2, cp: int = 1):
    """The :class:`vitp.parallel.PlanReport` of :data:`vitp.models.GENERATOR_PLAN` (a Wan model:
    :data:`vitp.models.parallelize_wan.WAN_PLAN`) in ``mode``
    (``tp`` | ``sp`` | ``partial``) at tensor- and context-parallel degrees ``tp`` and ``cp`` (the
    rows of an axis apply when its degree is above 1; the default ``tp=2`` lists the TP roles)
    for layers ``first..end`` (a pipeline stage; all by default) of the ``model`` config, from its
    meta-device layers. Cached: do not modify it. It depends on the degrees only through which
    of them are above 1 (:func:`vitp.parallel.describe_plan`), and is cached by that."""
    return _plan_report(_frozen(model), first, end, mode, min(tp, 2), min(cp, 2))


@functools.lru_cache(maxsize=4096)
def _stage_report(frozen: Tuple, first: int, end: Optional[int], mode: str, tp: int, cp: int):
    from .facts import decode_report, encode_report, facts_of

    from . import arith

    facts = facts_of(frozen)
    whole = first == 0 and end is None

    def compute():
        if arith.covers(dict(frozen)):  # vitp's generator: by arithmetic, no torch
            return arith.report_record(dict(frozen), first, end, mode, tp, cp, whole)
        return encode_report(_plan_report(frozen, first, end, mode, tp, cp), whole)

    return facts.get(f"report/{mode}/{first}/{end}/{tp}/{cp}", compute, lambda rec: decode_report(facts, rec))


def stage_report(model: Any, mode: str = "tp", first: int = 0, end: Optional[int] = None, tp: int = 2, cp: int = 1):
    """What the planner reads of :func:`plan_report` (the same arguments): a
    :class:`vitp.parallel.report.PlanReport` with its collectives, partial-gradient elements and,
    for the whole model (``first=0, end=None``), its parameter roles, but no rows. Kept on disk
    (:mod:`vitp.plan.facts`): a model planned before is read without torch. Cached: do not modify it."""
    return _stage_report(_frozen(model), first, end, mode, min(tp, 2), min(cp, 2))


@model_cache()
def layer_params_per_rank(model: Any, tp: int, adaln_sharded: bool = True) -> List[int]:
    """Parameters a TP rank holds per layer (Embed, blocks, FinalLayer): the plan's sharded
    tensors divided by ``tp`` (the adaLN modulation counted whole when not ``adaln_sharded``)."""
    roles = stage_report(model).params
    depth = to_dict(model)["depth"]
    out = []
    for i, sizes in enumerate(layer_params(model)):
        lname = "embed" if i == 0 else "final" if i == depth + 1 else f"blocks.{i - 1}"
        out.append(sum(n // tp if roles.get(f"{lname}.{k}", "").startswith("sharded")
                       and (adaln_sharded or not k.startswith(ADALN)) else n for k, n in sizes.items()))
    return out


@functools.lru_cache(maxsize=256)
def stage_layer_ranges(depth: int, pp: int) -> List[Tuple[int, int]]:
    """``[(first, end)]`` layer indices (of Embed, blocks, Final) per pipeline stage, as DeepSpeed's
    ``type:BlockPipe`` partition cuts them (:func:`vitp.pipeline.stage_blocks`).

    Raises ``ValueError`` when ``depth < pp``.
    """
    from .facts import stage_ranges

    def cut():
        from . import arith

        if arith.meta_only():
            from vitp.pipeline import stage_blocks
        else:  # DeepSpeed's partition, computed as DeepSpeed computes it, without importing it (torch)
            stage_blocks = arith.stage_blocks
        ranges, start = [], 0
        for s, n in enumerate(stage_blocks(depth, pp)):
            end = start + n + (1 if s == 0 else 0) + (1 if s == pp - 1 else 0)
            ranges.append((start, end))
            start = end
        return ranges

    return stage_ranges(depth, pp, cut)


@model_cache(256)
def _shape_of(model: Any) -> ModelShape:
    return ModelShape._from_config(model)
