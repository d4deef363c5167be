"""A Hugging Face ``transformers`` text encoder, loaded from a local folder, that turns captions into
per-token embeddings and an attention mask.

This is the frozen text tower of PixArt-alpha (T5-XXL, 120 tokens; Chen et al. 2023,
https://github.com/PixArt-alpha/PixArt-alpha ``diffusion/model/t5.py``), Stable Diffusion 3 (T5-XXL
and CLIP), Wan 2.1 and Open-Sora 2 (umT5-XXL): the caption is tokenized, padded to a fixed length,
and the encoder's last hidden state is the condition, with the tokenizer's attention mask telling
real tokens from padding.

The encoder is read from a folder that holds its ``config.json`` and weights (one saved with
``save_pretrained``, or a snapshot downloaded beforehand, e.g. ``hf download
google/t5-v1_1-xxl --local-dir /models/t5-v1_1-xxl``); every ``from_pretrained`` here passes
``local_files_only=True``, so vitp never downloads anything.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

# config.model_type -> the transformers class that holds the text encoder alone
ENCODER_CLASSES = {"t5": "T5EncoderModel", "umt5": "UMT5EncoderModel", "mt5": "MT5EncoderModel",
                   "clip": "CLIPTextModel", "clip_text_model": "CLIPTextModel"}
T5_FAMILY = ("t5", "umt5", "mt5")
T5_MAX_LENGTH = 120  # PixArt-alpha's caption length (diffusion/model/t5.py, max_length=120)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# config keys that change with the transformers version or the folder, not with the encoder
VOLATILE_KEYS = ("transformers_version",)

PathLike = Union[str, Path]


def _config_file(path: PathLike) -> Path:
    """``path/config.json``; raises ``FileNotFoundError`` naming ``path`` when it is missing."""
    from .tiny import local_encoder

    folder = local_encoder(path)
    if not (folder / "config.json").is_file():
        what = "does not exist" if not folder.exists() else "has no config.json"
        if folder.name == "tiny-t5" and folder.parent.name == "text-encoders":
            raise FileNotFoundError(f"text encoder {folder} {what}: it is vitp's demo encoder; give "
                                    f"data.text_encoder=tiny (or --encoder tiny), which builds it here")
        raise FileNotFoundError(
            f"text encoder {folder} {what}: give a local folder saved with save_pretrained or a downloaded "
            f"snapshot (e.g. hf download google/t5-v1_1-xxl --local-dir {folder}); vitp never downloads")
    return folder / "config.json"


def load_config(path: PathLike) -> Any:
    """The ``transformers`` config of the encoder folder ``path`` (``AutoConfig``, local files only).

    Raises ``FileNotFoundError`` (no ``config.json``), ``ValueError`` for a ``model_type`` not in
    :data:`ENCODER_CLASSES`."""
    from transformers import AutoConfig

    _config_file(path)
    config = AutoConfig.from_pretrained(str(Path(path).expanduser()), local_files_only=True)
    if config.model_type not in ENCODER_CLASSES:
        raise ValueError(f"text encoder {path}: model_type {config.model_type!r} is not supported; "
                         f"supported: {', '.join(ENCODER_CLASSES)}")
    return config


def _text_config(config: Any) -> Any:
    """The text part of a config (a full CLIP config holds the text and the vision tower)."""
    return config.text_config if config.model_type == "clip" else config


def config_sha256(config: Any) -> str:
    """SHA-256 (hex) of the canonical JSON (sorted keys, no spaces) of ``config.to_dict()`` without
    :data:`VOLATILE_KEYS` and the private ``_``-prefixed keys (``_name_or_path``: the folder)."""
    d = {k: v for k, v in config.to_dict().items() if k not in VOLATILE_KEYS and not k.startswith("_")}
    text = json.dumps(d, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def encoder_record(path: PathLike) -> Dict[str, Any]:
    """What identifies the encoder in ``path``, as stored in an embedding store's ``index.json``:
    ``{"name", "path", "model_type", "class", "config_sha256", "hidden_size"}``.

    ``name`` is the ``_name_or_path`` written in ``config.json`` when it is a hub id such as
    ``google/t5-v1_1-xxl`` (hub configs often carry one), else the folder's name; ``path`` is absolute (``"tiny"`` for the demo encoder); ``class`` the transformers class used
    (:data:`ENCODER_CLASSES`); ``config_sha256`` is :func:`config_sha256`; ``hidden_size`` the
    embedding width ``Dc`` (channels per token).

    Raises ``FileNotFoundError`` when ``path`` has no ``config.json``; ``ValueError`` for an
    unsupported ``model_type``."""
    from .tiny import DEMO_ENCODER, local_encoder

    demo = str(path) == DEMO_ENCODER  # recorded by its name: every machine builds the same one
    path = local_encoder(path)
    raw = json.loads(_config_file(path).read_text())
    config = load_config(path)
    folder = Path(path).expanduser().absolute()
    name = str(raw.get("_name_or_path") or "")
    hub_id = re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name) and not name.startswith(".")  # not a local path
    return {"name": name if hub_id else folder.name, "path": DEMO_ENCODER if demo else str(folder),
            "model_type": config.model_type, "class": ENCODER_CLASSES[config.model_type],
            "config_sha256": config_sha256(config), "hidden_size": int(_text_config(config).hidden_size),
            "weights_fingerprint": weights_fingerprint(folder)}


def weights_fingerprint(folder: Path) -> str:
    """sha256 over the encoder's weight files (``*.safetensors``, ``*.bin``): each one's name,
    size and first and last MiB. Two encoders of one architecture (same :func:`config_sha256`)
    but other weights differ here, without reading a 10 GB checkpoint whole."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(folder).iterdir() if p.suffix in (".safetensors", ".bin")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read(1 << 20))
    return h.hexdigest()


def resolve_device(device: str) -> torch.device:
    """``"auto"``: CUDA when available, else CPU; any other name as ``torch.device`` reads it.

    Raises ``ValueError`` for ``"cuda"`` on a machine without CUDA."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: this machine has no CUDA device; use cpu or auto")
    return dev


def _load_tokenizer(path: Path) -> Any:
    """``AutoTokenizer`` of ``path`` (local files only). Raises ``ValueError`` naming the folder when
    it cannot be read; a folder whose tokenizer is only a SentencePiece ``spiece.model`` (T5, umT5
    snapshots without ``tokenizer.json``) needs the ``sentencepiece`` package to convert it."""
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (ValueError, ImportError, OSError, TypeError) as e:
        hint = ""
        if any(path.glob("*.model")) and not (path / "tokenizer.json").is_file():
            hint = ("; its tokenizer is a SentencePiece .model file without tokenizer.json: transformers needs the "
                    "sentencepiece package to read it (pip install sentencepiece)")
        raise ValueError(f"text encoder {path}: cannot load its tokenizer ({' '.join(str(e).split())[:300]}){hint}") \
            from None


def _load_model(path: Path, record: Dict[str, Any], dtype: torch.dtype) -> Any:
    """The encoder class of ``record`` from ``path`` (local files only).

    Weights the checkpoint holds beyond the encoder (a full T5's decoder, a full CLIP's vision tower)
    go unused, so transformers' load report is silenced; weights the encoder needs and the checkpoint
    lacks (or holds in another shape) would be left random, so they raise ``ValueError``."""
    import transformers

    cls = getattr(transformers, record["class"])
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    bar = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # a per-load "Loading weights" bar in every log
    try:
        model, info = cls.from_pretrained(str(path), local_files_only=True, dtype=dtype, output_loading_info=True)
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bar:
            transformers.utils.logging.enable_progress_bar()
    for what in ("missing_keys", "mismatched_keys"):
        keys = sorted(map(str, info.get(what) or []))
        if keys:
            raise ValueError(f"text encoder {path}: the checkpoint lacks {len(keys)} {record['class']} weights "
                             f"({what}: {', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''}); it is not a "
                             f"complete {record['model_type']} encoder")
    return model


class TextEncoder:
    """A frozen text encoder from the local folder ``path`` (see the module docstring).

    ``device``: ``"auto"`` (CUDA if available), ``"cpu"``, ``"cuda"``, ``"cuda:1"``; ``dtype``: the
    weights' and compute dtype, ``"float32"``, ``"bfloat16"`` or ``"float16"``; ``max_length``: the
    padded token count ``L`` (default 120 for the T5 family, as PixArt-alpha; the tokenizer's
    ``model_max_length``, 77, for CLIP). Captions longer than ``L`` tokens are truncated and
    counted (:attr:`truncated`, :attr:`last_truncated`); :attr:`encoded` counts the captions encoded.
    The tokenizer and config load at once; the weights (:attr:`model`) on the first :meth:`encode`.

    Raises ``FileNotFoundError`` (no ``config.json``), ``ValueError`` for an unsupported
    ``model_type``, dtype or device, or ``max_length < 1``.
    """

    def __init__(self, path: PathLike, device: str = "cpu", dtype: str = "float32",
                 max_length: Optional[int] = None):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r}: use one of {', '.join(DTYPES)}")
        from .tiny import local_encoder

        self.path = local_encoder(path).absolute()
        self.record = encoder_record(path)
        self.device = resolve_device(device)
        self.dtype = dtype
        self.config = load_config(self.path)
        self.tokenizer = _load_tokenizer(self.path)
        self._model: Any = None
        self.max_length = int(max_length) if max_length is not None else self._default_max_length()
        if self.max_length < 1:
            raise ValueError(f"max_length={self.max_length}: use a positive number of tokens")
        self.dim = self.record["hidden_size"]
        self.encoded = 0  # captions encoded by every encode() call so far
        self.truncated = 0  # ... of them truncated
        self.last_truncated = 0  # ... by the last call

    @property
    def model(self) -> Any:
        """The transformers encoder, loaded on first use (a rerun on a finished store never loads it)."""
        if self._model is None:
            self._model = _load_model(self.path, self.record, DTYPES[self.dtype])
            self._model.to(self.device).eval().requires_grad_(False)
        return self._model

    def _default_max_length(self) -> int:
        if self.record["model_type"] in T5_FAMILY:
            return T5_MAX_LENGTH
        n = int(getattr(self.tokenizer, "model_max_length", 0) or 0)
        positions = int(_text_config(self.config).max_position_embeddings)
        return n if 0 < n <= positions else positions  # tokenizers without a limit report 1e30

    def encode(self, captions: List[str]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Embeddings ``(B, L, Dc)`` float32 on the CPU and the mask ``(B, L)`` bool (True: a real
        token, False: padding) of the ``B`` captions, ``L`` = :attr:`max_length`, ``Dc`` = :attr:`dim`.

        The encoder's last hidden state at every position, padding included (the mask is passed
        to the encoder and is what a model should use; SD3 attends to the padded positions too).
        Raises ``TypeError`` for a caption that is not a string."""
        bad = [c for c in captions if not isinstance(c, str)]
        if bad:
            raise TypeError(f"captions must be strings; got {type(bad[0]).__name__} {bad[0]!r}")
        if not captions:
            return torch.zeros(0, self.max_length, self.dim), torch.zeros(0, self.max_length, dtype=torch.bool)
        lengths = [len(ids) for ids in self.tokenizer(list(captions))["input_ids"]]
        self.last_truncated = sum(n > self.max_length for n in lengths)
        self.truncated += self.last_truncated
        self.encoded += len(captions)
        tok = self.tokenizer(list(captions), padding="max_length", truncation=True, max_length=self.max_length,
                             return_tensors="pt")
        ids, mask = tok["input_ids"].to(self.device), tok["attention_mask"].to(self.device)
        with torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        return out.float().cpu(), mask.bool().cpu()
