"""Deterministic batch schedule and the flow-matching collate that feeds DeepSpeed's pipeline.

Every sample of a training run is named by ``(step, g)``: its position ``g`` in the global
batch of optimizer step ``step``. From that name alone we derive which dataset item it is (an
epoch-wise permutation of the stream ``step * G + g``), its augmentation seed, and its noise
seed (``t``, ``eps``, CFG label drop). The micro-batch ``m`` of data-parallel rank ``r`` holds
positions ``g = (m * dp + r) * micro + i``. Consequences:

- all TP ranks and the first/last pipeline stage of a replica build identical batches;
- different DP ranks get disjoint samples;
- any (micro-batch, accumulation, dp) split of the same global batch sees the same samples with
  the same noise, so losses and gradients match the single-process run;
- resuming at step ``s`` reproduces the batches of an uninterrupted run.

Each yielded batch is the DeepSpeed pipeline pair ``((z_t, t, y_in), (x, z_t, t))``, or for a
text-conditional run ``((z_t, t, caption embeddings, mask), (x, z_t, t))``
(:mod:`vitp.data.text`). The CFG drop replaces a label by the null class, a caption by the empty
caption, drawn from the sample's own seed (so every layout and a resumed run drop the same).
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import weakref
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from ..config import check_batch_split
from ..objectives.flow import draw_sample_noise, make_pair, sample_seed
from .text import ClassConditioning

log = logging.getLogger("vitp")

# Stream tags keep the seeds of order, augmentation and noise independent.
_ORDER, _AUG, _NOISE = 1, 2, 3


def epoch_order(n: int, key: Sequence[int], groups: Optional[Sequence[int]] = None, window: int = 0) -> np.ndarray:
    """The order of the ``n`` items in one epoch: a permutation drawn from the seed words ``key``.

    Without ``groups``, or when all groups fit in one ``window``, a uniform permutation of all items.
    With ``groups`` (sizes of runs of consecutive items, e.g. the items of each shard, summing to
    ``n``): the groups are permuted, cut into windows of ``window`` groups, and the items of each
    window permuted; the epoch reads one window after the other, so consecutive positions touch at
    most ``window`` groups (shards stay in the readers' caches). This is WebDataset's shard shuffle +
    shuffle buffer (webdataset/webdataset, ``wids.ChunkedSampler``), but a function of ``key`` alone:
    any data-parallel degree and a resumed run read the same order.

    Returns int64 ``(n,)``.
    """
    rng = np.random.default_rng(np.random.SeedSequence(list(key)))
    if groups is None or window < 1 or len(groups) <= window:
        return rng.permutation(n)
    starts = np.concatenate([[0], np.cumsum(groups)[:-1]]).astype(np.int64)
    shards = rng.permutation(len(groups))
    out = []
    for w in range(0, len(shards), window):
        members = np.concatenate([np.arange(starts[g], starts[g] + groups[g]) for g in shards[w:w + window]])
        out.append(members[rng.permutation(len(members))])
    return np.concatenate(out).astype(np.int64)


class BatchSchedule:
    """Which samples form micro-batch ``m`` of step ``s`` on DP rank ``r``.

    Parameters
    ----------
    num_items : dataset length N
    global_batch, micro_batch, dp : batch sizes; ``global_batch = micro_batch * accumulation * dp``
    seed : run seed
    groups, window : the shard-local order of :func:`epoch_order` (None: a uniform permutation)

    Raises
    ------
    ValueError if the global batch is not a multiple of ``micro_batch * dp``.
    """

    def __init__(self, num_items: int, global_batch: int, micro_batch: int, dp: int, seed: int,
                 groups: Optional[Sequence[int]] = None, window: int = 0):
        if num_items < 1:
            raise ValueError("the training dataset is empty")
        check_batch_split(global_batch, micro_batch, dp)
        self.N, self.G, self.mb, self.dp, self.seed = num_items, global_batch, micro_batch, dp, seed
        self.accumulation = global_batch // (micro_batch * dp)
        self._perm_epoch, self._perm = -1, None
        self.groups, self.window = groups, window

    def _item(self, pos: int) -> int:
        epoch, k = divmod(pos, self.N)
        if epoch != self._perm_epoch:
            self._perm = epoch_order(self.N, [self.seed, _ORDER, epoch], self.groups, self.window)
            self._perm_epoch = epoch
        return int(self._perm[k])

    def micro_batch_keys(self, step: int, micro: int, dp_rank: int) -> List[Tuple[int, int, int]]:
        """``[(item index, aug seed, noise seed)] * micro_batch`` for one micro-batch."""
        keys = []
        for i in range(self.mb):
            g = (micro * self.dp + dp_rank) * self.mb + i
            keys.append(
                (
                    self._item(step * self.G + g),
                    sample_seed(self.seed, _AUG, step, g),
                    sample_seed(self.seed, _NOISE, step, g),
                )
            )
        return keys

    def iter_keys(self, start_step: int, stop_step: int, dp_rank: int) -> Iterator[List[Tuple[int, int, int]]]:
        """Micro-batch keys in training order for steps ``[start_step, stop_step)``."""
        for step in range(start_step, stop_step):
            for m in range(self.accumulation):
                yield self.micro_batch_keys(step, m, dp_rank)


class _KeyedItems(Dataset):
    """``(index, aug_seed, noise_seed) -> (x, y, noise_seed)`` over a keyed dataset, or
    ``(bucket, index, aug_seed, noise_seed)`` over a list of them (one per bucket)."""

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: Tuple[int, ...]):
        if len(key) == 4:  # bucketed (vitp.data.buckets): the dataset is one per bucket
            bucket, index, aug_seed, noise_seed = key
            x, y = self.dataset[bucket][(index, aug_seed)]
        else:
            index, aug_seed, noise_seed = key
            x, y = self.dataset[(index, aug_seed)]
        return x, int(y), noise_seed


class FlowCollate:
    """Collate ``[(x (C,T,H,W), y, noise_seed)]`` into the pipeline pair (see module doc).

    Parameters
    ----------
    objective : ObjectiveConfig (P_mean, P_std, noise_scale, label_drop)
    conditioning : :class:`vitp.data.text.ClassConditioning` / ``TextConditioning`` (ids ->
        the model's conditioning tensors; ``null_id`` is what a CFG drop gives), or an int
        ``num_classes`` (class labels, null class ``num_classes``)
    """

    def __init__(self, objective: Any, conditioning: Any):
        self.objective = objective
        self.conditioning = ClassConditioning(conditioning) if isinstance(conditioning, int) else conditioning

    def __call__(self, items):
        xs, ys, eps, ts, y_in = [], [], [], [], []
        for x, y, noise_seed in items:
            e, t, yi = draw_sample_noise(x.shape, noise_seed, self.objective, self.conditioning.null_id, y)
            xs.append(x), ys.append(y), eps.append(e), ts.append(t), y_in.append(yi)
        x = torch.stack(xs)
        inputs, targets = make_pair(
            x,
            torch.tensor(ys),
            torch.stack(eps).to(x.dtype),
            torch.tensor(ts, dtype=torch.float32),
            torch.tensor(y_in, dtype=torch.long),
            self.objective.noise_scale,
        )
        return (*inputs[:2], *self.conditioning(inputs[2])), targets


class WanCollate:
    """Collate ``[(x (C,T,H,W), caption id, noise_seed)]`` into Wan's pipeline pair
    (:func:`vitp.objectives.wan_flow.make_wan_pair`): inputs ``(x_t, timestep (B,) = 1000 s,
    text (B, 512, text_dim))`` with ``x_t = (1 - s) x + s eps``, targets ``(x, eps, s)`` of
    :class:`vitp.objectives.wan_flow.WanFlowLoss` (velocity target ``eps - x``).

    Each sample draws from its own generator seeded with its noise seed, in this order: its noise
    level ``s`` (``loss.draw_sigmas``: the shifted draw in ``objective.sigma_range``), the CFG drop
    (probability ``objective.label_drop``: the caption becomes the encoded empty caption, as
    ``WanPipeline``'s default negative prompt), then ``eps``; so every layout and a resumed run
    draw the same. The caption embeddings are given as ``WanPipeline`` gives them: each caption's
    tokens (its mask), then zeros up to 512 (:func:`vitp.objectives.wan_sampling.pad_prompt_embeds`).

    Parameters
    ----------
    loss : :class:`vitp.objectives.wan_flow.WanFlowLoss` (its ``draw_sigmas``)
    conditioning : :class:`vitp.data.text.TextConditioning` (ids -> ``(embeddings, mask)``)
    label_drop : probability of the empty caption
    text_tokens : caption tokens of the model's input (512, Wan's ``max_sequence_length``)
    """

    def __init__(self, loss: Any, conditioning: Any, label_drop: float, text_tokens: int = 512):
        self.loss, self.conditioning = loss, conditioning
        self.label_drop, self.text_tokens = float(label_drop), int(text_tokens)

    def __call__(self, items):
        from ..objectives.wan_flow import make_wan_pair
        from ..objectives.wan_sampling import pad_prompt_embeds

        xs, eps, ss, ids = [], [], [], []
        for x, y, noise_seed in items:
            g = torch.Generator().manual_seed(noise_seed)
            ss.append(self.loss.draw_sigmas(1, g)[0])
            drop = torch.rand((), generator=g).item() < self.label_drop
            eps.append(torch.randn(tuple(x.shape), generator=g))
            xs.append(x), ids.append(self.conditioning.null_id if drop else int(y))
        x = torch.stack(xs).float()
        emb, mask = self.conditioning(torch.tensor(ids, dtype=torch.long))
        text = pad_prompt_embeds(emb.float(), mask, self.text_tokens)
        return make_wan_pair(x, torch.stack(eps), torch.stack(ss), text)


class _KeySampler:
    """Lazy batch sampler over :meth:`BatchSchedule.iter_keys`."""

    def __init__(self, schedule: BatchSchedule, start: int, stop: int, dp_rank: int):
        self.schedule, self.start, self.stop, self.dp_rank = schedule, start, stop, dp_rank

    def __iter__(self):
        return self.schedule.iter_keys(self.start, self.stop, self.dp_rank)

    def __len__(self) -> int:
        return max(0, self.stop - self.start) * self.schedule.accumulation


def ignore_stop_signals(worker_id: int = 0) -> None:
    """DataLoader ``worker_init_fn``: the worker ignores SIGINT and SIGTERM.

    Ctrl-C, ``scancel``, Kubernetes, SageMaker and the torchrun/deepspeed launchers signal every
    process of the job, DataLoader workers included. A worker that dies of it makes the main
    process raise "DataLoader worker ... killed by signal" in the middle of the step it should
    finish and checkpoint (:class:`vitp.train.stop.StopSignal`). Ignoring the signal leaves the
    stop to the main process, which shuts its workers down through the loader's queues
    (:class:`LoaderBatches`); a worker whose main process is gone exits by itself (torch's parent
    watchdog), and SIGKILL still works.
    """
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)


_OPEN: "weakref.WeakSet[LoaderBatches]" = weakref.WeakSet()


def _close_open_loaders() -> None:
    for batches in list(_OPEN):
        batches.close()


class LoaderBatches:
    """``iter(loader)`` whose worker processes :meth:`close` shuts down, and at the latest an
    ``atexit`` hook does.

    Why: the workers ignore SIGTERM (:func:`ignore_stop_signals`), while torch leaves the workers
    of an iterator still referenced at interpreter exit to multiprocessing, which SIGTERMs its
    daemonic children and then joins them: the main process would wait forever. The hook is
    registered after multiprocessing's and torch's own, so it runs before them.
    """

    _hook = False

    def __init__(self, loader: DataLoader):
        self._it = iter(loader)
        if loader.num_workers > 0:
            if not LoaderBatches._hook:
                atexit.register(_close_open_loaders)
                LoaderBatches._hook = True
            _OPEN.add(self)

    def __iter__(self) -> "LoaderBatches":
        return self

    def __next__(self):
        try:
            return next(self._it)
        except (ValueError, OSError) as e:  # bad input or storage: the CLIs' one line, as without workers
            raise worker_error(e) from None

    def close(self) -> None:
        """Shut the worker processes down (through torch's own queue protocol); idempotent."""
        _OPEN.discard(self)
        shutdown = getattr(self._it, "_shutdown_workers", None)  # absent without workers
        if shutdown is not None:
            shutdown()


def worker_error(error: BaseException) -> BaseException:
    """``error`` as the DataLoader worker raised it. torch raises a worker's exception again in
    the main process with its type but the message ``Caught <type> in DataLoader worker process N.``
    followed by the worker's traceback (``torch.utils.data._utils.ExceptionWrapper.reraise``);
    this gives the original message back (the text after the traceback's last ``<type>: ``), so
    that an error the CLIs report in one line (a damaged pack, :class:`vitp.data.base.UnreadableData`)
    is one line. Other errors are returned as they are."""
    import re

    text = str(error)
    if not (text.startswith("Caught ") and "DataLoader worker" in text and "Original Traceback" in text):
        return error
    found = list(re.finditer(rf"^(?:[\w.]+\.)?{re.escape(type(error).__name__)}: ", text, re.M))
    if not found:
        return error
    try:
        return type(error)(text[found[-1].end():].rstrip("\n"))
    except Exception:  # noqa: BLE001 - a type whose constructor takes other arguments: keep torch's
        return error


def usable_workers(num_workers: int) -> int:
    """``num_workers`` (``data.num_workers``), at most the CPUs this process may run on (torch
    suggests no more and warns otherwise: ``data=image_folder``'s 4 workers on a 2-core machine);
    a cut is logged once, naming the key."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if num_workers <= cpus:
        return num_workers
    if not _said_workers:
        _said_workers.append(cpus)
        log.info("data.num_workers=%d: %d DataLoader workers, the CPUs this process may use", num_workers, cpus)
    return cpus


_said_workers: List[int] = []


def train_loader(
    dataset: Any, schedule: BatchSchedule, objective: Any, conditioning: Any, *,
    start_step: int, stop_step: int, dp_rank: int, num_workers: int = 0, collate: Any = None,
) -> DataLoader:
    """A DataLoader that yields the pipeline pairs of steps ``[start_step, stop_step)`` for one DP
    rank, ``schedule.accumulation`` micro-batches per step; its ``num_workers`` worker processes
    ignore SIGINT/SIGTERM (:func:`ignore_stop_signals`), at most one per CPU (:func:`usable_workers`).
    ``conditioning``: as :class:`FlowCollate`; ``collate`` replaces ``FlowCollate(objective,
    conditioning)`` (a Wan run's :class:`WanCollate`)."""
    num_workers = usable_workers(num_workers)
    return DataLoader(
        _KeyedItems(dataset),
        batch_sampler=_KeySampler(schedule, start_step, stop_step, dp_rank),
        collate_fn=collate if collate is not None else FlowCollate(objective, conditioning),
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        worker_init_fn=ignore_stop_signals,  # the main process handles a stop (see there)
        # items are keyed, so the loader needs no randomness; its own generator keeps it from
        # drawing from the global RNG (dropout), which a resumed run restores from the checkpoint
        generator=torch.Generator().manual_seed(0),
    )
