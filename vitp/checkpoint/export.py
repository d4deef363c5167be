"""Exported weights: one safetensors file of full fp32 tensors (format ``vitp.export/1``).

The ViT blocks are stored under timm's ``VisionTransformer`` names and layouts, generator-only
tensors under ``gen.`` (:mod:`vitp.models.keys`), and the model and run config as JSON metadata
(plus a ``<stem>.json`` sidecar). An export loads into any ``(tp, pp)`` (``trainer.init_from``),
into one process (:func:`load_generator`, ``vitp-sample``), and its blocks into a stock timm ViT
with strict key matching. The final ``model_ema.safetensors`` / ``model.safetensors`` of a run
use the same layout.

Large models come out sharded as Hugging Face transformers shards its checkpoints
(``modeling_utils.save_pretrained``, ``model.safetensors.index.json``): files
``<stem>-00001-of-0000N.safetensors`` of whole tensors plus ``<name>.index.json`` mapping every
tensor to its file (:func:`export_checkpoint`, written straight from a training checkpoint).
:func:`read_export` reads a single file, a sharded export (only the shards holding the keys asked
for) and a training checkpoint's weights (a torch distributed checkpoint, :mod:`.sharded`) named
as the ``model_ema.safetensors`` / ``model.safetensors`` of its tag folder.
"""
from __future__ import annotations

import json
import math
import os
import re
from glob import escape as glob_escape
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from omegaconf import DictConfig, OmegaConf

from vitp.config import parse_resolution
from vitp.models import Generator, export_key, from_export_state, to_export_state
from vitp.utils import atomic_write, atomic_write_text, save_safetensors, shard_groups, to_dict

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
INDEX_SUFFIX = ".index.json"  # a sharded export's index: <out name>.index.json (transformers' naming)
CHECKPOINT_META = "vitp_meta.json"  # a training checkpoint's completion record (vitp.checkpoint.training.META)
CHECKPOINT_KINDS = {"model_ema.safetensors": "ema", "model.safetensors": "model"}  # file name -> tensor kind
DCP_METADATA = ".metadata"  # a torch distributed checkpoint's metadata file (vitp.checkpoint.sharded.METADATA)


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
    path = Path(path)
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    model = cfg_dict["model"]
    meta, side = export_metadata(cfg_dict, step, weights)
    with atomic_write(path) as tmp:
        save_safetensors(to_export_state(gen_state, model["width"], model["depth"]), str(tmp), metadata=meta)
    _remove_stale(path, 1)
    _write_sidecar(path, side, path.name)
    return path


def export_metadata(cfg_dict: Dict[str, Any], step: Optional[int], weights: str,
                    model: Optional[Dict[str, Any]] = None) -> Tuple[Dict[str, str], Dict[str, Any]]:
    """``(safetensors metadata, sidecar content)`` of an export of the run config ``cfg_dict`` (a
    plain dict; ``model`` defaults to its ``model`` section), as :func:`save_export` documents
    them; the sidecar's ``tensors`` entry is set by :func:`_write_sidecar`."""
    model = cfg_dict["model"] if model is None else model
    meta = {"format": FORMAT, "vitp_model": json.dumps(model), "vitp_config": json.dumps(cfg_dict),
            "step": str(step if step is not None else -1), "weights": weights}
    text = text_conditioning(cfg_dict)
    meta["conditioning"] = "text" if text else "class"
    if text:
        meta["text_encoder"] = json.dumps(text)
    ps = partial_sync_of(cfg_dict.get("parallel"))
    if ps["p"] < 1.0:  # also in vitp_config; spelled out for readers that do not parse it
        meta.update(partial_sync=str(ps["p"]), partial_sync_tp=str(ps["tp"]), partial_sync_scale=ps["scale"])
    side = {"format": FORMAT, "weights": weights, "step": step, "model": model, "tensors": None,
            "conditioning": meta["conditioning"], **({"text_encoder": text} if text else {})}
    if ps["p"] < 1.0:
        side["partial_sync"] = {**ps, "note": PARTIAL_SYNC_NOTE}
    return meta, side


def _write_sidecar(path: Path, side: Dict[str, Any], tensors: str) -> None:
    """``<stem>.json`` next to export ``path``, naming ``tensors`` (the file, or a sharded export's index)."""
    atomic_write_text(path.with_suffix(".json"), json.dumps({**side, "tensors": tensors}, indent=2) + "\n", fsync=True)


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


def export_checkpoint(tag_dir: str | os.PathLike, out: str | os.PathLike, cfg: Any = None, *, kind: str = "ema",
                      step: Optional[int] = None, rank: int = 0, world: int = 1,
                      max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write the ``kind`` (``ema`` | ``model``) weights of training checkpoint ``tag_dir`` (a
    torch distributed checkpoint, :mod:`.sharded`) in the export layout of :func:`save_export`
    (same keys, fp32, identity block norms, metadata with ``weights`` = ``ema`` | ``raw``, and the
    ``<stem>.json`` sidecar); returns ``out`` or, sharded, the index file.

    ``cfg``: the run config (``DictConfig`` or dict; default: the checkpoint's ``vitp_meta.json``
    ``config``); ``step`` defaults to the checkpoint's. When the export-layout tensors total more
    than ``max_shard_bytes`` (bytes, fp32 = 4 per element) the weights are sharded as Hugging Face
    transformers shards its checkpoints (``save_pretrained``, ``model.safetensors.index.json``):
    ``<stem>-00001-of-0000N.safetensors`` ... next to ``out``, whole tensors in
    :func:`_export_order` (``blocks.2`` before ``blocks.10``), each shard at most
    ``max_shard_bytes`` unless one tensor alone is larger, every shard with the full safetensors
    metadata, plus ``<out name>.index.json`` (``{"metadata": {"total_size": bytes, "format", ...},
    "weight_map": {export key: shard file}}``). Otherwise the single file ``out`` (what timm's
    ``load_state_dict`` takes).

    Collective-friendly, without communication: rank ``rank`` of ``world`` writes the shards
    ``k`` with ``k % world == rank`` (the single file: rank 0), reading from the checkpoint only
    their tensors, one shard at a time (memory: one shard); rank 0 also writes the index and the
    sidecar and removes what an earlier export of the same stem left (the single file or index,
    shards of another count). Every file is written atomically (:func:`vitp.utils.atomic_write`).
    With ``world > 1`` the caller must put a barrier after every rank's call: only then is the
    export complete.

    Raises ``ValueError`` for an ``out`` not ending in ``.safetensors``, a bad ``rank``/``world``,
    a checkpoint without ``kind`` tensors; ``FileNotFoundError`` / ``ValueError`` naming the file
    when the checkpoint is incomplete or damaged.
    """
    from .sharded import tensor_shapes

    tag_dir, out = Path(tag_dir), Path(out)
    if out.suffix != ".safetensors":
        raise ValueError(f"export file {out}: use a .safetensors file name")
    if not 0 <= rank < world:
        raise ValueError(f"export rank {rank} is not one of world {world}'s ranks 0..{world - 1}")
    record = checkpoint_record(tag_dir)
    cfg_dict = to_dict(cfg) if cfg is not None else record["config"]
    step = record.get("step") if step is None else step
    meta, side = export_metadata(cfg_dict, step, "ema" if kind == "ema" else "raw")
    shapes = tensor_shapes(tag_dir, kind)
    if not shapes:
        raise ValueError(f"checkpoint {tag_dir} holds no {kind} tensors (kinds: ema, model)")
    plan = _export_plan(shapes, cfg_dict["model"]["width"], cfg_dict["model"]["depth"])
    shards = shard_groups({k: nbytes for k, (_, _, nbytes) in plan.items()}, max_shard_bytes)
    names = [out.name] if len(shards) == 1 else shard_names(out, len(shards))
    for k in range(rank, len(shards), world):
        _write_shard(tag_dir, kind, out.with_name(names[k]), shards[k], plan, meta)
    index = out.with_name(out.name + INDEX_SUFFIX)
    if rank == 0:
        if len(shards) > 1:
            total = sum(plan[n][2] for n in plan)
            weight_map = {n: names[k] for k, group in enumerate(shards) for n in group}
            atomic_write_text(index, json.dumps({"metadata": {"total_size": total, **meta}, "weight_map": weight_map},
                                                indent=2) + "\n", fsync=True)
        _remove_stale(out, len(shards))
        _write_sidecar(out, side, index.name if len(shards) > 1 else out.name)
    return index if len(shards) > 1 else out


def shard_names(out: Path, n: int) -> List[str]:
    """File names of the ``n`` shards of export ``out``: ``<stem>-00001-of-0000N.safetensors`` ...
    (transformers' ``WEIGHTS_NAME`` sharding pattern)."""
    return [f"{out.stem}-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]


def _export_order(key: str) -> Tuple[Any, ...]:
    """Sort key of an export key: by its generator name (``gen.`` dropped, so a block's tensors sit
    together), numbers compared as numbers (``blocks.2`` before ``blocks.10``)."""
    name = key[4:] if key.startswith("gen.") else key
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)), key


def _export_plan(shapes: Dict[str, Tuple[Tuple[int, ...], torch.dtype]], width: int, depth: int
                 ) -> Dict[str, Tuple[Optional[str], Tuple[int, ...], int]]:
    """``{export key: (generator key or None for an identity norm, shape, fp32 bytes)}`` of the
    export of a checkpoint whose tensors have ``shapes`` (:func:`vitp.models.to_export_state`'s keys), in
    :func:`_export_order`."""
    plan = {export_key(k): (k, tuple(s)) for k, (s, _) in shapes.items()}
    plan.update({f"blocks.{i}.{n}.{w}": (None, (width,)) for i in range(depth) for n in ("norm1", "norm2")
                 for w in ("weight", "bias")})
    return {k: (*plan[k], 4 * math.prod(plan[k][1])) for k in sorted(plan, key=_export_order)}


def _write_shard(tag_dir: Path, kind: str, path: Path, keys: List[str],
                 plan: Dict[str, Tuple[Optional[str], Tuple[int, ...], int]], meta: Dict[str, str]) -> None:
    """One export file ``path`` holding export ``keys``, read from the checkpoint (only those)."""
    from .sharded import read_full

    loaded = read_full(tag_dir, kind, [plan[k][0] for k in keys if plan[k][0] is not None])
    tensors = {}
    for key in keys:
        src, shape, _ = plan[key]
        if src is None:  # the affine-free block norms, as the identity affine (to_export_state)
            tensors[key] = torch.ones(shape) if key.endswith(".weight") else torch.zeros(shape)
        else:
            tensors[key] = loaded.pop(src).detach().float().contiguous()
    with atomic_write(path) as tmp:
        save_safetensors(tensors, str(tmp), metadata=meta)


def _remove_stale(out: Path, n: int) -> None:
    """Delete what an earlier export to ``out`` left that this one (``n`` files) does not replace:
    shards of ``out``'s stem counted other than ``n``; for a single file also the index; sharded,
    an older single ``out`` (which :func:`read_export` would read before the index)."""
    pattern = re.compile(re.escape(out.stem) + r"-\d{5,}-of-(\d{5,})\.safetensors")
    for f in out.parent.glob(f"{glob_escape(out.stem)}-*-of-*.safetensors"):
        m = pattern.fullmatch(f.name)
        if m and (n == 1 or int(m.group(1)) != n):
            f.unlink(missing_ok=True)
    if n == 1:
        out.with_name(out.name + INDEX_SUFFIX).unlink(missing_ok=True)
    elif out.is_file():
        out.unlink()


def read_export(path: str | os.PathLike, keys: Optional[Iterable[str]] = None
                ) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """``(generator state dict, metadata)`` of vitp weights; with ``keys`` (generator keys) only
    those tensors are read (a pipeline stage needs only its own layers).

    ``path``: an export file (also the older layout: generator keys, ``vitp_config`` metadata
    only); a sharded export (Hugging Face transformers' layout, :func:`export_checkpoint`): its
    index ``X.safetensors.index.json`` or the ``X.safetensors`` it stands for, reading only the
    shards holding ``keys``; or ``<tag>/model_ema.safetensors`` / ``<tag>/model.safetensors`` of a
    training checkpoint tag holding a torch distributed checkpoint (``.metadata``) instead: its
    ``ema`` / ``model`` tensors (:func:`vitp.checkpoint.sharded.read_full`, as fp32) with metadata
    built as an export file's from its ``vitp_meta.json`` (``model``, ``config``, ``step``).

    Raises ``FileNotFoundError`` / ``ValueError`` naming the file when it (or a shard, or the
    checkpoint's ``vitp_meta.json``) is missing, truncated, corrupt, or not written by vitp.
    """
    path = Path(path)
    if path.is_file() and not path.name.endswith(INDEX_SUFFIX):
        return check_finite(_read_file(path, keys), path)
    index = path if path.name.endswith(INDEX_SUFFIX) else path.with_name(path.name + INDEX_SUFFIX)
    if index.is_file():
        return check_finite(_read_sharded(index, keys), path)
    if path.name in CHECKPOINT_KINDS and (path.parent / DCP_METADATA).is_file():
        return check_finite(_read_checkpoint(path.parent, CHECKPOINT_KINDS[path.name], keys), path)
    raise FileNotFoundError(f"weights file {path} does not exist")


def check_finite(read: Tuple[Dict[str, torch.Tensor], Dict[str, str]], path: Path
                 ) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """``read`` (tensors, metadata) as it is when every floating-point tensor is finite.

    Raises ``ValueError`` naming ``path`` and the tensors holding NaN / inf: bytes damaged inside a
    file of the right size read as numbers (a checkpoint overwritten in place sampled black
    grids and exported NaNs without a word)."""
    bad = [(k, int((~torch.isfinite(v)).sum())) for k, v in read[0].items()
           if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        what = ", ".join(f"{k} ({n} values)" for k, n in bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise ValueError(f"{path}: {len(bad)} tensor(s) hold NaN / inf: {what}; the file is damaged (or the training "
                         "had diverged when it was written): use an earlier checkpoint or export")
    return read


def read_export_shards(path: str | os.PathLike, places: Dict[str, Any]
                       ) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """``({generator key: this rank's TP shard, flat fp32}, metadata)``: for each key of
    ``places`` (:class:`vitp.checkpoint.sharded.Place`: the full shape and the rank's TP split)
    only the boxes of the full tensor the rank holds are read (safetensors' ``get_slice``; from a
    training checkpoint, its pieces by offsets), so a rank's memory is its own share. The shard
    is flattened in the parameter's row-major order (``.view(param.shape)`` gives the parameter).
    ``path`` as :func:`read_export`.

    Raises ``ValueError`` naming the file and the key on a missing tensor or a shape other than
    ``place.full``; ``FileNotFoundError`` / ``ValueError`` as :func:`read_export`."""
    from safetensors import safe_open

    from .sharded import boxes, load_pieces, piece_tensor, piece_view, tensor_shapes

    path = Path(path)
    _, meta = read_export(path, keys=[])
    bufs = {k: torch.empty(pl.numel, dtype=torch.float32) for k, pl in places.items()}
    tag = path.parent if path.name in CHECKPOINT_KINDS and (path.parent / DCP_METADATA).is_file() else None
    if tag is not None and not path.is_file():
        kind = CHECKPOINT_KINDS[path.name]
        shapes = {k: s for k, (s, _) in tensor_shapes(tag, kind).items()}
        _check_shapes(path, shapes, places)
        load_pieces(tag, {f"{kind}/{k}": piece_tensor(bufs[k], places[k]) for k in places}, no_dist=True)
        return check_finite((bufs, meta), path)
    index = path if path.name.endswith(INDEX_SUFFIX) else path.with_name(path.name + INDEX_SUFFIX)
    name = export_key if meta.get("format") == FORMAT else (lambda k: k)
    if path.is_file() and not path.name.endswith(INDEX_SUFFIX):
        where = {name(k): path for k in places}
    else:
        weight_map = json.loads(index.read_text())["weight_map"]
        where = {name(k): index.parent / weight_map[name(k)] for k in places if name(k) in weight_map}
    missing = {k: pl for k, pl in places.items() if name(k) not in where}
    if missing:
        _check_shapes(path, {}, missing)  # raises, naming them
    by_file: Dict[Path, List[str]] = {}
    for k in places:
        by_file.setdefault(where[name(k)], []).append(k)
    for file, keys in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            held = set(f.keys())
            _check_shapes(path, {k: tuple(f.get_slice(name(k)).get_shape()) for k in keys if name(k) in held},
                          {k: places[k] for k in keys})
            for k in keys:
                sl = f.get_slice(name(k))
                for g, z, w in boxes(places[k]):
                    piece_view(bufs[k], w).copy_(sl[tuple(slice(o, o + n) for o, n in zip(g, z))])
    return check_finite((bufs, meta), path)


def _check_shapes(source: Path, shapes: Dict[str, Tuple[int, ...]], places: Dict[str, Any]) -> None:
    """Raise ``ValueError`` naming ``source`` when a tensor of ``places`` is missing from ``shapes``
    or has another full shape."""
    missing = [k for k in places if k not in shapes]
    if missing:
        raise ValueError(f"{source} lacks {len(missing)} tensors of this model, e.g. {missing[:4]}: it was written "
                         f"for another model config")
    for k, pl in places.items():
        if tuple(shapes[k]) != tuple(pl.full):
            raise ValueError(f"{source}: {k} has shape {tuple(shapes[k])} but the model expects {tuple(pl.full)}")


def _read_file(path: Path, keys: Optional[Iterable[str]]) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """:func:`read_export` of one safetensors file."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            exported = meta.get("format") == FORMAT
            if keys is not None and "vitp_config" in meta:
                name = export_key if exported else (lambda k: k)
                return {k: f.get_tensor(name(k)) for k in keys}, meta
        tensors = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
        raise ValueError(f"weights file {path} is corrupt, truncated or not a safetensors file: {e}; copy it again, "
                         f"or {_rewrite_advice(path)}") from e
    if "vitp_config" not in meta:
        raise ValueError(f"weights file {path} has no vitp_config metadata: it was not written by vitp "
                         f"(a timm ViT state dict loads with trainer.init_from_timm)")
    return (from_export_state(tensors, str(path)) if exported else tensors), meta


def _read_sharded(index: Path, keys: Optional[Iterable[str]]) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """:func:`read_export` of a sharded export by its index file: only the shards holding ``keys``."""
    try:
        head = json.loads(index.read_text())
        weight_map = dict(head["weight_map"])
        meta = {k: str(v) for k, v in head.get("metadata", {}).items() if k != "total_size"}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"weights index {index} is corrupt ({e}): re-export the weights (vitp-export)") from e
    if "vitp_config" not in meta:
        raise ValueError(f"weights index {index} has no vitp_config metadata: it was not written by vitp")
    wanted = list(weight_map) if keys is None else [export_key(k) for k in keys]
    missing = [k for k in wanted if k not in weight_map]
    if missing:
        raise ValueError(f"weights index {index} lists no tensors {missing[:4]}: it was written for another model")
    by_file: Dict[str, List[str]] = {}
    for k in wanted:
        by_file.setdefault(weight_map[k], []).append(k)
    tensors: Dict[str, torch.Tensor] = {}
    for name in sorted(by_file):
        if Path(name).name != name:
            raise ValueError(f"weights index {index} names shard {name!r} outside its folder: it is corrupt")
        tensors.update(_read_shard(index.parent / name, by_file[name], index))
    if keys is None:
        return from_export_state(tensors, str(index)), meta
    return {k: tensors[export_key(k)] for k in keys}, meta


def _read_shard(path: Path, keys: List[str], index: Path) -> Dict[str, torch.Tensor]:
    """Export ``keys`` from shard ``path`` of the sharded export ``index``."""
    from safetensors import safe_open

    if not path.is_file():
        raise FileNotFoundError(f"weights shard {path} is missing (listed in {index}): copy it next to the index, "
                                f"or export the weights again (vitp-export)")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in keys}
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
        raise ValueError(f"weights shard {path} (of {index}) is corrupt, truncated or not a safetensors file: "
                         f"{e}; copy it again, or {_rewrite_advice(index)}") from e


def _rewrite_advice(path: Path) -> str:
    """How to write a damaged weights file again: from the latest checkpoint of the run it lies
    in (to a new file: vitp-export never overwrites the run's own), else from its run's checkpoint."""
    ckpts = Path(path).parent / "checkpoints"
    if (ckpts / "latest").is_file():
        return (f"write the weights again from the run's latest checkpoint to a new file, vitp-export {ckpts} -o "
                f"NEW.safetensors, and use that file (vitp-sample NEW.safetensors, vitp-eval RUN --weights "
                f"NEW.safetensors)")
    return "write them again from the run's checkpoint with vitp-export RUN/checkpoints/step_N -o NEW.safetensors"


def checkpoint_record(tag_dir: Path) -> Dict[str, Any]:
    """The ``vitp_meta.json`` of a training checkpoint (with ``config``, ``model``, ``step``).
    Raises ``FileNotFoundError`` / ``ValueError`` naming the file."""
    path = tag_dir / CHECKPOINT_META
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {tag_dir} is incomplete ({CHECKPOINT_META} missing): its save never "
                                f"finished; pass a complete checkpoint")
    try:
        record = json.loads(path.read_text())
        record.setdefault("model", record["config"]["model"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"checkpoint metadata {path} is corrupt (no run config: {e}); pass a complete "
                         f"checkpoint") from e
    return record


def _read_checkpoint(tag_dir: Path, kind: str, keys: Optional[Iterable[str]]
                     ) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """:func:`read_export` of a training checkpoint's ``kind`` tensors (fp32), metadata as an export's."""
    from .sharded import read_full

    record = checkpoint_record(tag_dir)
    meta, _ = export_metadata(record["config"], record.get("step"), "ema" if kind == "ema" else "raw",
                              record["model"])
    if record.get("lora"):  # a LoRA run's checkpoint: the adapters and the base they were trained on
        meta["vitp_lora"] = json.dumps(record["lora"])
    state = read_full(tag_dir, kind, None if keys is None else list(keys))
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}, meta


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


def with_lora_merged(state: Dict[str, torch.Tensor], meta: Dict[str, str], source: Any = "the weights"
                     ) -> Dict[str, torch.Tensor]:
    """The weights a generator LoRA run samples with. Its checkpoints hold the adapters alone
    (``blocks.<i>.<linear>.lora_A`` ``(n r, in)`` / ``lora_B`` ``(n out_piece, r)``), so they are
    merged (:func:`vitp.models.lora_files.merge_lora`: ``W + alpha / r * B A`` per targeted piece,
    peft's merge) into the base the run adapted, its ``trainer.init_from`` export. A state without
    adapters is returned as it is.

    Raises ``FileNotFoundError`` naming the base when it is no longer there, ``ValueError`` when its
    weights changed since the adapters were trained (the hash the checkpoint recorded)."""
    from vitp.models.lora import run_record
    from vitp.models.lora_files import merge_lora
    from vitp.parallel.lora import is_lora_key

    adapters = {k: v for k, v in state.items() if is_lora_key(k)}
    if not adapters:
        return state
    saved = OmegaConf.create(json.loads(meta["vitp_config"]))
    trained = json.loads(meta["vitp_lora"]) if "vitp_lora" in meta else None
    fix = ("put that base back there, or export merged weights while it is there (vitp-export RUN --merge -o "
           "X.safetensors)")
    base = Path(str(saved.trainer.init_from))
    try:
        record = run_record(saved)  # hashes the base: refused here when it is gone
    except FileNotFoundError:
        raise FileNotFoundError(f"{source} holds LoRA adapters of the base {base}, which no longer exists: {fix}"
                                ) from None
    if trained and trained["base"]["hash"] != record["base"]["hash"]:
        raise ValueError(f"{source} holds LoRA adapters trained on the base {base}, whose weights have changed since "
                         f"(hash {trained['base']['hash'][:16]} then, {record['base']['hash'][:16]} now): {fix}")
    base_state, _ = read_export(base)
    return merge_lora(base_state, adapters, trained or record)


def generator_from_state(model_cfg: Any, state: Dict[str, torch.Tensor], device: torch.device | str = "cpu",
                         partial_sync: Optional[Dict[str, Any]] = None,
                         meta: Optional[Dict[str, str]] = None) -> torch.nn.Module:
    """A :class:`~vitp.models.Generator` in eval mode holding ``state`` (strict key match); with
    ``partial_sync`` (:func:`partial_sync_of`) at ``p < 1`` and ``tp > 1`` it runs the ``tp``
    partially synchronized streams on this device (:class:`vitp.models.PartialSyncGenerator`).
    With the file's ``meta``, a LoRA run's adapters are merged into its base first
    (:func:`with_lora_merged`, which raises as documented there)."""
    if meta is not None:
        state = with_lora_merged(state, meta)
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
    return generator_from_state(cfg.model, state, device, file_partial_sync(meta), meta), cfg
