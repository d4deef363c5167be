"""The ViT generator (no parallel code in its layers) and its tensor-parallel plan; Wan's text-to-video
transformer as vitp layers (:mod:`vitp.models.wan`), its diffusers weights (:mod:`vitp.models.wan_keys`) and
its tensor / sequence / context-parallel plan (:mod:`vitp.models.parallelize_wan`)."""
from .generator import Block, Embed, FinalLayer, Generator, layer_specs, seed_layer, set_grid
from .layers import CrossAttention, GridAttention, TokenGroups, TubeletEmbed, input_grid, num_tokens, sincos_3d_pos_embed, token_grid
from .keys import export_key, from_export_state, generator_key, pipeline_to_generator, to_export_state
from .parallelize import GENERATOR_PLAN, generator_layers, parallelize_generator
from .parallelize_wan import WAN_PLAN, parallelize_wan
from .partial_sync_streams import PartialSyncGenerator
from .wan import WanConfig, WanModel
from .wan_keys import from_pretrained

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
