"""Exported weights: one safetensors file of full fp32 tensors (format ``vitp.export/1``).

The ViT blocks are stored under timm's ``VisionTransformer`` names and layouts, generator-only
tensors under ``gen.`` (:mod:`vitp.models.keys`), and the model and run config as JSON metadata
(plus a ``<stem>.json`` sidecar). An export loads into any ``(tp, pp)`` (``trainer.init_from``),
into one process (:func:`load_generator`, ``vitp-sample``), and its blocks into a stock timm ViT
with strict key matching. The final ``model_ema.safetensors`` / ``model.safetensors`` of a run
and the weights inside each training checkpoint use the same layout.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from omegaconf import DictConfig, OmegaConf

from vitp.config import parse_resolution
from vitp.models import Generator, export_key, from_export_state, to_export_state
from vitp.utils import atomic_write, atomic_write_text, to_dict

FORMAT = "vitp.export/1"
PARTIAL_SYNC_NOTE = ("trained with parallel.partial_sync < 1: every TP rank carries private channels, so these full "
                     "weights compute this model only with its tp streams (trainer.init_from at the same tp and p, "
                     "or vitp-sample / vitp-eval, which run the streams on one device); a plain timm/vitp model "
                     "built from them computes another function")
# model keys that change parameter shapes or names: must match to load weights
ARCH_KEYS = ("in_channels", "num_classes", "patch_size", "tubelet_size", "width", "depth", "num_heads",
             "mlp_ratio", "mlp", "qkv_bias", "qk_norm", "layer_scale_init")
# ... and those that change the computation (resuming must match them too)
RESUME_KEYS = ARCH_KEYS + ("image_size", "num_frames", "attention")


def save_export(path: str | os.PathLike, gen_state: Dict[str, torch.Tensor], cfg: DictConfig, *,
                step: Optional[int] = None, weights: str = "ema") -> Path:
    """Write ``gen_state`` (generator keys, full tensors) as an export file plus ``<stem>.json``,
    each atomically (:func:`vitp.utils.atomic_write`).

    Metadata: ``format``, ``vitp_model`` (model config JSON), ``vitp_config`` (the run config),
    ``step``, ``weights`` (``ema`` | ``raw``); for ``parallel.partial_sync < 1`` also
    ``partial_sync``, ``partial_sync_tp``, ``partial_sync_scale`` (and in the sidecar): the
    per-rank layout is fixed slices of the full tensors, so these define it. ``conditioning``
    (``class`` | ``text``) and for text ``text_encoder`` (:func:`text_conditioning`; in the
    sidecar too).
    """
    from safetensors.torch import save_file

    path = Path(path)
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    model = cfg_dict["model"]
    meta = {"format": FORMAT, "vitp_model": json.dumps(model), "vitp_config": json.dumps(cfg_dict),
            "step": str(step if step is not None else -1), "weights": weights}
    text = text_conditioning(cfg_dict)
    meta["conditioning"] = "text" if text else "class"
    if text:
        meta["text_encoder"] = json.dumps(text)
    ps = partial_sync_of(cfg_dict.get("parallel"))
    if ps["p"] < 1.0:  # also in vitp_config; spelled out for readers that do not parse it
        meta.update(partial_sync=str(ps["p"]), partial_sync_tp=str(ps["tp"]), partial_sync_scale=ps["scale"])
    with atomic_write(path) as tmp:
        save_file(to_export_state(gen_state, model["width"], model["depth"]), str(tmp), metadata=meta)
    side = {"format": FORMAT, "weights": weights, "step": step, "model": model, "tensors": str(path.name),
            "conditioning": meta["conditioning"], **({"text_encoder": text} if text else {})}
    if ps["p"] < 1.0:
        side["partial_sync"] = {**ps, "note": PARTIAL_SYNC_NOTE}
    atomic_write_text(path.with_suffix(".json"), json.dumps(side, indent=2) + "\n", fsync=True)
    return path


def text_conditioning(cfg: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """What a text-conditional model (``model.text_dim > 0`` in the run config ``cfg``, a plain
    dict) was trained on: ``{"embeddings": absolute store path, "max_length": L, "encoder": the
    store's encoder record (name, local path, class, config hash, channels)}``, read from the
    store's ``index.json`` (``encoder`` is ``{"path": data.text_encoder}`` when the store is
    gone); ``None`` for a class-conditional model."""
    if not cfg["model"].get("text_dim"):
        return None
    data = cfg["data"]
    where = data.get("text_embeddings")
    out: Dict[str, Any] = {"embeddings": str(Path(where).resolve()) if where else None,
                           "encoder": {"path": data.get("text_encoder")}}
    index = Path(where) / "index.json" if where else None
    if index is not None and index.is_file():
        head = json.loads(index.read_text())
        out.update(max_length=head.get("max_length"), encoder=head.get("encoder", out["encoder"]))
    return out


def save_weights(run_dir: Path, cfg: DictConfig, ema_state: Dict[str, torch.Tensor],
                 raw_state: Dict[str, torch.Tensor], step: Optional[int] = None) -> None:
    """A run's final ``model_ema.safetensors`` and ``model.safetensors`` (+ ``.json`` sidecars)."""
    save_export(run_dir / "model_ema.safetensors", ema_state, cfg, step=step, weights="ema")
    save_export(run_dir / "model.safetensors", raw_state, cfg, step=step, weights="raw")


def read_export(path: str | os.PathLike, keys: Optional[Iterable[str]] = None
                ) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """``(generator state dict, metadata)`` of a vitp weights file; with ``keys`` (generator keys)
    only those tensors are read (a pipeline stage needs only its own layers).

    Also reads the older layout (generator keys, ``vitp_config`` metadata only).
    Raises ``FileNotFoundError`` / ``ValueError`` naming the file when it is missing, truncated,
    corrupt, or not written by vitp.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            exported = meta.get("format") == FORMAT
            if keys is not None and "vitp_config" in meta:
                name = export_key if exported else (lambda k: k)
                return {k: f.get_tensor(name(k)) for k in keys}, meta
        tensors = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
        raise ValueError(f"weights file {path} is corrupt, truncated or not a safetensors file: {e}") from e
    if "vitp_config" not in meta:
        raise ValueError(f"weights file {path} has no vitp_config metadata: it was not written by vitp "
                         f"(a timm ViT state dict loads with trainer.init_from_timm)")
    return (from_export_state(tensors, str(path)) if exported else tensors), meta


def file_model(meta: Dict[str, str]) -> Dict[str, Any]:
    """The model config recorded in a weights file's metadata."""
    return json.loads(meta.get("vitp_model") or json.dumps(json.loads(meta["vitp_config"])["model"]))


def model_differences(file_cfg: Dict[str, Any], model_cfg: Any, keys: Iterable[str]) -> List[str]:
    """``model.<key>: <file> in the file vs <now> now`` for every ``keys`` entry that differs."""
    now = to_dict(model_cfg)

    def same(k: str) -> bool:  # 8, [8, 8] and "8x8" are one size
        if k == "image_size" and None not in (file_cfg.get(k), now.get(k)):
            return parse_resolution(file_cfg[k]) == parse_resolution(now[k])
        return file_cfg.get(k) == now.get(k)

    return [f"model.{k}: {file_cfg.get(k)!r} in the file vs {now.get(k)!r} now" for k in keys if not same(k)]


def check_model_matches(file_cfg: Dict[str, Any], model_cfg: Any, keys: Iterable[str], source: str, fix: str) -> None:
    """Raise ``ValueError`` listing every ``keys`` entry where the file's model config differs."""
    diffs = model_differences(file_cfg, model_cfg, keys)
    if diffs:
        raise ValueError(f"{source} was written for another model ({'; '.join(diffs)}); {fix}")


def partial_sync_of(parallel_cfg: Any) -> Dict[str, Any]:
    """``{"p", "tp", "scale"}`` of a ``parallel`` config section (or mapping); ``p = 1`` (exact
    TP, any layout) when absent or at ``tp = 1``. A ``p < 1`` model is a function of its weights
    *and* ``tp``."""
    par = to_dict(parallel_cfg) if parallel_cfg is not None else {}
    tp = int(par.get("tp", 1))
    p = float(par.get("partial_sync", 1.0)) if tp > 1 else 1.0  # one rank: nothing is private
    return {"p": p, "tp": tp, "scale": par.get("partial_sync_scale", "sqrt_tp")}


def file_partial_sync(meta: Dict[str, str]) -> Dict[str, Any]:
    """:func:`partial_sync_of` the run config stored in a weights file's metadata."""
    return partial_sync_of(json.loads(meta["vitp_config"]).get("parallel") if "vitp_config" in meta else None)


def check_partial_sync_layout(file_ps: Dict[str, Any], tp: int, p: float, source: str) -> None:
    """Raise ``ValueError`` when weights trained with ``partial_sync < 1`` are loaded at another
    tp or another ``p`` (their private channels belong to one TP layout). ``p = 1`` files load
    anywhere, also into a ``p < 1`` run (weights as a starting point)."""
    if file_ps["p"] >= 1.0:
        return
    if (file_ps["tp"], file_ps["p"]) != (int(tp), float(p)):
        raise ValueError(f"{source} was trained with parallel.partial_sync={file_ps['p']} at parallel.tp="
                         f"{file_ps['tp']}; each TP rank carries its own private channels, so it runs only at that "
                         f"layout (now tp={tp}, partial_sync={p}); set parallel.tp={file_ps['tp']} "
                         f"parallel.partial_sync={file_ps['p']}")


def generator_from_state(model_cfg: Any, state: Dict[str, torch.Tensor], device: torch.device | str = "cpu",
                         partial_sync: Optional[Dict[str, Any]] = None) -> torch.nn.Module:
    """A :class:`~vitp.models.Generator` in eval mode holding ``state`` (strict key match); with
    ``partial_sync`` (:func:`partial_sync_of`) at ``p < 1`` and ``tp > 1`` it runs the ``tp``
    partially synchronized streams on this device (:class:`vitp.models.PartialSyncGenerator`)."""
    gen = Generator.from_config(model_cfg)
    gen.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    if partial_sync and partial_sync["p"] < 1.0 and partial_sync["tp"] > 1:
        from vitp.models.partial_sync_streams import PartialSyncGenerator

        gen = PartialSyncGenerator(gen, partial_sync["tp"], partial_sync["p"], partial_sync["scale"])
    return gen.to(device).eval()


def load_generator(path: str | os.PathLike, device: torch.device | str = "cpu") -> Tuple[Generator, DictConfig]:
    """``(generator in eval mode, run config)`` from a vitp weights file (an export, or the
    ``model*.safetensors`` of a run directory or checkpoint).

    Raises ``FileNotFoundError`` / ``ValueError`` naming the file when it is missing, corrupt,
    or not written by vitp.
    """
    state, meta = read_export(path)
    cfg = OmegaConf.create(json.loads(meta["vitp_config"]))
    return generator_from_state(cfg.model, state, device, file_partial_sync(meta)), cfg
