"""Sharded training state: every rank saves and loads only its own pieces of each tensor.

A checkpoint is one torch distributed checkpoint (DCP, ``torch.distributed.checkpoint``): the
coordinator's ``.metadata`` and one ``__<rank>_0.distcp`` file per rank. Every tensor is saved
under ``<kind>/<generator key>`` with its full, layout-independent shape (the export layout's
shape, :mod:`vitp.models.keys`), and each rank contributes only the pieces it holds, each with
its global offsets:

- ``model``: the rank's TP shard of the weights (in the training dtype). A TP shard with fused
  chunks (timm's qkv ``[Q|K|V]``, packed GLU) is ``stride`` boxes of the full tensor, one per
  chunk. Replicas over dp/cp offer the same boxes; DCP's de-duplication writes each once, spread
  over the ranks holding it (``_dedup_save_plans``).
- ``ema``, ``exp_avg``, ``exp_avg_sq`` and (bf16) ``master``: the rank's ZeRO fragment of each
  parameter, a flat range of its TP shard (DeepSpeed's ``_hp_mapping.lp_fragment_address``),
  decomposed into boxes of the full tensor (Megatron-Core's ``flattened_range`` made
  rectangular: at most ``2 * ndim - 1`` boxes per chunk).

Loading at any ``(tp, cp, pp, dp)`` describes the pieces this rank needs the same way and lets
DCP's planner read them by global offsets (``create_read_items_for_chunk_list``). The pieces are
plain CPU tensors carrying DCP's checkpointable-tensor hooks (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``, as ``DTensor`` implements them), so no
DTensor or device mesh is needed. ``.metadata`` is read with an unpickler that admits DCP's
metadata classes only. Sources: torch DCP (``default_planner.py``, ``planner_helpers.py``);
Megatron-Core ``dist_checkpointing`` (``ShardedTensor.flattened_range``); DeepSpeed's tensor
fragments (``deepspeed/utils/tensor_fragment.py``).
"""
from __future__ import annotations

import io
import math
import pickle
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

Box = Tuple[Tuple[int, ...], Tuple[int, ...], Any]  # (global offsets, sizes, where in the local buffer: piece_view)
MOMENTS = ("exp_avg", "exp_avg_sq")
METADATA = ".metadata"


@dataclass(frozen=True)
class Place:
    """Where a rank's TP shard of a parameter sits in the full tensor: ``full`` shape; ``dim``
    the TP split dimension (``None``: replicated, the shard is the full tensor), ``stride`` the
    number of fused chunks along it, split separately (:func:`vitp.parallel.shard_tensor`), and
    this rank's ``tp_rank`` of ``tp``."""

    full: Tuple[int, ...]
    dim: Optional[int] = None
    stride: int = 1
    tp: int = 1
    tp_rank: int = 0

    @property
    def numel(self) -> int:
        """Elements of this rank's shard."""
        return math.prod(self.full) // self.tp


def place_of(param: torch.Tensor, state: Any) -> Place:
    """:class:`Place` of ``param`` (a possibly TP-sharded parameter) under ``state``."""
    if not getattr(param, "tensor_model_parallel", False) or state.tp_size == 1:
        return Place(tuple(param.shape))
    full = list(param.shape)
    full[param.partition_dim] *= state.tp_size
    return Place(tuple(full), param.partition_dim, param.partition_stride, state.tp_size, state.tp_rank)


def flat_boxes(shape: Sequence[int], start: int, end: int) -> List[Tuple[List[int], List[int]]]:
    """Boxes ``(offsets, sizes)`` of a row-major tensor of ``shape`` covering its flat elements
    ``[start, end)`` exactly, in order; each box is contiguous in memory."""
    if start >= end:
        return []
    if len(shape) == 1:
        return [([start], [end - start])]
    inner = math.prod(shape[1:])
    i0, r0 = divmod(start, inner)
    i1, r1 = divmod(end, inner)
    if i0 == i1:
        return [([i0, *o], [1, *s]) for o, s in flat_boxes(shape[1:], r0, r1)]
    out = []
    if r0:
        out += [([i0, *o], [1, *s]) for o, s in flat_boxes(shape[1:], r0, inner)]
        i0 += 1
    if i1 > i0:
        out.append(([i0] + [0] * (len(shape) - 1), [i1 - i0, *shape[1:]]))
    if r1:
        out += [([i1, *o], [1, *s]) for o, s in flat_boxes(shape[1:], 0, r1)]
    return out


def _flat_index(shape: Sequence[int], offsets: Sequence[int]) -> int:
    idx = 0
    for n, o in zip(shape, offsets):
        idx = idx * n + o
    return idx


def boxes(place: Place, start: int = 0, numel: Optional[int] = None) -> List[Box]:
    """The boxes of the full tensor that elements ``[start, start + numel)`` of this rank's
    (flattened, row-major) TP shard fill: ``(global offsets, sizes, where)``, ``where`` =
    ``(first element relative to start, shape of that contiguous run, (dim, index) to select
    in it or None)``; :func:`piece_view` cuts a piece out of the buffer."""
    numel = place.numel - start if numel is None else numel
    if place.dim is None:
        return [(tuple(o), tuple(s), (_flat_index(place.full, o) - start, tuple(s), None))
                for o, s in flat_boxes(place.full, start, start + numel)]
    d, s = place.dim, place.stride
    n = place.full[d]
    per = n // (place.tp * s)  # rows of one fused chunk on one rank
    view = [*place.full[:d], s, per, *place.full[d + 1:]]
    out: List[Box] = []
    for off, size in flat_boxes(view, start, start + numel):
        f = _flat_index(view, off) - start
        for c in range(off[d], off[d] + size[d]):  # one box of the full tensor per fused chunk
            g = (*off[:d], c * (n // s) + place.tp_rank * per + off[d + 1], *off[d + 2:])
            z = (*size[:d], *size[d + 1:])
            out.append((g, z, (f, tuple(size), (d, c - off[d]))))
    return out


def piece_view(buf: torch.Tensor, where: Tuple[int, Tuple[int, ...], Any]) -> torch.Tensor:
    """The piece of 1-D ``buf`` that :func:`boxes` describes by ``where`` (a view of ``buf``)."""
    f, shape, sel = where
    v = buf.narrow(0, f, math.prod(shape)).view(shape)
    return v if sel is None else v.select(*sel)


def piece_tensor(buf: torch.Tensor, place: Place, start: int = 0) -> torch.Tensor:
    """``buf`` (1-D: elements ``[start, start + buf.numel())`` of this rank's flattened TP shard)
    as a tensor DCP saves and loads as its boxes of the full tensor (:func:`boxes`): reads and
    writes go through views of ``buf``."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    pcs = boxes(place, start, buf.numel())
    full = torch.Size(place.full)
    chunks = [ChunkStorageMetadata(offsets=torch.Size(g), sizes=torch.Size(z)) for g, z, _ in pcs]
    views = {tuple(g): piece_view(buf, w) for g, _, w in pcs}
    t = buf.view(-1)  # a second tensor object: its hooks refer to buf, not to itself (no cycle)
    t.global_shape, t.global_offsets = tuple(full), tuple(tuple(g) for g, _, _ in pcs)
    t.local_offsets = tuple((0,) for _ in pcs)  # unused: the hooks below place the pieces
    t.local_sizes = tuple(tuple(z) for _, z, _ in pcs)
    props = TensorProperties.create_from_tensor(buf)

    def write_items(fqn, _obj):
        return [WriteItem(index=MetadataIndex(fqn, c.offsets, i), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=c, properties=props, size=full))
                for i, c in enumerate(chunks)]

    def shard(index):
        return views[tuple(index.offset)]

    t.__create_write_items__, t.__create_chunk_list__, t.__get_tensor_shard__ = write_items, lambda: chunks, shard
    return t


def balanced_dedup(all_plans: list) -> list:
    """DCP save plans with every piece that several ranks hold (weights replicated over dp/cp)
    kept in exactly one plan: the largest pieces first, each to the holder that writes the fewest
    bytes so far counting its own unique pieces (DCP's ``dedup_save_plans`` walks the pieces in
    plan order and so piles replicas onto the later ranks; Megatron-Core's ``fully_parallel``
    strategy balances the same way)."""
    import dataclasses
    from collections import defaultdict

    holders: Dict[Any, List[int]] = defaultdict(list)
    items: Dict[Any, Any] = {}
    for i, plan in enumerate(all_plans):
        for w in plan.items:
            holders[w.index].append(i)
            items[w.index] = w

    def size(idx) -> int:
        return items[idx].tensor_storage_size() or 1

    load = [sum(size(w.index) for w in plan.items if len(holders[w.index]) == 1) for plan in all_plans]
    keep = [{w.index for w in plan.items if len(holders[w.index]) == 1} for plan in all_plans]
    for idx in sorted((i for i in holders if len(holders[i]) > 1), key=lambda i: (-size(i), i.fqn, tuple(i.offset))):
        j = min(holders[idx], key=lambda r: (load[r], r))
        load[j] += size(idx)
        keep[j].add(idx)
    return [dataclasses.replace(plan, items=[w for w in plan.items if w.index in keep[i]])
            for i, plan in enumerate(all_plans)]


def save_planner():
    """DCP's default save planner with :func:`balanced_dedup`."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    class BalancedSavePlanner(DefaultSavePlanner):
        def _dedup_save_plans(self, all_plans):
            return balanced_dedup(all_plans)

    return BalancedSavePlanner()


# ----------------------------------------------------------------------------- reading
# what DCP's .metadata holds (torch 2.14): its metadata dataclasses and enums, the storage index
# entries, torch.Size, dtypes and layouts, the checkpoint path
_ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
            ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("collections", "OrderedDict")}
_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata",)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` (its metadata classes, ``torch.Size``, dtypes) and nothing
    else: a crafted file cannot call anything that runs code or touches files."""

    def find_class(self, module: str, name: str):
        if ((module, name) in _ALLOWED or module in _ALLOWED_MODULES
                or module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def _reader_class():
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(FileSystemReader):
        """DCP's file reader that unpickles only metadata classes, reads each stored piece once
        and counts the bytes it reads."""

        def __init__(self, path):
            super().__init__(str(path))
            self.bytes_read = 0

        def read_metadata(self, *args, **kwargs):
            path = Path(self.path) / METADATA
            if not path.is_file():
                raise FileNotFoundError(f"checkpoint file {path} is missing")
            try:
                md = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
            except Exception as e:
                raise ValueError(f"checkpoint file {path} is corrupt or not a checkpoint's metadata: {e}") from e
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

        def read_data(self, plan, planner):
            """DCP's file reading, each stored piece read and deserialised once however many of
            this rank's boxes it overlaps (DCP reads it once per box), tensors only."""
            from torch.distributed.checkpoint.planner import LoadItemType

            if any(r.type != LoadItemType.TENSOR for r in plan.items):
                return super().read_data(plan, planner)
            by_piece: Dict[Any, List[Any]] = {}
            for req in plan.items:
                info = self.storage_data[req.storage_index]
                by_piece.setdefault((info.relative_path, info.offset, info.length), []).append(req)
            for (rel, offset, length), reqs in sorted(by_piece.items(), key=lambda kv: kv[0]):
                with open(Path(self.path) / rel, "rb") as f:
                    f.seek(offset)
                    data = f.read(length)
                self.bytes_read += length
                try:  # a compressed piece (trainer.checkpoint_compress) through its stream extensions
                    descriptors = self.storage_data[reqs[0].storage_index].transform_descriptors or ()
                    if descriptors:
                        data = self.transforms.transform_load_stream(reqs[0], descriptors, io.BytesIO(data)).read(-1)
                    stored = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
                except Exception as e:  # torch's own advice (weights_only=False) must not reach the user
                    raise ValueError(f"checkpoint file {Path(self.path) / rel} is corrupt: its piece of "
                                     f"{reqs[0].storage_index.fqn} (bytes {offset}..{offset + length}) does not load "
                                     f"({type(e).__name__})") from None
                for req in reqs:
                    part = stored
                    for d, (o, n) in enumerate(zip(req.storage_offsets, req.lengths)):
                        part = part.narrow(d, o, n)
                    target = planner.resolve_tensor(req).detach()
                    if target.size() != part.size():
                        raise ValueError(f"checkpoint {self.path}: piece {req.storage_index.fqn} has size "
                                         f"{tuple(part.size())}, {tuple(target.size())} expected")
                    target.copy_(part)
                    planner.commit_tensor(req, target)
            fut = torch.futures.Future()
            fut.set_result(None)
            return fut

    return Reader


def reader(path: Path):
    """A DCP storage reader of checkpoint folder ``path`` (safe metadata, ``bytes_read`` counted)."""
    return _reader_class()(path)


def read_metadata(path: Path):
    """DCP's ``Metadata`` of checkpoint folder ``path``. Raises ``FileNotFoundError`` /
    ``ValueError`` naming the file."""
    return reader(path).read_metadata()


def tensor_shapes(path: Path, kind: str) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """``{generator key: (full shape, dtype)}`` of the tensors of ``kind`` in a checkpoint."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = {}
    for fqn, md in read_metadata(path).state_dict_metadata.items():
        k, _, key = fqn.partition("/")
        if k == kind and isinstance(md, TensorStorageMetadata):
            out[key] = (tuple(md.size), md.properties.dtype)
    return out


def load_pieces(path: Path, pieces: Dict[str, torch.Tensor], group=None, no_dist: bool = False) -> int:
    """Fill ``pieces`` (``{fqn: tensor}``: plain full tensors or :func:`piece_tensor` views)
    from checkpoint folder ``path`` (collective over ``group`` unless ``no_dist``); returns the
    bytes this rank read. Raises ``FileNotFoundError`` / ``ValueError`` naming the folder when a
    file is missing or damaged or a tensor is absent."""
    import torch.distributed.checkpoint as dcp

    rd = reader(path)
    rd.read_metadata()  # a damaged .metadata refused here, naming it (DCP would log tracebacks first)
    no_dist = no_dist or not (torch.distributed.is_available() and torch.distributed.is_initialized())
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():  # one process: DCP warns that it loads without a process group
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(pieces, storage_reader=rd, process_group=group, no_dist=no_dist)
    except (FileNotFoundError, ValueError):
        raise
    except (CheckpointException, Exception) as e:  # DCP wraps each failing rank's error (a BaseException)
        raise _readable(path, e) from None
    return rd.bytes_read


def _readable(path: Path, e: BaseException) -> Exception:
    """A ``ValueError`` / ``FileNotFoundError`` naming the file for DCP's failure ``e``: the first
    failing rank's own error when it is ours, else its message."""
    failures = [f[0] if isinstance(f, tuple) else f for f in getattr(e, "failures", {}).values()] or [e]
    first = failures[0]
    if isinstance(first, (FileNotFoundError, ValueError)):
        return type(first)(str(first))
    text = str(first).strip()
    ours = re.search(r"checkpoint file \S+ (is corrupt|is missing)[^;]*", text)
    if ours:
        return (FileNotFoundError if "missing" in ours.group(1) else ValueError)(ours.group(0).rstrip("."))
    kind = FileNotFoundError if isinstance(first, OSError) or "No such file" in text else ValueError
    return kind(f"checkpoint {path} could not be read: {text.splitlines()[-1] if text else type(first).__name__}")


def read_full(path: Path, kind: str, keys: Optional[Iterable[str]] = None) -> Dict[str, torch.Tensor]:
    """Full tensors ``{generator key: tensor}`` of ``kind`` (``model``, ``ema``, ...) from a
    checkpoint folder, in one process (no process group): every tensor, or those of ``keys``.
    Holds what it returns: read a subset to bound memory (export writes shard by shard)."""
    shapes = tensor_shapes(path, kind)
    wanted = list(shapes) if keys is None else list(keys)
    missing = [k for k in wanted if k not in shapes]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {kind} tensors {missing[:4]}: it was written for another model")
    out = {k: torch.empty(shapes[k][0], dtype=shapes[k][1]) for k in wanted}
    if out:
        load_pieces(path, {f"{kind}/{k}": v for k, v in out.items()}, no_dist=True)
    return out
