"""The tensor/sequence-parallel plan of the ViT generator (as torchtitan's ``parallelize_<model>``).

The generic machinery is :mod:`vitp.parallel`; this plan names the generator's modules:

- every :class:`~vitp.models.generator.Block`: ``attn`` / ``mlp`` become
  :class:`~vitp.parallel.TPAttention` / :class:`~vitp.parallel.TPMlp`
  (:func:`~vitp.parallel.parallelize_block`);
- with sequence parallelism, tokens are scattered over the TP group after
  :class:`~vitp.models.generator.Embed` and gathered before
  :class:`~vitp.models.generator.FinalLayer` (forward hooks, so the same plan serves the
  single-process :class:`~vitp.models.Generator` and pipeline stages holding either);
- the adaLN modulation of every block (``Linear(D, 6 D)``, a third of a block's ``18 D^2``
  weights) and of the final layer (``Linear(D, 2 D)``) is column-parallel with its output
  all-gathered (:class:`~vitp.parallel.ColumnParallelLinear` ``gather_output``): the gathered
  ``(B, 6 D)`` vector is tiny next to the ``6 D^2 / tp`` weights each rank no longer holds. Its
  backward splits the vector's gradient (reduce-scatters it under SP, where each rank's tokens
  give a partial sum). The conditioning ``c``'s gradient is then a per-rank partial sum in every
  consumer, so it is summed once, where ``c`` leaves :class:`~vitp.models.generator.Embed`
  (one all-reduce of ``(B, D)`` per micro-batch, tag ``cond``), instead of once per block.
- with ``parallel.partial_sync < 1`` (:mod:`vitp.parallel.partial_sync`) every rank keeps its
  own residual stream: no token sharding (SP only changes how the synchronized slice moves),
  the modulation gradients are reduce-scattered (per-rank partial), the patch embedding and the
  head get TP-partial gradients, and the prediction is the mean over the TP group.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch.nn as nn

from vitp.parallel import (
    ColumnParallelLinear,
    ParallelState,
    SequenceInfo,
    parallelize_block,
    register_grad_allreduce,
    sequence_parallel_enter,
    sequence_parallel_exit,
)
from vitp.parallel.mappings import copy_to_tp_region
from vitp.parallel.partial_sync import mean_over_tp

from .generator import Block, Embed, FinalLayer


def _install_hooks(model: nn.Module, state: ParallelState, info: SequenceInfo) -> None:
    """Embed's output: tokens into the sequence region (SP), ``c`` into the TP region (its
    gradient, partial on each rank, is all-reduced here once); FinalLayer's input: tokens out of
    the sequence region (SP)."""
    def after_embed(_m, _args, out):
        tokens, c = out
        return sequence_parallel_enter(tokens, state, info), copy_to_tp_region(c, state.tp_group, tag="cond")

    def before_final(_m, args):
        if len(args) == 1 and isinstance(args[0], (tuple, list)):  # pipeline adapter: final((x, c))
            x, c = args[0]
            return ((sequence_parallel_exit(x, state, info.seq_len), c),)
        x, c = args[:2]
        return (sequence_parallel_exit(x, state, info.seq_len), c) + tuple(args[2:])

    for m in model.modules():
        if isinstance(m, Embed):
            m.register_forward_hook(after_embed)
        elif isinstance(m, FinalLayer) and state.sequence_parallel:
            m.register_forward_pre_hook(before_final)


def _install_partial_sync(model: nn.Module, state: ParallelState) -> None:
    """``parallel.partial_sync < 1``: the patch embedding and the output head see this rank's own
    stream, so their (replicated) parameters get per-rank partial gradients, summed over the TP
    group; the prediction is the mean of the ranks' predictions (:func:`mean_over_tp`, tag
    ``head``), identical on every rank."""
    for m in model.modules():
        if isinstance(m, Embed):
            for p in m.x_embedder.parameters():
                register_grad_allreduce(p, state, "tp_partial_grad")
        elif isinstance(m, FinalLayer):
            for p in m.linear.parameters():
                register_grad_allreduce(p, state, "tp_partial_grad")
            m.register_forward_hook(lambda _m, _a, out: mean_over_tp(out, state.tp_group))


def _shard_modulation(seq: nn.Sequential, state: ParallelState, partial_output_grad: bool) -> None:
    """``seq = Sequential(SiLU, Linear(D, k D))``: the linear becomes column-parallel with a
    gathered output; its input gradient stays partial (summed where ``c`` leaves Embed)."""
    seq[1] = ColumnParallelLinear.from_linear(seq[1], state, input_comm=False, gather_output=True,
                                              partial_output_grad=partial_output_grad, tag="cond")


def parallelize_generator(model: nn.Module, state: ParallelState, seq_len: Optional[int] = None) -> nn.Module:
    """Apply the plan above to ``model`` in place and return it; a no-op when ``state.tp_size == 1``.

    ``model`` is a :class:`~vitp.models.Generator`, a DeepSpeed ``PipelineModule`` of
    :mod:`vitp.pipeline` layers, or one of its stages, holding full (identical on every TP rank)
    weights.

    Parameters
    ----------
    seq_len : int, optional
        True token count ``N``; inferred from an ``Embed``/``FinalLayer`` grid. Needed under
        sequence parallelism for a stage that holds only blocks.

    Raises
    ------
    ValueError
        No block found, sizes not divisible by tp, or an unknown ``seq_len`` under sequence
        parallelism.
    """
    if state.tp_size == 1:
        return model
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    if not blocks:
        raise ValueError("parallelize_generator: the model holds no generator Block")
    grids = [m.grid for m in model.modules() if isinstance(m, (Embed, FinalLayer))]
    info = SequenceInfo(seq_len)
    if info.seq_len is None and grids:
        info.seq_len = grids[0][0] * grids[0][1] * grids[0][2]
    if state.sequence_parallel and info.seq_len is None:
        raise ValueError("parallelize_generator: sequence parallel needs the token count; pass seq_len=N for a "
                         "stage without Embed/FinalLayer (e.g. a middle pipeline stage)")
    for blk in blocks:
        parallelize_block(blk, state, info, replicated_skip=("adaLN_modulation",))
        # per-rank partial gradient of the modulation vector: SP (token shards) or private channels
        _shard_modulation(blk.adaLN_modulation, state, partial_output_grad=state.sequence_parallel or state.partial)
    for final in (m for m in model.modules() if isinstance(m, FinalLayer)):
        _shard_modulation(final.adaLN_modulation, state, partial_output_grad=state.partial)  # after the SP exit
    if state.partial:  # no token-sharded region: every rank's stream holds all tokens
        _install_partial_sync(model, state)
        _install_hooks(model, dataclasses.replace(state, sequence_parallel=False), info)
    else:
        _install_hooks(model, state, info)
    return model
