"""Wan weights between diffusers folders and :class:`vitp.models.wan.WanModel`.

A diffusers ``WanTransformer3DModel`` folder holds ``config.json`` and
``diffusion_pytorch_model.safetensors``, or shards listed by
``diffusion_pytorch_model.safetensors.index.json``; a pipeline folder (``model_index.json``)
holds it as ``transformer/`` (Wan 2.2 A14B's second expert as ``transformer_2/``). Only local
folders are read; nothing is downloaded.

The key map (:func:`key_map`) sends each vitp key to the diffusers keys it is made of: most are
one-to-one renames; the fused projections stack diffusers' separate ones along the output rows,
``attn.qkv = [attn1.to_q; attn1.to_k; attn1.to_v]`` and ``cross_attn.kv = [attn2.to_k;
attn2.to_v]`` (the layouts of timm's ``Attention`` and of diffusers' own ``fuse_projections``).
Export (:func:`to_diffusers_state`) splits them back, so the round trip is exact.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch

from .wan import WanConfig, WanModel
from .wan_config import (CLASS_NAME, HINT, IGNORED, REQUIRED, read_config, read_json_object,  # noqa: F401
                         transformer_folder)
from .wan_config import _LINEARS, _TOP, _WEIGHTS_ONLY  # noqa: F401 (torch-free there: the config check reads them)

PathLike = Union[str, Path]
WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = WEIGHTS + ".index.json"


def key_map(config: WanConfig) -> Dict[str, Tuple[str, ...]]:
    """``{vitp key: (diffusers keys, stacked along dim 0 in this order)}`` for every parameter
    of a :class:`~vitp.models.wan.WanModel` of ``config``."""
    out: Dict[str, Tuple[str, ...]] = {"final.scale_shift_table": ("scale_shift_table",)}
    for v, d in _TOP:
        out.update({f"{v}.{p}": (f"{d}.{p}",) for p in ("weight", "bias")})
    for i in range(config.num_layers):
        b = f"blocks.{i}."  # the same prefix in both layouts
        for v, ds in _LINEARS:
            out.update({f"{b}{v}.{p}": tuple(f"{b}{d}.{p}" for d in ds) for p in ("weight", "bias")})
        out.update({f"{b}{v}.weight": (f"{b}{d}.weight",) for v, d in _WEIGHTS_ONLY})
        if config.cross_attn_norm:
            out.update({f"{b}norm2.{p}": (f"{b}norm2.{p}",) for p in ("weight", "bias")})
        out[f"{b}scale_shift_table"] = (f"{b}scale_shift_table",)
    return out


def _damaged(path: Path, err: Exception) -> ValueError:
    return ValueError(f"{path} is not a readable safetensors file ({err}): it is empty, truncated or damaged (an "
                      "interrupted download or copy); copy it again")


def open_safetensors(path: Path) -> Any:
    """``safetensors.safe_open(path, framework="pt")``. Raises ``ValueError`` naming the file and
    the fix when its header cannot be read (empty, truncated, not safetensors)."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as e:
        raise _damaged(path, e) from None


@contextmanager
def _reading(path: Path) -> Iterator[Any]:
    """:func:`open_safetensors` as a context; errors while reading tensors also name the file."""
    from safetensors import SafetensorError

    with open_safetensors(path) as f:
        try:
            yield f
        except SafetensorError as e:
            raise _damaged(path, e) from None


def weight_locations(folder: Path) -> Dict[str, Path]:
    """``{diffusers key: safetensors file holding it}`` of a transformer folder, read from the
    shard index or the single file's header (no tensor is read).

    Raises ``FileNotFoundError`` naming the missing file (no weights, a shard the index lists,
    or only a ``.bin`` file, which vitp does not read), ``ValueError`` naming a damaged file
    (:func:`open_safetensors`) or an index that is not JSON.
    """
    index, single = folder / INDEX, folder / WEIGHTS
    if index.is_file():
        where = {k: folder / f for k, f in read_json_object(index).get("weight_map", {}).items()}
        for f in sorted(set(where.values())):
            if not f.is_file():
                raise FileNotFoundError(f"{f} is listed in {index} but does not exist; copy the folder again")
        return where
    if single.is_file():
        with _reading(single) as f:
            return {k: single for k in f.keys()}
    bins = sorted(p.name for p in folder.glob("diffusion_pytorch_model*.bin"))
    fix = (f"only {bins} found: vitp reads safetensors; re-save with save_pretrained(safe_serialization=True)"
           if bins else HINT)
    raise FileNotFoundError(f"{folder} has no {WEIGHTS} nor {INDEX}; {fix}")


def read_tensors(where: Dict[str, Path], keys: Iterable[str]) -> Dict[str, torch.Tensor]:
    """The tensors ``keys`` (each in the file ``where[key]``), every file opened once with
    ``safetensors.safe_open`` and only these tensors read. Raises ``ValueError`` naming a damaged
    file (:func:`open_safetensors`)."""
    by_file: Dict[Path, List[str]] = defaultdict(list)
    for k in keys:
        by_file[where[k]].append(k)
    out = {}
    for path, ks in by_file.items():
        with _reading(path) as f:
            out.update({k: f.get_tensor(k) for k in ks})
    return out


def _few(keys: List[str]) -> str:
    return f"{keys[:6]}{' ...' if len(keys) > 6 else ''}"


def load_state(folder: Path, config: WanConfig) -> Dict[str, torch.Tensor]:
    """vitp state dict (fp32) of the transformer folder's weights, fused projections stacked.

    Raises ``ValueError`` naming the folder when the files lack a key the config needs, hold
    one it does not explain (e.g. image-to-video weights under a text-to-video config) or hold a
    tensor of another shape than the config implies (:func:`check_shapes`).
    """
    kmap, where = key_map(config), weight_locations(folder)
    needed = [d for ds in kmap.values() for d in ds]
    missing = [k for k in needed if k not in where]
    extra = sorted(set(where) - set(needed) - {k for k in where if any(i in k for i in IGNORED)})
    if missing or extra:
        raise ValueError(f"{folder}: the weights do not match config.json: missing {_few(missing)}, unexpected "
                         f"{_few(extra)} ({len(missing)} and {len(extra)} keys); copy the folder again")
    raw = read_tensors(where, needed)
    check_shapes(raw, config, folder)
    return {v: torch.cat([raw[d] for d in ds]).float() if len(ds) > 1 else raw[ds[0]].float()
            for v, ds in kmap.items()}


def check_shapes(raw: Dict[str, torch.Tensor], config: WanConfig, folder: Path) -> None:
    """Raises ``ValueError`` naming the folder, the diffusers key and both shapes for the first
    tensor of ``raw`` ``{diffusers key: tensor}`` whose shape is not the one ``config`` implies."""
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in WanModel(config).state_dict().items()}
    for v, ds in key_map(config).items():
        want = (shapes[v][0] // len(ds), *shapes[v][1:])
        for d in ds:
            if d in raw and tuple(raw[d].shape) != want:
                raise ValueError(f"{folder}: weight {d} has shape {tuple(raw[d].shape)} but {folder / 'config.json'} "
                                 f"implies {want}; config.json does not belong to these weights (check text_dim, "
                                 "ffn_dim, num_attention_heads, attention_head_dim, in_channels, patch_size); copy "
                                 "the folder again")


def to_diffusers_state(state: Dict[str, torch.Tensor], config: WanConfig, partial: bool = False
                       ) -> Dict[str, torch.Tensor]:
    """diffusers ``WanTransformer3DModel`` state dict of a vitp state dict: keys renamed, ``qkv``
    and ``kv`` split into ``to_q``/``to_k``/``to_v`` and ``to_k``/``to_v``; contiguous CPU tensors
    of their own storage (safetensors files refuse shared storage), dtypes kept.

    ``partial``: ``state`` holds some of the model's keys (a pipeline stage's), converted alone.
    Raises ``KeyError`` naming a vitp key the state lacks (not ``partial``) or one Wan does not have.
    """
    out = {}
    kmap = key_map(config)
    for v in kmap if not partial else state:
        if v not in state or v not in kmap:
            raise KeyError(f"vitp Wan state has no {v!r}; export a WanModel's state_dict()" if v not in state else
                           f"{v!r} is not a parameter of a Wan model of this config")
        parts = state[v].detach().cpu().chunk(len(kmap[v]), dim=0)
        out.update({d: p.contiguous().clone() for d, p in zip(kmap[v], parts)})
    return out


def save_pretrained(model: WanModel, folder: PathLike) -> Path:
    """Write ``model`` as a diffusers transformer folder (``config.json`` +
    ``diffusion_pytorch_model.safetensors``, tensors in the model's dtypes) that
    ``WanTransformer3DModel.from_pretrained`` loads with no missing or unexpected keys. Returns
    the folder.

    Raises ``TypeError`` when ``model`` is not a vitp :class:`~vitp.models.wan.WanModel` (a
    diffusers model saves itself: ``model.save_pretrained(folder)``), ``FileExistsError`` when
    ``folder`` is an existing file.
    """
    from importlib.metadata import version

    from vitp.utils import save_safetensors

    if not isinstance(model, WanModel):
        raise TypeError(f"save_pretrained takes a vitp WanModel (vitp.models.from_pretrained), got "
                        f"{type(model).__name__}; a diffusers model writes itself with model.save_pretrained(folder)")
    path = Path(folder).expanduser()
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} is an existing file; save_pretrained writes a folder (config.json + {WEIGHTS}): "
                              "give a folder path")
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"_class_name": CLASS_NAME, "_diffusers_version": version("diffusers"), **model.config.to_dict()}
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_safetensors(to_diffusers_state(model.state_dict(), model.config), path / WEIGHTS, metadata={"format": "pt"})
    return path


def from_pretrained(folder: PathLike, subfolder: Optional[str] = "transformer") -> WanModel:
    """The one-process :class:`~vitp.models.wan.WanModel` of a local diffusers Wan folder (a
    transformer folder, or a pipeline folder's ``subfolder``: ``transformer``, or
    ``transformer_2`` for Wan 2.2 A14B's low-noise expert; None: ``folder`` is the transformer
    folder), in eval mode, always fp32 whatever the files hold (bf16: load, then
    ``model.cast(torch.bfloat16)``).

    Built on the meta device and filled with the folder's tensors (no random init, one copy in
    memory). Raises ``FileNotFoundError`` / ``ValueError`` / ``TypeError`` naming the path and the
    fix (:func:`transformer_folder`, :func:`read_config`, :func:`load_state`).
    """
    path = transformer_folder(folder, subfolder)
    config = read_config(path)
    state = load_state(path, config)
    with torch.device("meta"):
        model = WanModel(config)
    model.load_state_dict(state, strict=True, assign=True)
    return model.float().eval()


def _slice_rows(view: Any, piece_shape: Tuple[int, ...], dim: int, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank`` of ``size`` equal parts of a safetensors slice ``view`` along ``dim`` (0 or 1),
    reading only that part."""
    n = piece_shape[dim]
    if n % size:
        raise ValueError(f"dimension {dim} of size {n} does not split over {size} tensor-parallel ranks")
    a, b = rank * n // size, (rank + 1) * n // size
    return view[a:b] if dim == 0 else view[:, a:b]


def load_shard(folder: PathLike, params: Dict[str, torch.nn.Parameter], config: WanConfig, tp_rank: int = 0,
               tp_size: int = 1, subfolder: Optional[str] = "transformer") -> Dict[str, Any]:
    """Fill this rank's parameters ``{vitp key: parameter}`` (a pipeline stage's, possibly
    tensor-parallel shards marked ``tensor_model_parallel`` / ``partition_dim`` /
    ``partition_stride`` as :mod:`vitp.parallel.layers` marks them) from a diffusers Wan folder,
    reading only this rank's slices of the stage's tensors (``safe_open(...).get_slice``).

    A fused projection sharded with a per-head stride (``qkv``: 3, ``kv``: 2) is the rank's rows of
    each diffusers piece, stacked; a row-parallel weight its columns. Returns ``{"bytes": bytes
    read, "share": bytes of the filled parameters, "keys": number filled}``.

    Raises ``ValueError`` naming the folder for a key the folder lacks or a shape that differs
    from the parameter's full shape, ``FileNotFoundError`` as :func:`weight_locations`.
    """
    path = transformer_folder(folder, subfolder)
    kmap, where = key_map(config), weight_locations(path)
    missing = [d for k in params for d in kmap.get(k, (k,)) if d not in where]
    if missing or any(k not in kmap for k in params):
        raise ValueError(f"{path}: no weights for {_few(missing or [k for k in params if k not in kmap])}; "
                         "is it the folder this model was built from?")
    files: Dict[Path, Any] = {}
    read = share = 0
    try:
        with torch.no_grad():
            for key, p in params.items():
                pieces = []
                for d in kmap[key]:
                    f = files.get(where[d]) or files.setdefault(where[d], open_safetensors(where[d]))
                    view = f.get_slice(d)
                    shape = tuple(view.get_shape())
                    sharded = getattr(p, "tensor_model_parallel", False) and tp_size > 1
                    t = _slice_rows(view, shape, p.partition_dim, tp_rank, tp_size) if sharded else view[:]
                    pieces.append(t)
                    read += t.numel() * t.element_size()
                full = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
                if tuple(full.shape) != tuple(p.shape):
                    raise ValueError(f"{path}: {' + '.join(kmap[key])} read as {tuple(full.shape)} for {key} of "
                                     f"{tuple(p.shape)}; the folder's config.json does not match the model")
                p.copy_(full.to(p.dtype))
                share += p.numel() * p.element_size()
    finally:
        files.clear()
    return {"bytes": read, "share": share, "keys": len(params)}
