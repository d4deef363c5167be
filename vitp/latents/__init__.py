"""Latent-space training: VAEs from local diffusers folders (:mod:`vitp.latents.vae`)."""
from .vae import LatentGeometry, LocalVAE, geometry, vae_config

__all__ = ["LatentGeometry", "LocalVAE", "geometry", "vae_config"]
