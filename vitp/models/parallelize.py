"""The tensor/sequence-parallel plan of the ViT generator (as torchtitan's ``parallelize_<model>``).

The generic machinery is :mod:`vitp.parallel`; this plan names the generator's modules:

- every :class:`~vitp.models.generator.Block`: ``attn`` / ``mlp`` become
  :class:`~vitp.parallel.TPAttention` / :class:`~vitp.parallel.TPMlp`
  (:func:`~vitp.parallel.parallelize_block`);
- with sequence parallelism, tokens are scattered over the TP group after
  :class:`~vitp.models.generator.Embed` and gathered before
  :class:`~vitp.models.generator.FinalLayer` (forward hooks, so the same plan serves the
  single-process :class:`~vitp.models.Generator` and pipeline stages holding either), and each
  block's adaLN output ``(B, 6D)`` passes through :class:`~vitp.parallel.CopyToTPRegion`: it is
  replicated, but its gradient is a per-rank partial sum over local tokens, and one all-reduce of
  that gradient makes the adaLN weights' and ``c``'s gradients (back to the embedders) complete,
  cheaper than reducing ``6 D^2`` weight gradients.
"""
from __future__ import annotations

from typing import Optional

import torch.nn as nn

from vitp.parallel import (
    CopyToTPRegion,
    ParallelState,
    SequenceInfo,
    parallelize_block,
    sequence_parallel_enter,
    sequence_parallel_exit,
)

from .generator import Block, Embed, FinalLayer


def _install_sequence_hooks(model: nn.Module, state: ParallelState, info: SequenceInfo) -> None:
    def after_embed(_m, _args, out):
        tokens, c = out
        return sequence_parallel_enter(tokens, state, info), c

    def before_final(_m, args):
        if len(args) == 1 and isinstance(args[0], (tuple, list)):  # pipeline adapter: final((x, c))
            x, c = args[0]
            return ((sequence_parallel_exit(x, state, info.seq_len), c),)
        x, c = args[:2]
        return (sequence_parallel_exit(x, state, info.seq_len), c) + tuple(args[2:])

    for m in model.modules():
        if isinstance(m, Embed):
            m.register_forward_hook(after_embed)
        elif isinstance(m, FinalLayer):
            m.register_forward_pre_hook(before_final)


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
        if state.sequence_parallel:
            blk.adaLN_modulation.append(CopyToTPRegion(state.tp_group, tag="cond"))
    if state.sequence_parallel:
        _install_sequence_hooks(model, state, info)
    return model
