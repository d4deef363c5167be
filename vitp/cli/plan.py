"""``vitp-plan``: rank the ``(tp, cp, pp, dp, sp, AC, micro-batch)`` layouts of a run config on N devices.

    vitp-plan --gpus 16 --device h100 experiment=video512 data.root=x data.num_classes=101
    vitp-plan --gpus 4 --device cpu experiment=smoke data.resolution=16 --json

Overrides are ``vitp-train``'s (Hydra's grammar, composed from ``conf/`` and checked by the
schema: :func:`vitp.cli.overrides.compose_checked`). Prints, per layout, the memory of the fullest
rank (weights, gradients, optimizer state, activations with SP / checkpointing / in-flight
micro-batches, workspace), the bytes each rank moves per step over TP, CP (context parallelism:
attention exchanges and the gathered prediction), PP and DP (sizes with three
significant digits in B, KiB, MiB, GiB or TiB: :func:`vitp.plan.format_bytes`), the predicted step
time, tokens/s and MFU, and whether it fits; fitting layouts first, fastest first
(:mod:`vitp.plan`). Each row's ``vitp-train`` overrides are in the JSON output (``--json``).
``--show-plan ROW`` prints what the parallel plan does at a row's layout (:func:`plan_text`; with
``--json`` it is the document's ``show_plan`` field, so stdout stays one JSON document). A text model
(``model.text_dim``) without ``model.text_len`` is planned without caption tokens, with a note on stderr.
On ``--device cpu``, ``--mem-gib`` is the machine's memory, split among the ``--gpus`` ranks on it.
A latent run (``data.vae`` or ``data.latent_channels``, docs/latents.md) also prints its latent and
pixel shapes, tokens per sample and the VAE decoder's memory (JSON: ``latents``;
:func:`vitp.plan.latent_plan`); ``data.latent_channels`` / ``data.vae_compression`` left at 0 / [1, 1]
are read from a readable ``data.vae`` folder (:func:`vitp.plan.with_vae_geometry`).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import threading
from dataclasses import replace
from typing import List, Optional

from vitp.cli import run_cli
from vitp.config import MAX_DEVICE_MEMORY_GIB


def _ints(lowest: int, example: str):
    """Parser of ``"0,1,2"`` -> ``[0, 1, 2]``, every value ``>= lowest``."""
    def parse(text: str) -> List[int]:
        try:
            values = [int(x) for x in text.split(",") if x]
        except ValueError:
            values = []
        if not values or min(values) < lowest:
            raise argparse.ArgumentTypeError(f"{text!r}: use comma-separated integers >= {lowest}, e.g. {example}")
        return values
    return parse


MAX_MEM_GIB = float(MAX_DEVICE_MEMORY_GIB)  # --mem-gib's upper bound (1 PiB), as parallel.auto_memory_gib's


def _positive(kind, most: float = float("inf"), unit: str = ""):
    """Parser of a number > 0 of ``kind``: a whole number (``int``: ``8.5`` and ``1e3`` are refused)
    or a finite ``float`` at most ``most`` (``unit``: how the refusal names the bound)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if kind is int and not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r}: use a whole number > 0, e.g. 8")
        if not 0 < value <= most or value == float("inf"):
            rule = f"> 0 and at most {most:.0f}{unit}" if most < float("inf") else "> 0"
            raise argparse.ArgumentTypeError(f"{text!r}: use a finite number {rule}")
        return value
    return parse


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="vitp-plan", description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=_positive(int), default=8, help="devices (processes) in the job (default 8)")
    p.add_argument("--device", default="h100", help="h100 | h200 | a100 | cpu (measured here, cached)")
    p.add_argument("--mem-gib", type=_positive(float, MAX_MEM_GIB, " (1 PiB)"), default=None,
                   help="memory per device in GiB (default: the profile's), above 0, at most 1048576 (1 PiB); on "
                        "--device cpu the machine's memory (default: its RAM), split among the --gpus ranks on it")
    p.add_argument("--gpus-per-node", type=_positive(int), default=None, help="devices per node (default: the profile's, 8)")
    p.add_argument("--ac", type=_ints(0, "0,1"), default=[0, 1], help="activation checkpoint intervals to try (default 0,1)")
    p.add_argument("--micro", type=_ints(1, "1,2,4"), default=None, help="micro-batch sizes to try, e.g. 1,2,4 (default: all)")
    p.add_argument("--adaln-replicated", action="store_true",
                   help="model the adaLN modulation replicated on every TP rank (older vitp); default: sharded, as trained")
    p.add_argument("--top", type=int, default=20, help="rows to print (0 = all)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table (one document on stdout)")
    p.add_argument("--show-plan", type=int, nargs="?", const=1, default=None, metavar="ROW",
                   help="also print the parallel plan of the table's row ROW (default 1): per stage, the rows "
                        "applied, the parameters sharded / with partial gradients, the TP and CP collectives of a "
                        "micro-batch; with --json, the same text is the JSON's \"show_plan\" field. At tp or cp > 1 "
                        "it builds the model on torch's meta device: the torch and timm imports add about 4-5 s")
    p.add_argument("overrides", nargs="*", default=[], help="Hydra overrides, e.g. experiment=img256 model.depth=24")
    return p.parse_intermixed_args(argv)


def _count(n: float) -> str:
    """A count with three significant digits: ``24300`` -> ``24.3k``, ``1.2e9`` -> ``1.20B``."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale * 0.9995:
            return f"{n / scale:#.3g}".rstrip(".") + unit
    return f"{n:.0f}"


def _header(cfg, args, prof, preds) -> str:
    from vitp.plan import GIB, ModelShape, format_bytes, layer_params
    from vitp.plan.lora import lora_params, lora_plan_of
    from vitp.plan.planner import rank_limit_bytes

    shape = ModelShape.from_config(cfg.model)
    params = sum(sum(layer.values()) for layer in layer_params(cfg.model))
    fits = sum(p.fits for p in preds)
    lora = lora_plan_of(cfg)
    tuned = (f"; LoRA rank {lora.rank} on {list(lora.targets)}, base frozen ({cfg.trainer.precision}), "
             f"{_count(lora_params(cfg.model, lora.targets, lora.rank))} adapter parameters" if lora else "")
    mem = format_bytes(prof.memory_gib * GIB)
    if prof.kind == "cpu":  # one machine's memory, split among the ranks on it (vitp.plan.planner.rank_limit_bytes)
        mem += f" shared: {format_bytes(rank_limit_bytes(prof, args.gpus))} per rank"
    return (f"model: {_count(params)} parameters, {shape.tokens} tokens/sample, depth {shape.depth}, width "
            f"{shape.width}; global batch {cfg.trainer.global_batch_size}; {args.gpus} x {prof.name} "
            f"({mem}, {prof.devices_per_node}/node){tuned}; {len(preds)} valid layouts{_fixed_text(args)}, {fits} fit")


def _fixed_text(args) -> str:
    """`` with parallel.tp=2 ...`` for the layout keys among the overrides (they filter the table)."""
    from vitp.plan.auto import fixed_keys

    keys = fixed_keys(args.overrides)
    return f" with {' '.join(o for o in args.overrides if o.split('=', 1)[0].lstrip('+') in keys)}" if keys else ""


def plan_text(cfg, lay) -> str:
    """The generator's parallel plan (:data:`vitp.models.GENERATOR_PLAN`) at layout ``lay``: per
    pipeline stage the rows it applies (TP rows at tp > 1, context-parallel rows at cp > 1), and
    the collectives a micro-batch (and a step) issues there with the group each runs over (TP, or
    cp for tags ``cp`` / ``cp_boundary``), as the planner counts them
    (:func:`vitp.plan.plan_collectives`)."""
    from vitp.plan import CP_TAGS, ModelShape, format_bytes, plan_collectives, plan_report, stage_layer_ranges
    from vitp.plan.comm import plan_mode_of

    cp = f" cp={lay.cp}" + (f" ({lay.cp_mode})" if lay.cp > 1 else "")
    out = [f"parallel plan at tp={lay.tp}{cp} pp={lay.pp} dp={lay.dp} sp={'on' if lay.sp else 'off'} "
           f"partial_sync={lay.partial_sync} micro={lay.micro}:"]
    if lay.tp == 1 and lay.cp == 1:
        return out[0] + " tp=1 and cp=1, nothing is sharded"
    for s, (first, end) in enumerate(stage_layer_ranges(ModelShape.from_config(cfg.model).depth, lay.pp)):
        out.append(plan_report(cfg.model, plan_mode_of(lay), first, end, lay.tp, lay.cp).table(f"stage {s}"))
        for c in plan_collectives(cfg.model, lay, s):
            per = "per step" if c.per_step else "per micro-batch"
            group = f"cp group ({lay.cp})" if c.tag in CP_TAGS else f"TP group ({lay.tp})"
            out.append(f"    {c.count:>3} x {c.kind:14} {c.direction:3} {c.tag:11} {format_bytes(c.nbytes):>9} {per:15} "
                       f"over the {group}")
    return "\n".join(out)


def _phases(cfg, pred, prof, model=None) -> list:
    """The sample grid, held-out loss and final samples of ``pred``'s layout (:mod:`vitp.plan.phases`);
    ``model``: ``cfg.model`` resolved (:class:`vitp.plan.shapes.ResolvedModel`), once for many rows."""
    from vitp.plan import phase_costs_of
    from vitp.plan.shapes import ResolvedModel

    return phase_costs_of(cfg, pred, model or ResolvedModel.of(cfg.model), prof)


@contextlib.contextmanager
def _progress(what: str, after_s: float = 1.0):
    """Print ``vitp-plan: <what> ...`` on stderr once if the block is still running after
    ``after_s`` seconds (the process start alone, torch and DeepSpeed imports, can take that long)."""
    timer = threading.Timer(after_s, lambda: print(f"vitp-plan: {what} ...", file=sys.stderr, flush=True))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def run(argv: Optional[List[str]] = None) -> list:
    """Plan and print; returns the predictions (JSON-able dicts). Raises ``ValueError`` on bad input,
    and after the table when no layout fits (``vitp-plan`` then exits with status 2)."""
    args = parse_args(argv)
    if args.top < 0:
        raise ValueError(f"--top {args.top}: use a number of rows >= 0 (0 = all)")
    if args.show_plan is not None and (args.show_plan < 1 or (args.top and args.show_plan > args.top)):
        raise ValueError(f"--show-plan {args.show_plan}: give a row of the table, 1 to {args.top or 'its length'}"
                         + (" (or raise --top)" if args.top and args.show_plan > args.top else ""))
    _check_nodes(args)
    with _progress(f"planning the layouts of {args.gpus} device(s) (config, model shapes, every valid layout)"):
        return _run(args)


def _check_nodes(args: argparse.Namespace) -> None:
    """Refuse ``--gpus`` that no cluster of equal nodes holds: more devices than a node has
    (``--gpus-per-node``, else the ``--device`` preset's 8) and not a multiple of it. Raises
    ``ValueError`` naming both numbers and the nearest valid ones. Fewer devices than a node has
    are one node, partly used (``torchrun --nproc_per_node 4`` on an 8-GPU node): accepted."""
    from vitp.plan import PRESETS
    from vitp.utils import divisors

    preset = PRESETS.get(args.device.lower())
    per = args.gpus_per_node or (preset.devices_per_node if preset else None)  # cpu: one node of any size
    if per is None or args.gpus <= per or args.gpus % per == 0:
        return
    node = (f"--gpus-per-node {per}" if args.gpus_per_node else
            f"the {preset.name} profile's {per} devices per node")
    low, high = args.gpus // per * per, (args.gpus // per + 1) * per
    fits = ", ".join(str(d) for d in divisors(args.gpus) if d <= 16)  # GPU nodes hold up to 16 devices
    raise ValueError(f"--gpus {args.gpus} is not a multiple of {node}: a job fills whole nodes, the same number of "
                     f"processes on each (torchrun, the deepspeed launcher, SageMaker); use --gpus {low} or {high}, or "
                     f"the devices your nodes have as --gpus-per-node (a divisor of {args.gpus}, e.g. {fits})")


def _say(line: str) -> None:
    """Print ``vitp-plan: <line>`` on stderr at once (the user waits while it happens)."""
    print(f"vitp-plan: {line}", file=sys.stderr, flush=True)


def _run(args: argparse.Namespace) -> list:
    from omegaconf import OmegaConf

    from vitp.cli.overrides import compose_checked
    from vitp.plan import MemoryOptions, format_phases, format_table, get_profile, latent_plan, with_vae_geometry
    from vitp.plan.auto import fixed_keys, plan_fixed, why_no_layout
    from vitp.plan.lora import lora_plan_of
    from vitp.plan.shapes import ResolvedModel

    cfg = with_vae_geometry(compose_checked(args.overrides))
    _note_text_len(cfg)
    # cpu: measured once (gloo among at most vitp.plan.devices.LINK_PROCS_MAX processes), said on stderr
    cpu_kw = {"procs": args.gpus, "notify": _say} if args.device.lower() == "cpu" else {}
    prof = get_profile(args.device, args.mem_gib, **cpu_kw)
    if args.gpus_per_node:
        prof = replace(prof, devices_per_node=args.gpus_per_node)
    opts = MemoryOptions(adaln_sharded=not args.adaln_replicated, lora=lora_plan_of(cfg))
    want = {k: OmegaConf.select(cfg, k) for k in fixed_keys(args.overrides)}  # layout keys the user set
    preds = plan_fixed(cfg, args.gpus, prof, want, opts, args.ac, args.micro)
    if not preds:
        flags = [f"--micro {','.join(map(str, args.micro))}"] if args.micro else []  # they filter as fixed keys do
        flags += [f"--ac {','.join(map(str, args.ac))}"] if args.ac != [0, 1] else []
        named = [f"{k}={v}" for k, v in want.items()] + flags
        fixed = f" with {' '.join(named)} (drop those to list every layout)" if named else ""
        why = why_no_layout(cfg, args.gpus, want, prof.kind, planner=True)
        raise ValueError(f"no valid layout of this config on {args.gpus} devices{fixed}: " + ("; ".join(why) if why else
                         "check heads, MLP hidden units, depth and trainer.global_batch_size against the device count"))
    shown = preds[:args.top] if args.top else preds
    if args.show_plan is not None and args.show_plan > len(shown):
        raise ValueError(f"--show-plan {args.show_plan}: the table has rows 1 to {len(shown)}")
    model = ResolvedModel.of(cfg.model)
    rows = [{**p.as_dict(), "overrides": p.layout.overrides(),
             "phases": [c.as_dict() for c in _phases(cfg, p, prof, model)]} for p in shown]
    lat = latent_plan(cfg)
    shown_plan = None if args.show_plan is None else plan_text(cfg, shown[args.show_plan - 1].layout)
    if args.json:  # one JSON document on stdout: the shown plan is a field of it, not text after it
        print(json.dumps({"device": prof.as_dict(), "world": args.gpus, "latents": lat and lat.as_dict(),
                          "layouts": rows, **({"show_plan": shown_plan} if shown_plan else {})}, indent=1))
    else:
        print(_header(cfg, args, prof, preds))
        if lat is not None:
            print(lat.describe())
        print(format_table(shown))
        print(f"sampling and evaluation of row 1 (per rank; held-out loss for 1000 held-out items):\n"
              f"{format_phases(_phases(cfg, shown[0], prof, model), shown[0].limit_bytes)}")
        if shown_plan:
            print(shown_plan)
    if not any(p.fits for p in preds):  # the table shows why; the exit status says it to scripts
        raise ValueError(_nothing_fits(args, prof, preds))
    return rows


def _note_text_len(cfg) -> None:
    """A note on stderr for a text-conditional model (``model.text_dim`` > 0) with ``model.text_len``
    0: the plan then counts no caption tokens (cross-attention keys / values, the embeddings), though
    training takes the length from the caption store (``vitp.train.trainer``). Not a refusal: the
    same overrides train."""
    m = cfg.model
    if not m.get("text_dim") or m.get("text_len"):
        return
    print(f"vitp-plan: note: model.text_dim={m.text_dim} but model.text_len=0: this plan counts no caption "
          "tokens (vitp-train takes their number from the caption store); add model.text_len=<the encoder's tokens per "
          "caption>, e.g. model.text_len=77 for CLIP, 512 for T5 / umT5 at their full length (120: "
          "vitp-encode-captions' default for T5)", file=sys.stderr, flush=True)


def _nothing_fits(args: argparse.Namespace, prof, preds) -> str:
    """The one-line refusal after a table where no layout fits: the smallest layout's need and what
    to change (more memory per device, more devices, smaller micro-batches where not all were tried)."""
    from vitp.plan import format_bytes

    small = min(preds, key=lambda p: p.peak.total)
    need = math.ceil(small.peak.total / 2**30 + prof.reserve_gib)  # the profile keeps reserve_gib free
    fixes = [f"a device with more memory (--mem-gib {need} or more, or another --device)",
             f"more --gpus than {args.gpus}"]
    if args.micro and min(args.micro) > 1:
        fixes.append("a smaller micro-batch (--micro 1, then trainer.micro_batch_size=1)")
    if 1 not in args.ac:
        fixes.append("activation checkpointing (--ac 0,1)")
    return (f"nothing fits: none of the {len(preds)} valid layouts fits {args.gpus} x {prof.name} "
            f"({format_bytes(prof.memory_gib * 2**30)}, {format_bytes(small.limit_bytes)} usable per rank); the smallest, {' '.join(small.layout.overrides())}, needs "
            f"{format_bytes(small.peak.total)}. Use {', '.join(fixes[:-1])} or {fixes[-1]}, or a smaller model")


def main(argv: Optional[List[str]] = None) -> None:
    """Console entry point ``vitp-plan``; bad input exits with a one-line message (status 2)."""
    run_cli("vitp-plan", run, argv)


if __name__ == "__main__":
    main()
