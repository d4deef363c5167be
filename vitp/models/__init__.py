"""The ViT generator (no parallel code in its layers) and its tensor-parallel plan; Wan's text-to-video
transformer as vitp layers (:mod:`vitp.models.wan`), its diffusers weights (:mod:`vitp.models.wan_keys`) and
its tensor / sequence / context-parallel plan (:mod:`vitp.models.parallelize_wan`)."""

import importlib as _importlib

# Names load on first use (PEP 562): a command that needs none of them (vitp-plan, the config
# check) does not import torch.
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


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(_importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("_"):  # a submodule, as an eager package would have it
        try:
            return _importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


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
