"""Shared test helpers: config composition and multi-process runs (gloo, CPU)."""
from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

import json  # noqa: E402
from pathlib import Path  # noqa: E402

from vitp.config import compose as compose_cfg  # noqa: E402,F401
from vitp.parallel.local_group import run_local_group  # noqa: E402
from vitp.utils import free_port  # noqa: E402

# Forked from one server that imported these once (the suite starts ~100 ranks); the second line
# is what a training run imports on first use (checkpoints, TensorBoard, text encoders, image
# transforms): 1.9 s -> 0.9 s for a rank's first smoke run. The last entry is what DeepSpeed's ZeRO
# optimizer imports at its first gradient reduction (DeepSpeedZeroOptimizer.average_tensor imports
# its Muon optimizer, whose kernels compile at import: inductor, 0.9 CPU-s of every ZeRO rank).
_PRELOAD = ["torch", "deepspeed", "timm", "albumentations", "hydra", "vitp.train", "vitp.data", "vitp.eval",
            "vitp.pipeline", "tests.helpers",
            "scipy.stats", "torch.distributed.checkpoint", "torch.utils.tensorboard", "transformers",
            "deepspeed.runtime.zero.muon.muon_optimizer"]


def run_ranks(world: int, fn, *args, timeout: float = 300):
    """Run ``fn(rank, *args)`` in ``world`` fresh processes forming one gloo group; returns the
    results ordered by rank. ``fn`` must be importable (module level). A failing rank raises
    ``AssertionError`` with its traceback."""
    try:
        return run_local_group(world, fn, *args, timeout=timeout, preload=_PRELOAD)
    except RuntimeError as e:
        raise AssertionError(str(e)) from None


def run_ranks_until_killed(world: int, fn, *args, kill_rank: int, timeout: float = 300) -> None:
    """``fn(rank, *args)`` on ``world`` ranks forked as :func:`run_ranks` forks them, of which rank
    ``kill_rank`` must die by SIGKILL (the fault hook :data:`vitp.checkpoint.KILL_HOOK`); then the
    others, waiting in a collective for the dead rank, are killed too, as a crashed job's."""
    import signal
    import time

    from vitp.parallel.local_group import start_local_group

    procs, queue = start_local_group(world, fn, *args, preload=_PRELOAD)
    procs[kill_rank].join(timeout=timeout)
    died = procs[kill_rank].exitcode
    time.sleep(1)
    for p in procs:
        p.kill()
        p.join()
    reports = []
    while not queue.empty():  # ranks that returned or raised before the kill
        reports.append(queue.get())
    assert died == -signal.SIGKILL, (died, reports)


def train_rank_killed(rank, hook, overrides, run_dir):
    """:func:`train_rank` with :data:`vitp.checkpoint.KILL_HOOK` set to ``hook`` ("<rank>:<step>")."""
    from vitp.checkpoint import KILL_HOOK

    os.environ[KILL_HOOK] = hook
    return train_rank(rank, overrides, run_dir)


def train_rank(rank, overrides, run_dir):
    """``vitp.train.train`` on one rank of :func:`run_ranks`; returns per-step losses and grad norms."""
    from vitp.config import compose
    from vitp.train import train

    res = train(compose(overrides), run_dir)
    return {k: res[k] for k in ("losses", "grad_norms", "stopped_at")}


def launch(world, args, run_dir, env_extra=None):
    """Start ``python -m vitp.train *args`` as ``world`` ranks the way torchrun would (env://);
    returns the ``Popen`` objects (output in ``run_dir.parent / f"rank{r}.log"``)."""
    import subprocess
    import sys

    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", **(env_extra or {}))
        out = open(run_dir.parent / f"rank{r}.log", "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "vitp.train", *args, f"hydra.run.dir={run_dir}"],
                                      env=env, stdout=out, stderr=subprocess.STDOUT, cwd=run_dir.parent))
    return procs


# tp=2 x pp=2 with dropout in attention, projections and drop-path (so the TP and default RNG
# streams matter), a checkpoint every 2 steps and the held-out evaluation at the end (at 2 noise
# levels: the pipelined held-out loss is most of such a run's time at 10).
TP2PP2 = ["experiment=smoke", "trainer.max_steps=4", "model.depth=3", "parallel.tp=2", "parallel.pp=2",
          "model.attn_drop=0.2", "model.proj_drop=0.1", "model.drop_path=0.1", "trainer.checkpoint_every=2",
          "eval.enabled=true", "eval.classifier_epochs=1", "eval.num_samples=20", "eval.t_grid=2"]




REFERENCE = Path(__file__).parent / "fixtures" / "reference"
PERTURBED = REFERENCE / "perturbed.safetensors"  # the smoke model with non-zero adaLN gates (record_reference.py)
SMOKE4 = ["experiment=smoke", "trainer.max_steps=4"]
TIME_KEYS = ("samples_per_s",)
TELEMETRY_PREFIXES = ("perf/", "comm/", "data/")  # wall time, memory, traffic, skipped samples (vitp.train.telemetry)


def metrics(run_dir) -> list:
    """``metrics.jsonl`` rows of a run without its wall-time and telemetry columns."""
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in TIME_KEYS and not k.startswith(TELEMETRY_PREFIXES)}
            for row in rows]


def recorded(name: str) -> list:
    """The recorded reference rows ``tests/fixtures/reference/<name>.jsonl``."""
    return [json.loads(x) for x in (REFERENCE / f"{name}.jsonl").read_text().splitlines()]


def assert_rows_close(rows: list, ref: list, rel: float) -> None:
    """Same steps and keys; every value within ``rel`` relative tolerance of ``ref``."""
    import pytest

    assert [r["step"] for r in rows] == [r["step"] for r in ref]
    for a, b in zip(rows, ref):
        assert a.keys() == b.keys(), (a, b)
        assert a == pytest.approx(b, rel=rel), (a, b)


def reference_rank(rank: int, cases: dict, base: str) -> dict:
    """Train every ``{name: overrides}`` case on this rank, each in ``base/name``; a case whose
    overrides hold ``trainer.exit_at_step`` is run again without it (resumed)."""
    out = {}
    for name, over in cases.items():
        res = train_rank(rank, over, f"{base}/{name}")
        if any(o.startswith("trainer.exit_at_step=") for o in over):
            res = train_rank(rank, [o for o in over if not o.startswith("trainer.exit_at_step=")], f"{base}/{name}")
        out[name] = res
    return out


def reference_cases(init: str) -> dict:
    """``{world size: {case name: overrides}}`` of the recorded cases for ``init`` (default|perturbed)."""
    extra = [f"trainer.init_from={PERTURBED}"] if init == "perturbed" else []
    return {
        1: {f"{init}_tp1pp1": [*SMOKE4, *extra], f"{init}_resume": [*SMOKE4, *extra, "trainer.exit_at_step=2"]},
        2: {f"{init}_tp2sp": [*SMOKE4, *extra, "parallel.tp=2", "parallel.sequence_parallel=true"]},
        4: {f"{init}_tp2pp2": [*SMOKE4, *extra, "parallel.tp=2", "parallel.pp=2"]},
    }


def compiled_cases() -> dict:
    """``{world size: {case name: overrides}}``: the perturbed recorded cases with
    ``trainer.compile=blocks``, named ``compiled_<layout>`` (``compiled_resume`` stops at step 2
    and resumes)."""
    return {world: {name.replace("perturbed_", "compiled_"): [*over, "trainer.compile=blocks"]
                    for name, over in cases.items()}
            for world, cases in reference_cases("perturbed").items()}


# LoRA on the generator from the perturbed export (B drawn non-zero so every path matters from step 1):
# the fused qkv's q and v pieces, the attention's proj and the MLP's fc2
GEN_LORA = [*SMOKE4, f"trainer.init_from={PERTURBED}", "trainer.lora.enabled=true", "trainer.lora.rank=4",
            "trainer.lora.alpha=6", "trainer.lora.targets=[q,v,attn.proj,fc2]", "trainer.lora.b_init_std=0.05"]


def lora_cases(base: str) -> dict:
    """``{world size: {case name: overrides}}`` of the generator's LoRA runs that ride on the reference
    groups (:func:`reference_rank`, run dirs under ``base``): ``lora_tp1pp1`` and ``lora_tp2sp`` (4
    steps of :data:`GEN_LORA`), and ``lora_cont`` (one step at lr 0 continuing ``lora_tp1pp1``'s
    ``RUN/lora``, its rank, alpha and targets taken from the file)."""
    cont = [*SMOKE4, f"trainer.init_from={PERTURBED}", "trainer.lora.enabled=true", "optim.lr=0",
            "trainer.max_steps=1", f"trainer.lora.init_from={base}/lora_tp1pp1/lora"]
    return {1: {"lora_tp1pp1": GEN_LORA, "lora_cont": cont},
            2: {"lora_tp2sp": [*GEN_LORA, "parallel.tp=2", "parallel.sequence_parallel=true"]}, 4: {}}


# Two model sizes the planner is validated on (tests/unit/test_plan.py, tests/distributed/test_plan_validation.py):
# "S" an image model (GELU MLP, full attention, 8x8 = 64 tokens of 16 px RGB); "V" a video model (SwiGLU,
# qk-norm, factorized space/time attention, 2 x 3 x 3 = 18 tokens: padded under SP at tp=4).
PLAN_MODELS = {
    "S": ["experiment=smoke", "data=synthetic", "data.synthetic_size=64", "data.resolution=16", "data.channels=3",
          "data.num_classes=10", "model.width=64", "model.depth=4", "model.num_heads=4", "model.mlp_ratio=4"],
    "V": ["experiment=smoke", "data=synthetic", "data.synthetic_size=64", "data.resolution=12", "data.channels=3",
          "data.num_classes=10", "data.num_frames=4", "model.tubelet_size=2", "model.patch_size=4", "model.width=96",
          "model.depth=4", "model.num_heads=4", "model.mlp_ratio=4", "model.mlp=swiglu", "model.qk_norm=true",
          "model.attention=factorized"],
}
# "T": model S conditioned on captions (16 caption tokens of the demo encoder, 32 channels), its
# store encoded by the first training run into TEXT_STORE (the test substitutes a folder)
TEXT_STORE = "@TEXT_STORE@"
PLAN_MODELS["T"] = [*PLAN_MODELS["S"], "data.captions=templates", 'data.caption_templates=["a {class_word}","class {class}"]',
                    "data.text_encoder=tiny", f"data.text_embeddings={TEXT_STORE}", "model.text_dim=32",
                    "model.text_len=16"]


def plan_case(model: str, tp: int, pp: int, dp: int, sp: bool = False, ac: int = 0, extra=(), cp: int = 1) -> list:
    """Overrides of a planner validation case: :data:`PLAN_MODELS` ``model`` in layout ``tp x pp x dp``
    (sequence parallel ``sp``, checkpoint interval ``ac``, context-parallel degree ``cp``: world
    ``tp cp pp dp``), micro-batch 2 and 4 micro-batches per step."""
    return [*PLAN_MODELS[model], f"parallel.tp={tp}", f"parallel.pp={pp}",
            f"parallel.sequence_parallel={str(sp).lower()}", f"parallel.activation_checkpoint_interval={ac}",
            "trainer.micro_batch_size=2", f"trainer.global_batch_size={8 * dp}", *extra] + (
        [f"parallel.cp={cp}"] if cp > 1 else [])


def make_tiny_wan():
    """``scripts/make_tiny_wan.py`` as a module (its tiny diffusers Wan builders and ``main``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tiny_wan", Path(__file__).parents[1] / "scripts" / "make_tiny_wan.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def eval_weights_script():
    """``scripts/make_random_eval_weights.py`` as a module (its ``random_inception``, ``random_clip``,
    ``random_i3d`` and ``main`` write the random-weight feature networks of docs/evaluation.md)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "make_random_eval_weights", Path(__file__).parents[1] / "scripts" / "make_random_eval_weights.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
