"""The generator as a DeepSpeed ``PipelineModule`` (a 1-stage pipeline when pp=1).

Layers are ``LayerSpec``s of thin adapters over :mod:`vitp.models` that pass the activation
tuple between layers (DeepSpeed calls ``layer(inputs)`` with one argument):

    EmbedPipe:  (z_t, t, y)  -> (tokens, c)
    BlockPipe:  (tokens, c)  -> (tokens, c)        x depth
    FinalPipe:  (tokens, c)  -> x_pred (B, C, T, H, W)

A text-conditional generator (``model.text_dim > 0``) passes the projected caption tokens and
their mask along: ``(z_t, t, y, mask) -> (tokens, c, ctx, mask) -> ... -> x_pred``. The caption
tokens travel with the activations from stage to stage (and their gradient back to the first
stage's ``y_embedder``) rather than being re-read by every stage: DeepSpeed feeds data to the
first and last stage only, the projection's weights live on the first stage, and ``ctx``
(``B L D``) is small next to the tokens (``B N D``, ``N`` >> ``L`` at generation sizes).

``seed_layers=True`` with :func:`vitp.models.seed_layer` builds layer ``i`` after seeding
``seed + i`` (and only then: :func:`vitp.deepspeed_adapter.seed_layers_for_init_only`), so the weights are the same as :class:`vitp.models.Generator` built with the same
seed, whatever the number of stages, so runs in different layouts start from the same model.
"""
from __future__ import annotations

from typing import Any, List, Tuple

import torch

import vitp.deepspeed_adapter as ds  # first: it quiets DeepSpeed's accelerator probe on CPU

ds.import_deepspeed()

from deepspeed.pipe import LayerSpec, PipelineModule  # noqa: E402
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology  # noqa: E402

from vitp.models import Block, Embed, FinalLayer, layer_specs, seed_layer
from vitp.objectives import FlowMatchingLoss
from vitp.parallel import checkpoint_activations
from vitp.utils import to_dict


class EmbedPipe(Embed):
    """Pipeline adapter: ``(z_t, t, y) -> (tokens, c)``."""

    def forward(self, inputs: Tuple[torch.Tensor, ...]):  # type: ignore[override]
        return super().forward(*inputs)


class BlockPipe(Block):
    """Pipeline adapter: ``(tokens, c[, ctx, mask]) -> (tokens, c[, ctx, mask])``."""

    def forward(self, inputs: Tuple[torch.Tensor, ...]):  # type: ignore[override]
        x, c, *text = inputs
        return (super().forward(x, c, *text), c, *text)


class FinalPipe(FinalLayer):
    """Pipeline adapter: ``(tokens, c[, ctx, mask]) -> x_pred``."""

    def forward(self, inputs: Tuple[torch.Tensor, ...]):  # type: ignore[override]
        return super().forward(*inputs)


_PIPE = {Embed: EmbedPipe, Block: BlockPipe, FinalLayer: FinalPipe}


def build_pipeline(model_cfg: Any, loss_fn: FlowMatchingLoss, *, seed: int, tp: int = 1, pp: int = 1, dp: int = 1,
                   activation_checkpoint_interval: int = 0) -> PipelineModule:
    """Build the ``PipelineModule`` of the ``model`` config section on the
    ``PipeModelDataParallelTopology(pp, tp, dp)`` grid, with full weights on every TP rank
    (shard them with :func:`vitp.models.parallelize_generator`).

    Requires ``torch.distributed`` to be initialised with ``world_size == tp * pp * dp``;
    ``dp`` counts the engine's data-parallel ranks, ``dp * cp`` under context parallelism
    (:class:`vitp.config.Layout`, :mod:`vitp.parallel.state`). Stages are balanced by block count (``partition_method="type:BlockPipe"``), not by parameter
    count, which the adaLN weights skew; the embedding and final layer ride on the first and last
    stage.
    """
    specs = [LayerSpec(_PIPE[cls], **kw) for cls, kw in layer_specs(**to_dict(model_cfg))]
    module = PipelineModule(
        activation_checkpoint_func=checkpoint_activations,
        layers=specs,
        topology=PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp),
        loss_fn=loss_fn,
        seed_layers=True,
        seed_fn=seed_layer,
        base_seed=seed,
        partition_method="type:BlockPipe",
        activation_checkpoint_interval=activation_checkpoint_interval,
    )
    ds.seed_layers_for_init_only(module)  # seeded construction, no reseeding in forward
    return module


def stage_blocks(depth: int, pp: int) -> List[int]:
    """Blocks per stage as DeepSpeed's ``type:BlockPipe`` partition assigns them.

    Raises ``ValueError`` when ``depth < pp`` (a stage would own no block).
    """
    if depth < pp:
        raise ValueError(f"model.depth={depth} < parallel.pp={pp}: every pipeline stage needs at least one block; "
                         f"use parallel.pp <= {depth}")
    w = [0] + [1] * depth + [0]
    parts = ds.partition_balanced(weights=w, num_parts=pp)
    return [sum(w[parts[i]:parts[i + 1]]) for i in range(pp)]


def build_parallel_pipeline(cfg: Any, lay: Any, loss_fn: FlowMatchingLoss, *, defer_grad_sync: bool = False,
                            activation_checkpoint_interval: int = 0) -> Tuple[PipelineModule, Any]:
    """``(module, state)``: this rank's stage of the run config ``cfg``'s generator in the layout
    ``lay`` (:class:`vitp.config.Layout`) with the TP / SP / context-parallel plan applied
    (:func:`vitp.models.parallelize_generator`) and its :class:`vitp.parallel.ParallelState`, as
    :func:`build_pipeline` initialises the weights (load yours after). ``defer_grad_sync``:
    training sums TP-partial gradients once per step (:class:`vitp.parallel.ParallelState`).
    Collective: every rank calls it (process groups). Raises as :func:`build_pipeline`."""
    import contextlib
    import io

    from vitp.models import num_tokens, parallelize_generator, token_grid
    from vitp.parallel import from_grid

    par, m = cfg.parallel, cfg.model
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints its layer table on rank 0
        module = build_pipeline(m, loss_fn, seed=cfg.seed, tp=lay.tp, pp=lay.pp, dp=lay.engine_dp,
                                activation_checkpoint_interval=activation_checkpoint_interval)
    state = from_grid(ds.pipeline_grid(module), par.sequence_parallel, defer_grad_sync=defer_grad_sync,
                      partial_sync=par.partial_sync, partial_sync_scale=par.partial_sync_scale, cp=lay.cp,
                      cp_mode=par.cp_mode)
    parallelize_generator(module, state, seq_len=num_tokens(**m),
                          grid=token_grid(m.image_size, m.num_frames, m.patch_size, m.tubelet_size))
    return module, state
