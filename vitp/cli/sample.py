"""``vitp-sample``: class-conditional samples from a run directory or a weights file, one process, any device.

``vitp-sample SOURCE [--classes C ...] [--num N] [--out FILE|DIR] [--format gif|mp4] [--force] [key=value ...]``;
the overrides (Hydra's grammar, checked by the schema: :mod:`vitp.cli.overrides`) change the run's
sampler, size and device (:data:`SAMPLE_KEYS`). Images: one PNG grid (a row per class). Video: one
GIF (or MP4) per class and seed (``class<c>_seed<k>``; prompts: ``prompt<i>_seed<k>``, ``i`` the
line of ``prompts.txt``) plus a grid video. By default the output is named by what made it
(:func:`output_name`), so two different calls never write the same file; an existing output is
refused without ``--force`` (as ``vitp-export`` does) and every file is written atomically.

Under a launcher (``torchrun --nproc_per_node N -m vitp.cli.sample SOURCE cli.num=8``, or the
``deepspeed`` launcher) the samples are split over ``N`` replicas of the whole generator when one
fits a device, else (or with ``parallel.tp/cp/pp`` given) the generator runs in that layout, each
rank holding its shard (:mod:`vitp.eval.launch`); rank 0 alone writes and prints. Every flag has an override form,
``cli.<flag>=value`` (``cli.num=8``, ``cli.classes=[3,7]``, ``cli.out=grid.png``, ``cli.format=mp4``,
``cli.force=true``, ``cli.prompt=['a dog','a cat']``, ``cli.prompt_file=p.txt``), which a launcher's
own parser passes on untouched (torchrun refuses ``--num``: it could be its ``--numa-binding``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any, List, Optional, Tuple

import torch
from omegaconf import OmegaConf

from vitp.checkpoint import generator_from_state, read_export, resolve_weights
from vitp.checkpoint.export import file_partial_sync
from vitp.checkpoint.outputs import check_sample_out
from vitp.cli import run_cli
from vitp.cli.overrides import apply_overrides, flag_overrides, override_key, typed_config
from vitp.config import check_patch_grid, input_frames, input_size, parse_resolution, validate_config
from vitp.eval import class_grid_labels, generate
from vitp.latents.config import check_decoder
from vitp.eval.launch import (LAYOUT_KEYS, build_sharded, check_layout_overrides, choose_layout, finish, launched,
                              quiet_unless_main)
from vitp.media import to_grid
from vitp.parallel.distributed import is_main, resolve_device, world_size
from vitp.utils import atomic_write, atomic_write_text, check_output_in_run


# what vitp-sample may change: the sampler, the size it samples at, and where it runs
SAMPLE_KEYS = ("sampler.", "model.image_size", "model.num_frames", "data.resolution", "data.num_frames",
               "trainer.device", "data.text_encoder", "data.text_embeddings", "data.vae", *LAYOUT_KEYS)
# flags of earlier versions -> the override each stands for (still read, with a note)
OLD_FLAGS = {"seed": "sampler.seed", "method": "sampler.method", "steps": "sampler.steps",
             "cfg_scale": "sampler.cfg_scale", "cfg_interval": "sampler.cfg_interval", "device": "trainer.device",
             "fps": "sampler.fps", "resolution": "model.image_size", "frames": "model.num_frames"}
USAGE = ("vitp-sample SOURCE [--classes C ... | --prompt TEXT ... | --prompt-file F] [--num N] [--out FILE|DIR] "
         "[--format gif|mp4] [--force] [key=value ...]  (under a launcher: cli.num=N, cli.classes=[C,...], ...)")
# the flags that have an override form, cli.<flag>=value (vitp.cli.overrides.flag_overrides)
FLAGS = {"classes": [int], "prompt": [str], "prompt_file": str, "num": int, "out": str, "format": ("gif", "mp4"),
         "force": bool, "scheduler": ("unipc", "euler"), "flow_shift": float}
_VIDEO_FILE = re.compile(r"^((class|prompt)\d+(_[A-Za-z0-9.-]+)?_seed\d+|grid)\.(gif|mp4)$")  # what write_video_samples writes


def main(argv: Optional[List[str]] = None) -> None:
    """Console entry point (also under torchrun or the ``deepspeed`` launcher, whose
    ``--local_rank=N`` is taken out); bad input exits with a one-line message (status 2)."""
    from vitp.parallel.distributed import strip_launcher_args

    argv = strip_launcher_args(["vitp-sample", *(sys.argv[1:] if argv is None else argv)])[1:]
    run_cli("vitp-sample", run, argv)


def parse_args(argv: Optional[List[str]] = None) -> Tuple[argparse.Namespace, List[str]]:
    """``(flags, overrides)`` of a ``vitp-sample`` command line: the flags of paths and counts, and
    the ``key=value`` overrides, those of the deprecated flags (``--steps 3`` ->
    ``sampler.steps=3``, noted on stderr) first. Raises ``ValueError`` on a bad ``--num`` or class."""
    p = argparse.ArgumentParser(prog="vitp-sample", usage=USAGE, description=run.__doc__.splitlines()[0],
                                allow_abbrev=False)
    p.add_argument("source", type=Path, help="run directory (its model_ema.safetensors, else its latest checkpoint), "
                                             "a checkpoint folder, or a .safetensors file")
    p.add_argument("--classes", nargs="*", default=None, help="class labels (default: all classes)")
    p.add_argument("--prompt", action="append", default=None,
                   help="text-conditional models: a prompt, one grid row (repeat the flag for more rows)")
    p.add_argument("--prompt-file", type=Path, default=None,
                   help="text-conditional models: prompts, one per line (.txt) or a \"caption\" per JSON line (.jsonl)")
    p.add_argument("--num", type=int, default=None, help="samples per class (default: the run's "
                                                         "sampler.samples_per_class)")
    p.add_argument("--out", type=Path, default=None,
                   help="images: output PNG (default: SOURCE_DIR/samples/sample_<settings>.png); video: a folder for "
                        "one file per class (or prompt) and seed + grid (default: SOURCE_DIR/samples/sample_<settings>/), or a "
                        ".gif/.mp4 file for the grid alone")
    p.add_argument("--format", choices=["gif", "mp4"], default=None, help="video file format (default gif)")
    p.add_argument("--force", action="store_true", help="replace an existing output (a video folder: the files an "
                                                        "earlier vitp-sample wrote there)")
    p.add_argument("--scheduler", choices=["unipc", "euler"], default=None,
                   help="Wan: diffusers' UniPCMultistepScheduler or FlowMatchEulerDiscreteScheduler (default: the "
                        "pipeline's scheduler/)")
    p.add_argument("--flow-shift", type=float, default=None, help="Wan: the schedule's shift (default: the pipeline's)")
    p.add_argument("overrides", nargs="*", default=[],
                   help="Hydra-style key=value: sampler.* (steps, method, cfg_scale, cfg_interval, seed, fps), "
                        "model.image_size=HxW, model.num_frames=T, trainer.device=auto|cpu|cuda")
    for flag, key in OLD_FLAGS.items():
        p.add_argument("--" + flag.replace("_", "-"), nargs=2 if flag == "cfg_interval" else None, default=None,
                       help=f"deprecated: write {key}=...")
    a = p.parse_intermixed_args(argv)
    words = [str(c) for c in a.classes or []]  # --classes 3 7 sampler.steps=2: the override is no class
    a.classes = [int(c) if c.lstrip("-").isdigit() else _bad_class(c) for c in words if "=" not in c] or None
    flags, a.overrides = flag_overrides([c for c in words if "=" in c] + a.overrides, "vitp-sample", FLAGS)
    _set_flags(a, flags)
    overrides = []
    if a.flow_shift is not None and not a.flow_shift > 0:
        raise ValueError(f"--flow-shift {a.flow_shift}: use a positive shift (Wan's folders: 3.0 at 480p, 5.0 at 720p)")
    if a.num is not None and a.num < 1:
        raise ValueError(f"--num {a.num}: use a positive number of samples per class")
    for flag, key in OLD_FLAGS.items():
        val = getattr(a, flag)
        if val is not None:
            overrides.append(f"{key}=[{val[0]},{val[1]}]" if flag == "cfg_interval" else f"{key}={val}")
            print(f"vitp-sample: --{flag.replace('_', '-')} is deprecated; write {overrides[-1]}", file=sys.stderr)
    return a, overrides + a.overrides


def _set_flags(a: argparse.Namespace, flags: dict) -> None:
    """Set the flags written as overrides (``cli.num=8``) on ``a``; raises ``ValueError`` for a
    flag also given as ``--flag``."""
    for name, value in flags.items():
        if getattr(a, name) not in (None, False):
            raise ValueError(f"--{name.replace('_', '-')} and cli.{name}= both given; give one of them")
        setattr(a, name, Path(value) if name in ("out", "prompt_file") else value)


def _bad_class(text: str) -> int:
    raise ValueError(f"--classes {text}: class labels are integers, e.g. --classes 0 3 7")


def sample_config(path: Path, overrides: List[str], num: Optional[int] = None) -> Tuple[Any, Any, dict]:
    """``(generator, config, file metadata)`` of the weights file ``path``: its run config with the ``overrides``
    (keys :data:`SAMPLE_KEYS`; ``data.resolution`` / ``data.num_frames`` also set the model's size,
    as in training; ``trainer.device`` defaults to ``auto``, not the run's), validated; the
    whole generator on this process (:func:`sample_settings` alone reads no tensor).

    Raises ``ValueError`` (one line) for a key outside :data:`SAMPLE_KEYS`, a bad value or a size
    the model cannot sample at; ``FileNotFoundError`` for a missing file."""
    cfg, meta = sample_settings(path, overrides, num)
    check_layout_overrides(cfg, overrides, "vitp-sample")  # one process: the layout keys must fit it
    state, _ = read_export(path)
    saved = OmegaConf.create(json.loads(meta["vitp_config"]))
    gen = generator_from_state(saved.model, state, resolve_device(cfg.trainer.device), file_partial_sync(meta), meta)
    return gen, cfg, meta


def sample_settings(path: Path, overrides: List[str], num: Optional[int] = None) -> Tuple[Any, dict]:
    """``(config, file metadata)`` of the weights file ``path`` as :func:`sample_config` makes
    them, reading its metadata only. Raises as :func:`sample_config` does."""
    _, meta = read_export(path, keys=[])
    saved = OmegaConf.create(json.loads(meta["vitp_config"]))
    cfg = typed_config(saved)
    cfg.trainer.device = "auto"  # vitp-sample runs where it is started, whatever the run trained on
    if num is not None:
        cfg.sampler.samples_per_class = num
    cfg = apply_overrides(cfg, overrides, "vitp-sample", allowed=SAMPLE_KEYS)
    given = {override_key(o) for o in overrides}
    comp = list(cfg.data.get("vae_compression") or [1, 1])  # a latent run samples latents of the pixel size
    for data_key, model_key, to_model in (("data.resolution", "model.image_size", lambda v: input_size(v, comp)),
                                          ("data.num_frames", "model.num_frames", lambda v: input_frames(v, comp))):
        if data_key in given and model_key not in given:  # the model follows the data, as in training
            value = to_model(OmegaConf.select(cfg, data_key))
            if model_key == "model.image_size":  # a refusal names the key given (data.resolution), not the model's
                check_patch_grid(parse_resolution(value), cfg.model.patch_size, data_key)
            OmegaConf.update(cfg, model_key, value)
    frames = cfg.model.num_frames
    if frames != saved.model.num_frames and saved.model.num_frames == 1:
        raise ValueError(f"model.num_frames={frames}: this is an image model (1 frame); leave the frames out")
    if frames < 1:
        raise ValueError(f"model.num_frames={frames}: use a positive number of frames")
    validate_config(cfg)
    check_decoder(cfg.data)  # a latent run decodes with its VAE: found before sampling, not after
    return cfg, meta


def _classes_token(classes: List[int]) -> str:
    """``c3+7`` for classes 3 and 7 (in row order), runs as ``c0..9``; a long list as its count and hash."""
    runs: List[List[int]] = []
    for c in classes:
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    text = "c" + "+".join(f"{r[0]}..{r[-1]}" if len(r) > 2 else "+".join(map(str, r)) for r in runs)
    if len(text) <= 40:
        return text
    return f"c{len(classes)}cls-{hashlib.sha1(','.join(map(str, classes)).encode()).hexdigest()[:8]}"


def _grid_words(classes: int, per: int, prompts: bool = False) -> str:
    """``"2 classes x 1 sample"`` (singular where it is one; ``prompts``: ``"2 prompts x ..."``)."""
    rows = (f"{classes} prompt{'s' if classes != 1 else ''}" if prompts else
            f"{classes} class{'es' if classes != 1 else ''}")
    return f"{rows} x {per} sample{'s' if per != 1 else ''}"


def _conditioning(a: argparse.Namespace, cfg: Any, meta: dict) -> Tuple[Any, List[int], List[str]]:
    """``(conditioning, row ids, prompts)`` of the grid: the requested classes of a
    class-conditional model, or the prompts (``--prompt``, ``--prompt-file``) of a text-conditional
    one, read from the run's caption embeddings where they hold them, else encoded with the run's
    local encoder (:class:`vitp.data.text.PromptConditioning`). Raises ``ValueError`` for prompts
    to a class model, classes to a text model, a text model without prompts, or a class out of range."""
    prompts = list(a.prompt or []) + (_prompt_file(a.prompt_file) if a.prompt_file else [])
    if not cfg.model.text_dim:
        if prompts:
            raise ValueError("this model is class-conditional (model.text_dim=0): give --classes, not --prompt")
        n_cls = cfg.model.num_classes
        classes = a.classes if a.classes else list(range(n_cls))
        bad = [c for c in classes if not 0 <= c <= n_cls]
        if bad:
            raise ValueError(f"classes {bad} out of range; valid 0..{n_cls - 1} (and {n_cls} = unconditional)")
        return None, classes, []
    if a.classes:
        raise ValueError("this model is text-conditional: give --prompt \"...\" (or --prompt-file F), not --classes")
    if not prompts:
        raise ValueError("this model is text-conditional: give --prompt \"...\" (repeat for more rows) or --prompt-file F")
    from vitp.data.text import PromptConditioning

    text = json.loads(meta["text_encoder"]) if meta.get("text_encoder") else {}  # what the export recorded
    store = _run_store(cfg, text)
    trained = (text.get("encoder") or {}).get("config_sha256")
    if store is not None and trained and store.encoder.get("config_sha256") != trained:
        raise ValueError(f"the caption embeddings at {store.path} were made by encoder {store.encoder['name']}, but "
                         f"this model was trained on {text['encoder'].get('name')}'s: use a store of that encoder")
    encoder = (cfg.data.text_encoder or (text.get("encoder") or {}).get("path")
               or (store.encoder.get("path") if store is not None else None))  # the recorded local path
    device = str(resolve_device(cfg.trainer.device))
    cond = PromptConditioning(prompts, store, encoder, device=device)
    if cond.truncated:
        length = store.max_length if store is not None else "the encoder's"
        print(f"vitp-sample: {cond.truncated} prompt(s) longer than {length} tokens were cut there (the model "
              "was trained on captions of that length)", file=sys.stderr)
    return cond, list(range(1, len(prompts) + 1)), prompts


def _run_store(cfg: Any, text: dict) -> Any:
    """The run's caption embeddings (``data.text_embeddings``, else the path its export
    recorded in ``text``), or ``None`` when neither exists any more."""
    from vitp.text import TextEmbeddings

    for where in (cfg.data.text_embeddings, text.get("embeddings")):
        if where and (Path(where) / "index.json").is_file():
            return TextEmbeddings(where)
    return None


def _prompt_file(path: Path) -> List[str]:
    """Prompts of a ``.txt`` (one per line, blank lines skipped) or ``.jsonl`` (``"caption"``
    field) file. Raises ``FileNotFoundError`` / ``ValueError`` naming the file."""
    from vitp.cli.encode_captions import read_caption_file

    if not Path(path).is_file():
        raise FileNotFoundError(f"--prompt-file {path} not found: give a .txt file (one prompt per line) or .jsonl")
    prompts = [p for p in read_caption_file(path) if p]
    if not prompts:
        raise ValueError(f"--prompt-file {path} holds no prompt: write one per line")
    return prompts


def output_name(cfg: Any, meta: dict, classes: List[int], per: int, fmt: Optional[str], source: Path,
                step: Optional[int] = None, prompts: Optional[List[str]] = None) -> str:
    """The default output name (no suffix) from everything that decides the samples: the weights
    (a file's stem, also a sharded export's ``X.safetensors`` or its index, unless it is a run's
    ``model_ema.safetensors``; ``raw`` weights; the training step:
    ``step``, else the file's),
    the classes in row order, samples per class, the sampler (method, steps, CFG scale and interval,
    seed), a size other than the trained one, and for video the fps and ``mp4``. E.g.
    ``sample_step0000300_c3+7_n8_heun20_cfg1_seed0``."""
    sp, trained = cfg.sampler, json.loads(meta["vitp_config"])["model"]
    words = ["sample"]
    name = source.name.removesuffix(".index.json")  # a sharded export: by the name it stands for
    weights_file = source.is_file() or Path(f"{source}.index.json").is_file()
    if weights_file and name != "model_ema.safetensors":
        words.append(re.sub(r"[^A-Za-z0-9.-]+", "-", Path(name).stem).strip("-.")[:40] or "weights")
    if meta.get("weights") == "raw":
        words.append("raw")
    step = int(meta.get("step", -1)) if step is None else step
    if step >= 0:
        words.append(f"step{step:07d}")
    method = getattr(sp.method, "name", sp.method)  # the schema's enum
    rows = (f"p{len(prompts)}-{hashlib.sha1(chr(10).join(prompts).encode()).hexdigest()[:8]}" if prompts
            else _classes_token(classes))
    words += [rows, f"n{per}", f"{method}{sp.steps}", f"cfg{sp.cfg_scale:g}"]
    if list(sp.cfg_interval) != [0.0, 1.0]:
        words.append("ci{:g}-{:g}".format(*sp.cfg_interval))
    words.append(f"seed{sp.seed}")
    size, trained_size = (list(parse_resolution(m["image_size"])) + ([m["num_frames"]] if m["num_frames"] > 1 else [])
                          for m in (cfg.model, trained))
    if size != trained_size:
        words.append("x".join(map(str, size)))
    if cfg.model.num_frames > 1:
        words += [f"fps{sp.fps:g}"] + (["mp4"] if fmt == "mp4" else [])
    return "_".join(words)


def _check_free(out: Path, folder: bool, force: bool, remove: bool = True) -> None:
    """Refuse (``ValueError``) to overwrite ``out`` (a file, or with ``folder`` the video files an
    earlier call wrote into that folder) or to write into a folder holding other files without
    ``force``; with it (and ``remove``: the rank that writes) remove those earlier video files so
    the folder holds one call's samples."""
    old = sorted(p for p in out.iterdir() if _VIDEO_FILE.match(p.name)) if folder and out.is_dir() else []
    if folder and out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; a video model writes a folder there (or give a .gif / .mp4 name)")
    if not force and (old or (not folder and out.exists())):
        what = f"{out} holds {len(old)} sample videos" if folder else f"{out} exists"
        raise ValueError(f"{what}; choose another --out, or pass --force to replace {'them' if folder else 'it'}")
    if not force and folder and out.is_dir() and any(out.iterdir()):  # as vitp-export refuses a non-empty -o
        raise ValueError(f"{out} exists and holds other files than sample videos; choose another --out, or pass "
                         "--force to write into it")
    for p in old if remove else []:
        p.unlink()


def run(argv: Optional[List[str]] = None) -> None:
    """Write a PNG grid (one row per requested class), or videos for a video model.

    ``vitp-sample SOURCE [--classes C ...] [--num N] [--out FILE|DIR] [--format gif|mp4] [--force]
    [key=value ...]`` with Hydra-style overrides of the run's ``sampler.*`` (``sampler.steps=20``,
    ``sampler.cfg_scale=2.0``, ``sampler.cfg_interval=[0.1,1]``, ``sampler.seed=0``,
    ``sampler.fps=8``), ``model.image_size=HxW`` / ``model.num_frames=T`` (sample at another size
    than the run's: any bucket, or any size whose sides divide by the patch size; sin-cos positions
    follow the grid) and ``trainer.device=auto|cpu|cuda`` (default ``auto``). The flags
    ``--seed --method --steps --cfg-scale --cfg-interval --device --fps --resolution --frames`` of
    earlier versions still work, with a note naming the override. The default output,
    ``samples/<output_name>.png`` (video: a folder of that name) next to the weights, is named by
    :func:`output_name`. Raises ``ValueError`` before sampling for an output that exists (without
    ``--force``), a bad ``--out`` / ``--format`` or class, ``PermissionError`` for an output into
    the run folder where this process may not write (:func:`vitp.utils.check_output_in_run`),
    ``FileNotFoundError`` for a missing source.
    """
    with quiet_unless_main():  # under a launcher: rank 0 alone prints
        a, overrides = parse_args(argv)
        from vitp.eval.wan_sample import is_wan_source, run_wan

        if is_wan_source(a.source):  # a Wan run or diffusers folder: WanPipeline's sampling (vitp.eval.wan_sample)
            return run_wan(a, overrides, _conditioning, SAMPLE_KEYS)
        if a.scheduler is not None or a.flow_shift is not None:
            raise ValueError("--scheduler and --flow-shift are for Wan runs and folders; this run samples with "
                             "sampler.method=heun|euler")
        path, step, base = resolve_weights(a.source, "ema")  # a run dir without final weights: its latest checkpoint
        check_output_in_run(a.out, base / "samples", base, "vitp-sample")  # a read-only run: before any work
        sharded = launched()
        if sharded:  # each rank builds its replica or its stage's shard below (build_sharded)
            gen, (cfg, meta) = None, sample_settings(path, overrides, a.num)
            cfg = choose_layout(cfg, overrides, world_size(), resolve_device(cfg.trainer.device), "vitp-sample")
        else:
            gen, cfg, meta = sample_config(path, overrides, a.num)
        conditioning, rows, prompts = _conditioning(a, cfg, meta)
        per = cfg.sampler.samples_per_class
        video = cfg.model.num_frames > 1
        _check_out(a.out, a.format, video)
        name = output_name(cfg, meta, rows, per, a.format, path, step, prompts)
        default = base / "samples" / (name if video else name + ".png")
        if a.out is not None:
            check_sample_out(a.out, default)  # not among a run's or a model's files, --force or not
        out = a.out or default
        grid_file = not video or (a.out is not None and bool(a.out.suffix))  # else a folder (names hold dots: cfg1.5)
        _check_free(out, folder=not grid_file, force=a.force, remove=is_main())  # before sampling: refused at once
        labels = torch.tensor(rows)[class_grid_labels(len(rows), per)]
        if sharded:
            part = build_sharded(cfg, path, "vitp-sample")
            x = generate(part.denoiser, cfg, labels, cfg.sampler.seed, conditioning, part.share)  # rank 0's
            finish()
            if x is None:
                return
        else:
            x = generate(gen, cfg, labels, cfg.sampler.seed, conditioning)
        _write_samples(x, labels, cfg, out, grid_file, a.format, prompts)


def _write_samples(x: torch.Tensor, labels: torch.Tensor, cfg: Any, out: Path, grid_file: bool,
                   fmt: Optional[str], prompts: List[str]) -> None:
    """Write the samples ``x`` (B, C, T, H, W) in [0, 1] of ``labels`` (B,): a PNG grid (a row per
    class or prompt), or for video the grid as one GIF / MP4 (``grid_file``) or a folder of one file
    per class and seed plus the grid; print what was written."""
    per = cfg.sampler.samples_per_class
    rows = len(labels) // per
    how = f"{cfg.sampler.method} {cfg.sampler.steps} steps, CFG {cfg.sampler.cfg_scale}"
    if cfg.model.num_frames > 1:
        from vitp.media import video_grid, write_gif, write_mp4, write_video_samples

        fps = cfg.sampler.fps
        if grid_file:  # each writer replaces its file atomically
            grid = (video_grid(x, nrow=per) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
            (write_gif if out.suffix.lower() == ".gif" else write_mp4)(out, grid, fps=fps)
            print(f"wrote {out} ({_grid_words(rows, per, bool(prompts))}, {x.shape[2]} frames, {how})")
        else:
            paths = write_video_samples(x, labels, out, fps=fps, fmt=fmt or "gif",
                                        prefix="prompt" if prompts else "class")
            print(f"wrote {len(paths)} videos to {out} ({_grid_words(rows, per, bool(prompts))} + "
                  f"{paths[-1].name}, {x.shape[2]} frames, {how})")
        if prompts:  # prompt<i> in the file names is line i (1-based) of prompts.txt
            side = out / "prompts.txt" if not grid_file else out.with_suffix(".txt")
            atomic_write_text(side, "".join(f"{i} {p}\n" for i, p in enumerate(prompts, 1)))
        return
    from torchvision.utils import save_image

    grid = to_grid(x, nrow=per)
    if prompts:
        from vitp.media import caption_rows

        grid = caption_rows(grid, prompts)
    with atomic_write(out) as tmp:
        save_image(grid, str(tmp))
    print(f"wrote {out} ({_grid_words(rows, per, bool(prompts))}, {how})")


def _check_out(out: Optional[Path], fmt: Optional[str], video: bool) -> None:
    """Refuse an ``--out`` / ``--format`` that does not fit the model (``ValueError``, one line)."""
    suffix = out.suffix.lower() if out is not None else ""
    if not video and (fmt or (out is not None and suffix not in (".png", ".jpg", ".jpeg", ".webp"))):
        raise ValueError("this is an image model: --out takes a .png, .jpg or .webp file name and --format is for video")
    if video and suffix and suffix not in (".gif", ".mp4"):
        raise ValueError(f"--out {out}: use a folder, or a .gif / .mp4 file (this is a video model)")
    if video and suffix and fmt and suffix != "." + fmt:
        raise ValueError(f"--out {out} and --format {fmt} disagree; give one of them")


if __name__ == "__main__":
    main()
