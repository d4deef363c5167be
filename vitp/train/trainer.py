"""The training loop: one path for every ``tp x pp x dp`` layout.

config -> :class:`Trainer` (checks, process groups, datasets, ``PipelineModule`` with the TP
plan, ``deepspeed.initialize``, EMA, resume; only then the run dir is written) -> :meth:`Trainer.fit` (a
``train_batch`` per optimizer step; the logger, sampler, evaluator and checkpointer decide when
they act) -> metrics.jsonl / TensorBoard / sample grids / checkpoints -> final weights and eval.json.
The loop follows torchtitan's ``Trainer`` (its ``train_step`` / ``train``: here
:meth:`Trainer.train_step` / :meth:`Trainer.fit`) on DeepSpeed's pipeline engine
(``PipelineEngine.train_batch``: 1F1B over the micro-batches of one step).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")  # albumentations checks PyPI at import otherwise
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed would warn and probe for accelerators

from omegaconf import DictConfig, OmegaConf  # noqa: E402

import vitp.deepspeed_adapter as ds  # noqa: E402
from vitp.checkpoint.storage import detect_storage_groups  # noqa: E402
from vitp.config import absolute_paths, validate_config, validate_text_run  # noqa: E402
from vitp.models.wan_run import is_wan  # noqa: E402
from vitp.parallel import distributed as dist  # noqa: E402
from vitp.utils import atomic_write_text  # noqa: E402

from .autolayout import apply_auto_layout  # noqa: E402
from .checkpointer import Checkpointer  # noqa: E402
from .ema import EMA  # noqa: E402
from .logger import RunLogger, binned_loss, log_stages, quiet_third_party  # noqa: E402
from .preflight import log_phase_times, preflight, with_text_len  # noqa: E402
from .rundir import check_same_config, hold_log_files, lock_run_dir, release_log_files, resume_command  # noqa: E402
from .stop import StopSignal  # noqa: E402
from .telemetry import Telemetry  # noqa: E402

log = logging.getLogger("vitp")


def write_run_config(run_dir: Path, cfg: DictConfig, overrides: Optional[list]) -> None:
    """``.hydra/config.yaml`` (what ``vitp-eval`` reloads; the trainer's ``cfg`` holds absolute paths
    by then) and ``overrides.yaml`` (the command line as given), atomically."""
    atomic_write_text(run_dir / ".hydra" / "config.yaml", OmegaConf.to_yaml(cfg))
    if overrides is not None:
        atomic_write_text(run_dir / ".hydra" / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(list(overrides))))


def check_config(cfg: DictConfig, device: Optional[torch.device] = None, run_dir: Optional[Path] = None
                 ) -> Optional[Any]:
    """The checks that need no process group, for a launch on ``device`` (default:
    ``trainer.device``) with the world size of the environment (``WORLD_SIZE``, 1 without a
    launcher): the whole config (:func:`vitp.config.validate_config`), a text model's captions
    and embeddings options (:func:`vitp.config.validate_text_run`), the data folders
    (:func:`vitp.data.build.check_data_paths`), where the final weights go (in ``run_dir`` and
    ``trainer.export_dir``: not onto the run's base, :func:`vitp.checkpoint.outputs.check_final_writes`)
    and, unless ``parallel.auto`` (whose layout the planner chooses later), the layout. Returns the
    :class:`vitp.config.Layout` (``None`` with ``parallel.auto``).

    Raises ``ValueError`` naming the key and the valid values; when the layout does not fit this
    world size and ``run_dir``'s latest checkpoint was written at another one, the message names
    that layout and the options.
    """
    from .autolayout import world_change

    device = device or dist.resolve_device(cfg.trainer.device)
    try:
        layout = validate_config(cfg, None if cfg.parallel.auto else dist.world_size(), device.type)
    except ValueError as e:
        moved = world_change(run_dir, dist.world_size()) if run_dir is not None else None
        if not moved:
            raise
        raise ValueError(f"{e}. Resuming: {moved}; relaunch with the checkpoint's number of ranks, or continue "
                         f"on {dist.world_size()} at another layout: add parallel.tp=1 parallel.cp=1 parallel.pp=1 (or "
                         f"degrees whose product divides {dist.world_size()}) to the command, also after --resume "
                         f"RUN (the whole training state is resharded to any layout)") from None
    validate_text_run(cfg)
    from vitp.checkpoint.outputs import check_final_writes

    check_final_writes(cfg, run_dir)  # the final weights must not land on trainer.init_from
    from vitp.models.lora import check_lora_config

    check_lora_config(cfg)  # trainer.lora against the model (its depth known from the Wan folder by now)
    from vitp.data.build import check_data_paths

    check_data_paths(cfg.data)  # a missing folder is named before the planner's memory check (preflight)
    return layout


def _warn_without_effect(cfg: DictConfig) -> None:
    if cfg.parallel.sequence_parallel and cfg.parallel.tp == 1:
        log.warning("parallel.sequence_parallel=true has no effect with parallel.tp=1")
    if cfg.parallel.partial_sync < 1 and cfg.parallel.tp == 1:
        log.warning("parallel.partial_sync < 1 has no effect with parallel.tp=1 (nothing to synchronize)")
    from vitp.models.wan_run import unused_wan_keys

    if unused_wan_keys(cfg):
        log.warning(f"{', '.join(unused_wan_keys(cfg))} set: these objective keys are Wan's (model.family=wan) and have "
                    "no effect on vitp's generator")
    if cfg.data.captions is not None and not cfg.model.text_dim:
        log.warning(f"data.captions={cfg.data.captions} has no effect with model.text_dim=0: the model trains on "
                    "class labels (set model.text_dim to the encoder's channels to train on captions)")


def log_defaults(cfg: DictConfig) -> None:
    """The start-up notes of choices made for the user: the Wan 2.2 A14B expert trained when
    ``model.expert`` is not set (:func:`vitp.models.wan_run.expert_note`)."""
    from vitp.models.wan_run import expert_note

    note = expert_note(cfg)
    if note:
        log.info(note)


def _due(every: int, step: int) -> bool:
    return bool(every) and step % every == 0


def node_first(fn: Any) -> Any:
    """``fn()`` on every rank, on each node's first rank (``LOCAL_RANK`` 0) before the others: what
    it writes to node-local caches (a video folder's probe index, a pack's caption ids) the
    others then read instead of doing the work again. A failure on a first rank is raised on
    every rank (the others' message names it). One process: ``fn()``."""
    if dist.world_size() == 1:
        return fn()
    first, out, error = int(os.environ.get("LOCAL_RANK", "0")) == 0, None, None
    if first:
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, with the other ranks told
            error = e
    told = [m for m in dist.gather_objects(None if error is None else f"rank {dist.rank()}: {type(error).__name__}: "
                                                                      f"{error}") if m]
    if error is not None:
        raise error
    if told:
        raise RuntimeError(f"the data could not be built: {told[0]}")
    return fn() if not first else out


def tokens_text(cfg: DictConfig) -> str:
    """Tokens per sample of the shapes a run trains, as the start line says it: ``"1024"``, or
    with ``data.buckets`` the smallest and largest bucket's, ``"15 to 16"`` (not ``data.resolution``'s)."""
    from vitp.config import run_shapes

    tokens = sorted({math.prod(grid) for _, grid in run_shapes(cfg)})
    return " to ".join(str(n) for n in tokens[::max(1, len(tokens) - 1)])


class Trainer:
    """Build everything a run needs (the constructor), then :meth:`fit`.

    The constructor checks before it writes, in this order: the config, and unless
    ``parallel.auto`` the layout against the world size of the environment (``WORLD_SIZE``), before
    any process group exists (:func:`check_config`); a text model's caption embeddings (opened and
    checked against the model and ``data.text_encoder``, :func:`vitp.data.text.open_text_embeddings`);
    then the process group (after which the config's relative paths are made absolute,
    :func:`vitp.config.absolute_paths`, so the recorded run resumes, evaluates and samples from any
    folder; with ``parallel.auto`` the planner chooses the layout, :mod:`.autolayout`, keeping the keys named in ``overrides``,
    and the layout is checked); the planner's memory and step time of that layout (:mod:`.preflight`:
    refused when it does not fit, a warning when a step is slow); the data; the run directory's lock (rank 0 owns the folder while
    the run lasts, :mod:`.rundir`: a second launch into it is refused); the resume checkpoint or
    the folder's earlier config (:class:`.checkpointer.Checkpointer`); the model with its init
    files; the engine (restoring the checkpoint). Only then does rank 0 write: the log files held
    back until now (:func:`.rundir.hold_log_files`), the clean-up of an interrupted attempt
    (:meth:`.checkpointer.Checkpointer.prepare_run_dir`), ``run_dir/.hydra/config.yaml`` (and
    ``overrides.yaml`` from ``overrides``), ``metrics.jsonl`` and TensorBoard events. So a refused
    launch writes nothing into the run directory, bar the lock file ``.vitp.lock`` when the refusal
    comes after the lock was taken, and leaves a folder another run owns as it was.

    ``resumed``: ``cfg`` is the run's recorded config with overrides set on purpose (``vitp-train
    --resume``, :func:`vitp.cli.train.resume_config`); otherwise a launch into a folder whose run
    has checkpoints must bring that run's config (:func:`.rundir.check_relaunch`).

    Raises ``ValueError`` / ``FileNotFoundError`` on an invalid layout, config or input file,
    before any training step; :class:`.rundir.RunDirBusy` when another run owns the folder.
    """

    def __init__(self, cfg: DictConfig, run_dir: str | os.PathLike, overrides: Optional[list] = None,
                 resumed: bool = False):
        quiet_third_party()  # DeepSpeed's compiler probe lines, torch's deprecation of a collective DeepSpeed calls
        self.cfg, self.run_dir, self.resumed = cfg, Path(run_dir), resumed
        self._t_log, self._n_log, self._samples_log = time.perf_counter(), 0, 0  # train_step works outside fit too
        self.lock, self.saved_step = None, None  # saved_step: the last step this launch checkpointed
        hold_log_files(self.run_dir)  # a refused launch must not write into a folder's train.log
        checked = False
        try:
            self._check_and_build(overrides)
            checked = True
            self.finished = self._finished_before()  # collective
            if self.finished:  # a no-op resume: train.log, the config, events and the lock stay as they were
                release_log_files(write=False)
                self.logger, self.losses, self.grad_norms = None, [], []
            else:
                release_log_files(write=True)  # every check has passed: the run dir is ours to write
                self._write_run_dir(overrides)
        except BaseException:
            if not checked:
                release_log_files(write=False)
            if self.lock is not None:
                self.lock.release(refused=not checked)
            raise

    def _check_and_build(self, overrides: Optional[list]) -> None:
        """Every check and everything that can fail on bad input, writing nothing (class doc)."""
        cfg = self.cfg
        self.device = dist.resolve_device(cfg.trainer.device)
        self.layout = check_config(cfg, self.device, self.run_dir)  # None with parallel.auto
        if not cfg.parallel.auto:
            _warn_without_effect(cfg)
        self.text_store = None  # a missing, damaged or mismatched store is refused before any process group
        if cfg.model.text_dim:
            from vitp.data.text import open_text_embeddings, text_embeddings_pending

            if not text_embeddings_pending(cfg):  # else vitp-train encodes the captions first (_build_data)
                self.text_store = open_text_embeddings(cfg)
                log.info(f"caption embeddings: {cfg.data.text_embeddings} (encoder "
                         f"{self.text_store.index['encoder']['name']})")
        dist.init_distributed(self.device, dist.timeout_of(cfg))
        check_same_config(cfg)  # every node's launcher was given the same overrides
        absolute_paths(cfg)  # as recorded: the run resumes, evaluates and samples from any folder
        self.auto = None  # parallel=auto: the planner's choice, written into cfg (.autolayout)
        text_len = self.text_store.max_length if self.text_store is not None else 0  # the planner counts captions
        if cfg.parallel.auto:
            self.auto = apply_auto_layout(cfg, self.run_dir, self.device, overrides, text_len=text_len)
            _warn_without_effect(cfg)
            self.layout = validate_config(cfg, dist.world_size(), self.device.type)
        preflight(with_text_len(cfg, text_len), self.device)  # the planner's memory and step time (.preflight)
        self.main = dist.is_main()  # rank 0 writes everything
        self._build_data()
        log_phase_times(self._heldout_items())  # rank 0: the planner's phase times over the real held-out set
        self.lock = lock_run_dir(self.run_dir)  # before reading the folder: one owner at a time
        self.storage = detect_storage_groups(self.run_dir)  # node-local run dirs (leaves nothing behind)
        if self.main and not self.storage.shared:
            log.info("node-local run dirs: %d checkpoint folders (ranks %s)", len(self.storage.groups),
                     " | ".join(",".join(map(str, g)) for g in self.storage.groups))
        self.checkpointer = Checkpointer(cfg, self.run_dir, self.layout, self.storage, self.resumed)
        self.start_step = self.checkpointer.start_step
        # resumed at trainer.exit_at_step: a relaunch (the same command, a requeued or restarted job)
        # of a run that stopped there; it stops again at once (fit), as the first launch did
        tr = cfg.trainer
        self.stopped_before = tr.exit_at_step == self.start_step < tr.max_steps
        self._build_model()
        self._build_engine()
        self._log_start()
        self.telemetry = Telemetry(self._with_text_len(cfg), self.layout, self.device)

    def _write_run_dir(self, overrides: Optional[list]) -> None:
        """Rank 0 (with node-local run dirs, each folder's first rank: :mod:`vitp.checkpoint.storage`)
        cleans up an interrupted attempt and records the config; every rank opens the run logger
        (metrics.jsonl and TensorBoard on rank 0) and the data iterator."""
        cfg = self.cfg
        if self.storage.is_leader:  # rank 0; with node-local run dirs also each other node's first rank
            self.checkpointer.prepare_run_dir()
            write_run_config(self.run_dir, cfg, overrides)  # vitp-train --resume RUN_DIR works on every node
            self._record_split()
        self.logger = RunLogger(self.run_dir, self.main, cfg.trainer.tensorboard_dir, self.start_step,
                                log_every=cfg.trainer.log_every, max_steps=cfg.trainer.max_steps)
        self.data_iter = self.telemetry.timed(self._data_iterator())
        self.losses: list = []
        self.grad_norms: list = []
        meta = self.checkpointer.meta or {}  # the unlogged steps before the checkpoint (_log_window)
        self._carried = {k: list(meta.get("log_window", {}).get(k, [])) for k in ("losses", "grad_norms")}
        self.bar = None

    def _record_split(self) -> None:
        """Write the held-out split of a folder split by ``data.holdout_fraction`` into the run
        folder once, at every frame count its clips are cut at (``data.num_frames``, each bucket's):
        the first launch; one whose record predates a frame count adds it now. A resume keeps it
        (:mod:`vitp.data.heldout_record`)."""
        from vitp.data.heldout_record import RECORD_NAME, record_split

        d = self.cfg.data
        if d.name in ("image_folder", "video_folder") and d.heldout_root is None:
            record_split(self.run_dir / RECORD_NAME, {t: (s.base, s.split_items) for t, s in self._split.items()},
                         d.num_frames)

    # ------------------------------------------------------------------------------- build
    def _build_data(self) -> None:
        from vitp.data import build_datasets
        from vitp.data.loader import BatchSchedule
        from vitp.data.build import ensure_text_embeddings
        from vitp.data.text import conditioned, conditioning
        from vitp.latents.config import check_trainable

        cfg = self.cfg
        check_trainable(cfg.data)  # latents come from a latent pack
        fvd = cfg.eval.fvd.num and cfg.model.num_frames > 1  # FVD of a video run
        if cfg.eval.fid.every and not (cfg.eval.fid.num or fvd):
            raise ValueError(f"eval.fid.every={cfg.eval.fid.every} needs samples: set eval.fid.num (e.g. 5000 during "
                             "training, 50000 at the end with vitp-eval) and eval.fid.weights=FILE (a video run: "
                             "or eval.fvd.num and eval.fvd.weights)")
        if cfg.eval.enabled or cfg.eval.fid.every:  # the feature networks, CLIP folder, caches: now, not after
            from vitp.eval.metrics import check_quality_inputs

            check_quality_inputs(cfg, bool(fvd))  # an image run's eval.fvd.num is skipped, not refused
            if is_wan(cfg):  # a Wan run's samples decode through the pipeline's vae/
                from vitp.eval.wan_eval import check_wan_quality

                check_wan_quality(cfg)
        # node_first: one rank per node probes video folders and writes the per-node caches, the others map them
        from vitp.data.heldout_record import RECORD_NAME, read_record

        # a resumed run keeps the split it started with, whatever changed in its folder (vitp.data.heldout_record);
        # read at data.num_frames: a bucket's build has its own frame count in its config
        build_datasets = functools.partial(build_datasets,
                                           split=read_record(self.run_dir / RECORD_NAME, cfg.data.num_frames))
        self.train_ds, self.heldout_ds = node_first(lambda: build_datasets(cfg.data, cfg.seed))
        self._split = {cfg.data.num_frames: self.heldout_ds}  # per frame count, before captions wrap: _record_split
        self._on_main_first(lambda: ensure_text_embeddings(cfg))  # the demo's one-command caption encoding
        self.conditioning = conditioning(cfg, self.text_store)  # class labels, or caption embeddings (vitp.data.text)
        self.train_ds, self.heldout_ds = node_first(lambda: conditioned(self.conditioning, self.train_ds,
                                                                        self.heldout_ds))
        if cfg.eval.enabled or cfg.eval.fid.every:  # FID / FVD against an empty held-out set: now, not at the end
            from vitp.eval.metrics import check_real_split, evaluation_notes

            check_real_split(cfg, len(self.heldout_ds))
            for note in evaluation_notes(cfg, len(self.heldout_ds)) if self.main else []:
                log.info(note)
        self.schedule = BatchSchedule(len(self.train_ds), cfg.trainer.global_batch_size,
                                      cfg.trainer.micro_batch_size, self.layout.dp, cfg.seed,
                                      getattr(self.train_ds, "groups", None), cfg.data.shuffle_window)
        self.buckets = None
        if cfg.data.buckets:  # one shape per step (vitp.data.buckets)
            from vitp.data.buckets import BucketSchedule, bucket_datasets, buckets_of

            self.buckets = buckets_of(cfg.data)
            raw = node_first(lambda: bucket_datasets(cfg.data, cfg.seed, build_datasets))
            for b, (_, ho) in zip(self.buckets, raw):  # another frame count cuts other clip windows
                self._split.setdefault(b.frames, ho)
            self.bucket_data = node_first(lambda: [tuple(conditioned(self.conditioning, tr, ho)) for tr, ho in raw])
            self.schedule = BucketSchedule([len(tr) for tr, _ in self.bucket_data], self.buckets,
                                           self.schedule.accumulation, self.layout.dp, cfg.seed,
                                           [getattr(tr, "groups", None) for tr, _ in self.bucket_data],
                                           cfg.data.shuffle_window)
            self._bucket = None
        from vitp.data.base import check_readable

        for data in [self.train_ds] if self.buckets is None else [tr for tr, _ in self.bucket_data]:
            check_readable(data)  # a pack of damaged samples only: refused here, before the run writes anything

    def _heldout_items(self) -> int:
        """Items the held-out loss scores: with ``data.buckets`` every bucket's held-out items (each
        at its bucket's shape and frame count, :func:`vitp.eval.metrics.bucket_heldout_loss`), else
        the held-out set's."""
        if self.buckets is None:
            return len(self.heldout_ds)
        return sum(len(ho) for _, ho in self.bucket_data)

    def _with_text_len(self, cfg: DictConfig) -> DictConfig:
        """``cfg`` with ``model.text_len`` from the caption store when unset (0), so the model FLOPs
        of the telemetry count the cross-attention over the caption tokens (a copy; the run config
        stays as given)."""
        return with_text_len(cfg, self.conditioning.store.max_length if self.conditioning.text else 0)

    def _on_main_first(self, fn) -> None:
        """Run ``fn`` on rank 0 while the others wait; a failure there is raised on every rank."""
        error = None
        if self.main:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
                error = e
        if dist.world_size() > 1:
            failed = dist.broadcast_object(None if error is None else f"rank 0: {type(error).__name__}: {error}")
            if failed and error is None:
                raise RuntimeError(failed)
        if error is not None:
            raise error

    def _build_model(self) -> None:
        from vitp.checkpoint.initialize import initialize_weights
        from vitp.objectives import FlowMatchingLoss
        from vitp.parallel import model_parallel_seed
        from vitp.pipeline import build_parallel_pipeline

        cfg = self.cfg
        self.wan = is_wan(cfg)
        if self.wan:  # a diffusers Wan folder, each rank reading its slices (vitp.train.wan)
            from .wan import build_wan_model

            self.module, self.state, self.loss_fn, self.folder_read = build_wan_model(
                cfg, self.layout, load=self.checkpointer.resume_tag is None)  # folder_read: {"bytes", "share"}
            model_parallel_seed(cfg.seed, self.state)
            self._compile_blocks()
            return
        self.loss_fn = FlowMatchingLoss(cfg.objective.t_eps)
        # TP-partial gradients are summed once per step (engine.install_step_hook), not per micro-batch
        self.module, self.state = build_parallel_pipeline(
            cfg, self.layout, self.loss_fn, defer_grad_sync=True,
            activation_checkpoint_interval=cfg.parallel.activation_checkpoint_interval)
        lora = cfg.trainer.lora.enabled
        if self.checkpointer.resume_tag is None or lora:  # a LoRA checkpoint holds no base weight
            initialize_weights(self.module, cfg, self.state)
        if lora:  # the generator's adapters (vitp.models.lora), as Wan's: after the plan, base frozen
            from vitp.models.lora import apply_lora, initial_factors, spec_of

            from .wan import module_key

            init = initial_factors(cfg) if self.checkpointer.resume_tag is None and cfg.trainer.lora.init_from else None
            apply_lora(self.module, spec_of(cfg), self.state, key_of=lambda n: module_key(n, cfg.model.depth),
                       seed=cfg.seed, init=init)
        model_parallel_seed(cfg.seed, self.state)
        self._compile_blocks()

    def _compile_blocks(self) -> None:
        """``trainer.compile=blocks``: each block compiled in place (:mod:`vitp.models.compiled`), with
        inductor's cache under the run dir (written from the first step on, when the run dir is ours)."""
        from vitp.models.compiled import CompileLog, compile_blocks, compile_cache_dir

        mode = str(self.cfg.trainer.compile)
        n = compile_blocks(self.module, mode, compile_cache_dir(self.run_dir))
        self.compile_log = CompileLog(n > 0)
        if n and self.main:
            log.info("trainer.compile=%s: %d blocks compiled on first use (one graph per distinct shape)", mode, n)

    def _build_engine(self) -> None:
        deepspeed = ds.import_deepspeed()

        from .engine import build_optimizer, deepspeed_config, install_step_hook

        o = self.cfg.optim
        optimizer = build_optimizer(self.module, self.cfg, self.layout, self.state, ds.pipeline_grid(self.module))
        ds_log = logging.getLogger("DeepSpeed")
        ds_log.setLevel(logging.ERROR)  # "lr before the scheduler started" warnings during set-up
        self.engine, _, _, _ = deepspeed.initialize(model=self.module, optimizer=optimizer,
                                                    config=deepspeed_config(self.cfg, self.layout))
        ds_log.setLevel(logging.WARNING)
        install_step_hook(self.engine, self.layout)
        self.timeline = None  # trainer.profile_steps: per-stage instruction timeline (.timeline)
        if self.cfg.trainer.profile_steps:
            from .timeline import Timeline

            st = self.state
            self.timeline = Timeline(self.cfg.trainer.profile_steps, {"stage": st.pp_rank, "tp": st.tp_rank,
                                     "dp": st.dp_rank, "cp": st.cp_rank}, self.device, self.run_dir)
            self.timeline.install(self.engine)  # after the step hook: ReduceGrads' time includes it
        # DeepSpeed's warmup schedulers hold lr = 0 until their first step(); advance once so that
        # the first optimizer step trains at lr / warmup_steps.
        self.engine.lr_scheduler.step()
        from vitp.checkpoint.train_state import fragments
        from vitp.eval.inference import Share, StageDenoiser

        self.ema = EMA(self.engine.module, o.ema_decay, fragments(self.engine))  # sharded like ZeRO's partitions
        m = self.cfg.model  # sampling and evaluation in this layout (ema_denoiser); share: their dp split
        self.denoiser = StageDenoiser(self.engine.module, self.cfg.trainer.micro_batch_size, m.patch_size,
                                      m.tubelet_size)
        self.share = Share.of(self.engine.module, self.state)
        self.checkpointer.load(self.engine, self.ema, self.state)

    def _log_start(self) -> None:
        if not self.main:
            return
        lay = self.layout
        base = getattr(self.train_ds, "base", None)
        skipped = base.skip_summary() if hasattr(base, "skip_summary") else ""  # "2 unreadable file(s), 1 too short ..."
        cp = f" cp={lay.cp}" if lay.cp > 1 else ""
        split = f"{len(self.train_ds)} train / {len(self.heldout_ds)} held-out"
        if self.buckets is not None:  # what trains and what the held-out loss scores: every bucket's items
            at = "data.resolution" + (" x data.num_frames" if self.cfg.data.num_frames > 1 else "")
            split = (f"{sum(len(tr) for tr, _ in self.bucket_data)} train / {self._heldout_items()} held-out in "
                     f"{len(self.buckets)} buckets ({split} at {at}: the real items of FID / FVD)")
        log.info("run dir %s | layout tp=%d%s pp=%d dp=%d | %s on %s | %s tokens per sample | %s%s", self.run_dir,
                 lay.tp, cp, lay.pp, lay.dp, lay.precision, self.device, tokens_text(self.cfg), split,
                 f" | skipped {skipped}" if skipped else "")
        if self.checkpointer.resume_tag is not None:
            log.info("resumed from %s (step %d of %d)", self.checkpointer.resume_tag, self.start_step,
                     self.cfg.trainer.max_steps)
        log_defaults(self.cfg)

    def _data_iterator(self):
        """Pipeline pairs of the remaining steps for this dp rank; the first batch is checked to be
        the same on every rank of the replica."""
        from vitp.data.base import attach_skip_counter
        from vitp.data.loader import LoaderBatches, train_loader

        from .engine import check_batch_consistency
        from .nonfinite import StepBatches

        cfg, tr = self.cfg, self.cfg.trainer
        self.batches = self.step_batches = None
        if self.start_step >= tr.max_steps or self.stopped_before:
            return None
        data = self.train_ds if self.buckets is None else [tr for tr, _ in self.bucket_data]
        self.telemetry.skipped = attach_skip_counter(data)  # data/skipped_samples, also from the workers
        collate = None
        if self.wan:  # Wan's pairs: x_t, 1000 s, captions zero-padded to 512 tokens (vitp.data.loader.WanCollate)
            from vitp.data.loader import WanCollate

            collate = WanCollate(self.loss_fn, self.conditioning, cfg.objective.label_drop, cfg.model.text_len)
        self.batches = LoaderBatches(train_loader(
            data, self.schedule, cfg.objective, self.conditioning, start_step=self.start_step,
            stop_step=tr.max_steps, dp_rank=self.state.dp_rank, num_workers=cfg.data.num_workers, collate=collate))
        try:
            first = next(self.batches)
            check_batch_consistency(first, self.state)
        except BaseException:
            self.batches.close()
            raise
        self.step_batches = StepBatches(itertools.chain([first], self.batches))  # what a step read (.nonfinite)
        return self.step_batches

    # ----------------------------------------------------------------- weights, samples, eval
    @contextlib.contextmanager
    def ema_denoiser(self):
        """This rank's stage with the EMA weights swapped in, as a denoiser for sampling and
        evaluation in the training layout (:class:`vitp.eval.inference.StageDenoiser`, micro-batches
        of ``trainer.micro_batch_size``); the live weights and the training step's token grid come
        back when the block ends. Collective: every rank enters."""
        from vitp.eval.inference import ema_weights

        with self.telemetry.paused(), self.denoiser.grid_kept(), ema_weights(self.engine.module, self.ema):
            yield self.denoiser

    def sample_grid(self, step: int) -> None:
        """Fixed-seed sample grid (and GIFs for video) of the EMA weights, to files and TensorBoard:
        ``samples/step_N.png`` at ``data.resolution``, or with ``data.buckets`` one grid per bucket,
        ``samples/step_N/grid_<HxW[xT]>.png`` (TensorBoard ``samples/<HxW[xT]>``)."""
        from vitp.eval import write_bucket_grids, write_sample_grid

        path = self.run_dir / "samples" / f"step_{step:07d}.png"
        prompts = self._grid_prompts()
        with self.ema_denoiser() as gen:
            if self.wan:  # WanPipeline's loop with the folder's scheduler, decoded by its VAE (vitp.eval.wan_eval)
                from vitp.eval.wan_eval import write_wan_grid

                outs = {"": write_wan_grid(gen, self.cfg, path, prompts, self.share)}
            elif self.buckets is None:
                outs = {"": write_sample_grid(gen, self.cfg, path, prompts, self.share)}
            else:
                outs = {f"/{k}": v for k, v in write_bucket_grids(gen, self.cfg, self.buckets, path.with_suffix(""),
                                                                  prompts, self.share).items()}
        self.compile_log.after(f"sampling at step {step}")
        if not self.main:
            return
        if prompts is not None:
            self.logger.text("samples/prompts", "\n".join(f"{i}. {p}" for i, p in enumerate(prompts.prompts[1:], 1)),
                             step)
        for suffix, out in outs.items():
            if out is None:  # Wan from a transformer folder without its pipeline's scheduler/: no grid
                continue
            self.logger.image("samples" + suffix, out["grid"], step)
            if out["strips"] is not None:
                self.logger.images(f"samples{suffix}/frames", out["strips"], step)

    def _grid_prompts(self):
        """A text model's sample-grid prompts (:func:`vitp.data.text.grid_prompts`), kept once made;
        ``None`` for a class-conditional model."""
        from vitp.data.text import PromptConditioning, grid_prompts

        if not self.conditioning.text:
            return None
        if getattr(self, "_prompts", None) is None:
            self._prompts = PromptConditioning(grid_prompts(self.cfg, [self.heldout_ds, self.train_ds]),
                                               self.conditioning.store, self.cfg.data.text_encoder)
        return self._prompts

    def heldout_eval(self, step: int, final: bool) -> Dict[str, Any]:
        """Held-out loss (per bucket with ``data.buckets``: ``heldout_loss/<HxW[xT]>``, and overall;
        at the end the full evaluation) of the EMA weights; rank 0's results."""
        if self.wan:  # Wan's flow-matching loss; video statistics at the end (vitp.eval.wan_eval)
            from vitp.eval.wan_eval import wan_evaluate as evaluate
        else:
            from vitp.eval import evaluate
        per_bucket = None if self.buckets is None else {b.name: ho for b, (_, ho) in zip(self.buckets, self.bucket_data)}
        with self.ema_denoiser() as gen, self.sample_source(step):
            res = evaluate(gen, self.cfg, self.train_ds, self.heldout_ds, self.run_dir, full=final, step=step,
                           logger=self.logger, buckets=per_bucket, conditioning=self.conditioning, share=self.share)
        if not self.main:
            return {}
        if not final and "heldout_loss" in res:  # a log record: train.log keeps it too
            log.info("step %d: held-out loss %.4f", step, res["heldout_loss"])
        with open(self.run_dir / "eval.jsonl", "a") as f:
            f.write(json.dumps({k: v for k, v in res.items() if isinstance(v, (int, float))}) + "\n")
        return res

    def sample_source(self, step: int):
        """:func:`vitp.eval.fid.sample_source` of the EMA weights after ``step``: the step and the run
        config (less the keys of a relaunch), so the FID / FVD samples of another training (resumed
        with other settings, trained longer) are drawn again, not reused; stale ones are replaced."""
        import hashlib

        from vitp.eval.fid import sample_source

        conf = OmegaConf.to_container(self.cfg, resolve=True)
        for key in ("resume", "exit_at_step"):
            conf.get("trainer", {}).pop(key, None)
        digest = hashlib.sha256(json.dumps(conf, sort_keys=True, default=str).encode()).hexdigest()
        return sample_source(f"training step {step}, run config {digest}", replace_stale=True)

    def quality_eval(self, step: int) -> Dict[str, Any]:
        """FID (with CLIP score: :func:`vitp.eval.metrics.quality_metrics`) and, for a video run with
        ``eval.fvd.num``, FVD (:func:`vitp.eval.fvd.fvd_metrics`) of the EMA weights after ``step``
        (``eval.fid.every``): the samples go to ``RUN/fid/step_NNNNNNN.npz`` / ``.fvd.npz``
        (resumable: a relaunch that reaches the step again reuses their finished blocks) and are
        removed once scored, the end's ``eval.npz`` being the one kept; the numbers go to TensorBoard
        (``eval/fid``, ``eval/clip_score``, ``eval/fvd``), ``eval.jsonl`` and the progress bar. Rank
        0's results. Collective."""
        from vitp.eval.metrics import fid_and_fvd, report

        cfg, npz = self.cfg, self.run_dir / "fid" / f"step_{step:07d}.npz"
        clips, res = npz.with_suffix(".fvd.npz"), {}
        with self.ema_denoiser() as gen, self.sample_source(step):
            if self.wan:  # WanPipeline's samples, decoded by the pipeline's VAE (vitp.eval.wan_eval)
                from vitp.eval.wan_eval import wan_quality_metrics

                res.update(wan_quality_metrics(gen, cfg, self.train_ds, self.heldout_ds, self.run_dir, npz, clips,
                                               self.conditioning, self.share))
            else:  # FID (and CLIP score), a video run's FVD: clips drawn once when FID's are their first frames
                res.update(fid_and_fvd(gen, cfg, self.train_ds, self.heldout_ds, self.run_dir, npz, clips,
                                       self.conditioning, self.share))
        res = report({"step": step, **res}, self.share, self.logger, step, False, self.run_dir, None)
        dist.barrier()  # every rank has read the samples (a tp / pp rank reads them too) before they go
        if not self.main:
            return {}
        for path in (npz, clips, npz.with_name(npz.name + ".json"), clips.with_name(clips.name + ".json")):
            path.unlink(missing_ok=True)
        res.pop("fid_npz", None)
        res.pop("fvd_npz", None)
        log.info("step %d: %s", step, ", ".join(f"{k} {v:.4g}" for k, v in res.items() if isinstance(v, float)))
        with open(self.run_dir / "eval.jsonl", "a") as f:
            f.write(json.dumps({k: v for k, v in res.items() if isinstance(v, (int, float))}) + "\n")
        return res

    def save_checkpoint(self, step: int, final: bool = False) -> None:
        """Checkpoint after ``step`` (collective): written in the background unless ``final``
        (published when this returns)."""
        save = self.checkpointer.save_final if final else self.checkpointer.save
        save(step, self.engine, self.ema, self.state, extra={"log_window": self._log_window()})
        self.saved_step = step

    def _log_window(self) -> Dict[str, list]:
        """The losses and grad norms of the steps since the last logged one (checkpoint meta
        ``log_window``): a resumed run's first logged mean covers the same steps as an
        uninterrupted run's."""
        n = self._n_log
        return {k: self._carried[k] + getattr(self, k)[len(getattr(self, k)) - n:] for k in ("losses", "grad_norms")}

    def export_final(self, step: int) -> None:
        """The run's ``model_ema.safetensors`` / ``model.safetensors`` (Hugging Face-style shards
        above ``trainer.export_shard_size_mb``) from the final checkpoint, each shard written by
        one rank reading only its tensors (collective; :func:`vitp.checkpoint.export.export_checkpoint`)."""
        from vitp.checkpoint.export import export_checkpoint

        if self.cfg.trainer.lora.enabled:  # the adapters alone (the base is the folder's): rank 0, small
            from .lora import LORA_DIR, write_lora

            self.checkpointer.wait()
            if self.main:
                out = write_lora(self.checkpointer.path(step), self.run_dir / LORA_DIR)
                log.info("LoRA adapters (EMA weights) of the base %s: %s", self.cfg.trainer.init_from, out)
            dist.barrier()
            return
        if self.wan:  # a diffusers folder of the EMA weights, each stage's file by its first rank
            from .wan import write_diffusers

            out = write_diffusers(self.run_dir, self.cfg, self.engine.module, self.ema, self.state)
            if self.main:
                log.info("diffusers folder of the EMA weights: %s", out)
            return
        tag, cfg = self.checkpointer.path(step), self.cfg
        limit = int(cfg.trainer.export_shard_size_mb * 2**20)
        shared = self.checkpointer.storage.shared
        if shared or self.main:  # node-local folders: rank 0's alone holds every piece of the final checkpoint
            rank, world = (dist.rank(), dist.world_size()) if shared else (0, 1)
            for kind, name in (("ema", "model_ema.safetensors"), ("model", "model.safetensors")):
                export_checkpoint(tag, self.run_dir / name, cfg, kind=kind, step=step, rank=rank, world=world,
                                  max_shard_bytes=limit)
        dist.barrier()

    # ------------------------------------------------------------------------------- loop
    def train_step(self, step: int) -> float:
        """One optimizer step (all micro-batches of the global batch through the 1F1B pipeline),
        the EMA update, and the metrics of ``step`` when they are due. Returns the loss.

        Raises ``FloatingPointError`` if the loss is NaN or infinite, saying where the non-finite
        value first appeared and what to change (:func:`.nonfinite.nonfinite_loss_error`), or if
        the global grad norm is (:func:`.nonfinite.nonfinite_grad_error`).
        """
        lr = self.engine.get_lr()[0]  # the lr this step uses
        batch = self.cfg.trainer.global_batch_size
        if self.buckets is not None:
            self._enter_bucket(self.schedule.bucket(step - 1))
            batch = self.buckets[self._bucket].batch_size
        self.step_batches.new_step()
        if self.timeline is not None:
            self.timeline.begin(step)
        loss = self.engine.train_batch(data_iter=self.data_iter).item()
        self.compile_log.after(f"training step {step}")  # the compile time of a new shape, logged once
        profile = self.timeline.end(step) if self.timeline is not None else {}  # collective on recorded steps
        self.telemetry.count_step(self._bucket if self.buckets is not None else None)  # this step's shape
        self._samples_log += batch
        self.ema.update(self.engine.module)
        norm = self.engine.get_global_grad_norm()
        self.losses.append(loss)
        self.grad_norms.append(float(norm) if norm is not None else float("nan"))
        self._n_log += 1
        if not math.isfinite(loss):
            raise self._nonfinite_loss(step, loss)
        if norm is not None and not math.isfinite(self.grad_norms[-1]):
            from .nonfinite import nonfinite_grad_error

            raise nonfinite_grad_error(self.grad_norms[-1], loss, step, grad_clip=self.cfg.optim.grad_clip,
                                       precision=self.layout.precision, resumed=self._resumed_note())
        if self.bar is not None:  # every step's own loss (not only logged steps'); drawn at the bar's update
            self.bar.set_postfix(loss=f"{loss:.4f}", gnorm=f"{self.grad_norms[-1]:.3f}", refresh=False)
        if self.logger.should_log(step):
            self._log_metrics(step, lr, profile)
        elif profile:  # a recorded step between logged ones: its own metrics.jsonl line
            self.logger.scalars(step, profile)
        return loss

    def _nonfinite_loss(self, step: int, loss: float) -> FloatingPointError:
        """The error for a non-finite ``loss`` at ``step`` (collective: every rank sees the loss)."""
        from .nonfinite import nonfinite_loss_error

        first = len(self.losses) == 1
        return nonfinite_loss_error(loss, step, batches=self.step_batches.read, first_step=first,
                                    prev_grad_norm=math.nan if first else self.grad_norms[-2],
                                    grad_clip=self.cfg.optim.grad_clip, precision=self.layout.precision,
                                    resumed=self._resumed_note())

    def _resumed_note(self) -> str:
        """The checkpoint this attempt resumed from, as a suspect, until it writes one of its own
        (:func:`.nonfinite.resumed_checkpoint_note`)."""
        from .nonfinite import resumed_checkpoint_note
        from .rundir import resume_command

        ck = self.checkpointer
        return resumed_checkpoint_note(ck.resume_tag, ck.saved, resume_command(self.run_dir))

    def _enter_bucket(self, b: int) -> None:
        """Give every layer of this rank the token grid of bucket ``b`` and, when the shape changes,
        make DeepSpeed's pipeline engine exchange activation shapes again
        (``PipelineEngine.reset_activation_shape``, documented for sequence lengths that change
        between batches; cheaper than ``dynamic_shape``, which re-sends shapes every micro-batch)."""
        from vitp.models import set_grid, token_grid

        if b == self._bucket:
            return
        m, bk = self.cfg.model, self.buckets[b]
        set_grid(self.engine.module, token_grid(list(bk.size), bk.frames, m.patch_size, m.tubelet_size))
        self.engine.reset_activation_shape()
        self._bucket = b

    def _log_metrics(self, step: int, lr: float, profile: Optional[Dict[str, float]] = None) -> None:
        n, elapsed = self._n_log, time.perf_counter() - self._t_log
        window = self._log_window()  # with the steps before a resume, summed in step order as one launch does
        values = {"loss": sum(window["losses"]) / len(window["losses"]),
                  "grad_norm": sum(window["grad_norms"]) / len(window["grad_norms"]), "lr": lr,
                  "samples_per_s": self._samples_log / elapsed}
        if self.buckets is not None:  # the shape of the logged step (samples_per_s counts each step's own batch)
            values["bucket"] = self._bucket
        values.update(binned_loss(*self.loss_fn.pop_records()))
        values.update(self.telemetry.metrics(n, elapsed))
        values.update(profile or {})  # the step's timeline fractions (trainer.profile_steps)
        self.logger.scalars(step, values)
        self._t_log, self._n_log, self._samples_log = time.perf_counter(), 0, 0
        self._carried = {"losses": [], "grad_norms": []}

    def _after_step(self, step: int) -> None:
        """The checkpoint, previews and held-out loss that are due after ``step`` (not the last one):
        the checkpoint first, so that a grid or evaluation that fails (a damaged VAE, out of memory
        in a decode) loses no step (its RNG-free draws do not depend on the order)."""
        tr = self.cfg.trainer
        if self.checkpointer.due(step):
            self.save_checkpoint(step)
        if _due(tr.sample_every, step):
            self.sample_grid(step)
        if _due(tr.eval_every, step):
            self.heldout_eval(step, final=False)
        ev = self.cfg.eval
        if (ev.fid.num or (ev.fvd.num and self.cfg.model.num_frames > 1)) and _due(ev.fid.every, step):
            self.quality_eval(step)

    def _missed_at_resume(self) -> None:
        """The sample grid and held-out loss due after the checkpoint's step that the launch which
        wrote it did not finish (a signal during them, or ``trainer.exit_at_step``, which stops before
        them), run before the first resumed step: eval.jsonl, TensorBoard and samples/ then hold every
        due step, as in an uninterrupted run. Rank 0's files decide (collective)."""
        step, tr = self.start_step, self.cfg.trainer
        todo = (False, False)
        if self.main:
            grid = self.run_dir / "samples" / f"step_{step:07d}{'.png' if self.buckets is None else ''}"
            todo = (_due(tr.sample_every, step) and not grid.exists(),
                    _due(tr.eval_every, step) and len(self.heldout_ds) > 0 and not self._evaluated(step))
        todo = dist.broadcast_object(todo)
        if todo[0]:
            self.sample_grid(step)
        if todo[1]:
            self.heldout_eval(step, final=False)

    def _evaluated(self, step: int) -> bool:
        """Whether eval.jsonl holds the held-out loss of ``step``."""
        path = self.run_dir / "eval.jsonl"
        for line in path.read_text().splitlines() if path.is_file() else []:
            try:
                row = json.loads(line)
            except ValueError:  # a line cut short by a kill: not a finished evaluation
                continue
            if row.get("step") == step and "heldout_loss" in row:
                return True
        return False

    def fit(self) -> Dict[str, Any]:
        """Train from the start (or resumed) step to ``trainer.max_steps``; stop early, with a
        checkpoint, on SIGTERM/SIGINT, ``trainer.exit_at_step`` or ``trainer.exit_after_minutes``
        (resumed at ``trainer.exit_at_step``: stop at once, training nothing).

        Returns ``{"losses", "grad_norms"}`` per step (every rank), ``eval`` (rank 0's final
        results), ``run_dir``, ``stopped_at`` (the step of an early stop, else ``None``) and
        ``signal`` (the name of the signal that stopped the run on any rank, else ``None``:
        :func:`.stop.exit_status` turns it into ``vitp-train``'s exit status), ``checkpoint`` (this
        rank's checkpoint bytes) and ``folder_read`` (a Wan run: ``{"bytes", "share"}`` this rank read
        of the ``trainer.init_from`` folder and the bytes of the tensors it filled; ``{}`` otherwise).
        Gives the run directory up when it returns or raises.
        """
        try:
            if self.stopped_before:
                return self._stop_again()
            if self.finished:
                return self._already_finished()
            stopper = StopSignal(self.device)
            try:
                stopped_at = self._train_loop(stopper)
                # the handlers stay installed through the save: a launcher's forwarded copy of the
                # signal, or one arriving after the last step, must not kill the checkpoint being written
                out = self._stop(stopped_at, stopper.flag) if stopped_at is not None else self._finish(stopper)
                return {**out, "signal": stopper.agreed}
            finally:
                stopper.restore()
        finally:
            self.checkpointer.writer.close()
            self.lock.release(restore=self.finished)

    def _train_loop(self, stopper: StopSignal) -> Optional[int]:
        """The optimizer steps; returns the step of an early stop (every rank the same), else ``None``."""
        from vitp.progress import progress_bar

        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        tr = self.cfg.trainer
        self.bar = progress_bar(tr.max_steps, "train", initial=self.start_step, disable=not (self.main and tr.progress))
        # on a terminal the console's log records are printed above tqdm's bar, not through it
        with logging_redirect_tqdm() if isinstance(self.bar, tqdm) else contextlib.nullcontext():
            return self._steps(stopper)

    def _steps(self, stopper: StopSignal) -> Optional[int]:
        """:meth:`_train_loop`'s body, with its progress bar ``self.bar`` made."""
        tr = self.cfg.trainer
        if tr.eval_every and self.start_step == 0:  # the untrained model's held-out loss, for reference
            if self._stopped_during(stopper, 0, lambda: self.heldout_eval(0, final=False)):
                return 0
        if 0 < self.start_step < tr.max_steps and self._stopped_during(stopper, self.start_step, self._missed_at_resume):
            return self.start_step
        self._t_log, self._n_log, self._samples_log = time.perf_counter(), 0, 0
        t_start = time.perf_counter()
        self.telemetry.start()
        try:
            for step in range(self.start_step + 1, tr.max_steps + 1):  # step = optimizer steps completed
                self.train_step(step)
                self.bar.update(1)
                if step == self.start_step + 1:
                    log_stages(self.engine.module, self.state, self.device, self.run_dir)
                last = step == tr.max_steps
                if stopper.requested(local=self._exit_due(step, t_start)) and not last:
                    return step
                if not last and self._stopped_during(stopper, step, lambda: self._after_step(step)):
                    return step
        finally:
            self.telemetry.stop()
            self.bar.close()
            if self.batches is not None:
                self.batches.close()  # the DataLoader workers: no batch is needed after the loop
        return None

    def _stopped_during(self, stopper: StopSignal, step: int, evaluation: Callable[[], Any],
                        doing: Optional[str] = None) -> bool:
        """Run ``evaluation`` (held-out loss, sample grids) after ``step`` so that a signal ends it
        within one forward (:func:`vitp.eval.progress.stoppable`, every rank at the same forward);
        True when one did. ``doing``: what the signal's log line says happens next."""
        from vitp.eval.progress import EvaluationStopped, stoppable

        before = stopper.doing
        stopper.doing = doing or ("stopping the evaluation after this forward, then saving a checkpoint"
                                  if step > self.start_step else "stopping the evaluation after this forward (no step "
                                  "has run in this launch: nothing to save)")
        try:
            with stoppable(stopper.requested):
                evaluation()
            return False
        except EvaluationStopped:
            return True
        finally:
            stopper.doing = before

    def _exit_due(self, step: int, t_start: float) -> bool:
        """``trainer.exit_at_step`` reached or ``trainer.exit_after_minutes`` passed (this rank's view)."""
        tr = self.cfg.trainer
        timed_out = tr.exit_after_minutes is not None and time.perf_counter() - t_start > 60 * tr.exit_after_minutes
        return step == tr.exit_at_step or timed_out

    def _result(self, evaluation: Dict[str, Any], stopped_at: Optional[int]) -> Dict[str, Any]:
        ck = self.checkpointer
        return {"losses": self.losses, "grad_norms": self.grad_norms, "eval": evaluation,
                "run_dir": str(self.run_dir), "stopped_at": stopped_at,
                "checkpoint": {"bytes_read": ck.bytes_read, "saves": list(ck.writer.stats),
                               "share_bytes": self.share_bytes()},
                "folder_read": dict(getattr(self, "folder_read", {}))}  # Wan: bytes read of trainer.init_from

    def share_bytes(self) -> int:
        """Bytes of this rank's share of the training state (weights, EMA and optimizer fragments)."""
        from vitp.checkpoint.train_state import state_bytes

        return sum(state_bytes(self.engine, self.ema).values())

    def _stop(self, step: int, signal_name: Optional[str]) -> Dict[str, Any]:
        tr = self.cfg.trainer
        if step == self.start_step:  # a signal during the evaluation before the first step: nothing new to save
            self.logger.close()
            if self.main:
                log.warning("stopped by %s before step %d: nothing trained in this launch, no checkpoint written. "
                            "To start again: %s", signal_name or "a signal on another rank", step + 1,
                            resume_command(self.run_dir))
            return self._result({}, step)
        if self.saved_step != step:  # a stop during the grid after a due checkpoint: saved
            self.save_checkpoint(step)
        self.checkpointer.wait()  # a stop (SIGTERM too) waits for its checkpoint to be published
        self.logger.close()
        if self.main:
            why = signal_name or ("trainer.exit_at_step" if step == tr.exit_at_step else "trainer.exit_after_minutes"
                                  if tr.exit_after_minutes is not None else "a signal on another rank")
            log.warning("stopped by %s after step %d; checkpoint %s saved. To continue: %s", why, step,
                        self.checkpointer.path(step), resume_command(self.run_dir))
        return self._result({}, step)

    def _stop_again(self) -> Dict[str, Any]:
        """End a launch that resumed at ``trainer.exit_at_step`` without training (exit 0): the
        run already stopped there, and a restarted job must not fail for that."""
        self.logger.close()
        if self.main:
            log.warning("trainer.exit_at_step=%d: this run already stopped after step %d (%s); nothing to train. "
                        "To continue: %s, or drop trainer.exit_at_step (or set it above %d)", self.start_step,
                        self.start_step, self.checkpointer.resume_tag, resume_command(self.run_dir), self.start_step)
        return self._result({}, self.start_step)

    def _finished_before(self) -> bool:
        """Resumed at ``trainer.max_steps`` of a run whose final weights were exported (rank 0's view,
        on every rank): it already finished, and a relaunch must not rewrite its results."""
        if self.cfg.trainer.lora.enabled:
            from .lora import LORA_DIR, STATE

            written = (self.run_dir / LORA_DIR / STATE).is_file()
        elif self.wan:
            from .wan import final_weights_written

            written = final_weights_written(self.run_dir, self.cfg)
        else:
            written = any((self.run_dir / n).is_file() for n in ("model_ema.safetensors",
                                                                 "model_ema.safetensors.index.json"))
        done = self.start_step >= self.cfg.trainer.max_steps and written
        return bool(dist.broadcast_object(done))

    def _already_finished(self) -> Dict[str, Any]:
        """End a launch that resumed a finished run (exit 0): nothing is trained, exported, sampled
        or evaluated again: no file of the run is written (the constructor skipped the run dir's
        config, ``train.log`` and TensorBoard events; the lock file gets its owner's record back)."""
        if self.main:
            from .rundir import unapplied

            tr, given = self.cfg.trainer, unapplied(self.run_dir, self.cfg)
            ignored = f"; {' '.join(given)} not applied (nothing is left to train)" if given else ""
            skipped = self.cfg.eval.enabled and not (self.run_dir / "eval.json").exists()  # stopped before it
            evaluate = (f"its final evaluation was skipped (the run was stopped before it): run it with vitp-eval "
                        f"{self.run_dir}" if skipped else f"to evaluate other settings: vitp-eval {self.run_dir} "
                        "key=value")
            log.warning("already finished: this run trained its trainer.max_steps=%d steps; its weights and results "
                        "in %s are kept, nothing was rewritten%s. To train longer: %s trainer.max_steps=N (N > %d)%s; "
                        "%s", tr.max_steps, self.run_dir, ignored, resume_command(self.run_dir), tr.max_steps,
                        f" {' '.join(given)}" if given else "", evaluate)
        return self._result({}, None)

    def _finish(self, stopper: Optional[StopSignal] = None) -> Dict[str, Any]:
        """Final checkpoint, weights, samples, evaluation and the copy to ``trainer.export_dir``;
        the samples and evaluation are skipped when ``stopper`` got a signal after the last step
        (``vitp-eval <run dir>`` runs the evaluation later)."""
        cfg, tr = self.cfg, self.cfg.trainer
        self.save_checkpoint(tr.max_steps, final=True)
        self.export_final(tr.max_steps)
        if stopper is not None:
            stopper.final_saved = True
        result: Dict[str, Any] = {}
        skipped = stopper is not None and stopper.requested()  # collective: every rank skips alike
        if not skipped:  # minutes, after the training bar's 100 %: each phase says what runs and shows a bar (rank 0)
            skipped = self._final_evaluation(stopper, result)
        grid = any((self.run_dir / "samples").glob(f"step_{tr.max_steps:07d}*"))  # the final grid, also when stopped after it
        if skipped and self.main:
            log.warning("%s after the last step: final checkpoint and weights saved, %s skipped (run vitp-eval %s)",
                        stopper.flag or "a signal on another rank",
                        "final sample grid saved, evaluation" if grid else "samples and evaluation", self.run_dir)
        self.logger.close()
        if self.main:  # what this launch wrote, not what a full finish would have
            ema = "model_ema.safetensors"
            if not (self.run_dir / ema).is_file():  # sharded: its index names the shards
                ema = f"{ema}.index.json"
            if self.wan or tr.lora.enabled:
                ema = "lora/" if tr.lora.enabled else "diffusers/"  # the EMA weights (adapters)
            held = [ema, *(["samples/"] if grid else []), "metrics.jsonl",  # a lone Wan transformer draws none
                    *(["eval.json"] if cfg.eval.enabled and not skipped else []),
                    *([] if tr.tensorboard_dir else ["tb/"])]
            log.info("done: %s holds %s", self.run_dir, ", ".join(held))
            if tr.export_dir:
                self._copy_to_export_dir(Path(tr.export_dir))
            if tr.output_data_dir:
                self._copy_outputs(Path(tr.output_data_dir))
        if dist.world_size() > 1:
            torch.distributed.barrier()
        return self._result(result, None)

    def _final_evaluation(self, stopper: Optional[StopSignal], result: Dict[str, Any]) -> bool:
        """The final sample grid and evaluation (into ``result``); True when a signal stopped them
        (within one forward: :meth:`_stopped_during`)."""
        from vitp.eval.progress import reporting

        cfg, tr = self.cfg, self.cfg.trainer

        def run() -> None:
            with reporting(bars=self.main and tr.progress, prefix="final sample grid"):
                self.sample_grid(tr.max_steps)
            with reporting(bars=self.main and tr.progress):
                result.update(self.heldout_eval(tr.max_steps, final=True) if cfg.eval.enabled else {})

        if stopper is None:
            run()
            return False
        return self._stopped_during(stopper, tr.max_steps, run, "stopping the final samples and evaluation after "
                                    "this forward (the final checkpoint and weights are saved)")

    def _copy_to_export_dir(self, export: Path) -> None:
        export.mkdir(parents=True, exist_ok=True)
        if self.wan:
            from .wan import copy_diffusers

            copy_diffusers(self.run_dir, export)
        if (self.run_dir / "lora").is_dir():  # a LoRA run's adapters (vitp.train.lora), Wan or the generator
            shutil.copytree(self.run_dir / "lora", export / "lora", dirs_exist_ok=True)
        for pattern in ("model_ema*.safetensors", "model_ema.safetensors.index.json", "model_ema.json",
                        "model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json", "model.json",
                        "eval.json"):
            for f in self.run_dir.glob(pattern):
                shutil.copy2(f, export / f.name)


    def _copy_outputs(self, out: Path) -> None:
        """The run's logs, ``eval.json`` and final samples (grid, and GIFs of video runs) to ``out``."""
        out.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "eval.jsonl", "eval.json"):
            if (self.run_dir / name).is_file():
                shutil.copy2(self.run_dir / name, out / name)
        final = self.run_dir / "samples" / f"step_{self.cfg.trainer.max_steps:07d}"
        if final.with_suffix(".png").is_file():
            (out / "samples").mkdir(exist_ok=True)
            shutil.copy2(final.with_suffix(".png"), out / "samples" / f"{final.name}.png")
        if final.is_dir():
            shutil.copytree(final, out / "samples" / final.name, dirs_exist_ok=True)


def train(cfg: DictConfig, run_dir: str | os.PathLike, overrides: Optional[list] = None,
          resumed: bool = False) -> Dict[str, Any]:
    """``Trainer(cfg, run_dir, overrides, resumed).fit()``: train with the composed config ``cfg``
    (``resumed``: the run's recorded one with overrides, ``vitp-train --resume``), writing
    everything under ``run_dir``; see :class:`Trainer` and :meth:`Trainer.fit`."""
    return Trainer(cfg, run_dir, overrides, resumed).fit()
