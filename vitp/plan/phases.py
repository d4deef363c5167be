"""Memory and time per rank of the phases around the training step: the sample grid, the held-out
loss, the final evaluation's samples, (``eval.fid.num``) FID with CLIP score and (``eval.fvd.num``)
FVD, as :mod:`vitp.eval.inference` runs them (every rank, in
the training layout, with the EMA swapped into the weights; samples and items split over the dp
replicas; each forward of at most one training micro-batch, stages overlapping across
micro-batches as in a forward-only GPipe schedule).

Memory: the training state stays resident (weights, gradients, optimizer, EMA of the fullest
stage), plus one layer's activations of one micro-batch (no graph is kept), one parameter's fp32
EMA while it is swapped in, and the ODE state of ``sampler.batch_size`` samples on the device
(the noisy sample, two velocities, Heun's Euler guess and the prediction, doubled by classifier-free
guidance). A latent run (:mod:`.latents`) adds, to the sample grid and the final samples, the VAE
decoder's weights and one sample's decode activations, where the VAE is known.
Time: a micro-batch forward is a third of the step's compute per micro-batch plus half
of its tp / cp / pp traffic (the forward's share), and ``m`` micro-batches take ``(m - 1) max_s
t_s + sum_s t_s`` over the stages.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Dict, List

from .layout import LayoutSpec
from .memory import layer_saved_bytes
from .shapes import ModelShape, stage_layer_ranges
from .steptime import stage_times

ODE_TENSORS = 5  # z, the two velocities of a Heun step, its Euler guess, the prediction (fp32)
# FID's Inception-V3 (torch-fidelity's port, fp32, 299 x 299 input): 5.7 G multiply-adds per image
# (Szegedy et al. 2016, arXiv:1512.00567, Table 3), 23.9M parameters; the largest activations are
# the 147 x 147 x 64 maps, two of which are alive at once; the feature sums and the distance's
# eigen-decomposition hold about five 2048 x 2048 float64 / complex matrices
INCEPTION_FLOPS = 2 * 5.7e9
INCEPTION_BYTES = 4 * 23.9e6
INCEPTION_ACT_BYTES = 2 * 147 * 147 * 64 * 4
FID_SUMS_BYTES = 5 * 2048 * 2048 * 16
# CLIP score's network (eval.clip.model): OpenAI's ViT-L/14 at 224, about 81 GFLOP per image and
# caption pair (Radford et al. 2021, arXiv:2103.00020, Table 19: image tower 77.8 GFLOP), 428M parameters
CLIP_FLOPS = 81e9
CLIP_BYTES = 4 * 428e6
# FVD's I3D (eval.fvd.num, cd-fvd's InceptionI3d at 224 x 224): 108 GFLOP per 64-frame clip
# (Carreira & Zisserman 2017, arXiv:1705.07750), 12.3M parameters; its largest activations are the
# first convolution's 64 channels at half the frames and 112 x 112, two alive at once
I3D_FLOPS_PER_FRAME = 108e9 / 64
I3D_BYTES = 4 * 12.3e6
I3D_MIN_FRAMES = 9  # shorter clips have each frame repeated (vitp/eval/fvd.py)


@dataclass(frozen=True)
class PhaseCost:
    """One phase on the busiest rank: ``samples`` (or held-out items) this replica handles,
    ``forwards`` micro-batch forwards it runs, ``memory_bytes`` its peak device memory (training
    state included), ``seconds`` its predicted wall time."""

    name: str
    samples: int
    forwards: int
    memory_bytes: float
    seconds: float

    def as_dict(self) -> dict:
        return {"name": self.name, "samples": self.samples, "forwards": self.forwards,
                "memory_bytes": int(self.memory_bytes), "seconds": round(self.seconds, 3)}


def nfe(sampler: Any) -> float:
    """Network evaluations per sample of the ODE sampler: Heun ``2 steps - 1``, Euler ``steps``;
    times two for the guided part of the interval when ``cfg_scale != 1``."""
    steps = int(sampler["steps"])
    calls = 2 * steps - 1 if str(sampler["method"]) == "heun" else steps
    if float(sampler["cfg_scale"]) != 1.0:
        lo, hi = (float(v) for v in sampler["cfg_interval"])
        calls *= 1 + max(0.0, min(hi, 1.0) - max(lo, 0.0))
    return calls


def grid_samples(cfg: Any) -> int:
    """Samples in the sample grid: rows (``sampler.prompts``, else ``sampler.grid_classes`` or
    every class) times ``sampler.samples_per_class``."""
    s, classes = cfg["sampler"], int(cfg["model"]["num_classes"])
    rows = len(s["prompts"]) if s["prompts"] else (min(int(s["grid_classes"]), classes) or classes)
    return rows * int(s["samples_per_class"])


def _forward_s(model: Dict[str, Any], lay: LayoutSpec, prof: Any, m: int) -> float:
    """Seconds for ``m`` micro-batch forwards through the stages (forward-only pipeline)."""
    st = stage_times(model, replace(lay, ac=0), prof)
    per = [t.compute_s / 3 + (t.tp_s + t.cp_s + t.pp_s) / 2 for t in st]
    return (m - 1) * max(per) + sum(per)


def _working_bytes(model: Dict[str, Any], lay: LayoutSpec, batch: int) -> float:
    """Device bytes of a forward on top of the training state: one layer's activations of a
    micro-batch (the largest of any stage), the largest parameter in fp32 (the EMA swap), and the
    ODE state of ``batch`` samples."""
    shape = ModelShape.from_config(model)
    layers = range(shape.depth + 2) if lay.pp == 1 else \
        [i for a, b in stage_layer_ranges(shape.depth, lay.pp) for i in range(a, b)]  # imports DeepSpeed
    layer = max(layer_saved_bytes(shape, i, lay) for i in layers)
    mlp = int(shape.width * float(model.get("mlp_ratio", 4.0)))
    param = 4.0 * shape.width * max(mlp, 3 * shape.width) / lay.tp
    return lay.micro * layer + param + batch * ODE_TENSORS * shape.pixels * 4


def phase_costs(cfg: Any, model: Dict[str, Any], lay: LayoutSpec, prof: Any, state_bytes: float,
                heldout_items: int = 1000, decode_bytes: float = 0.0) -> List[PhaseCost]:
    """``[grid, held-out loss, final samples]`` costs of the run config ``cfg`` (a mapping with
    ``sampler``, ``eval``, ``model``) for ``model`` (resolved) in ``lay`` on ``prof``;
    ``state_bytes``: the fullest rank's resident training state; ``heldout_items``: the held-out
    set's size (the plan does not read the data: 1000 by default); ``decode_bytes``: what decoding
    one sample to pixels adds to the grid and final samples (a latent run's VAE,
    :func:`vitp.plan.latents.decode_memory_bytes`; 0 in pixel space)."""
    from .shapes import ResolvedModel

    model = ResolvedModel.of(model)  # its key once: the formulas below take it per stage and layer
    s, ev = cfg["sampler"], cfg["eval"]
    per_call = max(1, int(s["batch_size"]))
    guided = 2 if float(s["cfg_scale"]) != 1.0 else 1
    work = state_bytes + _working_bytes(model, lay, per_call * guided)
    out = []
    for name, n, calls_per in (("sample grid", grid_samples(cfg), nfe(s)),
                               ("held-out loss", heldout_items, float(ev["t_grid"])),
                               ("final samples", int(ev["num_samples"]) or heldout_items, nfe(s))):
        mine = math.ceil(n / lay.dp)
        batch = per_call if name != "held-out loss" else lay.micro * lay.pp
        calls = math.ceil(mine / batch)
        m = math.ceil(min(batch, mine) * (guided if name != "held-out loss" else 1) / lay.micro)
        forwards = int(math.ceil(calls * calls_per * m))
        seconds = calls * calls_per * _forward_s(model, lay, prof, m)
        out.append(PhaseCost(name, mine, forwards, work + decode_bytes if name != "held-out loss" else
                             state_bytes + _working_bytes(model, lay, 0), seconds))
    fid, fvd, forward_s = ev.get("fid") or {}, ev.get("fvd") or {}, (lambda m: _forward_s(model, lay, prof, m))
    if int(fid.get("num", 0) or 0):
        out.append(_fid_phase(fid, lay, prof, per_call, nfe(s), guided, work + decode_bytes, forward_s,
                              bool((ev.get("clip") or {}).get("model"))))
    frames = int(model.get("num_frames", 1) or 1)
    if str(model.get("family", "vit")) == "wan" and frames > 1:  # decoded clips: Wan's VAE is 4x in time
        frames = (frames - 1) * 4 + 1
    if int(fvd.get("num", 0) or 0) and frames > 1:
        out.append(_fvd_phase(fvd, frames, lay, prof, per_call, nfe(s), guided, work + decode_bytes, forward_s))
    return out


def _fp32_flops(prof: Any) -> float:
    """FLOP/s the feature networks reach (fp32 at the device's efficiency)."""
    return float(prof.peak_flops.get("fp32", max(prof.peak_flops.values()))) * prof.efficiency


def _sampling(num: int, lay: LayoutSpec, per_call: int, calls_per: float, guided: int, forward_s: Any):
    """``(samples on the busiest replica, micro-batch forwards, seconds)`` of drawing ``num``
    samples as the final samples are drawn."""
    mine = math.ceil(num / lay.dp)
    calls = math.ceil(mine / per_call)
    m = math.ceil(min(per_call, mine) * guided / lay.micro)
    return mine, int(math.ceil(calls * calls_per * m)), calls * calls_per * forward_s(m)


def _fvd_phase(fvd: Any, frames: int, lay: LayoutSpec, prof: Any, per_call: int, calls_per: float, guided: int,
               work: float, forward_s: Any) -> PhaseCost:
    """The ``FVD`` phase (``eval.fvd.num`` clips, :mod:`vitp.eval.fvd`) on the busiest replica:
    sampling as the final samples are, then one I3D forward per clip of ``frames`` frames (at least
    :data:`I3D_MIN_FRAMES`, frames repeated as the evaluation repeats them), with I3D's weights and
    a batch's largest activations on top of the sampling memory; the real side not counted."""
    mine, forwards, seconds = _sampling(int(fvd["num"]), lay, per_call, calls_per, guided, forward_s)
    t = frames * math.ceil(I3D_MIN_FRAMES / frames) if frames < I3D_MIN_FRAMES else frames
    seconds += mine * t * I3D_FLOPS_PER_FRAME / _fp32_flops(prof)
    act = 2 * 64 * math.ceil(t / 2) * 112 * 112 * 4
    return PhaseCost("FVD", mine, forwards, work + I3D_BYTES + int(fvd.get("batch_size", 16)) * act, seconds)


def _fid_phase(fid: Any, lay: LayoutSpec, prof: Any, per_call: int, calls_per: float,
               guided: int, work: float, forward_s: Any, clip: bool = False) -> PhaseCost:
    """The ``FID`` phase (``eval.fid.num`` samples, :mod:`vitp.eval.fid`) on the busiest replica:
    sampling as the final samples are, then one Inception-V3 forward per sample (fp32, at the
    device's efficiency) with the Inception weights, a batch's largest activations and the feature
    sums on top of the sampling memory; with ``clip`` (``eval.clip.model``) one CLIP forward per
    sample too, its weights held after Inception's are freed. The real side's statistics are not
    counted (cached after the first evaluation)."""
    mine, forwards, seconds = _sampling(int(fid["num"]), lay, per_call, calls_per, guided, forward_s)
    seconds += mine * (INCEPTION_FLOPS + (CLIP_FLOPS if clip else 0.0)) / _fp32_flops(prof)
    inception = INCEPTION_BYTES + int(fid.get("batch_size", 50)) * INCEPTION_ACT_BYTES + FID_SUMS_BYTES
    return PhaseCost("FID", mine, forwards, work + max(inception, CLIP_BYTES if clip else 0.0), seconds)


def phase_costs_of(cfg: Any, pred: Any, model: Dict[str, Any], prof: Any, heldout_items: int = 1000
                   ) -> List[PhaseCost]:
    """:func:`phase_costs` in the layout of ``pred`` (a :class:`vitp.plan.Prediction`), with its
    fullest stage's training state resident (and, in a latent run, the VAE's decode:
    :func:`vitp.plan.latents.decode_memory_bytes`); ``heldout_items``: as :func:`phase_costs`."""
    from .latents import decode_memory_bytes

    state = max(m.weights + m.grads + m.optimizer + m.ema for m in pred.memory)
    return phase_costs(cfg, model, pred.layout, prof, state, heldout_items, decode_bytes=decode_memory_bytes(cfg))


def replica_bytes(cfg: Any, model: Dict[str, Any], device: str = "cpu") -> float:
    """Peak device bytes of one rank that samples and evaluates with the whole generator (``tp = cp =
    pp = 1``, a data-parallel replica of ``vitp-sample`` / ``vitp-eval``): the fp32 weights (no
    optimizer, gradients or EMA), one layer's activations and the ODE state of the largest forward
    (``sampler.batch_size`` samples, doubled by classifier-free guidance, or one held-out batch of
    ``trainer.micro_batch_size``), and a latent run's decode (:func:`vitp.plan.latents.decode_memory_bytes`).
    ``cfg``: a run config (mapping with ``sampler``, ``trainer``, ``model``); ``model``: its resolved ``model``."""
    from .latents import decode_memory_bytes
    from .shapes import layer_params

    s = cfg["sampler"]
    batch = max(1, int(s["batch_size"])) * (2 if float(s["cfg_scale"]) != 1.0 else 1)
    batch = max(batch, int(cfg["trainer"]["micro_batch_size"]))
    lay = LayoutSpec(tp=1, pp=1, dp=1, sp=False, ac=0, micro=batch, accum=1, device=device)
    weights = 4.0 * sum(sum(layer.values()) for layer in layer_params(model))
    return weights + _working_bytes(model, lay, batch) + decode_memory_bytes(cfg)


def format_phases(costs: List[PhaseCost], limit_bytes: float) -> str:
    """One line per phase: samples, forwards, memory and time per rank, and whether it fits."""
    from .units import format_bytes

    rows = []
    for c in costs:
        flags = [] if c.memory_bytes <= limit_bytes else ["does NOT fit"]
        rows.append(f"  {c.name:14} {c.samples:>7} per replica {c.forwards:>9} forwards "
                    f"{format_bytes(c.memory_bytes):>9} per rank {c.seconds:>10.4g} s {' '.join(flags)}".rstrip())
    return "\n".join(rows)

