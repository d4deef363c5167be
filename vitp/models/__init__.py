"""The ViT generator (no parallel code in its layers) and its tensor-parallel plan; Wan's text-to-video
transformer as vitp layers (:mod:`vitp.models.wan`), its diffusers weights (:mod:`vitp.models.wan_keys`) and
its tensor / sequence / context-parallel plan (:mod:`vitp.models.parallelize_wan`)."""

from vitp.utils import lazy_exports as _lazy_exports

# names load on first use: a command that needs none of them (vitp-plan, the config check) imports no torch
_EXPORTS = {
    "Block": ".generator",
    "CrossAttention": ".layers",
    "Embed": ".generator",
    "export_key": ".keys",
    "FinalLayer": ".generator",
    "from_export_state": ".keys",
    "from_pretrained": ".wan_keys",
    "Generator": ".generator",
    "generator_key": ".keys",
    "generator_layers": ".parallelize",
    "GENERATOR_PLAN": ".parallelize",
    "GridAttention": ".layers",
    "input_grid": ".grid",
    "layer_specs": ".generator",
    "num_tokens": ".grid",
    "parallelize_generator": ".parallelize",
    "parallelize_wan": ".parallelize_wan",
    "PartialSyncGenerator": ".partial_sync_streams",
    "pipeline_to_generator": ".keys",
    "seed_layer": ".generator",
    "set_grid": ".generator",
    "sincos_3d_pos_embed": ".layers",
    "to_export_state": ".keys",
    "token_grid": ".grid",
    "TokenGroups": ".layers",
    "TubeletEmbed": ".layers",
    "WAN_PLAN": ".parallelize_wan",
    "WanConfig": ".wan",
    "WanModel": ".wan",
}
__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)


__all__ = [
    "Block",
    "CrossAttention",
    "Embed",
    "FinalLayer",
    "GENERATOR_PLAN",
    "Generator",
    "GridAttention",
    "PartialSyncGenerator",
    "TokenGroups",
    "TubeletEmbed",
    "WanConfig",
    "WAN_PLAN",
    "WanModel",
    "export_key",
    "from_export_state",
    "from_pretrained",
    "generator_key",
    "generator_layers",
    "input_grid",
    "layer_specs",
    "num_tokens",
    "parallelize_generator",
    "parallelize_wan",
    "pipeline_to_generator",
    "seed_layer",
    "set_grid",
    "sincos_3d_pos_embed",
    "to_export_state",
    "token_grid",
]
