"""Latent-space training: VAEs from local diffusers folders (:mod:`vitp.latents.vae`)."""

from vitp.utils import lazy_exports as _lazy_exports

# names load on first use: a command that needs none of them (vitp-plan, the config check) imports no torch
_EXPORTS = {
    "geometry": ".vae",
    "LatentGeometry": ".vae",
    "LocalVAE": ".vae",
    "vae_config": ".vae",
}
__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)


__all__ = ["LatentGeometry", "LocalVAE", "geometry", "vae_config"]
