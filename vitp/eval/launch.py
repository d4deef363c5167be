"""``vitp-sample`` and ``vitp-eval`` under a launcher (torchrun, ``deepspeed``, MPI, srun): the
samples split over data-parallel replicas, the generator split over tp / cp / pp only where one
device cannot hold a replica.

With ``WORLD_SIZE > 1`` (:func:`launched`) the CLIs pick the layout (:func:`choose_layout`): unless
a layout key (:data:`LAYOUT_KEYS`) is given, ``dp = world`` replicas of the whole generator when
one replica fits a device (the planner's :func:`vitp.plan.replica_bytes`), else the run's training
layout; given keys are the run's layout with those overrides, ``dp = world / (tp * cp * pp)``
(:func:`inference_layout`). The choice is printed in one line (stderr, rank 0).

A replica (``tp = cp = pp = 1``) runs the plain :class:`vitp.models.Generator` as one process does,
read whole from the weights file, on a bare ``torch.distributed`` group (no DeepSpeed, no
collective per forward: one gather of the samples at the end). Otherwise the CLIs build the
pipeline module as ``vitp-train`` does (:func:`build_sharded`): each rank reads only the slices of
its shard (:func:`vitp.checkpoint.initialize.init_from_export`) and samples run through
:class:`vitp.eval.inference.StageDenoiser` in micro-batches of ``trainer.micro_batch_size``. Either
way the samples are split over the replicas (:class:`vitp.eval.inference.Share`); rank 0 alone gets
the result, writes and prints (:func:`quiet_unless_main` silences the others).

The parameters stay in fp32 whatever the run trained in, as the one-process path
(:func:`vitp.checkpoint.generator_from_state`) holds them, so both give the same samples and
losses (up to the order of floating-point sums in the sharded layers).
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, List, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf

from vitp.config import Layout, validate_layout
from vitp.parallel import distributed as dist
from vitp.utils import divisors

# the run-config keys that choose the inference layout (dp is what is left of the world)
LAYOUT_KEYS = ("parallel.tp", "parallel.cp", "parallel.pp", "parallel.sequence_parallel", "parallel.cp_mode")


def launched() -> bool:
    """Whether this process is one of several started by a launcher (``WORLD_SIZE > 1`` after
    :func:`vitp.parallel.distributed.adopt_launcher_env` maps MPI / srun variables)."""
    dist.adopt_launcher_env()
    return dist.world_size() > 1


def _layout_check(cfg: DictConfig, tp: int, cp: int, pp: int, world: int, device_type: str) -> Layout:
    """:func:`vitp.config.validate_layout` of ``cfg`` at ``(tp, cp, pp)`` on ``world`` processes,
    without the training-only rules: the batch split and the ZeRO stage mean nothing to inference."""
    dp = max(1, world // (tp * cp * pp)) if tp * cp * pp else 1
    micro = int(cfg.trainer.micro_batch_size)
    buckets = OmegaConf.to_container(cfg.data.buckets, resolve=True) if cfg.data.buckets else []
    for b in buckets:  # a bucket's batch must split over dp in training only
        b["batch_size"] = micro * dp
    probe = OmegaConf.merge(cfg, {"parallel": {"tp": tp, "cp": cp, "pp": pp, "zero_stage": 1},
                                  "trainer": {"global_batch_size": micro * dp}})
    if buckets:
        probe.data.buckets = buckets
    return validate_layout(probe, world, device_type)


def valid_layouts(cfg: DictConfig, world: int, device_type: str = "cpu") -> List[Tuple[int, int, int]]:
    """Every ``(tp, cp, pp)`` the model of ``cfg`` can run in on ``world`` processes (heads and
    MLP units divide tp, each stage gets a block, the token grid splits over cp)."""
    ok = []
    for tp in divisors(world):
        for cp in divisors(world // tp):
            for pp in divisors(world // (tp * cp)):
                try:
                    _layout_check(cfg, tp, cp, pp, world, device_type)
                    ok.append((tp, cp, pp))
                except ValueError:
                    pass
    return ok


def inference_layout(cfg: DictConfig, world: int, device_type: str = "cpu", prog: str = "vitp-sample") -> Layout:
    """The :class:`vitp.config.Layout` ``prog`` runs ``cfg`` in on ``world`` processes:
    ``parallel.tp`` x ``cp`` x ``pp`` of ``cfg`` and ``dp = world / (tp * cp * pp)`` replicas.

    Raises ``ValueError`` (one line) when that layout cannot work there, with the reason and the
    valid ``(tp, cp, pp)`` for ``world`` processes, written as overrides."""
    par = cfg.parallel
    try:
        return _layout_check(cfg, par.tp, par.cp, par.pp, world, device_type)
    except ValueError as e:
        why = str(e).split("; valid")[0].split("; launch a multiple")[0]
        ok = valid_layouts(cfg, world, device_type)
        spell = " | ".join(f"parallel.tp={t} parallel.cp={c} parallel.pp={p}" for t, c, p in ok) or "none"
        raise ValueError(f"{prog} on {world} process{'es' if world > 1 else ''} cannot run the layout parallel.tp="
                         f"{par.tp} x parallel.cp={par.cp} x parallel.pp={par.pp} ({why}); give a layout valid for "
                         f"{world} (dp = {world} / (tp x cp x pp)): {spell}") from None


def replica_fits(cfg: DictConfig, world: int, device: Any) -> Tuple[bool, float, float]:
    """``(fits, need, limit)``: whether one whole-generator replica of ``cfg`` (fp32 weights and the
    largest forward, :func:`vitp.plan.replica_bytes`) fits the memory a rank has: ``need`` and
    ``limit`` in bytes. The limit is ``parallel.auto_memory_gib`` when set, else 90% of the CUDA
    device's memory, or on CPU the machine's RAM shared by the ``LOCAL_WORLD_SIZE`` (else ``world``)
    processes."""
    import torch

    from vitp.plan import replica_bytes
    from vitp.utils import to_dict

    need = replica_bytes(cfg, to_dict(cfg.model), device.type)
    gib = cfg.parallel.get("auto_memory_gib")
    if gib:
        limit = float(gib) * 2 ** 30
    elif device.type == "cuda":
        limit = 0.9 * torch.cuda.get_device_properties(device).total_memory
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(1, local)
    return need <= limit, need, limit


def choose_layout(cfg: DictConfig, overrides: Sequence[str], world: int, device: Any,
                  prog: str = "vitp-sample") -> DictConfig:
    """``cfg`` with the inference layout of ``world`` launched processes in its ``parallel`` keys:
    with a layout key (:data:`LAYOUT_KEYS`) among ``overrides``, ``cfg`` as it is (the run's layout
    with those keys); else ``tp = cp = pp = 1`` (``dp = world`` replicas) when a replica fits a
    device (:func:`replica_fits`), else the run's own layout. Prints the choice and how to change it
    (or the layout given) in one line on stderr. ``device``: the ``torch.device`` the ranks run on."""
    from vitp.cli.overrides import override_key
    from vitp.plan import format_bytes

    what = "sampling" if prog == "vitp-sample" else "evaluation"
    par = cfg.parallel
    given = [o for o in overrides if override_key(o) in LAYOUT_KEYS]
    if given:  # said too, so that a user sees the layout that ran
        dp = max(1, world // (par.tp * par.cp * par.pp))
        sp = " with sequence parallel" if par.sequence_parallel and par.tp > 1 else ""
        cp = f" ({par.cp_mode})" if par.cp > 1 else ""
        print(f"{prog}: layout for {what}: tp={par.tp} cp={par.cp}{cp} pp={par.pp} dp={dp}{sp} (given: {' '.join(given)})",
              file=sys.stderr)
        return cfg
    fits, need, limit = replica_fits(cfg, world, device)
    sizes = f"{format_bytes(need)} of the {format_bytes(limit)} a rank has, planner"
    how = "set parallel.tp/cp/pp=N to choose another"
    if fits:
        cfg = OmegaConf.merge(cfg, {"parallel": {"tp": 1, "cp": 1, "pp": 1, "sequence_parallel": False}})
        line = f"dp={world} (a replica of the whole model fits one device: {sizes}; {how})"
    else:
        dp = max(1, world // (par.tp * par.cp * par.pp))
        line = (f"tp={par.tp} cp={par.cp} pp={par.pp} dp={dp}, the run's (a replica of the whole model does not fit "
                f"one device: {sizes}; {how})")
    print(f"{prog}: layout for {what}: {line}", file=sys.stderr)
    return cfg


def check_layout_overrides(cfg: DictConfig, overrides: Sequence[str], prog: str) -> None:
    """One process runs the whole generator whatever the run's layout; the layout keys given
    explicitly among ``overrides`` (:data:`LAYOUT_KEYS`; the others at 1) must still be a layout
    that one process can run.

    Raises ``ValueError`` as :func:`inference_layout` does."""
    from vitp.cli.overrides import override_key

    given = {override_key(o) for o in overrides} & set(LAYOUT_KEYS)
    if given:  # the run's own layout does not count here, only what was asked for
        probe = OmegaConf.merge(cfg, {"parallel": {"tp": 1, "cp": 1, "pp": 1}})
        for key in given:
            OmegaConf.update(probe, key, OmegaConf.select(cfg, key))
        inference_layout(probe, 1, "cpu", prog)


@dataclass
class ShardedGenerator:
    """This rank's part of the generator: ``denoiser`` (:class:`vitp.eval.inference.StageDenoiser`,
    ``(z_t (B, C, T, H, W), t (B,), *y) -> x_pred`` fp32 on every rank of a replica; at ``tp = cp =
    pp = 1`` the whole :class:`vitp.models.Generator`), ``share`` (:class:`vitp.eval.inference.Share`:
    which samples this replica draws, gathered on rank 0), the :class:`vitp.parallel.ParallelState`
    (``None`` for a whole-generator replica) and the :class:`vitp.config.Layout`."""

    denoiser: Any
    share: Any
    state: Any
    layout: Layout


def build_sharded(cfg: DictConfig, weights: Path, prog: str = "vitp-sample") -> ShardedGenerator:
    """Initialise the process group (gloo on CPU, NCCL on CUDA: ``trainer.device``) and build this
    rank's stage of the generator of ``cfg`` in :func:`inference_layout`, its tensor-parallel shard
    read from ``weights`` (a ``.safetensors`` file, a sharded export's index or a checkpoint:
    only this rank's slices), in fp32 and eval mode. Collective: every rank calls it.

    Raises ``ValueError`` for a layout the world cannot run (before any process group), a weights
    file of another model or partial-sync layout, a LoRA run's adapters at tp, cp or pp > 1; ``FileNotFoundError`` for a missing file."""
    from vitp.checkpoint.initialize import init_from_export
    from vitp.eval.inference import Share, StageDenoiser
    from vitp.objectives import FlowMatchingLoss
    from vitp.parallel import model_parallel_seed
    from vitp.pipeline import build_parallel_pipeline

    device = dist.resolve_device(cfg.trainer.device)
    lay = inference_layout(cfg, dist.world_size(), device.type, prog)  # refused before any process group
    if lay.tp * lay.cp * lay.pp == 1:
        return build_replica(cfg, weights, lay, device)
    if cfg.trainer.lora.enabled:  # its checkpoints hold the adapters alone; replicas merge them into the base
        raise ValueError(f"{weights} holds a LoRA run's adapters, which {prog} runs in data-parallel replicas only "
                         f"(no parallel.tp/cp/pp overrides); for tp={lay.tp} cp={lay.cp} pp={lay.pp} merge them first: "
                         f"vitp-export RUN --merge -o X.safetensors, then {prog} X.safetensors with this layout")
    dist.init_distributed(device, dist.timeout_of(cfg))
    m = cfg.model
    # the CLI prints what one process prints: not DeepSpeed's layer table, vitp's plan or load notes
    with contextlib.redirect_stdout(io.StringIO()), _log_level(("DeepSpeed", "vitp"), logging.WARNING):
        module, state = build_parallel_pipeline(cfg, lay, FlowMatchingLoss(cfg.objective.t_eps))
        init_from_export(module, OmegaConf.merge(cfg, {"trainer": {"init_from": str(weights)}}), state)
    model_parallel_seed(cfg.seed, state)
    module.to(device).eval()
    denoiser = StageDenoiser(module, cfg.trainer.micro_batch_size, m.patch_size, m.tubelet_size)
    return ShardedGenerator(denoiser, Share.of(module, state), state, lay)


def build_replica(cfg: DictConfig, weights: Path, lay: Layout, device: Any) -> ShardedGenerator:
    """This rank's data-parallel replica (``lay`` at ``tp = cp = pp = 1``): the whole
    :class:`vitp.models.Generator` of ``weights`` (read as the one-process CLIs read it,
    :func:`vitp.checkpoint.generator_from_state`) on ``device``, with the :class:`Share` of rank
    ``r`` of the ``world`` replicas over a plain ``torch.distributed`` group
    (:func:`vitp.parallel.distributed.init_process_group`; no DeepSpeed). Collective.

    Raises ``ValueError`` for a weights file of another model than ``cfg.model`` (its
    :data:`vitp.checkpoint.ARCH_KEYS`), ``FileNotFoundError`` for a missing one."""
    from vitp.checkpoint import ARCH_KEYS, check_model_matches, generator_from_state, read_export
    from vitp.checkpoint.export import file_model, file_partial_sync
    from vitp.eval.inference import Share

    dist.init_process_group(device, dist.timeout_of(cfg))
    state, meta = read_export(weights)
    check_model_matches(file_model(meta), cfg.model, ARCH_KEYS, str(weights),
                        "pass the weights of this run, or use that file's own run directory")
    gen = generator_from_state(file_model(meta), state, device, file_partial_sync(meta), meta)
    return ShardedGenerator(gen, Share.replicas(), None, lay)


@contextlib.contextmanager
def _log_level(names: Sequence[str], level: int) -> Iterator[None]:
    """The loggers ``names`` at ``level`` (at least) within the block."""
    loggers = [logging.getLogger(n) for n in names]
    old = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(max(level, lg.level))
    try:
        yield
    finally:
        for lg, lv in zip(loggers, old):
            lg.setLevel(lv)


@contextlib.contextmanager
def quiet_unless_main() -> Iterator[None]:
    """Within the block, ranks other than 0 print nothing (Python's stdout and stderr, and every
    logger); an error still propagates, for :func:`vitp.cli.run_cli` to report."""
    if dist.is_main():
        yield
        return
    logging.disable(logging.CRITICAL)
    try:
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
            yield
    finally:
        logging.disable(logging.NOTSET)


def finish() -> None:
    """Close the process group (no collective: a rank done with its share leaves)."""
    import torch

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
