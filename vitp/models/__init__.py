"""The ViT generator (no parallel code in its layers) and its tensor-parallel plan."""
from .generator import Block, Embed, FinalLayer, Generator, layer_specs, seed_layer, set_grid
from .layers import CrossAttention, GridAttention, TokenGroups, TubeletEmbed, input_grid, num_tokens, sincos_3d_pos_embed, token_grid
from .keys import export_key, from_export_state, generator_key, pipeline_to_generator, to_export_state
from .parallelize import GENERATOR_PLAN, generator_layers, parallelize_generator
from .partial_sync_streams import PartialSyncGenerator

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
    "export_key",
    "from_export_state",
    "generator_key",
    "generator_layers",
    "input_grid",
    "layer_specs",
    "num_tokens",
    "parallelize_generator",
    "pipeline_to_generator",
    "seed_layer",
    "set_grid",
    "sincos_3d_pos_embed",
    "to_export_state",
    "token_grid",
]
