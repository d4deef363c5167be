"""The run's checkpoint component: finds and verifies what to resume from (reading the run
directory, writing nothing), restores it after the engine is built, and decides when to save (as
torchtitan's ``CheckpointManager``: the loop only says which step it finished)."""
from __future__ import annotations

import logging
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from omegaconf import DictConfig, OmegaConf

from vitp import checkpoint as ckpt
from vitp.checkpoint import reshard, train_state
from vitp.checkpoint.export import read_export
from vitp.checkpoint.rng import rng_state
from vitp.checkpoint.saver import CheckpointWriter
from vitp.checkpoint.sharded import METADATA
from vitp.checkpoint.storage import StorageGroups, choose_resume_tag
from vitp.config import Layout
from vitp.models import generator_key
from vitp.parallel import ParallelState, shard_like
from vitp.parallel import distributed as dist
from vitp.utils import RANK_LOCAL, load_run_yaml

from .ema import EMA
from .rundir import check_history, check_relaunch, drop_failed_attempt

log = logging.getLogger("vitp")


def _together(fn: Callable[[], Any]) -> Any:
    """``fn()`` on every rank (collective); when it raises ``ValueError`` / ``FileNotFoundError`` on
    any rank, every rank raises (its own error, else the first rank's), so no rank waits alone in
    the next collective (node-local folders differ between nodes)."""
    try:
        out, err = fn(), None
    except (ValueError, FileNotFoundError) as e:
        out, err = None, e
    errors = dist.gather_objects(None if err is None else (type(err).__name__, str(err)))
    if err is not None:
        raise err
    first = next((e for e in errors if e), None)
    if first:
        raise (FileNotFoundError if first[0] == "FileNotFoundError" else ValueError)(first[1])
    return out


FORMAT = "vitp.sharded/1"  # the checkpoint format (vitp_meta.json "format"); absent: full tensors on rank 0


def _load_legacy(engine: Any, ema: EMA, state: ParallelState, tag: Path, meta: Dict[str, Any], depth: int) -> None:
    """A checkpoint of the earlier format (``model.safetensors``, ``model_ema.safetensors`` and
    ``optimizer.safetensors`` of full tensors beside DeepSpeed's files): weights, moments,
    master weights, counters (:func:`vitp.checkpoint.reshard.load_resharded`, any layout) and
    this rank's EMA fragments, sliced out of this stage's full EMA tensors."""
    reshard.load_resharded(engine, tag, meta, state, depth)
    named = dict(engine.module.named_parameters())
    keys = {n: generator_key(n, depth) for n in named}
    full, _ = read_export(tag / "model_ema.safetensors", keys=list(keys.values()))  # this stage only
    with torch.no_grad():
        for n, p in named.items():
            start, k = ema.fragments[n]
            ema.params[n].copy_(shard_like(p, full[keys[n]], state).reshape(-1).narrow(0, start, k))


class Checkpointer:
    """Checkpoints of one run directory (``<run_dir>/checkpoints``).

    Construction resolves ``trainer.resume`` (``auto`` | ``never`` | a path; the path this run
    started from, relaunched, gives way to the run's own latest checkpoint), verifies the
    checkpoint's files, that it matches this run's layout, precision and model and is past
    neither ``trainer.max_steps`` nor ``trainer.exit_at_step`` (equal to the latter: a relaunch of
    a run that stopped there, which :meth:`vitp.train.Trainer.fit` ends at once), and that the folder
    holds no other config's run (:func:`.rundir.check_history` starting fresh,
    :func:`.rundir.check_relaunch` resuming, unless ``resumed``: ``vitp-train --resume``, whose
    overrides change the run on purpose); it reads the run directory and writes nothing (the
    trainer holds the folder's lock by then).
    :meth:`prepare_run_dir` is the first write, once every check of the launch has passed.
    Raises ``ValueError`` / ``FileNotFoundError`` naming the problem and the fix.
    """

    def __init__(self, cfg: DictConfig, run_dir: Path, layout: Layout, storage: Optional[StorageGroups] = None,
                 resumed: bool = False):
        tr = self.tr = cfg.trainer
        self.cfg, self.run_dir, self.layout, self.resumed = cfg, run_dir, layout, resumed
        self.storage = storage or StorageGroups.single(dist.world_size(), dist.rank())
        self.dir = run_dir / "checkpoints"
        self.every, self.keep = tr.checkpoint_every, tr.keep_checkpoints
        compress = tr.checkpoint_compress == "zstd" or (tr.checkpoint_compress == "auto" and tr.lora.enabled)
        self.writer = CheckpointWriter(self.dir, self.storage, self.keep, asynchronous=tr.checkpoint_async,
                                       compress=compress)
        self.bytes_read = 0  # by this rank's resume
        self.saved = False  # whether this attempt saved a checkpoint (a NaN before: the resumed one is a suspect)
        self.lora = None  # a LoRA run's record: adapters, pieces, base folder and hash (vitp.models.lora)
        if tr.lora.enabled:
            from vitp.models.lora import run_record

            self.lora = run_record(cfg)
        self.resume_tag = self._agree(self._launch_resume(str(tr.resume)))
        self.reshard = False  # resuming at another layout (vitp.checkpoint.reshard)
        self.meta: Optional[Dict[str, Any]] = _together(self._check)
        self.start_step = self.meta["step"] if self.meta else 0
        self.writer.abandon_after = self.start_step  # what an earlier attempt wrote past it moves aside
        if self.meta and self.meta.get("max_steps") not in (None, tr.max_steps):
            log.warning("trainer.max_steps=%d differs from the checkpoint's run (%d): the LR schedule after step %d "
                        "changes accordingly", tr.max_steps, self.meta["max_steps"], self.start_step)

    def _launch_resume(self, resume: str) -> str:
        """``trainer.resume`` for this launch (rank 0 decides for all). A checkpoint outside this run
        that the run directory's recorded config already names is where the run started: a relaunch
        with it (the same command, a requeued or restarted job) continues from the run's own latest
        checkpoint once there is one (``auto``), instead of going back and dropping what the run
        did since. A path the record does not name (a new pin), or one of the run's own checkpoints
        (the latest is broken), is used as given; the record keeps what the user asked for."""
        if resume in ("auto", "never"):
            return resume
        choice = resume
        if dist.is_main():
            saved = self.run_dir / ".hydra" / "config.yaml"
            recorded = OmegaConf.select(load_run_yaml(saved), "trainer.resume") if saved.is_file() else None
            path, own = Path(resume).resolve(), self.dir.resolve()
            if (recorded is not None and Path(str(recorded)).resolve() == path and path != own
                    and own not in path.parents and (self.dir / "latest").is_file()):
                choice = "auto"
                log.info("trainer.resume=%s is where this run started (%s); it has checkpoints of its own since, so "
                         "it continues from its latest (to start over from %s, choose a new hydra.run.dir)", resume,
                         saved, resume)
        return dist.broadcast_object(choice)

    def _resume_folder(self, resume: str) -> Tuple[Optional[Path], Optional[str]]:
        """``(checkpoints folder, tag)`` that ``trainer.resume`` names on this rank: ``auto`` this run's
        folder and its newest tag every rank has (``None``), a tag folder that tag."""
        if resume == "auto":
            return self.dir, None
        found = ckpt.find_checkpoint(resume, self.dir)
        if (found / ckpt.META).is_file() or found.name.endswith(".partial"):
            return found.parent, found.name
        return found.parent, None

    def _agree(self, resume: str) -> Optional[Path]:
        """The checkpoint tag folder this rank resumes from (collective): every rank lists the
        checkpoints complete for its own part in its own folder; all take the newest one every
        rank has (:func:`vitp.checkpoint.storage.choose_resume_tag`), and rank 0 says why when the
        folders disagreed. ``None``: start at step 0."""
        if resume == "never":
            return None

        def local():
            folder, tag = self._resume_folder(resume)
            tags = [tag] if tag else ckpt.published_tags(folder)
            return folder, {t: ckpt.tag_problem(folder / t, dist.rank(), self.layout) for t in tags}

        folder, view = _together(local)
        views = dist.gather_objects((view, f"{socket.gethostname()}:{folder}"))
        tag, notes = choose_resume_tag([v for v, _ in views], [w for _, w in views])
        if notes and dist.is_main():
            log.warning("resuming from %s, the newest checkpoint in every node's folder: %s", tag, "; ".join(notes))
        named = folder / ckpt.LATEST if folder is not None else None
        if resume == "auto" and tag is not None and named is not None and named.is_file() and dist.is_main():
            said = named.read_text().strip()
            if said != tag and not (folder / said / ckpt.META).is_file():  # edited, or its tag folder was removed
                log.warning("%s names %r, which is no complete checkpoint there: resuming from %s, the newest one "
                            "(the next checkpoint rewrites the file)", named, said, tag)
        return None if tag is None else folder / tag

    def _check(self) -> Optional[Dict[str, Any]]:
        """This rank's checks of the resume checkpoint (or of the folder's history when starting
        fresh); returns the checkpoint's metadata."""
        tr, run_dir = self.tr, self.run_dir
        if self.resume_tag is None:
            if (run_dir / "metrics.jsonl").exists() and tr.resume == "never":
                raise ValueError(f"{run_dir} already holds a run (metrics.jsonl) and trainer.resume=never; choose a "
                                 f"new hydra.run.dir, or use trainer.resume=auto to continue it")
            if self.storage.is_leader:  # the rank that wrote the folder's record, from its working directory
                check_history(run_dir, self.cfg, self.resumed)
            return None
        meta = ckpt.verify_checkpoint(self.resume_tag, dist.rank(), layout=self.layout)
        self.reshard = ckpt.check_resumable(meta, self.resume_tag, self.cfg, self.layout)
        from vitp.models.lora import check_same_base

        check_same_base(self.lora, meta.get("lora"), self.resume_tag)  # adapters fit only their own base
        if meta["step"] > tr.max_steps:  # its outputs would be labelled max_steps, with weights of start_step
            raise ValueError(f"checkpoint {self.resume_tag} is at step {meta['step']}, past trainer.max_steps="
                             f"{tr.max_steps}: set trainer.max_steps={meta['step']} or more to continue it, or "
                             + ckpt.restart_advice(self.resume_tag, self.cfg, bool(meta.get("lora"))))
        if tr.exit_at_step is not None and tr.exit_at_step < meta["step"]:  # the loop would never meet it
            raise ValueError(f"trainer.exit_at_step={tr.exit_at_step} is before step {meta['step']}, where this run "
                             f"resumes ({self.resume_tag}), so it would never stop there: drop trainer.exit_at_step "
                             f"(or set it to null) to train on to trainer.max_steps={tr.max_steps}, or set it above "
                             f"{meta['step']}")
        if not self.resumed and self.storage.is_leader:  # a relaunch must bring the run's config (as check_history)
            check_relaunch(run_dir, self.cfg, self.resume_tag)
        return meta

    def prepare_run_dir(self) -> None:
        """Each storage group's leader (rank 0 for a shared folder), after every check of the
        launch (config, layout, data, resume, init files) has passed: create the run dir, remove
        half-written checkpoints and (rank 0) drop the log lines and sample grids an interrupted
        attempt wrote after the step we start from, having moved aside the results of a later step
        (:func:`vitp.checkpoint.results.set_aside_results`)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob("*.partial") if self.dir.is_dir() else []:
            # rank-local: with node-local run dirs each node's first rank cleans its own folder
            log.warning("removing %s: a checkpoint whose save never finished", stale, extra=RANK_LOCAL)
            shutil.rmtree(stale)
        if dist.is_main():
            drop_failed_attempt(self.run_dir, self.start_step)

    def load(self, engine: Any, ema: EMA, state: ParallelState) -> None:
        """Restore weights, optimizer, LR schedule, RNG streams and this rank's EMA fragments, at
        this or another layout, reading only this rank's pieces (:mod:`vitp.checkpoint.train_state`);
        a checkpoint of the earlier format (full tensors on rank 0, DeepSpeed's files) through
        :func:`_load_legacy`."""
        s = state  # every rank's coordinates, recorded by each save (they do not change during a run)
        self.coords = dist.gather_objects((s.pp_rank, s.dp_rank, s.cp_rank, s.tp_rank))
        if self.resume_tag is None:
            return
        if dist.is_main() and self.reshard:
            log.info("resuming %s at another layout: %s; weights, AdamW moments and step, EMA, LR schedule and "
                     "data position resharded from its pieces", self.resume_tag,
                     reshard.describe_change(self.meta, self.layout))
        if (self.resume_tag / METADATA).is_file():
            self.writer._ensure_group()
            self.bytes_read = _together(lambda: self._load_pieces(engine, ema, state))
        else:
            _load_legacy(engine, ema, state, self.resume_tag, self.meta, self.cfg.model.depth)
        src = reshard.rng_source_rank(self.meta, state) if self.reshard else dist.rank()
        if src is not None:  # a node-local folder may lack another rank's: then the streams stay seeded
            ckpt.load_rng(self.resume_tag, src, required=self.reshard is False)
        ema.updates = self.meta["ema_updates"]

    def _load_pieces(self, engine: Any, ema: EMA, state: ParallelState) -> int:
        """:func:`vitp.checkpoint.train_state.load` of the resume checkpoint; a damaged file is
        refused naming it and the earlier complete checkpoints to resume from instead."""
        try:
            return train_state.load(engine, ema, state, self.cfg.model.depth, self.resume_tag, self.meta,
                                    self.writer.group)
        except (FileNotFoundError, ValueError) as e:
            raise type(e)(f"{e}{ckpt.training._fix_hint(self.resume_tag)}") from None

    def due(self, step: int) -> bool:
        """A periodic checkpoint after ``step`` (``trainer.checkpoint_every``)."""
        return bool(self.every) and step % self.every == 0

    def save(self, step: int, engine: Any, ema: EMA, state: ParallelState, final: bool = False,
             extra: Optional[Dict[str, Any]] = None) -> None:
        """Save ``step_<step>`` (collective): this rank's pieces are copied to host memory, then
        written and published in the background (``trainer.checkpoint_async``) while training
        goes on; :meth:`wait` blocks until it is published. ``extra``: small JSON entries of the
        trainer's own state for ``vitp_meta.json`` (e.g. ``log_window``), read back from :attr:`meta`."""
        t0 = time.perf_counter()
        self.saved = True
        tr = self.cfg.trainer
        record = {"format": FORMAT, "tp": self.layout.tp, "cp": self.layout.cp, "pp": self.layout.pp,
                  "dp": self.layout.dp, "precision": self.layout.precision,
                  "zero_stage": self.cfg.parallel.zero_stage, "partial_sync": float(self.cfg.parallel.partial_sync),
                  "partial_sync_scale": self.cfg.parallel.partial_sync_scale,
                  "engine_zero_stage": self.layout.engine_zero_stage(self.cfg.parallel.zero_stage),
                  "model": OmegaConf.to_container(self.cfg.model, resolve=True), "ema_updates": ema.updates,
                  "seed": self.cfg.seed, "global_batch_size": tr.global_batch_size, "max_steps": tr.max_steps,
                  "world_size": dist.world_size(), "rank_coords": self.coords,
                  "engine": reshard.engine_counters(engine), "adam_step": reshard.adam_step(engine),
                  "config": OmegaConf.to_container(self.cfg, resolve=True), "lora": self.lora, **(extra or {})}
        depth = self.cfg.model.depth
        self.writer.save(step, lambda: train_state.stage(engine, ema, state, depth), rng_state(), record, t0, final)

    def wait(self) -> None:
        """Block until the checkpoint in flight (if any) is published; raises its error."""
        self.writer.wait()

    def save_final(self, step: int, engine: Any, ema: EMA, state: ParallelState,
                   extra: Optional[Dict[str, Any]] = None) -> None:
        """The last checkpoint of a finished run, published when this returns (none if the run
        resumed from it: a finished run relaunched). A ``step_<step>`` an earlier attempt wrote
        after the checkpoint this run resumed from is replaced, and moved into ``abandoned/``."""
        self.writer.wait()
        have = step == self.start_step and ckpt.tag_name(step) in ckpt.published_tags(self.dir)
        if not all(dist.gather_objects(have)):  # in every folder
            self.save(step, engine, ema, state, final=True, extra=extra)

    def path(self, step: int) -> Path:
        """Folder of the checkpoint after ``step``."""
        return self.dir / ckpt.tag_name(step)
