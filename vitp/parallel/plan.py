"""One declarative parallel plan per model, applied by one function.

A :class:`ParallelPlan` is a table of :class:`PlanRow`: a module-path pattern, a
:mod:`parallel style <vitp.parallel.styles>` and the modes (``tp``, ``sp``, ``partial``) it
applies in (torchtitan's ``parallelize_module(model, mesh, {"layers.*.attention.wq":
ColwiseParallel(), ...})``, pytorch/torchtitan ``torchtitan/models/llama3/infra/parallelize.py``).
Paths are canonical: the plan's ``layers`` function names the model's top-level layers (for the
generator ``embed``, ``blocks.<i>``, ``final``, whether they sit in one module or in the stages of
a DeepSpeed pipeline), and a pattern matches ``<layer>.<submodule path>`` component by component
(``*`` matches one component: ``blocks.*.attn`` is every block's attention, not its children).

:func:`apply_plan` applies the rows in table order and returns a :class:`PlanReport`: the rows and
the modules each matched, the parameters sharded and those replicated with partial gradients,
and (:meth:`PlanReport.collectives`) the collectives a micro-batch and a step issue. The planner
(:mod:`vitp.plan`) builds the same report with :func:`describe_plan` on a ``meta``-device model
without applying anything, so the two cannot drift. A row whose pattern names no layer of the
model, or a present layer but no module of it, is an error: a typo in a plan cannot silently
leave a module unsharded.

A new parallel dimension adds styles and rows; the model code stays free of parallel code.
"""
from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch.nn as nn

from .state import ParallelState
from .styles import (
    AXES,
    MODES,
    Collective,
    HeadParallelAttention,
    HiddenParallelMlp,
    ParallelStyle,
    PartialGradient,
    PlanContext,
    plan_mode,
)
from .report import PlanReport
from .timm_tp import TPAttention, is_timm_block, sequence_parallel_enter, sequence_parallel_exit

log = logging.getLogger("vitp")

Layers = Callable[[nn.Module], List[Tuple[str, nn.Module]]]


@dataclass(frozen=True)
class PlanRow:
    """``pattern`` (canonical module path, ``*`` = one component) -> ``style``, in ``modes``,
    when the parallel degree ``axis`` (``tp`` or ``cp``) is above 1. ``optional``: the pattern
    names a module only some variants of the model have (text conditioning's cross-attention),
    so matching none is not an error."""

    pattern: str
    style: ParallelStyle
    modes: Tuple[str, ...] = MODES
    axis: str = "tp"
    optional: bool = False

    def __post_init__(self):
        bad = [m for m in self.modes if m not in MODES]
        if bad:
            raise ValueError(f"plan row {self.pattern!r}: unknown mode(s) {bad}; use {MODES}")
        if self.axis not in AXES:
            raise ValueError(f"plan row {self.pattern!r}: unknown axis {self.axis!r}; use {AXES}")


@dataclass(frozen=True)
class ParallelPlan:
    """A model's plan: its ``rows``, the canonical ``roots`` of its layers (first path
    components a row may name) and ``layers(model)`` -> ``[(canonical name, module)]`` of the
    top-level layers a model (or one pipeline stage of it) holds."""

    name: str
    rows: Tuple[PlanRow, ...]
    roots: Tuple[str, ...]
    layers: Layers

    def with_rows(self, *rows: PlanRow) -> "ParallelPlan":
        """This plan with ``rows`` appended (tests; a new axis adds rows this way)."""
        return ParallelPlan(self.name, self.rows + tuple(rows), self.roots, self.layers)


@dataclass
class _Match:
    name: str  # canonical path
    module: nn.Module
    parent: Optional[nn.Module]
    attr: str


def _path_match(pattern: Sequence[str], path: Sequence[str]) -> bool:
    return len(pattern) == len(path) and all(fnmatch.fnmatchcase(p, q) for q, p in zip(pattern, path))


def _matches(row: PlanRow, layers: List[Tuple[str, nn.Module]]) -> List[_Match]:
    pat = row.pattern.split(".")
    out = []
    for lname, layer in layers:
        base = lname.split(".")
        if not _path_match(pat[:len(base)], base):
            continue
        for sub, m in layer.named_modules():
            if _path_match(pat, base + (sub.split(".") if sub else [])):
                parent_path, _, attr = sub.rpartition(".")
                parent = layer.get_submodule(parent_path) if sub else None
                out.append(_Match(f"{lname}.{sub}" if sub else lname, m, parent, attr))
    return out


def _check_row(plan: ParallelPlan, row: PlanRow, layers, matches: List[_Match]) -> None:
    root = row.pattern.split(".")[0]
    if not any(fnmatch.fnmatchcase(r, root) for r in plan.roots):
        raise ValueError(f"parallel plan {plan.name!r}: row {row.pattern!r} ({row.style}) names no layer of the "
                         f"model; its layers are {', '.join(plan.roots)}: fix the pattern")
    present = [n for n, _ in layers if fnmatch.fnmatchcase(n.split(".")[0], root)]
    if present and not matches and not row.optional:
        names = sorted({f"{n}.{s}" if s else n for n, layer in layers[:3] for s, _ in layer.named_modules()})
        raise ValueError(f"parallel plan {plan.name!r}: row {row.pattern!r} ({row.style}) matches no module of the "
                         f"model; module paths look like {', '.join(names[:12])} ...: fix the pattern")


def _memo(memo: Optional[dict], key: tuple, fn: Callable):
    """``fn()``, remembered in ``memo`` under ``key`` (computed each time without a memo)."""
    if memo is None:
        return fn()
    if key not in memo:
        memo[key] = fn()
    return memo[key]


def _run(layers, plan: ParallelPlan, mode: str, ctx: Optional[PlanContext], axes: Sequence[str],
         memo: Optional[dict] = None) -> PlanReport:
    """Match every row against ``layers`` (checked in every mode), apply those of ``mode`` and an
    active axis (``axes``) when ``ctx`` is given. ``memo`` (describing only): a dict remembering
    each row's matches per layer and each matched module's roles and sizes, keyed by object ids,
    so it must live as long as the layers (the planner's cached meta layers)."""
    report = PlanReport(plan.name, mode, axes=tuple(axes))
    for row in plan.rows:
        matches = (_matches(row, layers) if memo is None else  # per layer: _matches concatenates them
                   [m for lname, layer in layers for m in
                    _memo(memo, ("match", id(row), lname, id(layer)), lambda: _matches(row, [(lname, layer)]))])
        _check_row(plan, row, layers, matches)
        applied = mode in row.modes and row.axis in axes
        report.rows.append((row.pattern, repr(row.style), row.modes, applied, [m.name for m in matches]))
        if not applied:
            continue
        for m in matches:
            roles = _memo(memo, ("roles", id(row.style), id(m.module), mode), lambda: row.style.roles(m.module, mode))
            for n, role in roles.items():
                report.params[f"{m.name}.{n}"] = role
                if role.startswith("partial_grad"):
                    report.partial_grad_elements += _memo(memo, ("numel", id(m.module), n),
                                                          lambda: m.module.get_parameter(n).numel())
            new = row.style.apply(m.module, ctx) if ctx is not None else None
            if new is not None:
                if m.parent is None:
                    raise ValueError(f"parallel plan {plan.name!r}: row {row.pattern!r} would replace a whole "
                                     f"layer ({m.name}); plan its submodules instead")
                setattr(m.parent, m.attr, new)
            report._sizes.append((row.style, _memo(memo, ("sizes", id(row.style), id(m.module)),
                                                   lambda: row.style.sizes(m.module))))
    return report


def _actual_roles(layers) -> Dict[str, str]:
    out, seen = {}, set()
    for lname, layer in layers:  # a parameter is named after the first layer holding it
        for n, p in layer.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if getattr(p, "tensor_model_parallel", False):
                out[f"{lname}.{n}"] = f"sharded(dim={p.partition_dim}, stride={p.partition_stride})"
            for attr in ("sequence_parallel", "tp_partial_grad"):
                if getattr(p, attr, False):
                    out[f"{lname}.{n}"] = f"partial_grad({attr})"
    return out


def _axes(tp: int, cp: int) -> Tuple[str, ...]:
    return tuple(a for a, n in (("tp", tp), ("cp", cp)) if n > 1)


def apply_plan(model: nn.Module, plan: ParallelPlan, state: ParallelState, seq_len: Optional[int] = None,
               grid: Optional[Tuple[int, int, int]] = None) -> PlanReport:
    """Apply ``plan`` to ``model`` (holding full weights, identical on every TP rank) in place,
    log it (INFO on the first TP rank of the first data-parallel replica), and return its
    :class:`PlanReport`. A no-op report when ``state.tp_size == state.cp_size == 1``.

    ``seq_len``: the true token count ``N`` of a sample (each context-parallel rank holds
    ``N / cp``), which sequence-parallel attention drops the padding to (updated later by
    ``set_grid``); ``grid``: the token grid ``(gt, gh, gw)`` (needed with context parallelism).

    Raises
    ------
    ValueError
        A row naming no layer of the model or matching no module of a layer the model holds;
        sizes that tp does not divide; unsupported timm options.
    RuntimeError
        If the parameters' attributes after applying differ from what the styles declared (a
        style whose :meth:`~vitp.parallel.styles.ParallelStyle.roles` is wrong).
    """
    mode = plan_mode(state)
    axes = _axes(state.tp_size, state.cp_size)
    if not axes:
        return PlanReport(plan.name, mode)
    if state.cp_size > 1 and grid is None:
        raise ValueError(f"parallel plan {plan.name!r}: context parallelism needs the token grid (grid=)")
    layers = plan.layers(model)  # before any swap: the layer finder may look for unsharded modules
    local = None if seq_len is None else seq_len // state.cp_size
    report = _run(layers, plan, mode, PlanContext(state, local, grid), axes)
    actual = _actual_roles(layers)
    if actual != report.params:
        diff = sorted(set(actual.items()) ^ set(report.params.items()))[:6]
        raise RuntimeError(f"parallel plan {plan.name!r}: applied parameter roles differ from the declared ones: {diff}")
    # one table per pipeline stage: its first TP rank of the first data-parallel replica
    log.log(logging.INFO if state.tp_rank == 0 and state.dp_rank == 0 else logging.DEBUG,
            "%s", report.table(f"stage {state.pp_rank}"))
    return report


def describe_plan(model: nn.Module, plan: ParallelPlan, mode: str, tp: int = 2, cp: int = 1,
                  memo: Optional[dict] = None) -> PlanReport:
    """The :class:`PlanReport` that :func:`apply_plan` would return in ``mode`` at tensor- and
    context-parallel degrees ``tp`` and ``cp``, without changing ``model`` (which may live on the
    ``meta`` device). ``memo``: see :func:`_run` (the planner describes many stages of one model).
    Raises ``ValueError`` as ``apply_plan``."""
    return _run(plan.layers(model), plan, mode, None, _axes(tp, cp), memo)


# --- stock timm VisionTransformer (or any module holding timm blocks) --------------------------


@dataclass(frozen=True)
class VitSequenceRegion(ParallelStyle):
    """A timm ``VisionTransformer``'s blocks form one sequence-parallel region: tokens are
    scattered before its first block (the true token count handed to its TP attention) and
    gathered after its last."""

    def apply(self, vit, ctx):
        state, blocks = ctx.state, list(vit.blocks)
        attns = [m for m in vit.blocks.modules() if isinstance(m, TPAttention)]

        def enter(_m, args):
            for a in attns:
                a.seq_len = args[0].shape[1]
            return (sequence_parallel_enter(args[0], state),) + args[1:]

        blocks[0].register_forward_pre_hook(enter)
        blocks[-1].register_forward_hook(lambda _m, _a, out: sequence_parallel_exit(out, state, attns[0].seq_len))

    def collectives(self, sizes, shape):
        T = shape.token_bytes(True)
        return [Collective("all_gather", "bwd", "sp_boundary", T), Collective("all_gather", "fwd", "sp_boundary", T)]


def timm_layers(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """``blocks.<i>`` for every timm block in ``model`` (module order), ``vit.<j>`` for every
    timm ``VisionTransformer``."""
    from timm.models.vision_transformer import VisionTransformer

    blocks = [("blocks", m) for m in model.modules() if is_timm_block(m)]
    vits = [("vit", m) for m in model.modules() if isinstance(m, VisionTransformer)]
    return [(f"{root}.{i}", m) for group in (blocks, vits) for i, (root, m) in enumerate(group)]


TIMM_PLAN = ParallelPlan(
    name="timm",
    roots=("blocks", "vit"),
    layers=timm_layers,
    rows=(
        PlanRow("blocks.*.attn", HeadParallelAttention(), ("tp", "sp")),
        PlanRow("blocks.*.mlp", HiddenParallelMlp(), ("tp", "sp")),
        PlanRow("blocks.*", PartialGradient("sequence_parallel", skip=("attn", "mlp")), ("sp",)),
        PlanRow("vit.*", VitSequenceRegion(), ("sp",)),
    ),
)


def tensor_parallelize(model: nn.Module, state: ParallelState, seq_len: Optional[int] = None) -> nn.Module:
    """Shard every timm block (``attn`` and ``mlp`` timm layers holding full weights) of
    ``model`` in place with :data:`TIMM_PLAN` and return ``model``; a no-op when
    ``state.tp_size == 1``. With ``state.sequence_parallel`` the tokens of every timm
    ``VisionTransformer`` are scattered before its first block and gathered after its last; for
    other models the caller opens and closes the region (:func:`sequence_parallel_enter` /
    :func:`sequence_parallel_exit`) and passes ``seq_len``.

    Raises
    ------
    ValueError
        Unsupported timm options, sizes not divisible by tp, no block found, or
        ``parallel.partial_sync < 1`` (which needs a plan that owns the output head, as
        :data:`vitp.models.GENERATOR_PLAN`).
    """
    if state.tp_size == 1:
        return model
    if state.partial:
        raise ValueError("parallel.partial_sync < 1 needs a model plan that owns the output head "
                         "(vitp.models.parallelize_generator); tensor_parallelize supports partial_sync=1 only")
    if not timm_layers(model):
        raise ValueError("tensor_parallelize: no block with timm `attn` and `mlp` children found")
    if state.cp_size > 1:
        raise ValueError("tensor_parallelize supports parallel.cp=1 only; context parallelism needs a model plan "
                         "(vitp.models.parallelize_generator)")
    apply_plan(model, TIMM_PLAN, state, seq_len)
    return model
