#!/usr/bin/env python
"""One-GPU check of vitp: bf16 + NCCL training, the SDPA kernel, MFU and memory against the planner.

    bash scripts/gpu_check.sh                      # one CUDA GPU (H200 target), < 8 minutes
    python scripts/gpu_check.py --out DIR [--only bf16_nccl,sdpa,mfu_jit_b_256px] [--cpu-smoke]

Each check runs in its own process with its own timeout (a crash, hang or OOM loses that check
only) and writes ``DIR/<check>.json`` and ``DIR/<check>.log``; ``DIR/gpu_check.json`` (every
result so far) is rewritten after each check, and one table is printed at the end.

- ``bf16_nccl``: the real :class:`vitp.train.Trainer` on a 1-rank NCCL group (what ``vitp-train``
  sets up without a launcher), ``trainer.precision=bf16`` (ZeRO-1), a few steps, the final
  checkpoint and sample grid; passes when the backend is NCCL, the weights are bf16 and every
  loss is finite.
- ``sdpa``: ``F.scaled_dot_product_attention`` forced onto each backend with
  ``torch.nn.attention.sdpa_kernel`` (flash, efficient, cuDNN, math) on a JiT-B head shape, and the
  ATen SDPA op (and CUDA kernel names) that one profiled training step of the real trainer runs;
  passes when flash runs when forced and the trainer's attention is a fused kernel (not math).
- ``cp``: context parallelism on 2 GPUs (skipped, saying so, with fewer): a small video
  generator (512 tokens, bf16, flash SDPA forced) at cp = 2 over NCCL with Ulysses and with
  ring attention, launched with torchrun, against cp = 1 on each rank alone: loss and every
  parameter gradient (summed over the cp group, divided by cp) within bf16 tolerance.
- ``compile_<case>``: the first ``mfu`` case with ``trainer.compile=blocks`` (each block compiled
  by ``torch.compile``, :mod:`vitp.models.compiled`): its MFU and step time against the eager
  ``mfu_<case>`` of the same run, compile time, graphs and graph breaks.
- ``mfu_<case>``: a JiT-B/L generator on synthetic data in bf16 (:data:`CASES`: 256 tokens at
  256 px with patch 16 and at 1024 px with patch 64); after warm-up, timed ``train_step`` calls
  and the trainer's own telemetry (:mod:`vitp.train.telemetry`: model FLOPs of
  :func:`vitp.plan.model_flops_per_step`, MFU against the device profile of
  :mod:`vitp.plan.devices`, ``torch.cuda.max_memory_allocated``), next to the planner's
  prediction for the same layout (:func:`vitp.plan.predict`: step time, MFU, peak memory per rank).

``--cpu-smoke`` runs the same code on a tiny model on CPU with gloo in seconds (what
``tests/unit/test_scripts.py`` runs): the numbers then say nothing about a GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
import traceback
from pathlib import Path
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

# synthetic data, no evaluation, previews only at the end, logs only when train_step asks
BASE = ["data=synthetic", "data.holdout_fraction=0", "eval.enabled=false", "trainer.eval_every=0",
        "trainer.sample_every=0", "trainer.checkpoint_every=0", "trainer.progress=false", "trainer.precision=bf16",
        "optim.warmup_steps=1", "sampler.steps=2", "sampler.samples_per_class=2", "sampler.grid_classes=2"]
# MFU cases: JiT-B and JiT-L (conf/model/jit_b.yaml, jit_l.yaml) at 256 tokens
CASES = {
    "jit_b_256px": ["model=jit_b", "model.patch_size=16", "data.resolution=256", "trainer.global_batch_size=128",
                    "trainer.micro_batch_size=128", "data.num_workers=6"],
    "jit_l_256px": ["model=jit_l", "model.patch_size=16", "data.resolution=256", "trainer.global_batch_size=128",
                    "trainer.micro_batch_size=128", "data.num_workers=6"],
    "jit_l_1024px": ["model=jit_l", "model.patch_size=64", "data.resolution=1024", "trainer.global_batch_size=32",
                     "trainer.micro_batch_size=32", "data.num_workers=12"],
}
TINY = ["model=tiny", "model.patch_size=2", "data.resolution=8", "data.channels=3", "data.num_classes=10",
        "trainer.global_batch_size=4", "trainer.micro_batch_size=4", "data.synthetic_size=64"]
SMOKE_CASES = {"tiny_8px": TINY}
TRAIN = {  # the bf16 + NCCL check: a small generator at 32 px (64 tokens), 6 steps
    "gpu": ["model.width=256", "model.depth=4", "model.num_heads=4", "model.patch_size=4", "data.resolution=32",
            "data.num_classes=10", "trainer.global_batch_size=32", "trainer.micro_batch_size=32",
            "trainer.max_steps=6", "data.synthetic_size=512"],
    "smoke": [*TINY, "trainer.max_steps=3"],
}
# text conditioning: the train check's model with cross-attention to 16 caption tokens of the demo
# encoder ("tiny", built locally), captions filled from the synthetic classes, encoded by vitp-train
TEXT = ["data.captions=templates", 'data.caption_templates=["a {class_word}","class {class}"]',
        "data.text_encoder=tiny", "model.text_dim=32", "model.text_len=16", "objective.label_drop=0.2"]
TIMEOUT_S = {"bf16_nccl": 90, "sdpa": 75, "cp": 90, "text_bf16": 90}  # each mfu_<case>: MFU_TIMEOUT_S
MFU_TIMEOUT_S = 100
COMPILE_TIMEOUT_S = 150  # compile_<case>: the mfu check with trainer.compile=blocks (compile time included)
WARMUP, STEPS = 3, 10


def _device():
    import torch

    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _trainer(overrides: List[str], run_dir: Path):
    """The real trainer (1 rank: it starts an NCCL group on CUDA, gloo on CPU) for ``overrides``."""
    from vitp.config import compose
    from vitp.train import Trainer

    return Trainer(compose([*BASE, *overrides]), run_dir)


def _close(trainer) -> None:
    """Stop the data workers and give the run directory up (what ``fit`` does at its end)."""
    if trainer.batches is not None:
        trainer.batches.close()
    trainer.lock.release()


# ----------------------------------------------------------------------------- checks

def check_bf16_nccl(smoke: bool, work: Path) -> Dict[str, Any]:
    """Train a few bf16 steps with the real trainer on a 1-rank group; report backend and losses."""
    import torch

    trainer = _trainer(TRAIN["smoke" if smoke else "gpu"], work / "bf16_nccl")
    dtype = str(next(trainer.engine.module.parameters()).dtype)
    start = time.perf_counter()
    res = trainer.fit()
    backend = torch.distributed.get_backend()
    losses = res["losses"]
    want = "gloo" if smoke else "nccl"
    ok = backend == want and dtype == "torch.bfloat16" and len(losses) == trainer.cfg.trainer.max_steps \
        and all(math.isfinite(x) for x in losses) and trainer.layout.precision == "bf16"
    return {"ok": ok, "backend": backend, "param_dtype": dtype, "precision": trainer.layout.precision,
            "engine_zero_stage": trainer.layout.engine_zero_stage(trainer.cfg.parallel.zero_stage),
            "device": str(trainer.device), "losses": losses, "fit_s": time.perf_counter() - start,
            "summary": f"{backend}, {dtype.split('.')[-1]} weights, {len(losses)} steps, loss {losses[0]:.4g} -> "
                       f"{losses[-1]:.4g} ({'finite' if all(map(math.isfinite, losses)) else 'NOT finite'})"}


def check_text_bf16(smoke: bool, work: Path) -> Dict[str, Any]:
    """Text conditioning in bf16 with the real trainer: the captions encoded on the device into a
    store, cross-attention with the caption mask (SDPA with a boolean mask), finite losses, and
    the cross-attention's SDPA kernel."""
    import torch

    trainer = _trainer([*TRAIN["smoke" if smoke else "gpu"], *TEXT, f"data.text_embeddings={work / 'text_emb'}"],
                       work / "text_bf16")
    dtype = str(next(trainer.engine.module.parameters()).dtype)
    block = next(m for m in trainer.engine.module.modules() if hasattr(m, "cross_attn"))
    D = block.cross_attn.q.in_features
    x = torch.randn(2, 8, D, device=trainer.device, dtype=torch.bfloat16)
    ctx = torch.randn(2, 16, D, device=trainer.device, dtype=torch.bfloat16)
    mask = torch.ones(2, 16, dtype=torch.bool, device=trainer.device)
    mask[0, 5:] = False
    with torch.profiler.profile() as prof, torch.no_grad():
        block.cross_attn(x, ctx, mask)
    kernel = sdpa_kernel_of(e.name for e in prof.events())
    res = trainer.fit()
    losses = res["losses"]
    ok = dtype == "torch.bfloat16" and len(losses) == trainer.cfg.trainer.max_steps and \
        all(math.isfinite(v) for v in losses)
    return {"ok": ok, "param_dtype": dtype, "losses": losses, "cross_attention_kernel": kernel,
            "summary": f"{len(losses)} steps, loss {losses[0]:.4g} -> {losses[-1]:.4g}, cross-attention SDPA "
                       f"{kernel} (boolean caption mask)"}


SDPA_OPS = (("_scaled_dot_product_flash_attention_for_cpu", "flash (cpu)"),
            ("_scaled_dot_product_flash_attention", "flash"), ("_scaled_dot_product_efficient_attention", "efficient"),
            ("_scaled_dot_product_cudnn_attention", "cudnn"), ("_scaled_dot_product_attention_math", "math"))


def sdpa_kernel_of(op_names) -> str:
    """The SDPA backend named by the profiled ATen op names (``"flash"``, ``"efficient"``,
    ``"cudnn"``, ``"math"``, ``"flash (cpu)"``), or ``"none"`` when no SDPA op ran."""
    names = " ".join(op_names)
    return next((kind for op, kind in SDPA_OPS if op in names), "none")


def forced_backends(device, dtype, shape=(4, 12, 256, 64)) -> Dict[str, str]:
    """``{backend: "ok" | "no: <reason>"}``: SDPA forward + backward on ``(B, H, N, hd)`` tensors
    with ``torch.nn.attention.sdpa_kernel`` restricted to each backend."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g).to(device, dtype).requires_grad_() for _ in range(3))
    out = {}
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        backend = getattr(SDPBackend, name, None)
        key = name.lower().replace("_attention", "")
        with warnings.catch_warnings(record=True) as caught:  # torch warns why a backend cannot run
            warnings.simplefilter("always")
            try:
                with sdpa_kernel(backend):
                    F.scaled_dot_product_attention(q, k, v).float().sum().backward()
                out[key] = "ok"
            except Exception as e:  # "No available kernel"
                why = [str(w.message).splitlines()[0][:200] for w in caught] or [str(e).splitlines()[0][:200]]
                out[key] = "no: " + " | ".join(why[:3])
    return out


def check_sdpa(smoke: bool, work: Path) -> Dict[str, Any]:
    """Forced backends on a JiT-B head shape, then one profiled step of the real trainer."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    device = _device()
    forced = forced_backends(device, torch.bfloat16, (2, 2, 16, 16) if smoke else (4, 12, 256, 64))
    over = [*TINY, "trainer.max_steps=3"] if smoke else [*CASES["jit_b_256px"], "trainer.global_batch_size=16",
                                                         "trainer.micro_batch_size=16", "trainer.max_steps=3"]
    trainer = _trainer([*over, "trainer.log_every=1000"], work / "sdpa")
    trainer.train_step(1)  # warm-up: kernels chosen and compiled
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        trainer.train_step(2)
    _close(trainer)
    names = sorted({e.key for e in prof.key_averages()})
    ops = [n for n in names if "scaled_dot_product" in n]
    kernels = [n for n in names if not n.startswith("aten::") and any(s in n.lower() for s in (
        "flash", "fmha", "cudnn", "attention", "attn"))][:12]
    used = sdpa_kernel_of(ops)
    flash_ok = forced.get("flash") == "ok"
    return {"ok": flash_ok and used not in ("none", "math"), "model_kernel": used, "sdpa_ops": ops,
            "cuda_kernels": kernels, "forced": forced, "device": str(device),
            "summary": f"trainer step uses {used} ({', '.join(ops) or 'no SDPA op'}); forced: "
                       + ", ".join(f"{k} {'ok' if v == 'ok' else 'no'}" for k, v in forced.items())}


def _planner_prediction(trainer):
    """The planner's prediction for the trainer's layout on the profile ``parallel=auto`` would use."""
    from vitp.plan import layout_of, predict
    from vitp.train.autolayout import detect_profile

    cfg, world = trainer.cfg, 1
    prof = detect_profile(cfg, trainer.device, world)
    return prof, predict(cfg.model, layout_of(cfg, world, trainer.device.type), prof)


def check_mfu(smoke: bool, work: Path, case: str, extra: tuple = ()) -> Dict[str, Any]:
    """MFU, step time and peak memory of ``case`` (plus the overrides ``extra``) from the trainer's
    telemetry, against the planner."""
    import torch

    cases = SMOKE_CASES if smoke else CASES
    warm, steps = (1, 2) if smoke else (WARMUP, STEPS)
    # max_steps one beyond the timed steps: the trainer logs (and resets telemetry) at the last step
    trainer = _trainer([*cases[case], *extra, f"trainer.max_steps={warm + steps + 1}", "trainer.log_every=100000"],
                       work / f"mfu_{case}")
    for s in range(1, warm + 1):
        trainer.train_step(s)
    tel = trainer.telemetry
    tel.metrics(warm, 1.0)  # reset the counters after warm-up (the peak memory stays a process peak)
    times = []
    for s in range(warm + 1, warm + steps + 1):
        t0 = time.perf_counter()
        trainer.train_step(s)  # ends with loss.item(): the device has finished the step
        times.append(time.perf_counter() - t0)
    perf = tel.metrics(steps, sum(times))
    _close(trainer)
    prof, pred = _planner_prediction(trainer)
    measured_gib, predicted_gib = perf["perf/peak_mem_gib"], pred.peak.total / 2**30
    mfu = perf.get("perf/mfu", float("nan"))
    res = {"ok": math.isfinite(mfu) and mfu > 0, "case": cases[case], "steps": steps, "step_s": times,
           "median_step_s": statistics.median(times), "perf": perf, "tflops_per_step": tel.flops_per_step / 1e12,
           "tokens_per_step": tel.tokens_per_step, "device_profile": prof.as_dict(),
           "device_name": torch.cuda.get_device_name(0) if trainer.device.type == "cuda" else "cpu",
           "mfu": mfu, "mfu_excluding_data_wait": mfu / max(1e-9, 1 - perf["perf/data_wait_frac"]),
           "predicted": {"step_s": pred.time["step_s"], "mfu": pred.mfu, "peak_gib": predicted_gib,
                         "memory_gib": pred.as_dict()["memory_gib"]},
           "peak_mem_gib": measured_gib, "memory_measured_over_predicted": measured_gib / predicted_gib,
           "memory_measure": "torch.cuda.max_memory_allocated" if trainer.device.type == "cuda" else "max RSS"}
    res["summary"] = (f"MFU {mfu:.1%} (predicted {pred.mfu:.1%}; {res['mfu_excluding_data_wait']:.1%} without data "
                      f"waits), {statistics.median(times):.4g} s/step (predicted {pred.time['step_s']:.4g}), "
                      f"{perf['perf/tflops']:.4g} TFLOP/s; peak {measured_gib:.3g} GiB vs predicted "
                      f"{predicted_gib:.3g} GiB ({res['memory_measured_over_predicted']:.2f}x, "
                      f"{res['memory_measure']}); data wait {perf['perf/data_wait_frac']:.0%}")
    return res


def check_compile(smoke: bool, work: Path, case: str) -> Dict[str, Any]:
    """``trainer.compile=blocks`` on ``case``: :func:`check_mfu` compiled (compile time in the
    warm-up steps, from :func:`vitp.models.compiled.compile_stats`), set against the eager
    ``mfu_<case>`` result of the same run when it is there (``compiled / eager`` MFU and step time)."""
    from vitp.models.compiled import compile_stats

    res = check_mfu(smoke, work, case, extra=("trainer.compile=blocks",))
    res["compile"] = compile_stats()
    eager_file = Path(os.environ.get("VITP_GPU_CHECK_OUT", ".")) / f"mfu_{case}.json"
    if eager_file.is_file():
        eager = json.loads(eager_file.read_text())
        if eager.get("ok"):
            res["eager_mfu"], res["compiled_over_eager_mfu"] = eager["mfu"], res["mfu"] / eager["mfu"]
            res["compiled_over_eager_step"] = res["median_step_s"] / eager["median_step_s"]
    res["summary"] = (f"compiled blocks: {res['summary']}; compile {res['compile']['compile_s']:.1f} s, "
                      f"{res['compile']['graphs']} graphs, {res['compile']['graph_breaks']} graph breaks"
                      + (f"; compiled / eager MFU {res['compiled_over_eager_mfu']:.3f}, step "
                         f"{res['compiled_over_eager_step']:.3f}" if "eager_mfu" in res else ""))
    return res


# ----------------------------------------------------------------------------- context parallelism

CP_MODEL = {  # (a small video generator; grid (gt, gh, gw), full attention)
    # 8 frames of 32x32 at patch 4: grid (8, 8, 8), N = 512, width 256, 4 heads of 64 (flash), bf16
    "gpu": ["data.channels=3", "data.num_classes=10", "data.num_frames=8", "data.resolution=32", "model.patch_size=4",
            "model.tubelet_size=1", "model.width=256", "model.depth=2", "model.num_heads=4"],
    # 4 frames of 8x8 at patch 2: grid (4, 4, 4), N = 64, width 32, 4 heads of 8, fp32
    "smoke": ["data.channels=3", "data.num_classes=10", "data.num_frames=4", "data.resolution=8", "model.patch_size=2",
              "model.tubelet_size=1", "model.width=32", "model.depth=2", "model.num_heads=4"],
}
CP_BATCH = 2
# max |a - b| / max |b| of the loss and of every parameter gradient against cp = 1 (same dtype):
# bf16 keeps 8 bits of mantissa (eps 2^-8 = 0.0039); fp32 for the CPU smoke run
CP_TOL = {"gpu": {"loss": 2e-2, "grad": 5e-2}, "smoke": {"loss": 1e-5, "grad": 1e-4}}


def _cp_step(model, batch, dtype, device):
    """Loss and parameter gradients of one micro-batch; SDPA restricted to flash (CPU: its CPU
    flash kernel), so a fallback to another backend fails the check instead of passing it."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from vitp.objectives import FlowMatchingLoss

    (z, t, y), x = batch
    model.zero_grad(set_to_none=True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        loss = FlowMatchingLoss(0.05)(model(z.to(device), t.to(device), y.to(device)),
                                      (x.to(device), z.to(device), t.to(device)))
        loss.backward()
    return loss.detach().float(), {n: p.grad.detach().float() for n, p in model.named_parameters()}


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def cp_rank_main(smoke: bool, out: Path) -> int:
    """One rank of :func:`check_cp` (under torchrun, 2 ranks): the same generator and batch on
    every rank, cp = 1 on each rank alone, then cp = 2 Ulysses and ring over both ranks (gradients
    summed over the cp group and divided by cp, as the dp x cp reduction of training does);
    rank 0 writes ``out/cp_ranks.json``."""
    import torch
    import torch.distributed as tdist

    from vitp.config import compose, parse_resolution
    from vitp.models import Generator, parallelize_generator, token_grid
    from vitp.parallel import distributed as dist
    from vitp.parallel import make_state

    kind = "smoke" if smoke else "gpu"
    device = torch.device("cpu") if smoke else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_distributed(device)
    dtype = torch.float32 if smoke else torch.bfloat16
    cfg = compose(["data=synthetic", *CP_MODEL[kind]])
    m = cfg.model
    (H, W), g = parse_resolution(m.image_size), torch.Generator().manual_seed(0)
    x = torch.randn(CP_BATCH, m.in_channels, m.num_frames, H, W, generator=g)
    z, t, y = torch.randn(x.shape, generator=g), torch.rand(CP_BATCH, generator=g), torch.tensor([1, 10])
    batch = ((z, t, y), x)

    def build():  # adaLN-Zero starts as the identity: random weights make every gradient non-trivial
        model = Generator.from_config(m, seed=0)
        noise = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=noise))
        return model.to(device, dtype)

    ref_loss, ref_grads = _cp_step(build(), batch, dtype, device)
    res = {"backend": tdist.get_backend(), "dtype": str(dtype), "world": tdist.get_world_size(),
           "tokens": math.prod(token_grid(m.image_size, m.num_frames, m.patch_size, m.tubelet_size)),
           "tol": CP_TOL[kind], "ref_loss": float(ref_loss), "modes": {}}
    for mode in ("ulysses", "ring"):
        state = make_state(tp=1, cp=2, cp_mode=mode)
        model = build()
        parallelize_generator(model, state, grid=token_grid(m.image_size, m.num_frames, m.patch_size, m.tubelet_size))
        loss, grads = _cp_step(model, batch, dtype, device)
        for gr in grads.values():
            tdist.all_reduce(gr, group=state.cp_group)
            gr /= state.cp_size
        errs = {n: _rel(gr, ref_grads[n]) for n, gr in grads.items() if n in ref_grads}
        worst = max(errs, key=errs.get)
        res["modes"][mode] = {"loss": float(loss), "loss_rel": _rel(loss, ref_loss), "grad_rel": errs[worst],
                              "worst": worst, "same_params": sorted(grads) == sorted(ref_grads)}
    if tdist.get_rank() == 0:
        (out / "cp_ranks.json").write_text(json.dumps(res, indent=1))
    tdist.barrier()
    return 0


def check_cp(smoke: bool, work: Path) -> Dict[str, Any]:
    """cp = 2 (Ulysses and ring) of a small video generator on 2 GPUs (NCCL, bf16, flash SDPA)
    against cp = 1, launched with torchrun; skipped with fewer than 2 GPUs. ``smoke``: 2 CPU
    processes with gloo at fp32."""
    import torch

    gpus = torch.cuda.device_count()
    if not smoke and gpus < 2:
        return {"ok": True, "skipped": True, "gpus": gpus,
                "summary": f"SKIPPED: cp=2 needs 2 GPUs, this machine has {gpus}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(Path(__file__).resolve()), "--cp-rank", "--out", str(work)] + (["--cpu-smoke"] if smoke else [])
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    path = work / "cp_ranks.json"
    if p.returncode != 0 or not path.is_file():
        return {"ok": False, "exit_code": p.returncode, "log_tail": (p.stdout + p.stderr)[-3000:],
                "summary": f"torchrun exited {p.returncode}"}
    res = json.loads(path.read_text())
    tol = res["tol"]
    res["ok"] = res["world"] == 2 and res["backend"] == ("gloo" if smoke else "nccl") and all(
        r["loss_rel"] <= tol["loss"] and r["grad_rel"] <= tol["grad"] and r["same_params"] for r in res["modes"].values())
    res["summary"] = f"{res['backend']}, {res['dtype'].split('.')[-1]}, N={res['tokens']}: " + ", ".join(
        f"{k} loss {r['loss_rel']:.2g} grad {r['grad_rel']:.2g}" for k, r in res["modes"].items()) \
        + f" (rel. to cp=1; tol {tol['loss']:g} / {tol['grad']:g})"
    return res


def checks(smoke: bool) -> Dict[str, tuple]:
    """``{name: (function, kwargs, timeout_s)}`` in run order."""
    out: Dict[str, tuple] = {"bf16_nccl": (check_bf16_nccl, {}, TIMEOUT_S["bf16_nccl"]),
                             "sdpa": (check_sdpa, {}, TIMEOUT_S["sdpa"]), "cp": (check_cp, {}, TIMEOUT_S["cp"]),
                             "text_bf16": (check_text_bf16, {}, TIMEOUT_S["text_bf16"])}
    for case in SMOKE_CASES if smoke else CASES:
        out[f"mfu_{case}"] = (check_mfu, {"case": case}, MFU_TIMEOUT_S)
    if not smoke:  # compiled against eager MFU on the first case (on a GPU only: a CPU compile takes minutes)
        case = next(iter(CASES))
        out[f"compile_{case}"] = (check_compile, {"case": case}, COMPILE_TIMEOUT_S)
    return out


# ----------------------------------------------------------------------------- runner

def run_one(name: str, smoke: bool, out: Path) -> int:
    """In the child process: run check ``name`` (its run directories in a temporary folder), write
    ``out/<name>.json``; exit status 0 if ok."""
    fn, kwargs, _ = checks(smoke)[name]
    os.environ["VITP_GPU_CHECK_OUT"] = str(out)  # compile_<case> reads the eager mfu_<case> result there
    try:
        with tempfile.TemporaryDirectory(prefix="vitp-gpu-check-") as work:  # run dirs: not sent back with out
            res = fn(smoke, Path(work), **kwargs)
    except BaseException as e:
        res = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:],
               "summary": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    (out / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))
    return 0 if res.get("ok") else 1


def _child_env(smoke: bool) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    if smoke:
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return env


def spawn(name: str, smoke: bool, out: Path, timeout_s: float) -> Dict[str, Any]:
    """Run check ``name`` in a fresh process group with a timeout; its result, status and time."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--check", name, "--out", str(out)]
    log = out / f"{name}.log"
    start, status = time.perf_counter(), "ok"
    (out / f"{name}.json").unlink(missing_ok=True)
    with open(log, "w") as f:
        p = subprocess.Popen(cmd + (["--cpu-smoke"] if smoke else []), stdout=f, stderr=subprocess.STDOUT,
                             env=_child_env(smoke), cwd=REPO, start_new_session=True)
        try:
            rc = p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the check and its DataLoader workers
            p.wait()
            rc, status = None, "timeout"
        except BaseException:  # SIGTERM of the whole run (Stopped), Ctrl-C: end the check's group too
            os.killpg(p.pid, signal.SIGKILL)
            raise
    path = out / f"{name}.json"
    res = json.loads(path.read_text()) if path.is_file() else {}
    if status == "ok" and not (rc == 0 and res.get("ok")):
        status = "FAILED"
    entry = {"status": status, "seconds": round(time.perf_counter() - start, 1), "timeout_s": timeout_s,
             "exit_code": rc, "result": res}
    if status != "ok":
        entry["log_tail"] = log.read_text(errors="replace")[-3000:]
    return entry


class Stopped(Exception):
    """SIGTERM reached the runner (``timeout`` in scripts/gpu_check.sh)."""


def _stop(signum, frame):
    raise Stopped()


def table(results: Dict[str, Dict[str, Any]]) -> str:
    """One text table: check, status, seconds, summary."""
    rows = [("check", "status", "s", "result")]
    for name, r in results.items():
        summary = r["result"].get("summary") or (f"no result within {r['timeout_s']} s" if r["status"] == "timeout"
                                                  else "no result (see the log)")
        rows.append((name, r["status"], f"{r['seconds']:.0f}", summary))
    w = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(f"{a:<{w[0]}}  {b:<{w[1]}}  {c:>{w[2]}}  {d}" for a, b, c, d in rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out", help="results folder (default: $OUT)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU with gloo (tests the script)")
    p.add_argument("--only", default=None, help="comma-separated checks to run (default: all)")
    p.add_argument("--check", default=None, help=argparse.SUPPRESS)  # internal: run one check in this process
    p.add_argument("--cp-rank", action="store_true", help=argparse.SUPPRESS)  # internal: a torchrun rank of cp
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.cp_rank:
        return cp_rank_main(args.cpu_smoke, out)
    if args.check:
        return run_one(args.check, args.cpu_smoke, out)
    todo = checks(args.cpu_smoke)
    names = args.only.split(",") if args.only else list(todo)
    unknown = [n for n in names if n not in todo]
    if unknown:
        p.error(f"unknown checks {unknown}; valid: {list(todo)}")
    results: Dict[str, Dict[str, Any]] = {}
    meta = {"cpu_smoke": args.cpu_smoke, "when": time.strftime("%Y-%m-%d %H:%M:%S"), "python": sys.version.split()[0]}
    signal.signal(signal.SIGTERM, _stop)
    for name in names:
        print(f"gpu_check: {name} (timeout {todo[name][2]} s) ...", flush=True)
        try:
            results[name] = spawn(name, args.cpu_smoke, out, todo[name][2])
        except Stopped:
            results[name] = {"status": "stopped", "seconds": 0.0, "timeout_s": todo[name][2], "exit_code": None,
                             "result": {"summary": "the whole run was stopped (SIGTERM) during this check"}}
        (out / "gpu_check.json").write_text(json.dumps({**meta, "checks": results}, indent=1, default=str))
        if results[name]["status"] == "stopped":
            break
    print(table(results))
    ok = all(r["status"] == "ok" for r in results.values())
    print(json.dumps({"results": str(out / "gpu_check.json"), "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
