"""Forward-only passes of the generator in its training layout: sampling and evaluation on every
rank, with no rank holding more than its own stage's tensor-parallel shard.

:class:`StageDenoiser` is the denoiser ``(z_t, t, *y) -> x_pred`` that the samplers
(:func:`vitp.objectives.sample`) and the held-out loss call. Every rank of one model replica
(its tp x cp x pp ranks) calls it with the same inputs; the first stage embeds them, each stage
runs its blocks on micro-batches and sends the activations on (so stages overlap across
micro-batches, as GPipe's forward does; Huang et al. 2019, arXiv 1811.06965), and the last stage's
prediction is broadcast over the pipeline group, so every rank of the replica returns it. Inside a
stage the tensor- and context-parallel layers work as in training (column/row-parallel linears,
sequence parallel, Ulysses or ring attention).

:func:`ema_weights` swaps the EMA into the stage's parameters for the duration of a ``with``
block: each parameter's ZeRO-sharded EMA is summed over its data-parallel partition group into the
parameter (one parameter at a time), and the live weights wait in host memory.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional, Tuple

import torch

import vitp.deepspeed_adapter as ds

# dtypes an activation tuple may hold, by their code in the p2p header (bool travels as uint8)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.bool, torch.int64, torch.int32)
_HEADER = 64  # int64 slots: count, then (dtype code, ndim, dims...) per tensor


def _header(tensors: Tuple[torch.Tensor, ...]) -> torch.Tensor:
    head = [len(tensors)]
    for t in tensors:
        head += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    if len(head) > _HEADER:
        raise ValueError(f"activation tuple of {len(tensors)} tensors does not fit the {_HEADER}-slot p2p header")
    return torch.tensor(head + [0] * (_HEADER - len(head)), dtype=torch.int64)


def _shapes(head: torch.Tensor) -> List[Tuple[torch.dtype, Tuple[int, ...]]]:
    h, out, i = head.tolist(), [], 1
    for _ in range(h[0]):
        dtype, nd = _DTYPES[h[i]], h[i + 1]
        out.append((dtype, tuple(h[i + 2:i + 2 + nd])))
        i += 2 + nd
    return out


def send_activations(tensors: Tuple[torch.Tensor, ...], dst: int, device: torch.device) -> None:
    """Send an activation tuple to global rank ``dst`` (which calls :func:`recv_activations`):
    a fixed-size header of dtypes and shapes, then each tensor (on ``device``, the p2p device)."""
    torch.distributed.send(_header(tensors).to(device), dst)
    for t in tensors:
        torch.distributed.send((t.to(torch.uint8) if t.dtype == torch.bool else t).contiguous().to(device), dst)


def recv_activations(src: int, device: torch.device) -> Tuple[torch.Tensor, ...]:
    """The activation tuple :func:`send_activations` sent from global rank ``src``, on ``device``."""
    head = torch.empty(_HEADER, dtype=torch.int64, device=device)
    torch.distributed.recv(head, src)
    out = []
    for dtype, shape in _shapes(head.cpu()):
        buf = torch.empty(shape, dtype=torch.uint8 if dtype == torch.bool else dtype, device=device)
        torch.distributed.recv(buf, src)
        out.append(buf.bool() if dtype == torch.bool else buf)
    return tuple(out)


def current_grid(module: torch.nn.Module) -> Optional[Tuple[int, int, int]]:
    """The token grid ``(gt, gh, gw)`` the layers of ``module`` are set to (``None`` if none holds one)."""
    for m in module.modules():
        g = getattr(m, "grid", None)
        if isinstance(g, tuple) and len(g) == 3 and callable(getattr(m, "set_grid", None)):
            return g
    return None


class StageDenoiser:
    """``(z_t (B, C, T, H, W), t (B,), *y) -> x_pred (B, C, T, H, W)`` fp32, computed by the
    pipeline stages of ``module`` (a :func:`vitp.pipeline.build_pipeline` module, parallelized by
    :func:`vitp.models.parallelize_generator`) in micro-batches of ``micro_batch`` samples; see the
    module doc. Every rank of the replica must call it with the same ``z_t`` (stages after the
    first use only its shape), in the same order. ``y``: the conditioning tuple of
    :class:`vitp.models.Embed` (labels ``(B,)``, or caption embeddings ``(B, L, Dc)`` and mask
    ``(B, L)``).

    ``device`` and ``dtype`` (the stage's parameters) tell the samplers where and in what
    precision to put their inputs; ``forwards`` counts the micro-batch forwards this rank ran.
    The token grid follows the input (:func:`vitp.models.set_grid` on every stage); within
    :meth:`grid_kept` it comes back afterwards.
    """

    def __init__(self, module: torch.nn.Module, micro_batch: int, patch_size: int, tubelet_size: int):
        grid = ds.pipeline_grid(module)
        self.module, self.micro = module, max(1, int(micro_batch))
        self.p, self.pt = patch_size, tubelet_size
        self.stage, self.stages = grid.get_stage_id(), grid.pipe_parallel_size
        self.prev = grid.stage_to_global(self.stage - 1) if self.stage > 0 else None
        self.next = grid.stage_to_global(self.stage + 1) if self.stage < self.stages - 1 else None
        self.last = grid.stage_to_global(self.stages - 1)
        self.pp_group = grid.get_pipe_parallel_group() if self.stages > 1 else None
        p = next(module.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.p2p = self.device if self.device.type == "cuda" else torch.device("cpu")
        self.forwards = 0

    @contextlib.contextmanager
    def grid_kept(self) -> Iterator["StageDenoiser"]:
        """Within the block the grid follows the inputs; afterwards every layer is back at the grid
        it had on entry (the training step's)."""
        from vitp.models import set_grid

        grid = current_grid(self.module)
        try:
            yield self
        finally:
            if grid is not None and current_grid(self.module) != grid:
                set_grid(self.module, grid)

    @torch.no_grad()
    def __call__(self, z_t: torch.Tensor, t: torch.Tensor, *y: torch.Tensor) -> torch.Tensor:
        from vitp.models import input_grid, set_grid

        grid = input_grid(z_t.shape, self.p, self.pt)
        if current_grid(self.module) != grid:
            set_grid(self.module, grid)
        was_training = self.module.training
        self.module.eval()
        try:
            outs = self._forward(z_t, t, y)
        finally:
            self.module.train(was_training)
        if self.stages == 1:
            return torch.cat(outs)
        out = torch.cat(outs).to(self.p2p) if self.next is None else \
            torch.empty(z_t.shape, dtype=torch.float32, device=self.p2p)
        torch.distributed.broadcast(out, src=self.last, group=self.pp_group)
        return out.to(self.device)

    def _forward(self, z_t: torch.Tensor, t: torch.Tensor, y: Tuple[torch.Tensor, ...]) -> List[torch.Tensor]:
        outs = []
        for i in range(0, z_t.shape[0], self.micro):
            if self.prev is None:
                part = slice(i, i + self.micro)
                x = (z_t[part].to(self.device), t[part].to(self.device), *(v[part].to(self.device) for v in y))
            else:
                x = tuple(v.to(self.device) for v in recv_activations(self.prev, self.p2p))
            x = self.module(x)
            self.forwards += 1
            if self.next is None:
                outs.append(x.float())
            else:
                send_activations(x if isinstance(x, tuple) else (x,), self.next, self.p2p)
        return outs


@contextlib.contextmanager
def ema_weights(module: torch.nn.Module, ema: Any) -> Iterator[None]:
    """Within the block, ``module``'s parameters hold the EMA weights of :class:`vitp.train.ema.EMA`
    ``ema`` (in the parameters' dtype); the live weights are restored afterwards, also on an error.
    Collective over each parameter's data-parallel partition group when the EMA is sharded (every
    rank of the stage must enter). Costs one parameter's fp32 copy on the device and the stage's
    weights in host memory."""
    saved = {}
    try:
        with torch.no_grad():
            for n, p in module.named_parameters():
                if n not in ema.params:  # frozen (a LoRA run's base): its weights are its EMA
                    continue
                saved[n] = p.detach().to("cpu", copy=True)
                p.copy_(ema.full(n, p))
        yield
    finally:
        with torch.no_grad():
            for n, p in module.named_parameters():
                if n in saved:
                    p.copy_(saved[n].to(p.device))



class Share:
    """How samples and held-out items are split over the data-parallel replicas, and how their
    results come back: each replica (dp rank) takes a contiguous range of the indices
    (:meth:`indices`); images go to global rank 0 alone (:meth:`gather`), sums to every rank
    (:meth:`sum`). The default is one process holding everything.

    ``group`` is the data-parallel group of this rank's stage and tp rank (``dp * cp`` ranks in
    data-rank order ``dp_rank * cp + cp_rank``, DeepSpeed's ``get_data_parallel_group``); the cp
    ranks of a replica hold the same samples, so only ``cp_rank == 0``'s count.
    """

    def __init__(self, rank: int = 0, size: int = 1, cp: int = 1, group: Any = None, gathers: bool = True,
                 main: bool = True):
        self.rank, self.size, self.cp, self.group, self.gathers, self.main = rank, size, cp, group, gathers, main

    @classmethod
    def of(cls, module: torch.nn.Module, state: Any) -> "Share":
        """The share of this rank of a pipeline ``module`` with parallel ``state``
        (:class:`vitp.parallel.ParallelState`)."""
        grid = ds.pipeline_grid(module)
        multi = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        return cls(state.dp_rank, state.dp_size, state.cp_size, grid.get_data_parallel_group() if multi else None,
                   gathers=state.pp_rank == 0 and state.tp_rank == 0,
                   main=not multi or torch.distributed.get_rank() == 0)

    @classmethod
    def replicas(cls) -> "Share":
        """The share of this rank when every rank of the world is a replica of the whole model (the
        process group is up)."""
        rank = torch.distributed.get_rank()
        return cls(rank, torch.distributed.get_world_size(), 1, torch.distributed.group.WORLD, gathers=True,
                   main=rank == 0)

    def per(self, n: int) -> int:
        """Indices per replica (the last ones may hold fewer)."""
        return -(-n // self.size)

    def indices(self, n: int) -> range:
        """This replica's contiguous range of ``range(n)``."""
        per = self.per(n)
        return range(min(n, self.rank * per), min(n, (self.rank + 1) * per))

    def gather(self, part: torch.Tensor, n: int) -> Optional[torch.Tensor]:
        """The ``n`` rows of every replica's ``part`` (this replica's :meth:`indices`), in index
        order, on global rank 0; ``None`` elsewhere. Collective over :attr:`group` for the ranks of
        stage 0 and tp rank 0 (the others return at once)."""
        if self.size * self.cp == 1 or self.group is None:
            return part if self.main else None
        if not self.gathers:
            return None
        from vitp.parallel.distributed import p2p_device

        device, per = p2p_device(self.group), self.per(n)
        buf = torch.zeros((per, *part.shape[1:]), dtype=part.dtype, device=device)
        buf[:len(part)] = part.to(device)
        dst = torch.distributed.get_global_rank(self.group, 0)
        pieces = [torch.empty_like(buf) for _ in range(self.size * self.cp)] if self.main else None
        torch.distributed.gather(buf, pieces, dst=dst, group=self.group)
        if not self.main:
            return None
        return torch.cat([pieces[r * self.cp].cpu() for r in range(self.size)])[:n]

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over replicas of each replica's ``t`` (float64), on every rank (collective over
        :attr:`group`; every rank of the world calls it)."""
        if self.group is None or self.size * self.cp == 1:
            return t.double()
        from vitp.parallel.distributed import p2p_device

        out = t.double().to(p2p_device(self.group))
        torch.distributed.all_reduce(out, group=self.group)
        return out.cpu() / self.cp
