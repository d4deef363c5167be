"""The options of a diffusers Wan transformer folder, read and checked without building a model.

:class:`WanConfig` holds a ``WanTransformer3DModel`` ``config.json`` (diffusers'
``diffusers/models/transformers/transformer_wan.py``; Wan, arXiv 2503.20314) and refuses what
vitp's Wan (:mod:`vitp.models.wan`) does not implement; :func:`transformer_folder` finds the
transformer folder of a transformer or pipeline folder and :func:`read_config` reads its
``config.json``. Apart from the layers, so that a run config's check (:mod:`vitp.models.wan_run`,
called by :func:`vitp.config.validate_config`) reads a folder's sizes without importing the model.
:mod:`vitp.models.wan` and :mod:`vitp.models.wan_keys` re-export these names.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple, Union

PathLike = Union[str, Path]
QK_NORM = "rms_norm_across_heads"
CLASS_NAME = "WanTransformer3DModel"
REQUIRED = ("patch_size", "num_attention_heads", "attention_head_dim", "in_channels", "text_dim", "freq_dim",
            "ffn_dim", "num_layers")  # config.json keys that size the weights
IGNORED = ("norm_added_q",)  # diffusers' _keys_to_ignore_on_load_unexpected for Wan
HINT = ("give a local diffusers Wan folder: a transformer folder (config.json + diffusion_pytorch_model*.safetensors) "
        "or a pipeline folder with model_index.json and transformer/, e.g. "
        "hf download Wan-AI/Wan2.1-T2V-1.3B-Diffusers --local-dir /models/wan2.1; vitp never downloads")


# The published Wan text-to-video transformer configs (vitp.plan.wan's docstring; the planner's model.preset)
_COMMON = {"patch_size": [1, 2, 2], "attention_head_dim": 128, "text_dim": 4096, "freq_dim": 256,
           "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": None,
           "added_kv_proj_dim": None, "rope_max_seq_len": 1024}
WAN_PRESETS: Dict[str, Dict[str, Any]] = {
    "wan2.1-t2v-1.3b": {**_COMMON, "num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30, "in_channels": 16,
                        "out_channels": 16},
    "wan2.1-t2v-14b": {**_COMMON, "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40, "in_channels": 16,
                       "out_channels": 16},
    "wan2.2-ti2v-5b": {**_COMMON, "num_attention_heads": 24, "ffn_dim": 14336, "num_layers": 30, "in_channels": 48,
                       "out_channels": 48},
    "wan2.2-t2v-a14b": {**_COMMON, "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40, "in_channels": 16,
                        "out_channels": 16},  # per expert; the pipeline holds two
}


@dataclass
class WanConfig:
    """The options of a diffusers ``WanTransformer3DModel`` ``config.json`` (same names and
    defaults), checked against what vitp implements.

    ``D = num_attention_heads * attention_head_dim``; ``out_channels`` null means
    ``in_channels`` (as diffusers). :meth:`from_dict` reads a ``config.json`` dict.
    """

    patch_size: Tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: Optional[int] = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    qk_norm: Optional[str] = QK_NORM
    eps: float = 1e-6
    image_dim: Optional[int] = None
    added_kv_proj_dim: Optional[int] = None
    rope_max_seq_len: int = 1024
    pos_embed_seq_len: Optional[int] = None

    def __post_init__(self):
        if isinstance(self.patch_size, (list, tuple)):
            self.patch_size = tuple(self.patch_size)
        if self.out_channels is None:
            self.out_channels = self.in_channels

    @property
    def width(self) -> int:
        """The inner width ``D = num_attention_heads * attention_head_dim``."""
        return self.num_attention_heads * self.attention_head_dim

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any], source: str = "config") -> "WanConfig":
        """A :class:`WanConfig` of a diffusers config dict (keys starting with ``_`` ignored), checked.

        Raises ``ValueError`` naming ``source`` and the key for a key diffusers' Wan does not
        have (``expand_timesteps`` is a pipeline option, of ``model_index.json``), a value of the
        wrong type (:func:`check_types`), or an option :meth:`check` refuses; ``TypeError`` when
        ``cfg`` is not a mapping.
        """
        if not isinstance(cfg, Mapping):
            raise TypeError(f"{source}: a Wan config must be a dict of config.json keys, got {type(cfg).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(k for k in cfg if not k.startswith("_") and k not in known)
        if unknown:
            raise ValueError(f"{source}: config keys {unknown} are not options of diffusers' WanTransformer3DModel "
                             f"known to vitp ({sorted(known)}); remove them or use a Wan text-to-video config")
        check_types({k: v for k, v in cfg.items() if k in known}, source)
        out = cls(**{k: v for k, v in cfg.items() if k in known})
        out.check(source)
        return out

    def check(self, source: str = "config") -> None:
        """Raises ``ValueError`` naming the key for what vitp does not implement: image-to-video
        (``image_dim``, ``added_kv_proj_dim`` not null), another ``qk_norm``, a non-square or
        non-3-D ``patch_size``, an odd ``attention_head_dim`` (rotary pairs), a size below 1, or a
        value of the wrong type (:func:`check_types`)."""
        check_types(asdict(self), source)
        if self.image_dim is not None:
            raise ValueError(f"{source}: image_dim={self.image_dim} is an image-to-video Wan (CLIP image tokens), "
                             "which vitp does not implement; use a text-to-video checkpoint (image_dim null)")
        if self.added_kv_proj_dim is not None:
            raise ValueError(f"{source}: added_kv_proj_dim={self.added_kv_proj_dim} (image key/value projections of "
                             "image-to-video Wan) is not implemented in vitp; use a text-to-video checkpoint "
                             "(added_kv_proj_dim null)")
        if self.qk_norm != QK_NORM:
            raise ValueError(f"{source}: qk_norm={self.qk_norm!r}; vitp's Wan implements only {QK_NORM!r} (every "
                             f"Wan 2.1/2.2 checkpoint), set qk_norm to {QK_NORM!r}")
        if len(self.patch_size) != 3 or self.patch_size[1] != self.patch_size[2]:
            raise ValueError(f"{source}: patch_size={list(self.patch_size)}; vitp's Wan takes (pt, p, p) patches "
                             "(Wan uses [1, 2, 2])")
        if self.attention_head_dim % 2:
            raise ValueError(f"{source}: attention_head_dim={self.attention_head_dim} is odd; rotary positions rotate "
                             "pairs of channels, so it must be even")
        sizes = ("num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "text_dim", "freq_dim",
                 "ffn_dim", "num_layers", "rope_max_seq_len")
        bad = [k for k in sizes if getattr(self, k) < 1] + (["patch_size"] if min(self.patch_size) < 1 else [])
        if bad:
            raise ValueError(f"{source}: {bad} must be at least 1")

    def to_dict(self) -> Dict[str, Any]:
        """The options as ``config.json`` writes them (``patch_size`` a list)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


INT_KEYS = ("num_attention_heads", "attention_head_dim", "in_channels", "text_dim", "freq_dim", "ffn_dim",
            "num_layers", "rope_max_seq_len")
OPTIONAL_INT_KEYS = ("out_channels", "image_dim", "added_kv_proj_dim", "pos_embed_seq_len")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_types(values: Mapping[str, Any], source: str = "config") -> None:
    """Raises ``ValueError`` naming ``source``, the key and the value for a config value of the
    wrong type: the sizes (:data:`INT_KEYS`) must be integers, :data:`OPTIONAL_INT_KEYS` integers
    or null, ``patch_size`` a list of three integers, ``eps`` a number, ``cross_attn_norm`` a
    boolean, ``qk_norm`` a string or null. Keys absent from ``values`` are not checked."""
    def bad(key: str, want: str) -> ValueError:
        return ValueError(f"{source}: {key}={values[key]!r} must be {want}; fix it in the config "
                          "(diffusers' Wan configs hold plain JSON numbers, e.g. \"num_layers\": 30)")

    for k in INT_KEYS:
        if k in values and not _is_int(values[k]):
            raise bad(k, "an integer")
    for k in OPTIONAL_INT_KEYS:
        if k in values and values[k] is not None and not _is_int(values[k]):
            raise bad(k, "an integer or null")
    ps = values.get("patch_size", (1, 2, 2))
    if not isinstance(ps, (list, tuple)) or len(ps) != 3 or not all(_is_int(v) for v in ps):
        raise bad("patch_size", "a list of three integers [pt, p, p] (Wan: [1, 2, 2])")
    if "eps" in values and (not isinstance(values["eps"], (int, float)) or isinstance(values["eps"], bool)):
        raise bad("eps", "a number")
    if "cross_attn_norm" in values and not isinstance(values["cross_attn_norm"], bool):
        raise bad("cross_attn_norm", "true or false")
    if "qk_norm" in values and values["qk_norm"] is not None and not isinstance(values["qk_norm"], str):
        raise bad("qk_norm", f"the string {QK_NORM!r}")


def transformer_folder(folder: PathLike, subfolder: Optional[str] = "transformer") -> Path:
    """The transformer folder of ``folder``: ``folder`` itself when it holds ``config.json``, or
    ``folder/<subfolder>`` of a pipeline folder (``model_index.json``). ``subfolder=None``: the
    folder itself, which must be a transformer folder.

    Raises ``FileNotFoundError`` naming the path (no folder, no config); ``ValueError`` for a
    transformer folder given with a ``subfolder`` other than ``"transformer"`` (the subfolder
    would be ignored: pass the pipeline folder), and for a pipeline :func:`read_pipeline` refuses
    (image-to-video, an expert without its ``boundary_ratio``), read from ``folder``'s
    ``model_index.json`` or, for a transformer folder, its parent's; ``TypeError`` for a
    ``subfolder`` that is not a string.
    """
    if subfolder is not None and not isinstance(subfolder, str):
        raise TypeError(f"subfolder={subfolder!r} must be a folder name such as 'transformer' or 'transformer_2', "
                        "or None for the folder itself")
    path = Path(folder).expanduser()
    if not path.is_dir():
        what = "is a file, not a folder" if path.exists() else "does not exist"
        moved = (" (a run whose base folder moved: add trainer.init_from=NEW_PLACE to vitp-train --resume RUN, "
                 "and for a LoRA run to vitp-sample RUN or vitp-eval RUN)"
                 if not path.exists() else "")
        raise FileNotFoundError(f"Wan folder {path} {what}: {HINT}{moved}")
    index = path / "model_index.json"
    if (path / "config.json").is_file():
        if subfolder not in (None, "transformer"):
            raise ValueError(f"{path} is a transformer folder (it holds config.json), so subfolder={subfolder!r} "
                             f"cannot apply; pass the pipeline folder (the one with model_index.json, e.g. "
                             f"{path.parent}) with subfolder={subfolder!r}, or the {subfolder}/ folder itself")
        if (path.parent / "model_index.json").is_file():
            _check_index(path.parent / "model_index.json", strict=False)
        return path
    if subfolder is None:
        raise FileNotFoundError(f"{path} holds no config.json: subfolder=None takes a transformer folder; for a "
                                "pipeline folder give subfolder='transformer' (or 'transformer_2')")
    if index.is_file():
        _check_index(index)
        sub = path / subfolder
        if not (sub / "config.json").is_file():
            what = "has no" if not sub.is_dir() else "has a"
            raise FileNotFoundError(f"{sub / 'config.json'} does not exist: the pipeline folder {path} {what} "
                                    f"{subfolder}/ folder{' without its config.json' if sub.is_dir() else ''}; "
                                    "copy the whole pipeline folder again")
        return sub
    raise FileNotFoundError(f"{path} holds neither config.json nor model_index.json: {HINT}")


@dataclass(frozen=True)
class PipelineInfo:
    """What ``model_index.json`` of a Wan pipeline folder says about its transformers (diffusers'
    ``WanPipeline.__init__``, ``pipelines/wan/pipeline_wan.py``): ``experts`` the transformer
    subfolders (``("transformer",)``, or Wan 2.2 A14B's ``("transformer", "transformer_2")``: high
    noise, low noise), ``boundary_ratio`` (A14B: ``transformer`` for timesteps ``t >= boundary_ratio
    * num_train_timesteps``, ``transformer_2`` below; None with one expert), ``expand_timesteps``
    (Wan 2.2 TI2V-5B: per-token timesteps ``(B, N)``)."""

    folder: Path
    experts: Tuple[str, ...] = ("transformer",)
    boundary_ratio: Optional[float] = None
    expand_timesteps: bool = False

    @property
    def two_experts(self) -> bool:
        """Whether the pipeline holds Wan 2.2 A14B's pair of experts."""
        return len(self.experts) == 2


I2V_PIPELINES = ("WanImageToVideoPipeline", "WanVACEPipeline", "WanAnimatePipeline", "WanVideoToVideoPipeline")


def read_pipeline(folder: PathLike) -> PipelineInfo:
    """The :class:`PipelineInfo` of a pipeline folder's ``model_index.json``. Raises ``ValueError``
    naming the file and the fix for an image- or video-conditioned pipeline (the TI2V/I2V
    image-conditioned first frame, VACE: vitp samples and trains text-to-video), ``transformer_2``
    without a ``boundary_ratio`` in (0, 1) or the other way round, and a listed ``transformer_2``
    or ``vae`` (:func:`check_listed_vae`) whose folder is missing; as :func:`read_json_object` for a damaged file."""
    folder = Path(folder)
    index = folder / "model_index.json"
    pipe = read_json_object(index, fix="copy the pipeline folder again")
    name = pipe.get("_class_name")
    if name in I2V_PIPELINES:
        raise ValueError(f"{index}: {name} conditions on an image or video (the image-conditioned first frame of Wan "
                         "2.2 TI2V / I2V), which vitp does not support; vitp trains and samples text-to-video: give a "
                         "WanPipeline folder (Wan2.1-T2V, Wan2.2-T2V-A14B, Wan2.2-TI2V-5B for text-to-video)")
    two = isinstance(pipe.get("transformer_2"), list) and pipe["transformer_2"][:1] not in ([None], [])
    ratio = pipe.get("boundary_ratio")
    if two and (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < 1):
        raise ValueError(f"{index} lists transformer_2 (Wan 2.2 A14B's low-noise expert) but boundary_ratio={ratio!r}; "
                         "the pipeline switches experts at boundary_ratio * num_train_timesteps: set "
                         "\"boundary_ratio\": 0.875 (Wan2.2-T2V-A14B's) in it, or copy the folder again")
    if not two and ratio is not None:
        raise ValueError(f"{index} has boundary_ratio={ratio!r} but no transformer_2 (the low-noise expert below the "
                         "boundary); copy the whole Wan 2.2 A14B folder (transformer_2/ and its model_index.json "
                         "entry), or set \"boundary_ratio\": null for one transformer")
    if two and not (folder / "transformer_2" / "config.json").is_file():
        raise FileNotFoundError(f"{folder / 'transformer_2' / 'config.json'} does not exist, but {index} lists "
                                "transformer_2 (Wan 2.2 A14B's low-noise expert); copy the whole pipeline folder again")
    check_listed_vae(folder, pipe)
    return PipelineInfo(folder, ("transformer", "transformer_2") if two else ("transformer",),
                        float(ratio) if two else None, bool(pipe.get("expand_timesteps", False)))


def check_listed_vae(folder: Path, pipe: Optional[Dict[str, Any]] = None) -> None:
    """Raises ``FileNotFoundError`` when the pipeline ``folder``'s ``model_index.json`` (``pipe``,
    else read; unreadable: nothing) lists a ``vae`` whose ``vae/config.json`` is missing: training
    would score latents instead of pixels and its ``RUN/diffusers`` would list a VAE it lacks.
    A pipeline without a VAE says ``"vae": [null, null]``."""
    if pipe is None:
        try:
            pipe = json.loads((Path(folder) / "model_index.json").read_text())
        except (OSError, ValueError):
            return
    vae = pipe.get("vae") if isinstance(pipe, dict) else None
    if isinstance(vae, list) and vae[:1] not in ([None], []) and not (Path(folder) / "vae" / "config.json").is_file():
        raise FileNotFoundError(f"{Path(folder) / 'vae' / 'config.json'} does not exist, but "
                                f"{Path(folder) / 'model_index.json'} lists vae (it decodes samples and evaluations); "
                                "copy the pipeline's vae/ again, or set \"vae\": [null, null] in it to work in "
                                "latent space")


def _check_index(index: Path, strict: bool = True) -> None:
    """:func:`read_pipeline` of the pipeline of ``index``. ``strict=False`` (a transformer folder
    given, in the pipeline ``index`` belongs to): only an image-conditioned pipeline and a listed
    ``vae`` without its folder are refused; an unreadable index is no pipeline, and the other
    expert's folder is not needed."""
    try:
        read_pipeline(index.parent)
    except (ValueError, FileNotFoundError) as e:
        if strict or any(name in str(e) for name in I2V_PIPELINES):
            raise
        check_listed_vae(index.parent)  # the transformer's run still decodes through this pipeline's vae/


def read_json_object(path: Path, what: str = "keys", fix: str = "copy the folder again") -> Dict[str, Any]:
    """The JSON object of ``path`` (a diffusers folder's ``config.json``, index, scheduler config).
    Raises ``ValueError`` naming the file, ``what`` it should hold and ``fix`` when it is not valid
    JSON or not a JSON object (``{...}``)."""
    try:
        out = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); {fix}") from None
    if not isinstance(out, dict):
        raise ValueError(f"{path} holds a JSON {type(out).__name__}, not an object {{...}} of {what}; {fix}")
    return out


def read_config(folder: Path) -> WanConfig:
    """The checked :class:`~vitp.models.wan.WanConfig` of a transformer folder's ``config.json``.
    Raises ``ValueError`` naming the file for invalid JSON or not an object, another
    ``_class_name``, a missing key that sizes the model (:data:`REQUIRED`: no default is
    guessed), a value of the wrong type or an option vitp lacks."""
    path = folder / "config.json"
    cfg = read_json_object(path)
    name = cfg.get("_class_name")
    if name != CLASS_NAME:
        raise ValueError(f"{path}: _class_name {name!r} is not a Wan text-to-video transformer ({CLASS_NAME}); give a "
                         "Wan pipeline folder or its transformer/ subfolder")
    missing = [k for k in REQUIRED if k not in cfg]
    if missing:
        raise ValueError(f"{path}: missing {missing}, which size the model (diffusers writes every one); copy the "
                         "folder again or add them from the checkpoint's published config.json")
    return WanConfig.from_dict(cfg, source=str(path))


# vitp's names of Wan's weights against diffusers' (vitp.models.wan_keys maps the weights with them)
_LINEARS = (  # (vitp module, diffusers modules stacked along the output rows), per block
    ("attn.qkv", ("attn1.to_q", "attn1.to_k", "attn1.to_v")),
    ("attn.proj", ("attn1.to_out.0",)),
    ("cross_attn.q", ("attn2.to_q",)),
    ("cross_attn.kv", ("attn2.to_k", "attn2.to_v")),
    ("cross_attn.proj", ("attn2.to_out.0",)),
    ("mlp.fc1", ("ffn.net.0.proj",)),
    ("mlp.fc2", ("ffn.net.2",)),
)
_WEIGHTS_ONLY = (("attn.q_norm", "attn1.norm_q"), ("attn.k_norm", "attn1.norm_k"),
                 ("cross_attn.q_norm", "attn2.norm_q"), ("cross_attn.k_norm", "attn2.norm_k"))
_TOP = (
    ("embed.x_embedder.proj", "patch_embedding"),
    ("embed.t_embedder.mlp.fc1", "condition_embedder.time_embedder.linear_1"),
    ("embed.t_embedder.mlp.fc2", "condition_embedder.time_embedder.linear_2"),
    ("embed.time_proj.1", "condition_embedder.time_proj"),
    ("embed.y_embedder.fc1", "condition_embedder.text_embedder.linear_1"),
    ("embed.y_embedder.fc2", "condition_embedder.text_embedder.linear_2"),
    ("final.linear", "proj_out"),
)
