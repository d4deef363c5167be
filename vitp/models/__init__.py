"""The ViT generator (no parallel code here)."""
from .generator import (
    Block,
    Embed,
    FinalLayer,
    Generator,
    GridAttention,
    TokenGroups,
    TubeletEmbed,
    layer_kinds,
    num_tokens,
    seed_layer,
    sincos_3d_pos_embed,
    token_grid,
    validate_model_config,
)

__all__ = [
    "Block",
    "Embed",
    "FinalLayer",
    "Generator",
    "GridAttention",
    "TokenGroups",
    "TubeletEmbed",
    "layer_kinds",
    "num_tokens",
    "seed_layer",
    "sincos_3d_pos_embed",
    "token_grid",
    "validate_model_config",
]
