"""Latent-space training: VAEs from local diffusers folders (:mod:`vitp.latents.vae`)."""

import importlib as _importlib

# Names load on first use (PEP 562): a command that needs none of them (vitp-plan, the config
# check) does not import torch.
_EXPORTS = {
    "geometry": ".vae",
    "LatentGeometry": ".vae",
    "LocalVAE": ".vae",
    "vae_config": ".vae",
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


__all__ = ["LatentGeometry", "LocalVAE", "geometry", "vae_config"]
