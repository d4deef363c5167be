"""``vitp-eval RUN_DIR [--weights FILE] [key=value ...]``: re-evaluate a trained run (e.g. other
sampler settings) into ``eval_<overrides>.json`` next to the training's ``eval.json``, which is
kept (:func:`eval_output`); see :mod:`vitp.eval.metrics`.

The overrides are Hydra's ``key=value`` grammar, set on the run's saved config and checked by the
schema as ``vitp-train`` checks them (:mod:`vitp.cli.overrides`): ``vitp-eval RUN sampler.steps=50
sampler.cfg_interval=[0.1,1]``.

Under a launcher (``torchrun --nproc_per_node N -m vitp.cli.eval RUN_DIR``, or the ``deepspeed``
launcher) ``N`` replicas of the whole generator evaluate when one fits a device, else (or with
``parallel.tp/cp/pp`` given) the generator runs in that layout, each rank holding its shard
(:func:`vitp.eval.launch.choose_layout`); the held-out items and samples are split over the
data-parallel replicas and rank 0 alone writes the results and prints. ``--weights FILE`` is also
written ``cli.weights=FILE`` (:func:`vitp.cli.overrides.flag_overrides`)."""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from vitp.checkpoint import ARCH_KEYS, check_model_matches, generator_from_state, read_export, resolve_weights
from vitp.checkpoint.export import file_model, file_partial_sync
from vitp.cli import run_cli
from vitp.cli.overrides import apply_overrides, flag_overrides, typed_config
from vitp.config import validate_config
from vitp.data import build_datasets
from vitp.eval import evaluate
from vitp.parallel.distributed import is_main, resolve_device
from vitp.utils import load_run_yaml


FLAGS = {"weights": str, "force": bool}  # the flags that have an override form, cli.<flag>=value (flag_overrides)


def last_step(run_dir: Path) -> Optional[int]:
    """The last logged training step of a run (from metrics.jsonl), if any."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return json.loads(lines[-1])["step"] if lines else None


def weights_path(run_dir: Path, weights: str) -> Path:
    """``run_dir/weights``; for an interrupted run without ``model_ema.safetensors``, its latest
    checkpoint's EMA. Raises ``FileNotFoundError`` when there is neither."""
    path = run_dir / weights
    if not path.is_file() and weights == "model_ema.safetensors":
        path = resolve_weights(run_dir, "ema")[0]
    return path


def given_weights(run_dir: Path, weights: str) -> str:
    """``--weights``: a file inside ``run_dir`` (as given), else a path from the current folder that
    exists (absolute: a new user's ``--weights other_run/export/x.safetensors`` was looked for inside
    ``run_dir``). A checkpoint folder (``checkpoints/step_N``, or ``checkpoints`` for its latest)
    stands for its EMA weights, ``<tag>/model_ema.safetensors``."""
    from vitp.checkpoint import LATEST, META, resolve_weights

    inside = Path(run_dir) / weights
    path = inside if inside.exists() else Path(weights)
    if path.is_dir() and ((path / META).is_file() or (path / LATEST).is_file()):
        got = resolve_weights(path, "ema")[0]
        return str(got.relative_to(run_dir)) if path == inside else str(got.resolve())
    if not inside.exists() and Path(weights).exists():
        return str(Path(weights).resolve())
    return weights


def checkpoint_advice(source: Path, run: Path) -> str:
    """The refusal of ``vitp-eval CHECKPOINT`` (``source`` a checkpoint of ``run``): the command that
    evaluates it (a Wan run's: its diffusers export first)."""
    saved = load_run_yaml(run / ".hydra" / "config.yaml")
    what = "the checkpoints folder" if Path(source).name == "checkpoints" else "a checkpoint"
    head = f"{source} is {what} of the run {run}: vitp-eval takes the run directory; "
    if str(OmegaConf.select(saved, "model.family", default="vit")) == "wan":
        merge = " --merge" if OmegaConf.select(saved, "trainer.lora.enabled") else ""
        return head + (f"write this checkpoint as a diffusers folder with vitp-export {source} --format "
                       f"diffusers{merge} -o OUT, then vitp-eval {run} --weights OUT")
    inside = Path(source).resolve().relative_to(run.resolve())
    return head + f"evaluate this checkpoint with vitp-eval {run} --weights {inside}"


def wan_checkpoint_weights(run: Path, given: str) -> Optional[str]:
    """The refusal of ``vitp-eval RUN --weights CHECKPOINT`` of a Wan run ``run`` (a checkpoints or
    tag folder holds no diffusers folder; it used to be read as ``<tag>/model_ema.safetensors``,
    which a Wan checkpoint lacks), naming the run's final transformer folder (a LoRA run's final
    adapters: no ``--weights``) when the run finished, and the export of that checkpoint; else None."""
    from vitp.checkpoint import LATEST, META
    from vitp.train.wan import DIFFUSERS_DIR

    inside = Path(run) / given
    path = inside if inside.exists() else Path(given)
    if not (path.is_dir() and ((path / META).is_file() or (path / LATEST).is_file())):
        return None
    lora = bool(OmegaConf.select(load_run_yaml(run / ".hydra" / "config.yaml"), "trainer.lora.enabled"))
    out = run / DIFFUSERS_DIR  # its trained transformer: a lone one, or the pipeline's not linked from the base
    final = next((f for f in (out / "transformer", out / "transformer_2", out)
                  if (f / "config.json").is_file() and not f.is_symlink()), None)
    if lora:
        final = f"vitp-eval {run} (no --weights: the base with its final adapters)" if (run / "lora").is_dir() else None
    else:
        final = f"vitp-eval {run} --weights {final} (its final EMA weights)" if final else None
    return (f"--weights {given} is a checkpoint of the Wan run {run}, and a Wan run's --weights is a diffusers "
            "transformer folder: " + (f"evaluate the finished run with {final}, or " if final else "")
            + f"write this checkpoint as one with vitp-export {path} --format diffusers{' --merge' if lora else ''} "
            f"-o OUT, then vitp-eval {run} --weights OUT")


def weights_step(run_dir: Path, weights: str) -> Optional[int]:
    """The training step of the weights evaluated (recorded in the file), else the run's last
    logged step (files written before the step was recorded)."""
    from safetensors import safe_open

    from vitp.checkpoint import META

    try:
        path = weights_path(run_dir, weights)
        if (path.parent / META).is_file():  # <tag>/model_ema.safetensors of a checkpoint: its record's step
            step = json.loads((path.parent / META).read_text()).get("step")
        else:
            with safe_open(str(path), framework="pt") as f:
                step = (f.metadata() or {}).get("step")
    except Exception:  # noqa: BLE001 - unreadable here: load_for_eval refuses it with the reason
        step = None
    step = int(step) if step is not None else -1  # -1: written without a step
    return step if step >= 0 else last_step(run_dir)


def eval_output(run_dir: Path, overrides: list, weights: str) -> Path:
    """Where ``vitp-eval`` writes its results: ``run_dir/eval.json`` when the run finished (its final
    weights are there) without one (its final evaluation was skipped), else
    ``run_dir/eval_<overrides>[_<weights>].json`` (``eval_again.json`` without any), so the
    training's ``eval.json`` is kept, an unfinished run's resumed end does not overwrite the result,
    and each setting has its own file. A path (an override's value, ``--weights``) shows as its last
    part, with a digest of the whole command (also when the name would pass 150 characters), so that
    two folders never share a file."""
    finished = any((run_dir / n).exists() for n in ("model_ema.safetensors", "model_ema.safetensors.index.json",
                                                     "diffusers", "lora"))
    if finished and not (run_dir / "eval.json").exists():
        return run_dir / "eval.json"
    parts, shown = list(overrides), []
    for part in overrides:  # a path by its last part: eval_eval.fid.real_stats=real.safetensors_<digest>.json
        key, eq, value = part.partition("=")
        shown.append(f"{key}={Path(value).name}" if eq and "/" in value else part)
    if weights != "model_ema.safetensors":
        from vitp.checkpoint import META

        parts.append(weights)
        path = Path(weights) if Path(weights).is_absolute() else run_dir / weights
        # a checkpoint's <tag>/model_ema.safetensors by its tag: "model_ema" read as the final EMA
        shown.append(path.parent.name if (path.parent / META).is_file() else path.name.removesuffix(".safetensors"))
    slug = re.sub(r"[^A-Za-z0-9._=+,-]", "_", "_".join(shown))
    if len(slug) > 150 or "/" in "".join(parts):  # with a digest of the whole: other settings never share a file
        slug = f"{slug[:140]}_{hashlib.sha256('_'.join(parts).encode()).hexdigest()[:8]}"
    return run_dir / f"eval_{slug or 'again'}.json"


def load_run_config(run_dir: Path, overrides: list) -> DictConfig:
    """The run's composed config (``.hydra/config.yaml``) on the typed schema, with the Hydra-style
    ``key=value`` ``overrides`` set (:func:`vitp.cli.overrides.apply_overrides`).

    Raises ``FileNotFoundError`` naming the missing file; ``ValueError`` (one line) for a key the
    schema lacks (in the file or an override), a bad value or a malformed override."""
    from vitp.utils import recorded_config

    path = recorded_config(run_dir)
    return apply_overrides(typed_config(load_run_yaml(path), path), overrides, "vitp-eval")


# The keys that choose which items a run held out (vitp.data.build.build_datasets): a split root
# (no data.heldout_root) is split by the seed and the fraction into items, a video folder's items
# being clip windows cut by these keys; a packed data set's split is its manifest's.
SPLIT_KEYS = ("seed", "data.holdout_fraction")
WINDOW_KEYS = ("data.num_frames", "data.frame_stride", "data.fps", "data.clip_step", "data.files",
               "data.class_per_file", "data.scene_cut_threshold", "data.class_per_shot")


def check_split_overrides(run_dir: Path, overrides: list) -> None:
    """Refuse overrides under which ``vitp-eval`` would split the run's data otherwise than the run
    did (e.g. ``data.num_frames=4`` cuts a video folder into other clip windows, a part of them
    trained on): its held-out loss, and FID / FVD against the held-out items, would then score
    training items. Overrides that keep the split (sampler and eval keys, ``data.resolution``, a
    moved ``data.root``, ``data.heldout_root=DIR``: other data) pass. Raises ``ValueError`` (one
    line) naming the key, the run's value and what to do instead."""
    if not overrides:
        return
    run_cfg, cfg = load_run_config(run_dir, []), load_run_config(run_dir, overrides)
    was, now = run_cfg.data.heldout_root, cfg.data.heldout_root
    if was is not None and now is None:
        raise ValueError(f"data.heldout_root=null: the run held out {was} and trained on all of data.root, so "
                         f"vitp-eval would score items the run trained on; drop the override, or give "
                         f"data.heldout_root=DIR to score other data")
    if now is not None or str(cfg.data.name) == "shards":  # a held-out folder, or the pack's own split
        return
    keys = SPLIT_KEYS + (WINDOW_KEYS if str(cfg.data.name) == "video_folder" else ())
    for key in keys:
        old, new = OmegaConf.select(run_cfg, key), OmegaConf.select(cfg, key)
        if old != new:
            raise ValueError(f"{key}={new}: the run held out its items at {key}={old}, and vitp-eval would split the "
                             f"data again, scoring items the run trained on as held-out; drop {key}= (score other "
                             f"data with data.heldout_root=DIR)")


def load_generator_for(path: Path, cfg: DictConfig):
    """The generator in ``path``, refused (``ValueError`` naming the keys) when it was written for
    another model than the run's."""
    state, meta = read_export(path)
    check_model_matches(file_model(meta), cfg.model, ARCH_KEYS, str(path),
                        "pass --weights of this run, or evaluate that file's own run directory")
    return generator_from_state(file_model(meta), state, resolve_device(cfg.trainer.device), file_partial_sync(meta),
                                meta)


def main(argv: Optional[list] = None) -> None:
    """Console entry point ``vitp-eval RUN_DIR [--weights FILE] [key=value ...]`` (also under
    torchrun or the ``deepspeed`` launcher, whose ``--local_rank=N`` is taken out); bad input exits
    with a one-line message (status 2)."""
    from vitp.parallel.distributed import strip_launcher_args

    argv = strip_launcher_args(["vitp-eval", *(sys.argv[1:] if argv is None else argv)])[1:]
    run_cli("vitp-eval", run, argv)


def load_for_eval(run_dir: Path, weights: str, overrides: list, sharded: bool = False
                  ) -> Tuple[DictConfig, Any, Any, Any, Optional[dict], Any]:
    """``(cfg, generator, train_ds, heldout_ds, heldout per bucket or None, conditioning)`` of a
    finished run (:func:`vitp.data.text.conditioning`: class labels or the caption embeddings):
    its config with ``overrides`` (validated), the weights file ``run_dir/weights`` (an
    interrupted run without ``model_ema.safetensors``: its latest checkpoint's EMA), and the
    run's data split (the one it recorded in ``heldout_split.json``, :mod:`vitp.data.heldout_record`,
    when its folder changed since). With ``sharded`` (under a launcher; collective) the generator is this
    rank's :class:`vitp.eval.launch.ShardedGenerator` in :func:`vitp.eval.launch.choose_layout`'s layout, else the whole
    :class:`vitp.models.Generator` (a layout key among ``overrides`` must then fit one process).
    Raises ``FileNotFoundError`` / ``ValueError`` on a missing or foreign file or an impossible layout."""
    from vitp.eval.launch import build_sharded, check_layout_overrides, choose_layout

    cfg = load_run_config(run_dir, overrides)
    validate_config(cfg)
    from vitp.latents.config import check_decoder

    check_decoder(cfg.data)  # samples of a latent run are decoded: its VAE is checked before minutes of work
    from vitp.eval.metrics import check_quality_inputs

    check_quality_inputs(cfg)  # FID / FVD / CLIP files and caches (FVD: a video run)
    if not os.access(run_dir, os.W_OK):  # found before minutes of evaluation, not after
        raise PermissionError(f"{run_dir} is not writable: vitp-eval writes its results (eval.json, or "
                              f"eval_<overrides>.json next to it) and the digits judge's cache there; evaluate a copy of the run")
    if sharded:
        from vitp.parallel.distributed import world_size

        cfg = choose_layout(cfg, overrides, world_size(), resolve_device(cfg.trainer.device), "vitp-eval")
        gen = build_sharded(cfg, weights_path(run_dir, weights), "vitp-eval")
    else:
        check_layout_overrides(cfg, overrides, "vitp-eval")
        gen = load_generator_for(weights_path(run_dir, weights), cfg)
    from vitp.data.text import conditioned, conditioning

    cond = conditioning(cfg)  # class labels, or the run's caption embeddings
    from vitp.data.heldout_record import RECORD_NAME, read_record

    # the split the run trained with, every frame count's (read at data.num_frames: a bucket's cfg has its own)
    split = functools.partial(build_datasets, split=read_record(run_dir / RECORD_NAME, cfg.data.num_frames))
    train_ds, heldout_ds = conditioned(cond, *split(cfg.data, cfg.seed))
    from vitp.eval.metrics import check_real_split, evaluation_notes

    check_real_split(cfg, len(heldout_ds), existing=True)  # before the generator samples; the split is the run's
    for note in evaluation_notes(cfg, len(heldout_ds), existing=True) if is_main() else []:
        logging.getLogger("vitp").info(note)
    per_bucket = None
    if cfg.data.buckets:  # held-out loss per shape bucket, items assigned as in training
        from vitp.data.buckets import bucket_datasets, buckets_of

        pairs = bucket_datasets(cfg.data, cfg.seed, split)
        per_bucket = {b.name: conditioned(cond, ho)[0] for b, (_, ho) in zip(buckets_of(cfg.data), pairs)}
    return cfg, gen, train_ds, heldout_ds, per_bucket, cond


def check_init_from(run_dir: Path, overrides: list, wan: bool, given: Optional[str]) -> None:
    """Refuse ``trainer.init_from=...`` where ``vitp-eval`` would not read it: it scores the run's
    own weights (``--weights`` for others); only a Wan LoRA run's base, moved elsewhere, is taken
    from it (the run's adapters go on top). Raises ``ValueError`` naming ``--weights``."""
    from vitp.cli.overrides import parse_overrides

    if not any(o.key_or_group == "trainer.init_from" for o in parse_overrides(overrides)):
        return
    if wan and given is None:
        saved = load_run_yaml(run_dir / ".hydra" / "config.yaml")
        if OmegaConf.select(saved, "trainer.lora.enabled"):
            return  # the LoRA run's base where it is now
    raise ValueError(f"trainer.init_from: vitp-eval does not read it here, it scores {run_dir}'s own weights "
                     "(the training's starting point does not change them); to score other weights give "
                     f"vitp-eval {run_dir} --weights PATH")


def run(argv: Optional[list] = None) -> dict:
    """Re-evaluate a run's weights with its config (plus ``overrides``) into :func:`eval_output`
    (``eval.json`` only when the run has none), and name the file written."""
    from vitp.eval.launch import finish, launched, quiet_unless_main
    from vitp.eval.progress import reporting

    p = argparse.ArgumentParser(prog="vitp-eval", description="Evaluate a finished vitp run into eval_<overrides>.json "
                                "(eval.json when the run has none).",
                                allow_abbrev=False)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--weights", default=None, help="weights file inside RUN_DIR, or any path (default "
                                                   "model_ema.safetensors; under a launcher also cli.weights=FILE)")
    p.add_argument("--force", action="store_true", help="replace an earlier vitp-eval's file of the same overrides "
                                                        "(under a launcher also cli.force=true)")
    p.add_argument("overrides", nargs="*", default=[], help="Hydra-style key=value overrides of the run's config, "
                                                            "e.g. sampler.cfg_scale=2.0 sampler.steps=50")
    a = p.parse_intermixed_args(argv)
    flags, a.overrides = flag_overrides(a.overrides, "vitp-eval", FLAGS)
    if a.weights is not None and "weights" in flags:
        raise ValueError("--weights and cli.weights= both given; give one of them")
    from vitp.checkpoint import run_of_checkpoint

    owner = run_of_checkpoint(a.run_dir)
    if owner is not None and not (a.run_dir / ".hydra").is_dir():
        raise ValueError(checkpoint_advice(a.run_dir, owner))
    given = flags.get("weights", a.weights)
    from vitp.eval.wan_sample import is_wan_source

    wan = is_wan_source(a.run_dir)  # its RUN/diffusers folder (vitp.eval.wan_eval)
    why = wan_checkpoint_weights(a.run_dir, given) if wan and given else None
    if why:
        raise ValueError(why)
    weights = given_weights(a.run_dir, given) if given else "model_ema.safetensors"
    sharded = launched()
    check_init_from(a.run_dir, a.overrides, wan, given)
    check_split_overrides(a.run_dir, a.overrides)  # before anything is loaded
    with quiet_unless_main():  # under a launcher: rank 0 alone logs, writes eval.json and prints
        if is_main():
            logging.basicConfig(level=logging.INFO, format="%(message)s")
        out = eval_output(a.run_dir, a.overrides, weights)  # the training's eval.json is kept
        if out.name != "eval.json" and out.exists() and not (a.force or flags.get("force")):
            raise ValueError(f"{out} exists (an earlier vitp-eval with these overrides); pass --force to replace it, "
                             f"or other overrides")
        if wan:
            from vitp.eval.wan_eval import run_wan_eval

            given = None if weights == "model_ema.safetensors" else weights
            with reporting(bars=is_main(), prefix="vitp-eval"):
                res = run_wan_eval(a.run_dir, given, a.overrides, sharded, out, last_step(a.run_dir))
        else:
            res = _evaluate_run(a, weights, sharded, out)
        if sharded:
            finish()
        if is_main():
            print(json.dumps(res, indent=2))
            kept = " (the training's eval.json is kept)" if out.name != "eval.json" else ""
            print(f"vitp-eval: wrote {out}{kept}", file=sys.stderr)
    return res


def _evaluate_run(a: Any, weights: str, sharded: bool, out: Path) -> dict:
    """The generator's evaluation of ``vitp-eval`` (:func:`load_for_eval`, :func:`vitp.eval.evaluate`)."""
    from vitp.eval.progress import reporting

    cfg, gen, train_ds, heldout_ds, per_bucket, cond = load_for_eval(a.run_dir, weights, a.overrides, sharded)
    step = weights_step(a.run_dir, weights)  # the weights', not the run's last logged step
    from vitp.eval.fid import sample_source, weights_identity

    source = weights_identity(weights_path(a.run_dir, weights))  # a finished .npz of other weights is drawn again
    with reporting(bars=is_main(), prefix="vitp-eval"), sample_source(source):  # each phase: a line, a bar
        res = evaluate(gen.denoiser if sharded else gen, cfg, train_ds, heldout_ds, a.run_dir, full=True,
                       step=step, buckets=per_bucket, conditioning=cond, share=gen.share if sharded else None,
                       out=out, weights=str(weights_path(a.run_dir, weights)))
    return res


if __name__ == "__main__":
    main()
