"""The tensor / sequence-parallel / partial-sync plan of the ViT generator: :data:`GENERATOR_PLAN`,
one table read by training (:func:`parallelize_generator`), the planner (:mod:`vitp.plan`) and
the tests. The styles are :mod:`vitp.parallel.styles`; the machinery :mod:`vitp.parallel.plan`.

Rows, in the order they are applied (modes: ``tp`` exact tensor parallelism, ``sp`` with
sequence parallelism, ``partial`` with ``parallel.partial_sync < 1``):

- ``embed``: with SP its tokens enter the sequence region (split over the TP group after the
  embedding); its conditioning ``c`` ``(B, D)`` enters the TP region: every consumer of ``c``
  (each block's and the final layer's column-parallel modulation) leaves a per-rank partial
  gradient, summed once here (one all-reduce of ``(B, D)`` per micro-batch, tag ``cond``)
  instead of once per block;
- ``blocks.*.attn`` / ``blocks.*.mlp``: heads / hidden units split (qkv column-parallel with
  a per-head stride of 3, proj and fc2 row-parallel); the partial-sync variants sum only
  ``int(p D)`` channels after proj and fc2 and let each rank keep its own residual stream;
- text conditioning (``model.text_dim > 0``): the embedding's caption tokens ``ctx``
  ``(B, L, D)`` enter the TP region like ``c`` (their gradient summed once, tag ``text``), and
  ``blocks.*.cross_attn`` splits by heads (``q``, ``kv`` column-parallel, ``proj``
  row-parallel, as NeMo's DiT); under context parallelism the caption stays whole on every rank
  and cross-attention needs no communication (queries are the rank's tokens);
- ``blocks.*.adaLN_modulation.1`` and ``final.adaLN_modulation.1`` (``Linear(D, 6 D)``, a third
  of a block's ``18 D^2`` weights; ``Linear(D, 2 D)``): column-parallel with the small ``(B, 6 D)``
  output all-gathered; its gradient is reduce-scattered where the output feeds a token shard
  (SP) or a rank's own stream (partial);
- ``blocks.*``: with SP or partial sync the block's other replicated parameters (LayerScale
  gammas) see part of the data, so their gradients are summed over the TP group;
- ``final``: with SP the tokens leave the sequence region before the final layer; with partial
  sync the prediction is the mean over the TP group, and the patch embedding and the output
  head (``embed.x_embedder``, ``final.linear``) get partial gradients.

Context-parallel rows (axis ``cp``, :mod:`vitp.parallel.context`; any mode): the embedding's
tokens are split over the cp group (before the sequence-parallel split, so SP regions hold
``N / (cp tp)`` tokens), every block's attention meets the other shards (Ulysses all-to-all or
ring; factorized blocks trade frames for positions), and the output head's token shards are
all-gathered for the loss, which every cp rank computes whole. All parameters see only their
rank's tokens, so their gradients are summed over cp by the data-parallel reduction over
``dp x cp`` (:class:`vitp.config.Layout`).

The same paths name the layers of a :class:`~vitp.models.Generator` and of a DeepSpeed pipeline
stage (:func:`generator_layers`).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch.nn as nn

from vitp.parallel import ParallelState
from vitp.parallel.plan import ParallelPlan, PlanReport, PlanRow, apply_plan
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
    token_count,
)

from .generator import Block, Embed, FinalLayer


def generator_layers(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """``[(canonical name, layer)]``: ``embed``, ``blocks.<i>``, ``final`` of a
    :class:`~vitp.models.Generator` (``blocks.<i>``), a ``PipelineModule`` or one of its stages
    (layer ``<i + 1>`` is block ``i``), or a lone :class:`~vitp.models.Block` (``blocks.0``)."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, Embed):
            out.append(("embed", m))
        elif isinstance(m, FinalLayer):
            out.append(("final", m))
        elif isinstance(m, Block):
            last = name.rsplit(".", 1)[-1]
            i = int(last) - (0 if name.startswith("blocks.") else 1) if last.isdigit() else 0
            out.append((f"blocks.{i}", m))
    return out


def _final_tokens(final: nn.Module) -> int:
    return token_count(final.grid)


_BLOCK_REST = ("attn", "cross_attn", "mlp", "adaLN_modulation")  # planned by their own rows
EXACT, ALL = ("tp", "sp"), ("tp", "sp", "partial")

GENERATOR_PLAN = ParallelPlan(
    name="generator",
    roots=("embed", "blocks", "final"),
    layers=generator_layers,
    rows=(
        PlanRow("embed", ContextEnter(output=0), axis="cp"),
        PlanRow("embed", SequenceEnter(output=0), ("sp",)),
        PlanRow("embed", TPRegionEnter(output=1, tag="cond"), ALL),
        PlanRow("embed", TPRegionEnter(output=2, tag="text", caption=True), ALL),
        PlanRow("embed.x_embedder", PartialGradient("tp_partial_grad"), ("partial",)),
        PlanRow("blocks.*.attn", HeadParallelAttention(), EXACT),
        PlanRow("blocks.*.attn", HeadParallelAttention(partial=True), ("partial",)),
        PlanRow("blocks.*.cross_attn", HeadParallelCrossAttention(), EXACT, optional=True),
        PlanRow("blocks.*.cross_attn", HeadParallelCrossAttention(partial=True), ("partial",), optional=True),
        PlanRow("blocks.*.mlp", HiddenParallelMlp(), EXACT),
        PlanRow("blocks.*.mlp", HiddenParallelMlp(partial=True), ("partial",)),
        PlanRow("blocks.*.adaLN_modulation.1", GatheredColumnParallel(partial_output_grad=False), ("tp",)),
        PlanRow("blocks.*.adaLN_modulation.1", GatheredColumnParallel(partial_output_grad=True), ("sp", "partial")),
        PlanRow("blocks.*", PartialGradient("sequence_parallel", skip=_BLOCK_REST), ("sp",)),
        PlanRow("blocks.*", PartialGradient("tp_partial_grad", skip=_BLOCK_REST), ("partial",)),
        PlanRow("final", SequenceExit(input=0, seq_len=_final_tokens), ("sp",)),
        PlanRow("final.adaLN_modulation.1", GatheredColumnParallel(partial_output_grad=False), EXACT),
        PlanRow("final.adaLN_modulation.1", GatheredColumnParallel(partial_output_grad=True), ("partial",)),
        PlanRow("final.linear", PartialGradient("tp_partial_grad"), ("partial",)),
        PlanRow("final", MeanOverTP(tag="head"), ("partial",)),
        PlanRow("blocks.*", ContextParallelAttention(), axis="cp"),
        PlanRow("final.linear", ContextExit(), axis="cp"),
    ),
)


def parallelize_generator(model: nn.Module, state: ParallelState, seq_len: Optional[int] = None,
                          plan: ParallelPlan = GENERATOR_PLAN, grid: Optional[Tuple[int, int, int]] = None
                          ) -> PlanReport:
    """Apply ``plan`` (:data:`GENERATOR_PLAN`) to ``model`` in place and return the
    :class:`~vitp.parallel.plan.PlanReport`; a no-op when ``state.tp_size == state.cp_size == 1``.

    ``model`` is a :class:`~vitp.models.Generator`, a DeepSpeed ``PipelineModule`` of
    :mod:`vitp.pipeline` layers, one of its stages, or a lone block, holding full (identical on
    every TP rank) weights.

    Parameters
    ----------
    seq_len : int, optional
        True token count ``N``; inferred from an ``Embed``/``FinalLayer`` grid. Needed under
        sequence parallelism for a stage that holds only blocks.
    grid : (gt, gh, gw), optional
        The token grid; inferred like ``seq_len``. Needed under context parallelism for a stage
        that holds only blocks.

    Raises
    ------
    ValueError
        No block found, sizes not divisible by tp, an unknown ``seq_len`` under sequence
        parallelism, or a plan row that names no module.
    """
    if state.tp_size == 1 and state.cp_size == 1:
        return PlanReport(plan.name, "tp")
    if not any(isinstance(m, Block) for m in model.modules()):
        raise ValueError("parallelize_generator: the model holds no generator Block")
    grids = [m.grid for m in model.modules() if isinstance(m, (Embed, FinalLayer))]
    grid = tuple(grid) if grid is not None else tuple(grids[0]) if grids else None
    if seq_len is None and grid is not None:
        seq_len = token_count(grid)
    if (state.sequence_parallel or state.cp_size > 1) and seq_len is None:
        raise ValueError("parallelize_generator: sequence and context parallelism need the token count; pass "
                         "seq_len=N (or grid=(gt, gh, gw), which context parallelism needs) for a stage without "
                         "Embed/FinalLayer (e.g. a middle pipeline stage)")
    return apply_plan(model, plan, state, seq_len, grid)
