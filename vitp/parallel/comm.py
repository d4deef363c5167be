"""Counted collectives over a tensor-parallel process group.

Every collective of :mod:`vitp.parallel` goes through the three functions here, so a
:class:`CommRecorder` can list them and tests can compare the traffic with theory
(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", §4.2.2:
per block and micro-batch, tensor parallelism does 2 all-reduces of ``B*N*D`` elements in forward
and 2 in backward; sequence parallelism replaces each by an all-gather plus a reduce-scatter of
the same logical tensor).

Collectives operate on one dimension of the tensor (``dim``). On NCCL the tensor is moved so
that ``dim`` is the leading one and the single-tensor primitives (``all_gather_single`` /
``reduce_scatter_single``, or their older names ``all_gather_into_tensor`` /
``reduce_scatter_tensor``) are used; on gloo the list primitives read and write strided views
of ``dim`` directly (fewer copies; reduce-scatter sums in another order above 2 ranks).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .wire import wire_bytes

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _graph_break(fn):
    """Run ``fn`` outside ``torch.compile``'s graphs (a graph break where a compiled block calls it;
    dynamo does not trace process groups passed around as Python objects here, see
    docs/performance.md); eager callers see ``fn`` unchanged."""
    return torch._dynamo.disable(fn, recursive=True)


@dataclass(frozen=True)
class CommRecord:
    """One collective.

    ``nbytes`` is the size of the full logical tensor: the all-reduced tensor, the gathered
    output, or the reduce-scatter input. ``direction`` is ``"fwd"``, ``"bwd"`` or ``"none"``;
    ``tag`` says who issued it (``"tp"`` block linears, ``"sp_boundary"`` enter/exit of the
    sequence region, ``"cond"`` the adaLN conditioning, ``"param_grad"`` gradient hooks,
    ``"export"`` gathering weights, ``"cp"`` context-parallel attention and ``"cp_boundary"`` the
    gathered prediction). For ``all_to_all`` ``nbytes`` is this rank's input; for ``send_recv``
    (one step of a ring: every rank sends to the next and receives from the previous) the bytes
    each rank sends.
    """

    def wire(self) -> int:
        """Bytes one rank sends (:func:`wire_bytes`)."""
        return wire_bytes(self.kind, self.nbytes, self.group_size)

    kind: str  # "all_reduce" | "all_gather" | "reduce_scatter" | "all_to_all" | "send_recv"
    group_size: int
    nbytes: int
    shape: Tuple[int, ...]
    direction: str
    tag: str


_RECORDERS: List["CommRecorder"] = []


class CommRecorder:
    """Context manager recording every collective issued by :mod:`vitp.parallel` inside it.

    Examples
    --------
    >>> with CommRecorder() as rec:
    ...     loss = model(x).sum(); loss.backward()
    >>> rec.summary()[("all_reduce", "fwd", "tp")]
    {'count': 2, 'bytes': 16384}
    """

    def __init__(self) -> None:
        self.records: List[CommRecord] = []

    def __enter__(self) -> "CommRecorder":
        _RECORDERS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _RECORDERS.remove(self)

    def add(self, record: CommRecord) -> None:
        """Called by every collective issued inside the context."""
        self.records.append(record)

    def summary(self) -> Dict[Tuple[str, str, str], Dict[str, int]]:
        """``{(kind, direction, tag): {"count": n, "bytes": total}}``."""
        out: Dict[Tuple[str, str, str], Dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
        for r in self.records:
            entry = out[(r.kind, r.direction, r.tag)]
            entry["count"] += 1
            entry["bytes"] += r.nbytes
        return dict(out)

    def wire_bytes(self, tag: Optional[str] = None) -> int:
        """Bytes each rank sends with ring algorithms (Patarasuk & Yuan 2009): all-reduce
        ``2 (p-1)/p n``, all-gather and reduce-scatter ``(p-1)/p n``; only records with ``tag``
        if given. An all-reduce costs the same as a reduce-scatter plus an all-gather."""
        return sum(int(r.wire()) for r in self.records if tag is None or r.tag == tag)


class CommCounter(CommRecorder):
    """A :class:`CommRecorder` that keeps running totals instead of the records (cheap enough to
    stay on for a whole run): ``count`` collectives and ``wire`` ring bytes sent per rank (as
    :meth:`CommRecorder.wire_bytes`), for the records whose tag is in ``tags`` (default: all);
    :meth:`reset` zeroes them."""

    def __init__(self, tags: Optional[Tuple[str, ...]] = None) -> None:
        super().__init__()
        self.tags = tags
        self.count, self.wire = 0, 0

    def add(self, record: CommRecord) -> None:
        if self.tags is None or record.tag in self.tags:
            self.count += 1
            self.wire += int(record.wire())

    def reset(self) -> None:
        self.count, self.wire = 0, 0


@_graph_break
def record(kind: str, group, tensor_numel: int, shape, dtype: torch.dtype, direction: str, tag: str) -> None:
    """Tell the active recorders of one collective (for primitives issued outside this module,
    e.g. the point-to-point steps of ring attention)."""
    _record(kind, group, tensor_numel, shape, dtype, direction, tag)


def _record(kind: str, group, tensor_numel: int, shape, dtype: torch.dtype, direction: str, tag: str) -> None:
    if _RECORDERS:
        rec = CommRecord(kind, dist.get_world_size(group), tensor_numel * dtype.itemsize, tuple(shape), direction, tag)
        for r in _RECORDERS:
            r.add(rec)


@_graph_break
def group_size(group) -> int:
    """World size of ``group`` (1 when ``torch.distributed`` is not initialised)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


@_graph_break
def group_rank(group) -> int:
    """Rank inside ``group`` (0 when ``torch.distributed`` is not initialised)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


@_graph_break
def all_reduce(x: torch.Tensor, group, *, direction: str = "none", tag: str = "tp") -> torch.Tensor:
    """Sum ``x`` over ``group`` in place and return it (``x`` made contiguous first if needed)."""
    x = x.contiguous()
    _record("all_reduce", group, x.numel(), x.shape, x.dtype, direction, tag)
    dist.all_reduce(x, group=group)
    return x


def _strided_ok(x: torch.Tensor, dim: int, group) -> bool:
    """Use the list collectives on strided views of a non-leading ``dim``: measured faster on
    gloo (no transposed copy of input and output); NCCL keeps the single-tensor primitives."""
    return dim % x.dim() != 0 and dist.get_backend(group) == "gloo"


class Pending:
    """A collective issued with ``async_op=True``: :meth:`wait` blocks until it is done and
    returns its result. Work placed between the call and :meth:`wait` overlaps the transfer
    (Megatron-LM ``LinearWithGradAccumulationAndAsyncCommunication``); on NCCL ``wait`` makes
    the current stream wait for the communication stream."""

    def __init__(self, work, finish) -> None:
        self._work, self._finish = work, finish

    def wait(self) -> torch.Tensor:
        self._work.wait()
        return self._finish()


@_graph_break
def all_gather(x: torch.Tensor, dim: int, group, *, direction: str = "none", tag: str = "tp",
               async_op: bool = False):
    """Concatenate every rank's ``x`` along ``dim`` in rank order.

    ``x`` of shape ``(..., n, ...)`` -> ``(..., world * n, ...)``; all ranks must pass equal shapes.
    With ``async_op=True`` returns a :class:`Pending` whose ``wait()`` gives that tensor.
    """
    world = dist.get_world_size(group)
    if _strided_ok(x, dim, group):  # gloo writes each rank's block into a view: no transposed copies
        shape = list(x.shape)
        shape[dim] *= world
        out = x.new_empty(shape)
        _record("all_gather", group, out.numel(), out.shape, x.dtype, direction, tag)
        work = dist.all_gather(list(out.chunk(world, dim)), x.contiguous(), group=group, async_op=async_op)
        return Pending(work, lambda: out) if async_op else out
    xs = x.movedim(dim, 0).contiguous()
    out = xs.new_empty((world * xs.shape[0],) + tuple(xs.shape[1:]))
    _record("all_gather", group, out.numel(), out.movedim(0, dim).shape, x.dtype, direction, tag)
    work = _all_gather_single(out, xs, group=group, async_op=async_op)
    finish = lambda: out.movedim(0, dim).contiguous()  # noqa: E731
    return Pending(work, finish) if async_op else finish()


@_graph_break
def reduce_scatter(x: torch.Tensor, dim: int, group, *, direction: str = "none", tag: str = "tp",
                   async_op: bool = False):
    """Sum ``x`` over ``group`` and keep this rank's ``1/world`` slice along ``dim``.

    ``x`` of shape ``(..., world * n, ...)`` -> ``(..., n, ...)``. With ``async_op=True``
    returns a :class:`Pending` whose ``wait()`` gives that tensor.

    Raises
    ------
    ValueError
        If ``x.shape[dim]`` is not divisible by the group size.
    """
    world = dist.get_world_size(group)
    if x.shape[dim] % world:
        raise ValueError(f"reduce_scatter: size {x.shape[dim]} of dim {dim} is not divisible by group size {world}")
    if _strided_ok(x, dim, group):
        shape = list(x.shape)
        shape[dim] //= world
        out = x.new_empty(shape)
        _record("reduce_scatter", group, x.numel(), x.shape, x.dtype, direction, tag)
        work = dist.reduce_scatter(out, list(x.chunk(world, dim)), group=group, async_op=async_op)
        return Pending(work, lambda: out) if async_op else out
    xs = x.movedim(dim, 0).contiguous()
    out = xs.new_empty((xs.shape[0] // world,) + tuple(xs.shape[1:]))
    _record("reduce_scatter", group, xs.numel(), x.shape, x.dtype, direction, tag)
    work = _reduce_scatter_single(out, xs, group=group, async_op=async_op)
    finish = lambda: out.movedim(0, dim).contiguous()  # noqa: E731
    return Pending(work, finish) if async_op else finish()


@_graph_break
def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group, *, direction: str = "none",
               tag: str = "cp") -> torch.Tensor:
    """Split ``x`` into ``world`` chunks along ``scatter_dim``, send chunk ``j`` to rank ``j``, and
    concatenate the chunks received along ``gather_dim`` in rank order (one
    ``all_to_all_single``, as DeepSpeed-Ulysses' ``single_all_to_all``, arXiv 2309.14509).

    ``x`` of shape ``(.., s, .., g, ..)`` -> ``(.., s / world, .., g * world, ..)``.

    Raises
    ------
    ValueError
        If ``x.shape[scatter_dim]`` is not divisible by the group size, or the two dims are equal.
    """
    world = dist.get_world_size(group)
    s, g = scatter_dim % x.dim(), gather_dim % x.dim()
    if s == g:
        raise ValueError("all_to_all: scatter_dim and gather_dim must differ")
    if x.shape[s] % world:
        raise ValueError(f"all_to_all: size {x.shape[s]} of dim {s} is not divisible by group size {world}")
    xs = x.movedim(s, 0)
    xs = xs.reshape((world, xs.shape[0] // world) + tuple(xs.shape[1:])).contiguous()
    out = torch.empty_like(xs)
    _record("all_to_all", group, xs.numel(), x.shape, x.dtype, direction, tag)
    dist.all_to_all_single(out, xs, group=group)
    y = out.movedim(1, s + 1).movedim(0, g)  # (.., world, x_g, ..): rank j's chunk at index j
    shape = list(y.shape)
    shape[g:g + 2] = [shape[g] * shape[g + 1]]
    return y.reshape(shape)
