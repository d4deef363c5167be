"""Wan's published transformer configs and their exact parameter counts (planner side).

:data:`WAN_PRESETS` are the ``config.json`` options of the released diffusers Wan text-to-video
transformers (the ``Wan-AI/*-Diffusers`` folders; the conversion script of github.com/huggingface/diffusers
for Wan 2.1): Wan 2.1 T2V 1.3B and 14B, Wan 2.2 TI2V 5B (48-channel latents of the Wan 2.2 VAE),
and Wan 2.2 T2V A14B, whose two experts (``transformer``, ``transformer_2``) each have the 14B
shape. :func:`wan_params` counts a config's parameters per layer from vitp's own layers
(:class:`vitp.models.wan.WanModel`'s embed / block / final) built on the ``meta`` device, as
:mod:`vitp.plan.shapes` counts the generator; ``tests/unit/test_plan_wan.py`` holds them equal to
diffusers' ``WanTransformer3DModel`` built on the meta device.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Dict, Mapping, Tuple

from vitp.models.wan_config import WAN_PRESETS, _COMMON  # noqa: F401 (the data live beside WanConfig)


def _numel(module: "torch.nn.Module") -> int:
    return sum(p.numel() for p in module.parameters())


@lru_cache(maxsize=32)
def _counts(frozen: tuple) -> Dict[str, int]:
    import torch

    from vitp.models.wan import WanBlock, WanConfig, WanEmbed, WanFinal

    c = WanConfig.from_dict(dict(frozen), "wan_params")
    with torch.device("meta"):  # shapes only: a 14B model costs nothing
        embed = WanEmbed(c.in_channels, c.width, c.patch_size, c.text_dim, c.freq_dim, c.attention_head_dim,
                         c.rope_max_seq_len)
        block = WanBlock(c.width, c.ffn_dim, c.num_attention_heads, c.eps, c.cross_attn_norm)
        final = WanFinal(c.width, c.patch_size, c.out_channels, c.eps)
    e, b, f = _numel(embed), _numel(block), _numel(final)
    return {"embed": e, "block": b, "final": f, "blocks": b * c.num_layers, "total": e + b * c.num_layers + f}


def wan_params(config: Mapping[str, Any] | str) -> Dict[str, int]:
    """Exact parameter counts of a Wan transformer: ``{"embed", "block" (one), "blocks" (all),
    "final", "total"}``.

    ``config``: a name of :data:`WAN_PRESETS` or a diffusers ``config.json`` dict. Raises
    ``KeyError`` naming the presets for an unknown name, ``ValueError`` as
    :meth:`vitp.models.wan.WanConfig.from_dict` for options vitp's Wan does not implement.
    """
    if isinstance(config, str):
        if config not in WAN_PRESETS:
            raise KeyError(f"unknown Wan preset {config!r}; known: {sorted(WAN_PRESETS)}")
        config = WAN_PRESETS[config]
    frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in config.items()
                          if not k.startswith("_")))
    return dict(_counts(frozen))


def wan_config_of_model(model: Mapping[str, Any]) -> Dict[str, Any]:
    """The diffusers ``config.json`` keys that size a Wan model, from a resolved ``model`` config
    section of ``model.family=wan`` (sizes written by :func:`vitp.models.wan_run.adopt_wan_model`):
    ``num_attention_heads = num_heads``, ``attention_head_dim = width / num_heads``, ``ffn_dim =
    round(mlp_ratio x width)``, ``num_layers = depth``, ``patch_size = [tubelet, p, p]``,
    ``in_channels = out_channels``, ``text_dim``; ``freq_dim`` 256, ``cross_attn_norm`` true, as
    every published Wan (:data:`WAN_PRESETS`)."""
    D, H, p = int(model["width"]), int(model["num_heads"]), int(model["patch_size"])
    return {**_COMMON, "patch_size": [int(model["tubelet_size"]), p, p], "num_attention_heads": H,
            "attention_head_dim": D // H, "ffn_dim": int(round(D * float(model["mlp_ratio"]))),
            "num_layers": int(model["depth"]), "in_channels": int(model["in_channels"]),
            "out_channels": int(model["in_channels"]), "text_dim": int(model["text_dim"])}


def wan_layer_kwargs(model: Mapping[str, Any]) -> Tuple[dict, dict, dict]:
    """``(embed, block, final)`` keyword arguments of :class:`vitp.models.wan.WanEmbed`,
    ``WanBlock`` and ``WanFinal`` for a resolved Wan ``model`` section at its token grid (as
    :func:`vitp.pipeline.wan_stages.wan_layer_specs` builds the pipeline's layers)."""
    from vitp.models import token_grid

    c = wan_config_of_model(model)
    D, (pt, p, _) = c["num_attention_heads"] * c["attention_head_dim"], c["patch_size"]
    grid = token_grid(model["image_size"], model["num_frames"], p, pt)
    embed = dict(in_channels=c["in_channels"], width=D, patch_size=c["patch_size"], text_dim=c["text_dim"],
                 freq_dim=c["freq_dim"], head_dim=c["attention_head_dim"], rope_max_seq_len=c["rope_max_seq_len"],
                 grid=grid)
    block = dict(dim=D, ffn_dim=c["ffn_dim"], num_heads=c["num_attention_heads"], eps=c["eps"],
                 cross_attn_norm=c["cross_attn_norm"])
    final = dict(width=D, patch_size=c["patch_size"], out_channels=c["out_channels"], eps=c["eps"], grid=grid)
    return embed, block, final
