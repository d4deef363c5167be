"""What a latent-space run (``data.vae`` or ``data.latent_channels > 0``, docs/latents.md) adds to
the plan: the latent shape the generator sees and the pixel shape it stands for, its tokens per
sample, and the VAE decoder that turns samples back into pixels.

The generator only ever sees latents: ``model.in_channels``, ``model.image_size`` and
``model.num_frames`` follow ``data.latent_channels`` and ``data.vae_compression`` (the latent
resolvers of :mod:`vitp.config`), so every training number of the plan is that of
a pixel run of the latent shape. The VAE only costs memory where samples are decoded: the sample
grid and the final samples (:mod:`.phases`), on every rank that samples (every rank: each dp
replica samples its share, and the plan charges each of its ranks), one sample at a time as
:meth:`vitp.latents.LocalVAE.decode` decodes.

Decoder memory (only when ``data.vae`` is a readable folder; otherwise unknown, never guessed):

- parameters: the exact count of the decoder's parameters (:func:`vitp.latents.vae.parameter_count`,
  built on the meta device from ``config.json``), held in fp32 (:data:`DECODE_BYTES`), as
  :class:`vitp.latents.LocalVAE` loads by default;
- activations of one sample's decode: the peak, over the decoder's run, of the bytes of the live
  tensors, found by running the VAE's own ``decode`` on PyTorch's ``meta`` device (shapes, no
  memory) on one sample's latent and following every tensor an operator returns until it is freed
  (:func:`decode_peak_bytes`). Attention counts as a fused kernel (its output only, no ``L x L``
  matrix), as on GPUs; the caching allocator's fragmentation and cuDNN workspaces are not counted.
  On CPU this equals the measured peak of live tensors of a real decode to the byte for small
  AutoencoderKL, AutoencoderKLWan and AutoencoderKLHunyuanVideo configs
  (tests/unit/test_plan_latents.py).
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

DECODE_BYTES = 4  # bytes per decoder parameter and activation: fp32, LocalVAE's default dtype


@dataclass(frozen=True)
class LatentPlan:
    """One sample of a latent run: ``latent_shape`` ``(C', T', h, w)`` (what the generator sees),
    ``pixel_shape`` ``(C, T, H, W)`` it decodes to, ``tokens`` per sample (``T'/tubelet x h/p x
    w/p``); the VAE at ``vae`` (a folder, or ``None``) of class ``vae_class``, its
    ``encoder_params`` / ``decoder_params`` and ``decode_activation_bytes`` for one sample, each
    ``None`` when unknown (``unknown`` says why)."""

    latent_shape: Tuple[int, int, int, int]
    pixel_shape: Tuple[int, int, int, int]
    tokens: int
    vae: Optional[str] = None
    vae_class: Optional[str] = None
    encoder_params: Optional[int] = None
    decoder_params: Optional[int] = None
    decode_activation_bytes: Optional[int] = None
    unknown: str = ""

    @property
    def decoder_bytes(self) -> Optional[int]:
        """Bytes of the decoder's parameters in fp32, or ``None`` when unknown."""
        return None if self.decoder_params is None else self.decoder_params * DECODE_BYTES

    @property
    def decode_bytes(self) -> int:
        """Bytes a sampling rank adds to decode one sample (decoder weights and activations; 0
        when unknown: then the plan does not count the VAE)."""
        return (self.decoder_bytes or 0) + (self.decode_activation_bytes or 0)

    def as_dict(self) -> Dict[str, Any]:
        """JSON-able: shapes, tokens, the VAE's counts and bytes (``null`` when unknown) and ``unknown``."""
        return {"latent_shape": list(self.latent_shape), "pixel_shape": list(self.pixel_shape), "tokens": self.tokens,
                "vae": self.vae, "vae_class": self.vae_class, "encoder_params": self.encoder_params,
                "decoder_params": self.decoder_params, "decoder_bytes": self.decoder_bytes,
                "decode_activation_bytes": self.decode_activation_bytes, "decode_bytes_counted": self.decode_bytes,
                "unknown": self.unknown or None}

    def describe(self) -> str:
        """Two lines for ``vitp-plan``'s header: the shapes and tokens, and the VAE decoder."""
        from .units import format_bytes

        c, t, h, w = self.latent_shape
        pc, pt, ph, pw = self.pixel_shape
        first = (f"latents: {c} x {t} x {h} x {w} (C' x T' x h x w) per sample, decoded to {pc} x {pt} x {ph} x {pw} "
                 f"pixels (C x T x H x W); {self.tokens} tokens/sample")
        if self.decoder_params is None:
            return f"{first}\nVAE decoder: unknown ({self.unknown}); sampling memory below leaves it out"
        return (f"{first}\nVAE decoder ({self.vae_class}, {self.vae}): {self.decoder_params:,} parameters, "
                f"{format_bytes(self.decoder_bytes)} in fp32; decoding one sample: "
                f"{format_bytes(self.decode_activation_bytes)} of activations; both counted in the sample grid and "
                f"final samples of every rank")


def is_latent(cfg: Any) -> bool:
    """Whether the run config ``cfg`` trains on latents (``data.vae`` set or ``data.latent_channels > 0``)."""
    data = cfg["data"]
    return bool(data.get("vae")) or int(data.get("latent_channels") or 0) > 0


def with_vae_geometry(cfg: Any) -> Any:
    """``cfg`` with ``data.latent_channels`` and ``data.vae_compression`` read from the VAE at
    ``data.vae`` when that is a readable folder and ``data.latent_channels`` is 0 (a copy; ``cfg``
    itself when nothing is filled). Raises ``ValueError`` when the recipe's values disagree with the
    VAE's :func:`vitp.latents.vae.geometry`."""
    folder = cfg.data.get("vae")
    if not folder or not (Path(str(folder)).expanduser() / "config.json").is_file():
        return cfg
    from omegaconf import OmegaConf

    from vitp.latents.vae import geometry

    g = geometry(str(folder))
    have = (int(cfg.data.latent_channels), [int(v) for v in cfg.data.vae_compression])
    want = (g.channels, [g.temporal, g.spatial])
    if have[0] == 0:
        out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
        out.data.latent_channels, out.data.vae_compression = want
        return out
    if have != want:
        raise ValueError(f"data.vae={folder} is a {g.cls} with {g.channels} latent channels and compression "
                         f"[{g.temporal}, {g.spatial}], but data.latent_channels={have[0]} and "
                         f"data.vae_compression={have[1]}: set data.latent_channels={g.channels} "
                         f"data.vae_compression=[{g.temporal},{g.spatial}] (or 0 to read them from the VAE)")
    return cfg


@contextlib.contextmanager
def _fused_attention():
    """``F.scaled_dot_product_attention`` returning only its output's shape (a fused kernel's memory)."""
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention

    def fused(q, k, v, *args, **kwargs):
        return q.new_empty(*q.shape[:-1], v.shape[-1])

    F.scaled_dot_product_attention = fused
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def decode_peak_bytes(cls: str, config: Dict[str, Any], latent: Tuple[int, ...], device: str = "meta") -> int:
    """Peak bytes of the live tensors while a ``cls`` VAE built from ``config`` (a diffusers config
    dict) decodes one latent of shape ``latent`` (the VAE's own input: ``(B, C', h, w)`` for image
    VAEs, ``(1, C', T', h, w)`` for video VAEs), in fp32, parameters and buffers excluded.

    ``device="meta"`` (the plan): no memory, only shapes, attention as a fused kernel's output;
    ``device="cpu"``: a real decode with random weights (what tests compare against). Every tensor
    an operator returns is followed (``TorchDispatchMode``) until its storage is freed."""
    import diffusers
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    with torch.device(device):
        model = getattr(diffusers, cls).from_config({k: v for k, v in config.items() if not k.startswith("_")})
    model.eval()
    skip = {StorageWeakRef(t.untyped_storage()).cdata for t in [*model.parameters(), *model.buffers()]}

    class Live(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live: Dict[int, Tuple[Any, int]] = {}
            self.peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    ref = StorageWeakRef(t.untyped_storage())
                    if ref.cdata not in skip:
                        self.live[ref.cdata] = (ref, t.untyped_storage().nbytes())
            for k in [k for k, (ref, _) in self.live.items() if ref.expired()]:
                del self.live[k]
            self.peak = max(self.peak, sum(n for _, n in self.live.values()))
            return out

    z = torch.zeros(latent, device=device)
    with torch.no_grad(), (_fused_attention() if device == "meta" else contextlib.nullcontext()), Live() as mode:
        model.decode(z).sample.clamp(-1, 1)
    return int(mode.peak)


@functools.lru_cache(maxsize=16)
def _vae_costs(folder: str, mtime: float, latent: Tuple[int, ...]) -> Tuple[str, int, int, int]:
    """``(class, encoder params, decoder params, decode peak bytes)`` of the VAE in ``folder``
    (cached per ``config.json`` modification time and latent shape)."""
    from vitp.latents.vae import parameter_count, vae_config

    cfg = vae_config(folder)
    enc, dec = parameter_count(cfg)
    return cfg["_class_name"], enc, dec, decode_peak_bytes(cfg["_class_name"], cfg, latent)


def _wan_pipeline_vae(cfg: Any) -> Optional[str]:
    """A Wan run's decoder: the ``vae/`` of the pipeline around ``trainer.init_from``'s transformer
    (what its sample grids, FID and FVD decode with), ``None`` for another family or without one."""
    if str(cfg["model"].get("family", "vit")) != "wan" or not cfg["trainer"].get("init_from"):
        return None
    try:
        from omegaconf import OmegaConf

        from vitp.models.wan_run import pipeline_folder, wan_source

        pipe = pipeline_folder(wan_source(cfg if hasattr(cfg, "trainer") else OmegaConf.create(cfg))[0])
    except (OSError, ValueError):  # a folder the config check refuses: no decoder counted here
        return None
    return str(pipe / "vae") if pipe is not None and (pipe / "vae" / "config.json").is_file() else None


def latent_plan(cfg: Any) -> Optional[LatentPlan]:
    """The :class:`LatentPlan` of the run config ``cfg`` (``None`` in pixel space). Tokens and the
    latent shape come from ``cfg.model`` (as the rest of the plan); the pixel shape from
    ``data.channels``, ``data.num_frames`` and ``data.resolution``. With ``data.vae`` a readable
    folder the decoder is counted (module docstring), else it is unknown and ``unknown`` says why."""
    if not is_latent(cfg):
        return None
    from vitp.config import parse_resolution
    from vitp.utils import to_dict

    from .shapes import ModelShape

    model, data = to_dict(cfg["model"]), cfg["data"]
    h, w = parse_resolution(model["image_size"])
    latent = (int(model["in_channels"]), int(model["num_frames"]), h, w)
    pixels = (int(data["channels"]), int(data["num_frames"]), *parse_resolution(data["resolution"]))
    tokens = ModelShape.from_config(model).tokens
    folder = data.get("vae") or _wan_pipeline_vae(cfg)
    if not folder:
        return LatentPlan(latent, pixels, tokens, unknown="data.vae is not set: set it to the local VAE folder "
                                                          "to count the decoder")
    path = Path(str(folder)).expanduser()
    try:
        from vitp.latents.vae import VIDEO_VAES, vae_config

        video = vae_config(path)["_class_name"] in VIDEO_VAES
        shape = (1, latent[0], latent[1], h, w) if video else (latent[1], latent[0], h, w)
        cls, enc, dec, peak = _vae_costs(str(path), (path / "config.json").stat().st_mtime, shape)
    except (OSError, ValueError) as e:
        return LatentPlan(latent, pixels, tokens, str(folder), unknown=f"data.vae={folder} is not readable here: "
                                                                        f"{str(e).split(':')[0]}")
    return LatentPlan(latent, pixels, tokens, str(folder), cls, enc, dec, peak)


def decode_memory_bytes(cfg: Any) -> int:
    """Bytes a sampling rank adds to decode one sample of the run config ``cfg`` (0 in pixel space
    or when the VAE is unknown: :attr:`LatentPlan.decode_bytes`)."""
    lp = latent_plan(cfg)
    return 0 if lp is None else lp.decode_bytes

