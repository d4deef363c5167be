"""``vitp-sample``: class-conditional samples from a run directory or a weights file, one process, any device.

Images: one PNG grid (a row per class). Video: one GIF (or MP4) per class and seed plus a grid video.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import List, Optional

import torch

from vitp.checkpoint import load_generator, resolve_weights
from vitp.cli import run_cli
from vitp.config import validate_config
from vitp.eval import class_grid_labels, generate
from vitp.media import to_grid
from vitp.parallel.distributed import resolve_device


def main(argv: Optional[List[str]] = None) -> None:
    """Console entry point; bad input exits with a one-line message (status 2)."""
    run_cli("vitp-sample", run, argv)


def run(argv: Optional[List[str]] = None) -> None:
    """Write a PNG grid (one row per requested class), or videos for a video model.

    ``vitp-sample RUN_DIR|FILE.safetensors [--classes 0 3 7] [--num 8] [--seed 0] [--method heun]
    [--steps 20] [--cfg-scale 2.0] [--cfg-interval 0.1 1.0] [--device auto] [--out grid.png|DIR|grid.gif]
    [--format gif|mp4] [--fps 8] [--resolution HxW] [--frames T]``

    ``--resolution`` / ``--frames`` sample at another size than the run's (any bucket, or any size
    whose sides divide by the patch size: sin-cos positions follow the grid).
    """
    p = argparse.ArgumentParser(prog="vitp-sample", description=run.__doc__.splitlines()[0])
    p.add_argument("source", type=Path, help="run directory (its model_ema.safetensors, else its latest checkpoint), "
                                             "a checkpoint folder, or a .safetensors file")
    p.add_argument("--classes", type=int, nargs="*", default=None, help="class labels (default: all classes)")
    p.add_argument("--num", type=int, default=None, help="samples per class (default: the run's sampler setting)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--method", choices=["euler", "heun"], default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--cfg-scale", type=float, default=None)
    p.add_argument("--cfg-interval", type=float, nargs=2, default=None)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--out", type=Path, default=None,
                   help="images: output PNG (default: SOURCE_DIR/samples/sample_seed<S>.png); video: a folder for "
                        "one file per class and seed + grid (default: SOURCE_DIR/samples/sample_seed<S>/), or a "
                        ".gif/.mp4 file for the grid alone")
    p.add_argument("--format", choices=["gif", "mp4"], default=None, help="video file format (default gif)")
    p.add_argument("--fps", type=float, default=None, help="video frames per second (default: sampler.fps)")
    p.add_argument("--resolution", default=None, help="sample size HxW in pixels, or one int for a square "
                                                      "(default: the run's model.image_size)")
    p.add_argument("--frames", type=int, default=None, help="video frames per sample (default: the run's)")
    a = p.parse_args(argv)
    if a.num is not None and a.num < 1:
        p.error("--num must be >= 1")

    path, _, base = resolve_weights(a.source, "ema")  # a run dir without final weights: its latest checkpoint
    gen, cfg = load_generator(path, resolve_device(a.device))
    _apply_options(cfg, a)
    validate_config(cfg)
    n_cls = cfg.model.num_classes
    classes = a.classes if a.classes else list(range(n_cls))
    bad = [c for c in classes if not 0 <= c <= n_cls]
    if bad:
        raise ValueError(f"classes {bad} out of range; valid 0..{n_cls - 1} (and {n_cls} = unconditional)")
    per = cfg.sampler.samples_per_class
    labels = torch.tensor(classes)[class_grid_labels(len(classes), per)]
    video = cfg.model.num_frames > 1
    suffix = a.out.suffix.lower() if a.out is not None else ""
    if not video and (a.format or (a.out is not None and suffix not in (".png", ".jpg", ".jpeg", ".webp"))):
        raise ValueError("this is an image model: --out takes a .png, .jpg or .webp file name and --format is for video")
    if video and suffix and suffix not in (".gif", ".mp4"):
        raise ValueError(f"--out {a.out}: use a folder, or a .gif / .mp4 file (this is a video model)")
    if video and suffix and a.format and suffix != "." + a.format:
        raise ValueError(f"--out {a.out} and --format {a.format} disagree; give one of them")
    x = generate(gen, cfg, labels, a.seed)
    how = f"{cfg.sampler.method} {cfg.sampler.steps} steps, CFG {cfg.sampler.cfg_scale}"
    if video:
        from vitp.media import video_grid, write_gif, write_mp4, write_video_samples

        fps = a.fps or cfg.sampler.fps
        if a.out is not None and a.out.suffix:
            grid = (video_grid(x, nrow=per) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
            (write_gif if a.out.suffix.lower() == ".gif" else write_mp4)(a.out, grid, fps=fps)
            print(f"wrote {a.out} ({len(classes)} classes x {per} samples, {x.shape[2]} frames, {how})")
        else:
            out = a.out or base / "samples" / f"sample_seed{a.seed}"
            paths = write_video_samples(x, labels, out, fps=fps, fmt=a.format or "gif")
            print(f"wrote {len(paths)} videos to {out} ({len(classes)} classes x {per} samples + {paths[-1].name}, "
                  f"{x.shape[2]} frames, {how})")
        return
    out = a.out or base / "samples" / f"sample_seed{a.seed}.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    from torchvision.utils import save_image

    save_image(to_grid(x, nrow=per), str(out))
    print(f"wrote {out} ({len(classes)} classes x {per} samples, {how})")


def _apply_options(cfg, a: argparse.Namespace) -> None:
    """The sampler options and the size given on the command line, over the run's config."""
    for key, val in (("method", a.method), ("steps", a.steps), ("cfg_scale", a.cfg_scale),
                     ("samples_per_class", a.num)):
        if val is not None:
            cfg.sampler[key] = val
    if a.cfg_interval is not None:
        cfg.sampler.cfg_interval = list(a.cfg_interval)
    _set_size(cfg, a.resolution, a.frames)


def _set_size(cfg, resolution: Optional[str], frames: Optional[int]) -> None:
    """Sample at ``resolution`` (``"HxW"`` or an int) and ``frames`` instead of the run's size.

    Raises ``ValueError`` for a malformed size or frames on an image model; sizes that do not
    tile into patches fail in :func:`vitp.config.validate_config`, naming the valid sizes.
    """
    from vitp.config import parse_resolution

    if resolution is not None:
        cfg.model.image_size = list(parse_resolution(resolution, "--resolution"))
    if frames is not None:
        if cfg.model.num_frames == 1 and frames != 1:
            raise ValueError(f"--frames {frames}: this is an image model (1 frame); leave --frames out")
        if frames < 1:
            raise ValueError(f"--frames {frames}: use a positive number of frames")
        cfg.model.num_frames = frames


if __name__ == "__main__":
    main()
