"""Wan (:mod:`vitp.models.wan`) as DeepSpeed pipeline stages, with the tensor / sequence / context
plan (:data:`vitp.models.WAN_PLAN`) applied to each stage.

The layers are :class:`~vitp.models.wan.WanModel`'s own (embed, ``num_layers`` blocks, final), so
a stage holds the same parameters under the same names as the one-process model; pipeline layer
``0`` is the embed, ``i`` block ``i - 1`` and ``num_layers + 1`` the final layer
(:func:`vitp.models.generator_key`). Stages pass ``(x (B, n, D), temb (B, D), mod (B, 6, D),
ctx (B, L, D), cos, sin (n, hd / 2))``: every block reads the modulation, the caption tokens and
the rotary tables of its tokens; the final layer reads ``temb``.

The rotary tables are constants, yet DeepSpeed's 1F1B engine sends a gradient back for every
floating-point tensor a stage received and runs backward through every floating-point tensor a
stage sent (``PipelineEngine._exec_send_grads`` / ``_exec_backward_pass``). The embed therefore
sends them as tensors that require a gradient (the small ``(n, hd / 2)`` gradients are computed
and dropped); recomputing them on every stage instead would need each stage to know its
context-parallel rows, which only the embed's plan row cuts.
"""
from __future__ import annotations

import contextlib
import io
from typing import Any, List, Tuple

import torch

import vitp.deepspeed_adapter as ds

ds.import_deepspeed()

from deepspeed.pipe import LayerSpec, PipelineModule  # noqa: E402
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology  # noqa: E402

from vitp.models import seed_layer, set_grid  # noqa: E402
from vitp.models.wan import WanBlock, WanConfig, WanEmbed, WanFinal  # noqa: E402
from vitp.parallel import checkpoint_activations  # noqa: E402

Grid = Tuple[int, int, int]


class WanEmbedPipe(WanEmbed):
    """Pipeline adapter: ``(x, timestep, text) -> (tokens, temb, mod, ctx, cos, sin)`` (module doc:
    the rotary tables leave as tensors that require a gradient, and so do the other outputs of a
    frozen embed, a LoRA run's).

    A per-token ``timestep (B, N)`` (Wan 2.2 TI2V) is taken when it is equal over each sample's
    tokens, as text-to-video gives it (the stages then pass the ``(B, 6, D)`` modulation). Raises
    ``ValueError`` for timesteps that differ across a sample's tokens (TI2V's image-conditioned
    first frame at timestep 0): the stages' tensor / sequence / context split of a per-token
    modulation is not implemented."""

    def forward(self, inputs: Tuple[torch.Tensor, ...]):  # type: ignore[override]
        tokens, temb, mod, ctx, cos, sin = super().forward(*inputs)
        if mod.dim() == 4:
            raise ValueError("per-token timesteps that differ across a sample's tokens (Wan 2.2 TI2V's image-"
                             "conditioned first frame) are not supported in vitp's pipeline stages (vitp-train, "
                             "vitp-sample under a launcher); text-to-video gives every token the same timestep. "
                             "Use one process (vitp.models.WanModel takes them) or diffusers' WanImageToVideoPipeline")
        # a frozen embed (LoRA) gives outputs without a graph: sent as leaves that take a gradient
        tokens, temb, mod, ctx = (t if t.requires_grad else t.detach().requires_grad_() for t in (tokens, temb, mod, ctx))
        return tokens, temb, mod, ctx, cos.detach().requires_grad_(), sin.detach().requires_grad_()


class WanBlockPipe(WanBlock):
    """Pipeline adapter: ``(x, temb, mod, ctx, cos, sin) -> (block(x), temb, mod, ctx, cos, sin)``."""

    def forward(self, inputs: Tuple[torch.Tensor, ...]):  # type: ignore[override]
        x, temb, mod, ctx, cos, sin = inputs
        return super().forward(x, mod, ctx, cos, sin), temb, mod, ctx, cos, sin


class WanFinalPipe(WanFinal):
    """Pipeline adapter: ``(x, temb, mod, ctx, cos, sin) -> (B, C, T, H, W)``."""

    def forward(self, inputs: Tuple[torch.Tensor, ...]):  # type: ignore[override]
        return super().forward(inputs[0], inputs[1])


def wan_layer_specs(config: WanConfig, grid: Grid) -> List[Tuple[type, dict]]:
    """Wan as an ordered list of ``(pipeline class, kwargs)``: embed, ``num_layers`` blocks, final,
    for inputs of the token grid ``grid`` ``(gt, gh, gw)``."""
    c = config
    embed = dict(in_channels=c.in_channels, width=c.width, patch_size=c.patch_size, text_dim=c.text_dim,
                 freq_dim=c.freq_dim, head_dim=c.attention_head_dim, rope_max_seq_len=c.rope_max_seq_len, grid=grid)
    block = dict(dim=c.width, ffn_dim=c.ffn_dim, num_heads=c.num_attention_heads, eps=c.eps,
                 cross_attn_norm=c.cross_attn_norm)
    final = dict(width=c.width, patch_size=c.patch_size, out_channels=c.out_channels, eps=c.eps, grid=grid)
    return [(WanEmbedPipe, embed)] + [(WanBlockPipe, block)] * c.num_layers + [(WanFinalPipe, final)]


def build_wan_pipeline(config: WanConfig, grid: Grid, loss_fn: Any, *, seed: int, tp: int = 1, pp: int = 1,
                       dp: int = 1, activation_checkpoint_interval: int = 0) -> PipelineModule:
    """The ``PipelineModule`` of a Wan ``config`` on the ``PipeModelDataParallelTopology(pp, tp,
    dp)`` grid (``dp`` the engine's data-parallel ranks: ``dp * cp``), full weights on every TP rank,
    initialised layer by layer after seeding ``seed + i`` (load a folder's weights after); stages
    balanced by block count (``partition_method="type:WanBlockPipe"``).

    Requires ``torch.distributed`` initialised with ``world_size == tp * pp * dp``. Raises
    ``ValueError`` when ``num_layers < pp`` (a stage would hold no block).
    """
    if config.num_layers < pp:
        raise ValueError(f"num_layers={config.num_layers} < parallel.pp={pp}: every pipeline stage needs at least "
                         f"one Wan block; use parallel.pp <= {config.num_layers}")
    specs = [LayerSpec(cls, **kw) for cls, kw in wan_layer_specs(config, grid)]
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints its layer table on rank 0
        module = PipelineModule(
            layers=specs, topology=PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp),
            loss_fn=loss_fn, seed_layers=True, seed_fn=seed_layer, base_seed=seed,
            partition_method="type:WanBlockPipe", activation_checkpoint_interval=activation_checkpoint_interval,
            activation_checkpoint_func=checkpoint_activations)
    ds.seed_layers_for_init_only(module)
    set_grid(module, grid)
    return module


def build_parallel_wan_pipeline(config: WanConfig, grid: Grid, loss_fn: Any, *, tp: int = 1, cp: int = 1,
                                pp: int = 1, dp: int = 1, sequence_parallel: bool = False,
                                cp_mode: str = "ulysses", seed: int = 0, defer_grad_sync: bool = False,
                                activation_checkpoint_interval: int = 0) -> Tuple[PipelineModule, Any]:
    """``(module, state)``: this rank's stage of Wan in the layout ``tp x cp x pp x dp`` with
    :data:`vitp.models.WAN_PLAN` applied (:func:`vitp.models.parallelize_wan`) and its
    :class:`vitp.parallel.ParallelState`. Collective: every rank calls it. Raises as
    :func:`build_wan_pipeline` and :func:`vitp.models.parallelize_wan`."""
    from vitp.models.parallelize_wan import parallelize_wan
    from vitp.parallel import from_grid

    module = build_wan_pipeline(config, grid, loss_fn, seed=seed, tp=tp, pp=pp, dp=dp * cp,
                                activation_checkpoint_interval=activation_checkpoint_interval)
    state = from_grid(ds.pipeline_grid(module), sequence_parallel, defer_grad_sync=defer_grad_sync, cp=cp,
                      cp_mode=cp_mode)
    parallelize_wan(module, state, grid=grid)
    return module, state


def save_wan_stages(folder: Any, module: PipelineModule, config: WanConfig, state: Any) -> Any:
    """Write the pipeline's weights as a diffusers ``WanTransformer3DModel`` folder: stage ``s``'s
    tensors (gathered over its tensor-parallel group) in ``diffusion_pytorch_model-<s+1>-of-<pp>
    .safetensors``, written by that stage's first rank (tp, cp and dp rank 0), then
    ``diffusion_pytorch_model.safetensors.index.json`` and ``config.json`` by global rank 0, so
    diffusers' ``WanTransformer3DModel.from_pretrained`` loads it with no missing or unexpected keys.

    Collective: every rank calls it (the gathers and the index's key lists). No rank holds more
    than its stage's full tensors. Returns the folder as a ``Path``.
    """
    import json
    from importlib.metadata import version
    from pathlib import Path

    from vitp.models import generator_key
    from vitp.models.wan_keys import CLASS_NAME, INDEX, to_diffusers_state
    from vitp.parallel import full_weight
    from vitp.utils import save_safetensors

    path = Path(folder).expanduser()
    stage = {generator_key(n, config.num_layers): full_weight(p, state) for n, p in module.named_parameters()}
    writer = state.tp_rank == 0 and state.cp_rank == 0 and state.dp_rank == 0
    name = f"diffusion_pytorch_model-{state.pp_rank + 1:05d}-of-{state.pp_size:05d}.safetensors"
    tensors = to_diffusers_state(stage, config, partial=True) if writer else {}
    if writer:
        path.mkdir(parents=True, exist_ok=True)
        save_safetensors(tensors, str(path / name), metadata={"format": "pt"})
    entries = ({k: name for k in tensors}, sum(t.numel() * t.element_size() for t in tensors.values()))
    table = [None] * torch.distributed.get_world_size() if torch.distributed.is_initialized() else [entries]
    if torch.distributed.is_initialized():
        torch.distributed.all_gather_object(table, entries)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        weight_map = {k: f for m, _ in table for k, f in m.items()}
        index = {"metadata": {"total_size": sum(n for _, n in table)}, "weight_map": dict(sorted(weight_map.items()))}
        path.mkdir(parents=True, exist_ok=True)
        (path / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        cfg = {"_class_name": CLASS_NAME, "_diffusers_version": version("diffusers"), **config.to_dict()}
        (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # the folder is whole when any rank returns
    return path
