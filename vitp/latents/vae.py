"""A ``diffusers`` VAE from a local folder: its latent geometry, and encode / decode between
vitp's pixel tensors and normalised latents.

Latent diffusion (Rombach et al. 2022, arXiv 2112.10752) trains the generator on a frozen
autoencoder's latents. The folder is one written by ``save_pretrained`` or a downloaded snapshot's
``vae/`` subfolder (``config.json`` + ``diffusion_pytorch_model.safetensors``); its class comes
from ``config.json``'s ``_class_name`` and every load passes ``local_files_only=True``, so vitp
never downloads. Supported: the image VAE ``AutoencoderKL`` (SD, SDXL, Flux) and ``AutoencoderDC``,
and the video VAEs ``AutoencoderKLWan``, ``AutoencoderKLHunyuanVideo``, ``AutoencoderKLLTXVideo``,
``AutoencoderKLCosmos`` and ``AutoencoderKLCogVideoX``.

Normalisation follows each model's diffusers pipeline: ``z = (mu - shift) * scale`` per channel,
with ``latents_mean`` / ``latents_std`` where the config has them (Wan, Cosmos:
``scale = scaling_factor / latents_std``; LTX keeps them as buffers in its weights, read by
:class:`LocalVAE`), else ``shift_factor`` / ``scaling_factor`` (SD: 0,
0.18215; Flux: 0.1159, 0.3611). The posterior's std is scaled by the same ``scale``.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

IMAGE_VAES = ("AutoencoderKL", "AutoencoderDC")
VIDEO_VAES = ("AutoencoderKLWan", "AutoencoderKLHunyuanVideo", "AutoencoderKLLTXVideo", "AutoencoderKLCosmos",
              "AutoencoderKLCogVideoX")
HINT = ("e.g. hf download Wan-AI/Wan2.1-T2V-1.3B-Diffusers --include 'vae/*' --local-dir /models/wan2.1 "
        "and data.vae=/models/wan2.1/vae; vitp never downloads")

PathLike = Union[str, Path]


@dataclass(frozen=True)
class LatentGeometry:
    """What a VAE does to shapes and values: ``channels`` C' of its latents, ``spatial`` and
    ``temporal`` compression (pixels / frames per latent cell; 1 for image VAEs), and the
    per-channel ``shift`` / ``scale`` of the normalisation (module docstring) (lists of C', or of 1 for all channels).
    ``cls`` is the diffusers class and ``config_sha256`` the hash of its config (weights not hashed)."""

    cls: str
    channels: int
    spatial: int
    temporal: int
    shift: Tuple[float, ...]
    scale: Tuple[float, ...]
    config_sha256: str

    @property
    def video(self) -> bool:
        return self.cls in VIDEO_VAES

    def latent_frames(self, frames: int) -> int:
        """Latent frames of ``frames`` pixel frames: causal video VAEs keep the first frame on its
        own (``1 + (T - 1) / temporal``); raises ``ValueError`` when ``T - 1`` is not a multiple."""
        if self.temporal == 1:
            return frames
        if (frames - 1) % self.temporal:
            raise ValueError(f"data.num_frames={frames}: {self.cls} compresses time by {self.temporal} after the first "
                             f"frame, so the frames must be 1 + a multiple of {self.temporal} "
                             f"(e.g. {1 + self.temporal * max(1, (frames - 1) // self.temporal)})")
        return 1 + (frames - 1) // self.temporal

    def latent_size(self, hw: Tuple[int, int]) -> Tuple[int, int]:
        """``(h, w)`` of pixels ``(H, W)``; raises ``ValueError`` unless both divide by ``spatial``."""
        if hw[0] % self.spatial or hw[1] % self.spatial:
            raise ValueError(f"data.resolution={hw[0]}x{hw[1]}: {self.cls} compresses space by {self.spatial}, so both "
                             f"sides must be multiples of {self.spatial}")
        return hw[0] // self.spatial, hw[1] // self.spatial

    def to_dict(self) -> Dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "LatentGeometry":
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def vae_config(folder: PathLike) -> Dict[str, Any]:
    """``folder/config.json`` as a dict. Raises ``FileNotFoundError`` (no folder / no config.json)
    and ``ValueError`` (damaged JSON, or a ``_class_name`` vitp does not support), each naming the fix."""
    path = Path(folder).expanduser()
    cfg_file = path / "config.json"
    if (path / "model_index.json").is_file() and (path / "vae" / "config.json").is_file():
        raise FileNotFoundError(f"data.vae={folder} is a pipeline folder: its VAE is the subfolder, data.vae={path / 'vae'}")
    if not cfg_file.is_file():
        what = ("does not exist" if not path.exists() else "is a file, not a folder" if path.is_file()
                else "has no config.json")
        raise FileNotFoundError(f"data.vae={folder} {what}: give a local diffusers VAE folder (config.json and "
                                f"diffusion_pytorch_model.safetensors), {HINT}")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"data.vae={folder}: config.json is not valid JSON ({e}); copy the folder again") from None
    name = cfg.get("_class_name")
    if name not in IMAGE_VAES + VIDEO_VAES:
        raise ValueError(f"data.vae={folder}: _class_name {name!r} is not a supported VAE; supported: "
                         f"{', '.join(IMAGE_VAES + VIDEO_VAES)} (a pipeline folder's VAE is in its vae/ subfolder)")
    return cfg


WEIGHTS = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.safetensors.index.json",
           "diffusion_pytorch_model.bin")


def check_vae_folder(folder: PathLike, channels: Optional[int] = None) -> LatentGeometry:
    """:func:`geometry` of ``folder`` after checking what loading it needs, without loading it:
    the weights file (a safetensors file's header is read), and with ``channels`` that the VAE
    codes that many pixel channels. Raises ``FileNotFoundError`` / ``ValueError`` naming the fix."""
    g, cfg, path = geometry(folder), vae_config(folder), Path(folder).expanduser()
    found = [path / w for w in WEIGHTS if (path / w).is_file()]
    if not found:
        raise FileNotFoundError(f"data.vae={folder} has config.json but no weights ({WEIGHTS[0]}); copy the whole "
                                f"VAE folder again")
    if found[0].name == WEIGHTS[0]:
        from safetensors import safe_open

        try:
            with safe_open(str(found[0]), framework="pt") as f:
                f.keys()
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a damaged header
            raise ValueError(f"data.vae={folder}: {found[0].name} is damaged ({e}); copy the VAE folder again") from None
    want = int(cfg.get("in_channels", 3))
    if channels is not None and channels != want:
        raise ValueError(f"data.vae={folder} codes {want}-channel pixels but the data has {channels} "
                         f"(data.channels={channels}); use a VAE of {channels} channel(s) or data of {want}"
                         + (" (the digits are grayscale: data=image_folder of RGB images fits an RGB VAE)"
                            if channels == 1 else ""))
    return g


def _compression(cfg: Dict[str, Any]) -> Tuple[int, int]:
    """``(spatial, temporal)`` compression from a diffusers VAE config."""
    name = cfg["_class_name"]
    if name == "AutoencoderKLWan":
        return int(cfg.get("scale_factor_spatial", 8)), int(cfg.get("scale_factor_temporal", 4))
    if name == "AutoencoderKLLTXVideo":  # saved configs hold null ratios: the model derives them from its blocks
        down = 2 ** sum(bool(v) for v in cfg.get("spatio_temporal_scaling", (True, True, True, False)))
        return (int(cfg.get("spatial_compression_ratio") or cfg.get("patch_size", 4) * down),
                int(cfg.get("temporal_compression_ratio") or cfg.get("patch_size_t", 1) * down))
    if name in ("AutoencoderKLHunyuanVideo", "AutoencoderKLCosmos"):
        return int(cfg.get("spatial_compression_ratio", 8)), int(cfg.get("temporal_compression_ratio", 4))
    if name == "AutoencoderKLCogVideoX":
        return 2 ** (len(cfg["block_out_channels"]) - 1), int(cfg.get("temporal_compression_ratio", 4))
    if name == "AutoencoderDC":
        return 2 ** (len(cfg["encoder_block_out_channels"]) - 1), 1
    return 2 ** (len(cfg["block_out_channels"]) - 1), 1


def geometry(folder: PathLike) -> LatentGeometry:
    """The :class:`LatentGeometry` of the VAE in ``folder`` (its ``config.json`` alone; raises as
    :func:`vae_config`)."""
    cfg = vae_config(folder)
    spatial, temporal = _compression(cfg)
    channels = int(cfg.get("latent_channels", cfg.get("z_dim", 0)))
    factor = cfg.get("scaling_factor")
    factor = 1.0 if factor is None else float(factor)
    if cfg.get("latents_mean") is not None and cfg.get("latents_std") is not None:
        shift = tuple(float(v) for v in cfg["latents_mean"])
        scale = tuple(factor / float(v) for v in cfg["latents_std"])
    else:
        shift, scale = (float(cfg.get("shift_factor") or 0.0),), (factor,)
    body = {k: v for k, v in cfg.items() if not k.startswith("_")}
    sha = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return LatentGeometry(cfg["_class_name"], channels, spatial, temporal, shift, scale, sha)


def _per_channel(v: Tuple[float, ...], ref: torch.Tensor) -> torch.Tensor:
    """``v`` shaped to broadcast over ``ref``'s channel dim 1 of ``(B, C, T, H, W)``."""
    return torch.tensor(v, dtype=ref.dtype, device=ref.device).view(1, -1, 1, 1, 1)


class LocalVAE:
    """A VAE loaded from ``folder`` on ``device`` in ``dtype``, frozen (eval, no grad).

    Pixels are vitp's ``(B, C, T, H, W)`` in ``[-1, 1]``; latents ``(B, C', T', h, w)``
    normalised as in the module docstring. An image VAE codes each frame on its own. ``tiling``
    turns on the model's tiled decoding (``enable_tiling``) where it has one, for long or large
    videos. Raises as :func:`vae_config`."""

    def __init__(self, folder: PathLike, device: Union[str, torch.device] = "cpu",
                 dtype: torch.dtype = torch.float32, tiling: bool = False):
        import diffusers

        self.folder = str(Path(folder).expanduser())
        self.geometry = geometry(self.folder)
        model_cls = getattr(diffusers, self.geometry.cls)
        self.model = model_cls.from_pretrained(self.folder, local_files_only=True, torch_dtype=dtype,
                                                low_cpu_mem_usage=False)
        self.model.to(device).eval().requires_grad_(False)
        if self.geometry.cls == "AutoencoderKLLTXVideo":  # LTX keeps its latent statistics in the weights
            mean, std = (getattr(self.model, k).float().tolist() for k in ("latents_mean", "latents_std"))
            self.geometry = replace(self.geometry, shift=tuple(mean),
                                    scale=tuple(self.geometry.scale[0] / v for v in std))
        if tiling and hasattr(self.model, "enable_tiling"):
            self.model.enable_tiling()
        self.device, self.dtype = torch.device(device), dtype

    def _frames_in(self, x: torch.Tensor) -> Tuple[torch.Tensor, int]:
        if self.geometry.video:
            return x, 0
        b, c, t, h, w = x.shape
        return x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w), t

    def _frames_out(self, y: torch.Tensor, t: int) -> torch.Tensor:
        if not t:
            return y
        bt, c, h, w = y.shape
        return y.reshape(bt // t, t, c, h, w).permute(0, 2, 1, 3, 4)

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(mean, std)`` of the normalised latent posterior of ``pixels``, each ``(B, C', T', h, w)``
        float32 on the CPU. Raises ``ValueError`` for sizes the VAE cannot code (:class:`LatentGeometry`)."""
        g = self.geometry
        g.latent_frames(pixels.shape[2])
        g.latent_size(tuple(pixels.shape[-2:]))
        x, t = self._frames_in(pixels.to(self.device, self.dtype))
        out = self.model.encode(x)
        dist = out.latent_dist if hasattr(out, "latent_dist") else None
        if dist is None:  # AutoencoderDC: a deterministic latent
            mu = self._frames_out(out.latent, t).float()
            std = torch.zeros_like(mu)
        else:
            mu, std = self._frames_out(dist.mean, t).float(), self._frames_out(dist.std, t).float()
        scale, shift = _per_channel(g.scale, mu), _per_channel(g.shift, mu)
        return ((mu - shift) * scale).cpu(), (std * scale.abs()).cpu()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Pixels ``(B, C, T, H, W)`` in ``[-1, 1]`` (float32, CPU) of normalised ``latents``
        ``(B, C', T', h, w)``, one sample at a time (the decoder's activations are the largest
        memory of sampling)."""
        g = self.geometry
        out: List[torch.Tensor] = []
        for z in latents.split(1):
            z = z.to(self.device, torch.float32)
            mu = z / _per_channel(g.scale, z) + _per_channel(g.shift, z)
            x, t = self._frames_in(mu.to(self.dtype))
            out.append(self._frames_out(self.model.decode(x).sample, t).float().clamp(-1, 1).cpu())
        return torch.cat(out) if out else torch.empty(0)


_DECODERS: Dict[Tuple[str, str], LocalVAE] = {}


def decoder(folder: PathLike, device: Union[str, torch.device] = "cpu") -> LocalVAE:
    """The :class:`LocalVAE` of ``folder`` on ``device``, loaded once per process (tiled decoding on)."""
    key = (str(Path(folder).expanduser()), str(device))
    if key not in _DECODERS:
        _DECODERS.clear()  # one VAE held at a time
        _DECODERS[key] = LocalVAE(folder, device, tiling=True)
    return _DECODERS[key]


def parameter_count(folder_or_config: Union[PathLike, Dict[str, Any]]) -> Tuple[int, int]:
    """``(encoder, decoder)`` parameter counts of the VAE (built on the meta device from its
    config, no weights read)."""
    import diffusers

    cfg = folder_or_config if isinstance(folder_or_config, dict) else vae_config(folder_or_config)
    model_cls = getattr(diffusers, cfg["_class_name"])
    with torch.device("meta"):
        model = model_cls.from_config({k: v for k, v in cfg.items() if not k.startswith("_")})
    count = {name: sum(p.numel() for n, p in model.named_parameters() if n.startswith(name))
             for name in ("encoder", "decoder")}
    return count["encoder"], count["decoder"]


def build_random(folder: PathLike, cls: str, config: Dict[str, Any], seed: int = 0) -> Path:
    """Save a ``cls`` VAE built from ``config`` with seeded random weights to ``folder`` (tests and
    demos: how diffusers' own tests run without downloads). Returns the folder."""
    import diffusers

    torch.manual_seed(seed)
    model = getattr(diffusers, cls)(**config)
    with torch.no_grad():  # random decoders/encoders whose outputs depend on every weight
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(str(folder), safe_serialization=True)
    return Path(folder)


def small_configs(image_channels: int = 3) -> Dict[str, Tuple[str, Dict[str, Any]]]:
    """Small configs of three supported VAEs (random weights, CPU-fast): ``name -> (class, config)``;
    the image VAE codes ``image_channels`` (1: the digits)."""
    return {
        "kl": ("AutoencoderKL", dict(in_channels=image_channels, out_channels=image_channels, block_out_channels=(8, 16),
                                     down_block_types=("DownEncoderBlock2D",) * 2,
                                     up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4,
                                     norm_num_groups=4, layers_per_block=1, scaling_factor=0.5, shift_factor=0.1)),
        "wan": ("AutoencoderKLWan", dict(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                         temperal_downsample=[False, True, True], latents_mean=[0.1, -0.1, 0.0, 0.2],
                                         latents_std=[0.5, 1.0, 1.5, 2.0])),
        "hunyuan": ("AutoencoderKLHunyuanVideo",
                    dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 8, 8),
                         layers_per_block=1, norm_num_groups=4, spatial_compression_ratio=8,
                         temporal_compression_ratio=4, scaling_factor=0.476986)),
    }
