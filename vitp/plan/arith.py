"""The facts the planner reads of vitp's generator (``model.family=vit``), by arithmetic: no torch.

:mod:`vitp.plan.shapes` reads a model's facts off its layers built on the ``meta`` device: each
layer's parameter names and counts, each pipeline stage's :class:`vitp.parallel.report.PlanReport`
(:func:`vitp.parallel.describe_plan` of :data:`vitp.models.GENERATOR_PLAN`: the parameters a TP
rank holds a slice of, those with partial gradients, the collective-issuing modules and their
sizes) and DeepSpeed's ``type:BlockPipe`` partition of the layers into stages. Building those
imports torch, timm (which imports torchvision and ``torch._dynamo``) and DeepSpeed: about 5 CPU-s,
most of a first plan (issue 54 item 2). For the generator the same facts follow from its sizes:

- :func:`layer_params`: ``Embed`` / ``Block`` / ``FinalLayer`` of :mod:`vitp.models.generator`
  with timm's ``Attention``, ``Mlp`` / ``SwiGLU`` and ``LayerScale`` (timm 1.0 parameter names);
- :func:`report_record`: :data:`ROWS`, the rows of :data:`vitp.models.GENERATOR_PLAN` with the
  same styles (:mod:`vitp.parallel.styles`, torch-free), each with what its style's ``roles`` and
  ``sizes`` read off a matched module, grouped as
  :meth:`vitp.parallel.report.PlanReport._groups` groups them and encoded as
  :func:`vitp.plan.facts.encode_report` encodes them;
- :func:`partition_balanced`: DeepSpeed's ``deepspeed.runtime.utils.partition_balanced`` (the
  linear-partition dynamic programme, ties broken as it breaks them).

They are a second description of the model and its plan, so ``tests/unit/test_plan_arith.py``
keeps them equal to the meta-device facts over a grid of configs (every option that changes a
parameter or a row), every mode, tp / cp degree and stage of a few partitions, and to DeepSpeed's
partition for every ``depth <= 64`` and ``pp <= depth``. A config they do not cover (another
family) is built on the meta device as before. ``VITP_PLAN_FACTS=meta`` builds every model there
(to compare by hand).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Tuple

from vitp.config import mlp_hidden_units
from vitp.parallel.styles import (
    ContextEnter,
    ContextExit,
    ContextParallelAttention,
    GatheredColumnParallel,
    HeadParallelAttention,
    HeadParallelCrossAttention,
    HiddenParallelMlp,
    MeanOverTP,
    PartialGradient,
    SequenceEnter,
    SequenceExit,
    TPRegionEnter,
    _partial,
    _partial_attr,
    _sharded,
)

Params = List[Tuple[str, int]]
FREQ_DIM = 256  # vitp.models.layers.TimestepEmbedder's sinusoid channels
BLOCK_REST = ("attn", "cross_attn", "mlp", "adaLN_modulation")
EXACT, ALL = ("tp", "sp"), ("tp", "sp", "partial")


def meta_only() -> bool:
    """Whether ``VITP_PLAN_FACTS=meta`` asks for every fact off the meta-device model (and DeepSpeed)."""
    return os.environ.get("VITP_PLAN_FACTS", "") == "meta"


def covers(model: Dict[str, Any]) -> bool:
    """Whether the facts of ``model`` (a plain config dict) come from here: vitp's generator,
    unless :func:`meta_only`."""
    return str(model.get("family", "vit")) == "vit" and not meta_only()


# --- parameters -------------------------------------------------------------------------------------


def _linear(prefix: str, n_in: int, n_out: int, bias: bool = True) -> Params:
    return [(f"{prefix}.weight", n_out * n_in)] + ([(f"{prefix}.bias", n_out)] if bias else [])


def _norm(prefix: str, n: int, on: bool) -> Params:  # nn.LayerNorm(n) (affine), or nn.Identity
    return [(f"{prefix}.weight", n), (f"{prefix}.bias", n)] if on else []


def _embed(m: Dict[str, Any]) -> Params:
    D, p, pt, C = int(m["width"]), int(m["patch_size"]), int(m["tubelet_size"]), int(m["in_channels"])
    out = _linear("x_embedder.proj", C * pt * p * p, D)  # Conv3d(C, D, kernel (pt, p, p))
    out += _linear("t_embedder.mlp.fc1", FREQ_DIM, D) + _linear("t_embedder.mlp.fc2", D, D)
    text_dim = int(m.get("text_dim") or 0)
    if text_dim:
        return out + _linear("y_embedder.fc1", text_dim, D) + _linear("y_embedder.fc2", D, D) + _linear("y_pool", D, D)
    return out + [("y_embedder.weight", (int(m["num_classes"]) + 1) * D)]


def _block(m: Dict[str, Any]) -> Params:
    D, heads, bias, qk = int(m["width"]), int(m["num_heads"]), bool(m["qkv_bias"]), bool(m["qk_norm"])
    hd, mlp = D // heads, str(m["mlp"])
    hidden = mlp_hidden_units(D, m["mlp_ratio"], mlp)
    out = _linear("attn.qkv", D, 3 * D, bias) + _norm("attn.q_norm", hd, qk) + _norm("attn.k_norm", hd, qk)
    out += _linear("attn.proj", D, D)
    fc1 = ("mlp.fc1_g", "mlp.fc1_x") if mlp == "swiglu" else ("mlp.fc1",)
    out += [x for fc in fc1 for x in _linear(fc, D, hidden)] + _linear("mlp.fc2", hidden, D)
    if m.get("layer_scale_init"):
        out += [("ls1.gamma", D), ("ls2.gamma", D)]
    if int(m.get("text_dim") or 0):
        out += _linear("cross_attn.q", D, D, bias) + _linear("cross_attn.kv", D, 2 * D, bias)
        out += _norm("cross_attn.q_norm", hd, qk) + _norm("cross_attn.k_norm", hd, qk)
        out += _linear("cross_attn.proj", D, D)
    return out + _linear("adaLN_modulation.1", D, 6 * D)


def _final(m: Dict[str, Any]) -> Params:
    D, p, pt, C = int(m["width"]), int(m["patch_size"]), int(m["tubelet_size"]), int(m["in_channels"])
    return _linear("linear", D, pt * p * p * C) + _linear("adaLN_modulation.1", D, 2 * D)


def layer_params(m: Dict[str, Any]) -> List[Params]:
    """``[[(parameter name, numel)]]`` per layer (Embed, ``depth`` x Block, FinalLayer), in
    ``named_parameters`` order: what :func:`vitp.plan.shapes.layer_params` counts on the meta device."""
    block = _block(m)
    return [_embed(m)] + [list(block) for _ in range(int(m["depth"]))] + [_final(m)]


# --- the plan's rows ---------------------------------------------------------------------------------


def _sub(params: Params, prefix: str) -> Params:
    """The parameters under ``prefix`` (names relative to it)."""
    return [(n[len(prefix) + 1:], c) for n, c in params if n.startswith(prefix + ".")]


def _region_roles(params: Params, mode: str, row: str, columns: Dict[str, int]) -> Dict[str, str]:
    """Roles of a TP region (``_TPRegion.roles``): ``row`` row-parallel (bias partial outside tp
    mode), each ``columns`` prefix column-parallel with its stride, q/k norms partial."""
    out = {f"{row}.weight": _sharded(1)}
    if mode != "tp" and any(n == f"{row}.bias" for n, _ in params):
        out[f"{row}.bias"] = _partial(_partial_attr(mode))
    for fc, stride in columns.items():
        out.update({f"{fc}.{n}": _sharded(0, stride) for n, _ in _sub(params, fc)})
    for norm in ("q_norm", "k_norm"):
        out.update({f"{norm}.{n}": _partial("tp_partial_grad") for n, _ in _sub(params, norm)})
    return out


def _attn(params, mode):
    return _region_roles(params, mode, "proj", {"qkv": 3})


def _cross(params, mode):
    return _region_roles(params, mode, "proj", {"q": 1, "kv": 2})


def _mlp(params, mode):  # SwiGLU is not timm's packed GluMlp: stride 1
    return _region_roles(params, mode, "fc2", {fc: 1 for fc in ("fc1", "fc1_g", "fc1_x") if _sub(params, fc)})


def _all_sharded(params, mode):
    return {n: _sharded(0) for n, _ in params}


def _partial_of(attr: str, skip: Tuple[str, ...] = ()):
    return lambda params, mode: {n: _partial(attr) for n, _ in params if n.split(".")[0] not in skip}


def _none(params, mode):
    return {}


def _out(n: Callable[[Dict[str, Any]], int]):
    return lambda m, kind: [("out", n(m))]


_WIDTH = _out(lambda m: int(m["width"]))


def _kind(m, kind):  # ContextParallelAttention: the block's token groups
    return [("kind", kind)]


# (layer kind, submodule path, style, modes, axis, roles(params under the path, mode),
# sizes(model, attention kind) or None)
ROWS: Tuple[tuple, ...] = (
    ("embed", "", ContextEnter(output=0), ALL, "cp", _none, None),
    ("embed", "", SequenceEnter(output=0), ("sp",), "tp", _none, None),
    ("embed", "", TPRegionEnter(output=1, tag="cond"), ALL, "tp", _none, None),
    ("embed", "", TPRegionEnter(output=2, tag="text", caption=True), ALL, "tp", _none, None),
    ("embed", "x_embedder", PartialGradient("tp_partial_grad"), ("partial",), "tp", _partial_of("tp_partial_grad"),
     None),
    ("block", "attn", HeadParallelAttention(), EXACT, "tp", _attn, _WIDTH),
    ("block", "attn", HeadParallelAttention(partial=True), ("partial",), "tp", _attn, _WIDTH),
    ("block", "cross_attn", HeadParallelCrossAttention(), EXACT, "tp", _cross, _WIDTH),
    ("block", "cross_attn", HeadParallelCrossAttention(partial=True), ("partial",), "tp", _cross, _WIDTH),
    ("block", "mlp", HiddenParallelMlp(), EXACT, "tp", _mlp, _WIDTH),
    ("block", "mlp", HiddenParallelMlp(partial=True), ("partial",), "tp", _mlp, _WIDTH),
    ("block", "adaLN_modulation.1", GatheredColumnParallel(partial_output_grad=False), ("tp",), "tp", _all_sharded,
     _out(lambda m: 6 * int(m["width"]))),
    ("block", "adaLN_modulation.1", GatheredColumnParallel(partial_output_grad=True), ("sp", "partial"), "tp",
     _all_sharded, _out(lambda m: 6 * int(m["width"]))),
    ("block", "", PartialGradient("sequence_parallel", skip=BLOCK_REST), ("sp",), "tp",
     _partial_of("sequence_parallel", BLOCK_REST), None),
    ("block", "", PartialGradient("tp_partial_grad", skip=BLOCK_REST), ("partial",), "tp",
     _partial_of("tp_partial_grad", BLOCK_REST), None),
    ("final", "", SequenceExit(input=0), ("sp",), "tp", _none, None),
    ("final", "adaLN_modulation.1", GatheredColumnParallel(partial_output_grad=False), EXACT, "tp", _all_sharded,
     _out(lambda m: 2 * int(m["width"]))),
    ("final", "adaLN_modulation.1", GatheredColumnParallel(partial_output_grad=True), ("partial",), "tp",
     _all_sharded, _out(lambda m: 2 * int(m["width"]))),
    ("final", "linear", PartialGradient("tp_partial_grad"), ("partial",), "tp", _partial_of("tp_partial_grad"), None),
    ("final", "", MeanOverTP(tag="head"), ("partial",), "tp", _none, None),
    ("block", "", ContextParallelAttention(), ALL, "cp", _none, _kind),
    ("final", "linear", ContextExit(), ALL, "cp", _none,
     _out(lambda m: int(m["tubelet_size"]) * int(m["patch_size"]) ** 2 * int(m["in_channels"]))),
)


def _layers(m: Dict[str, Any], first: int, end: Optional[int]) -> List[Tuple[str, str, str, Params]]:
    """``[(kind, canonical name, attention kind, parameters)]`` of layers ``first..end``."""
    depth, params = int(m["depth"]), layer_params(m)
    factorized = str(m["attention"]) != "full"
    out = []
    for i in range(first, depth + 2 if end is None else end):
        if i == 0:
            out.append(("embed", "embed", "", params[0]))
        elif i == depth + 1:
            out.append(("final", "final", "", params[i]))
        else:
            kind = ("spatial" if (i - 1) % 2 == 0 else "temporal") if factorized else "full"
            out.append(("block", f"blocks.{i - 1}", kind, params[i]))
    return out


def report_record(m: Dict[str, Any], first: int, end: Optional[int], mode: str, tp: int, cp: int,
                  with_params: bool) -> Dict[str, Any]:
    """:func:`vitp.plan.facts.encode_report` of the plan report of layers ``first..end`` in ``mode``
    at degrees ``tp`` and ``cp`` (only whether each is above 1 matters), as
    :func:`vitp.plan.shapes._plan_report` builds it; with ``with_params`` its parameter roles."""
    from .facts import style_record

    axes = tuple(a for a, n in (("tp", tp), ("cp", cp)) if n > 1)
    layers = _layers(m, first, end)
    params: Dict[str, str] = {}
    elements, groups = 0, {}
    for row, (kind, path, style, modes, axis, roles, what) in enumerate(ROWS):
        if mode not in modes or axis not in axes:
            continue
        for lkind, lname, attn_kind, lparams in layers:
            sub = _sub(lparams, path) if path else lparams
            if lkind != kind or (path and not sub):  # a submodule matches only where the model has it
                continue  # (cross-attention: text models); the plan's submodules all hold parameters
            for n, role in roles(sub, mode).items():
                params[f"{lname}.{path + '.' if path else ''}{n}"] = role
                if role.startswith("partial_grad"):
                    elements += dict(sub)[n]
            sizes = what(m, attn_kind) if what else []
            key = (row, tuple(sizes))
            groups.setdefault(key, [style_record(style), sizes, 0])[2] += 1
    out = {"plan": "generator", "mode": mode, "axes": list(axes), "partial_grad_elements": elements,
           "groups": [[rec, [list(s) for s in sizes], n] for rec, sizes, n in groups.values()]}
    if with_params:
        out["params"] = params
    return out


# --- DeepSpeed's partition -----------------------------------------------------------------------------


def partition_balanced(weights: List[int], num_parts: int) -> List[int]:
    """``deepspeed.runtime.utils.partition_balanced(weights, num_parts)``: part boundaries
    ``[0, ..., len(weights)]`` minimising the spread between the heaviest and lightest part (the
    linear partition problem by dynamic programming, DeepSpeed's ties: the last best cut wins),
    without importing DeepSpeed (torch). Its ``partition_uniform`` when ``len(weights) <= num_parts``."""
    n, m, inf = len(weights), num_parts, float("inf")
    if n <= m:
        return [min(p, n) for p in range(m + 1)]
    prefix = [0.0] * (n + 1)
    for i, w in enumerate(weights):
        prefix[i + 1] = prefix[i] + w
    dmax = [[inf] * (m + 1) for _ in range(n + 1)]
    dmin = [[inf] * (m + 1) for _ in range(n + 1)]
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    pos = [[0] * (m + 1) for _ in range(n + 1)]
    dmax[0][0] = cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            best, bmax, bmin, bpos = cost[i][j], dmax[i][j], dmin[i][j], pos[i][j]
            for k in range(i):
                s = prefix[i] - prefix[k]
                hi, lo = max(dmax[k][j - 1], s), min(dmin[k][j - 1], s)
                if best >= hi - lo:
                    best, bmax, bmin, bpos = hi - lo, hi, lo, k
            cost[i][j], dmax[i][j], dmin[i][j], pos[i][j] = best, bmax, bmin, bpos
    parts = [n]
    for j in reversed(range(1, m + 1)):
        parts.append(pos[parts[-1]][j])
    return parts[::-1]


def stage_blocks(depth: int, pp: int) -> List[int]:
    """Blocks per stage as :func:`vitp.pipeline.stage_blocks` (DeepSpeed's ``type:BlockPipe``
    partition of ``[Embed, blocks, Final]``) cuts them. Raises ``ValueError`` when ``depth < pp``."""
    if depth < pp:
        raise ValueError(f"model.depth={depth} < parallel.pp={pp}: every pipeline stage needs at least one block; "
                         f"use parallel.pp <= {depth}")
    w = [0] + [1] * depth + [0]
    parts = partition_balanced(w, pp)
    return [sum(w[parts[i]:parts[i + 1]]) for i in range(pp)]
