"""Smoke runs of ``scripts/``: each benchmark runs as a subprocess with its smallest arguments and
prints numbers that are checked here, so the scripts cannot rot when the package changes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
SCHEDULES = ("deepspeed_1f1b", "torch_1f1b", "torch_interleaved_1f1b")  # scripts/bench_schedule.py's variants


def _run(args, tmp_path: Path) -> str:
    """Run ``args`` (after ``sys.executable``) from the repo root with a CPU environment; return stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "NO_ALBUMENTATIONS_UPDATE": "1",
           "TMPDIR": str(tmp_path)}
    p = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"exit {p.returncode}\n--- stdout\n{p.stdout[-4000:]}\n--- stderr\n{p.stderr[-4000:]}"
    return p.stdout


def _json_object(stdout: str, key: str) -> dict:
    """The first JSON object in ``stdout`` (one line or indented) holding ``key``; other lines are logs."""
    decoder = json.JSONDecoder()
    lines = stdout.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.lstrip().startswith("{"):
            try:
                obj, _ = decoder.raw_decode("".join(lines[i:]).lstrip())
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict) and key in obj:
                return obj
    raise AssertionError(f"no JSON object with {key!r} in the output:\n{stdout[-4000:]}")


@pytest.mark.slow
def test_benchmark_train(tmp_path):
    run_dir = tmp_path / "run"
    # the tiny smoke model on 8x8 synthetic RGB images: N = 16 tokens, global batch 8
    out = _json_object(_run(["scripts/benchmark_train.py", "experiment=smoke", "data.resolution=8", "--steps", "3",
                             "--warmup", "1", "--peak-tflops", "1", "--run-dir", str(run_dir)], tmp_path),
                       "samples_per_s")
    assert out["world_size"] == 1 and out["tokens_per_sample"] == 16
    sps = out["samples_per_s"]
    assert sps > 0 and out["step_time_s"] == pytest.approx(8 / sps, rel=0.01, abs=1e-4)
    # by hand: depth 2, D 32, GELU MLP hidden 64, N 16, patch 3*2*2 = 12 values; per sample: adaLN
    # (D x 6D per block, D x 2D final) and the timestep MLP (256 x D, D x D)
    D, N, hidden, patch = 32, 16, 64, 12
    fwd = 2 * (2 * (4 * D * D + 2 * D * hidden) * N + 4 * N * N * D + 2 * D * 6 * D) + 2 * 2 * N * D * patch \
        + 2 * (256 * D + D * D) + 2 * D * 2 * D
    assert out["model_tflops_per_sample"] == pytest.approx(3 * fwd / 1e12, rel=1e-9)
    assert out["achieved_tflops_per_process"] == pytest.approx(sps * 3 * fwd / 1e12, abs=1e-4)
    assert 0 < out["mfu"] <= 1 and out["mfu"] == pytest.approx(sps * 3 * fwd / 1e12, abs=1e-4)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["samples_per_s"] > 0 for r in rows)


def _json_objects(stdout: str, key: str) -> list:
    """Every JSON object in ``stdout`` holding ``key``, in order (one line or indented; other text skipped)."""
    decoder, out, i = json.JSONDecoder(), [], 0
    while (j := stdout.find("{", i)) >= 0:
        try:
            obj, i = decoder.raw_decode(stdout, j)
        except json.JSONDecodeError:
            i = j + 1
            continue
        if isinstance(obj, dict) and key in obj:
            out.append(obj)
    return out


@pytest.fixture(scope="module")
def tp_comm(tmp_path_factory):
    """``scripts/benchmark_tp_comm.py --batch 2 --sp both --partial-sync 1,0.5`` in one torchrun launch
    of 2 processes: ``{(sequence_parallel, partial_sync): its JSON object}``."""
    args = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "scripts/benchmark_tp_comm.py",
            "--batch", "2", "--sp", "both", "--partial-sync", "1,0.5"]
    objs = _json_objects(_run(args, tmp_path_factory.mktemp("tp_comm")), "theory_block_linears")
    assert [(o["sequence_parallel"], o["partial_sync"]) for o in objs] == [(False, 1.0), (False, 0.5), (True, 1.0),
                                                                          (True, 0.5)]
    return {(o["sequence_parallel"], o["partial_sync"]): o for o in objs}


@pytest.mark.slow
def test_benchmark_tp_comm(tp_comm):
    """tp=2 with sequence parallelism (the traffic of both modes is checked in detail by
    tests/distributed/parallel; this keeps the script itself working)."""
    out = tp_comm[(True, 1.0)]
    # default config: the digits demo model, 16 tokens of width 128, 6 blocks; tp = 2 divides N
    assert out["tp"] == 2 and out["sequence_parallel"] is True and out["depth"] == 6 and out["tokens"] == 16
    bnd = 2 * 16 * 128 * 4
    assert out["B*N*D_bytes"] == bnd
    kinds = ("all_gather", "reduce_scatter")
    theory = out["theory_block_linears"]
    # backward all-gathers: the reduce-scatters' transposes plus the re-gathered column-parallel inputs
    assert theory == {f"{k}/{d}/tp": (4 if (k, d) == ("all_gather", "bwd") else 2) * 6 * bnd
                      for k in kinds for d in ("fwd", "bwd")}
    rtol = out["rtol"]
    assert 0 <= rtol < 0.01
    for key, expected in theory.items():
        measured = out["measured"][key]
        assert measured["count"] == expected // bnd, key
        assert abs(measured["bytes"] - expected) <= rtol * expected, (key, measured, expected)
        assert out["relative_error"][key] <= rtol
    assert out["within_rtol"] is True
    # all-gather / reduce-scatter send (p-1)/p n per rank: at p = 2 the block linears alone cost half
    # of sum(theory); SP adds the token split/merge and the adaLN conditioning all-reduces
    assert out["wire_bytes_per_rank"] > sum(theory.values()) // 2
    assert out["step_wall_s"] > 0
    plain = tp_comm[(False, 1.0)]  # without SP: the same bytes as 2 all-reduces per block each way
    assert plain["theory_block_linears"] == {f"all_reduce/{d}/tp": 2 * 6 * bnd for d in ("fwd", "bwd")}
    assert plain["within_rtol"] is True


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True])
def test_benchmark_tp_comm_partial_sync(tp_comm, sp):
    """``--partial-sync 0.5``: the block linears move half the channels (64 of 128), measured = theory."""
    out = tp_comm[(sp, 0.5)]
    half = 2 * 16 * 64 * 4 * 2 * 6  # B N k fp32, 2 per block, 6 blocks
    kinds = ("all_gather", "reduce_scatter") if sp else ("all_reduce",)
    assert out["partial_sync"] == 0.5 and out["theory_block_linears"] == {
        f"{k}/{d}/tp": half for k in kinds for d in ("fwd", "bwd")}
    assert out["within_rtol"] is True and all(out["measured"][k]["bytes"] == half for k in out["theory_block_linears"])


@pytest.fixture(scope="module")
def bench_quick(tmp_path_factory):
    """``scripts/bench.py --quick`` run once for the module (every section but ``compile``, ``cp``
    included): ``(results, Markdown)``."""
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "bench"
    _run(["scripts/bench.py", "--quick", "--out", str(out)], tmp)
    return json.loads(out.with_suffix(".json").read_text()), out.with_suffix(".md").read_text()


@pytest.mark.slow
def test_bench_quick(bench_quick):
    """``scripts/bench.py --quick``: every section on the tiny model writes its JSON and Markdown."""
    res, md = bench_quick
    r = res["overhead"]["tiny"]
    assert r["reps"] == 2 and r["vitp_ms"] > 0 and r["plain_ms"] > 0 and r["min"] <= r["ratio"] <= r["max"]
    assert r["first_loss"]["vitp"] == pytest.approx(r["first_loss"]["plain"], rel=1e-5)  # the same model and batch
    tp = res["tp"]["tiny"]
    assert tp["first_loss"]["vitp_tp"] == pytest.approx(tp["first_loss"]["dtensor"], rel=1e-5)
    assert tp["first_loss"]["vitp_sp"] == pytest.approx(tp["first_loss"]["vitp_tp"], rel=1e-5)
    for mode in ("tp", "sp"):  # every collective as theory has it (count and bytes)
        for key, row in tp["comm"][mode]["per_collective"].items():
            assert (row["count"], row["bytes"]) == (row["theory_count"], row["theory_bytes"]), (mode, key, row)
    assert len(res["memory"]["ranks"]) == 4
    act = res["activations"]["ratio_vs_tp1"]
    assert 0 < act["tp2_sp"] < act["tp2"] < 1
    pipe = res["pipeline"]["pp2"]
    assert set(pipe["micro_batches"]) == {"1", "2"} and res["tokens"]["16"]["vitp_ms"] > 0
    for m, row in pipe["micro_batches"].items():  # every stage's idle time set against 1F1B from the timeline
        assert set(row["stages"]) == {"0", "1"} and row["cpu_bound_ms"] > 0, row
        for st in row["stages"].values():
            assert st["idle_1f1b_ms"] > 0 and st["idle_ms"] > 0 and 0.5 < st["recorded"] <= 1.0, row
    assert "vs_previous" not in pipe["micro_batches"]["1"] and pipe["micro_batches"]["2"]["vs_previous"]["m"] == 1
    prev = pipe["micro_batches"]["2"]["vs_previous"]
    assert prev["min"] <= prev["ratio"] <= prev["max"] and pipe["non_increasing_paired"] == (prev["ratio"] <= 1)
    assert set(res["load"]) == set(res) - {"load", "quick", "reps", "steps", "when"}
    assert all(x["busy_processes"] == 0 and x["samples"] >= 1 and x["p10"] <= x["median"] <= x["p90"] for x in res["load"].values())
    assert "vitp / plain" in md and "1F1B theory" in md and "1F1B idle ms" in md and "Load during `pipeline`" in md


@pytest.mark.slow
def test_plan_step_order(tmp_path):
    """Two layout names on one process (the full comparison runs 8 layouts on 4 processes for minutes)."""
    env_cache = {"VITP_CACHE_DIR": str(tmp_path / "cache")}
    os.environ.update(env_cache)  # _run copies os.environ: a fresh CPU profile, measured once here
    try:
        out = _json_object(_run(["scripts/plan_step_order.py", "--world", "1", "--layouts", "1x1x4", "1x1x4 ac1",
                                 "--steps", "2", "--warmup", "1", "--rounds", "1"], tmp_path), "rows")
    finally:
        del os.environ["VITP_CACHE_DIR"]
    assert [r["layout"] for r in out["rows"]] == ["1x1x4", "1x1x4 ac1"] and out["profile"]["kind"] == "cpu"
    for row in out["rows"]:  # on one process: 1 x 1 x 1 without and with activation checkpointing
        assert row["measured_s"] > 0 and row["predicted_s"] > 0 and len(row["rounds_s"]) == 1
    assert sorted(r["rank_measured"] for r in out["rows"]) == [1, 2] and out["spearman"] in (-1.0, 1.0)


@pytest.mark.slow
def test_gpu_check_cpu_smoke(tmp_path):
    """``scripts/gpu_check.sh --cpu-smoke``: every check of the GPU script (bf16 training through the
    real trainer, the SDPA kernel, MFU and memory against the planner) on a tiny model, CPU and gloo."""
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "NO_ALBUMENTATIONS_UPDATE": "1",
           "TMPDIR": str(tmp_path), "PYTHON": sys.executable, "OUT": str(out), "VITP_CACHE_DIR": str(tmp_path / "c")}
    p = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu-smoke"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    table = p.stdout[p.stdout.index("check "):].splitlines()
    assert [row.split()[:2] for row in table[1:6]] == [["bf16_nccl", "ok"], ["sdpa", "ok"], ["cp", "ok"],
                                                       ["text_bf16", "ok"], ["mfu_tiny_8px", "ok"]]
    res = json.loads((out / "gpu_check.json").read_text())
    assert res["cpu_smoke"] is True and set(res["checks"]) == {"bf16_nccl", "sdpa", "cp", "text_bf16", "mfu_tiny_8px"}
    text = res["checks"]["text_bf16"]["result"]  # bf16 cross-attention with a boolean caption mask
    assert text["param_dtype"] == "torch.bfloat16" and len(text["losses"]) == 3 and text["cross_attention_kernel"]
    # cp: 2 torchrun ranks (gloo, fp32), cp = 2 Ulysses and ring against cp = 1 on a grid (4, 4, 4)
    cp = res["checks"]["cp"]["result"]
    assert (cp["backend"], cp["dtype"], cp["world"], cp["tokens"]) == ("gloo", "torch.float32", 2, 64)
    assert set(cp["modes"]) == {"ulysses", "ring"} and cp["ref_loss"] > 0
    for r in cp["modes"].values():
        assert r["same_params"] and r["loss_rel"] <= 1e-5 and 0 < r["grad_rel"] <= 1e-4
    train = res["checks"]["bf16_nccl"]["result"]
    assert (train["backend"], train["param_dtype"], train["precision"]) == ("gloo", "torch.bfloat16", "bf16")
    assert train["engine_zero_stage"] == 1 and len(train["losses"]) == 3 and all(0 < x < 10 for x in train["losses"])
    sdpa = res["checks"]["sdpa"]["result"]
    assert sdpa["forced"]["flash"] == "ok" and sdpa["forced"]["math"] == "ok"
    assert sdpa["model_kernel"] == "flash (cpu)" and "aten::_scaled_dot_product_flash_attention_for_cpu" in sdpa[
        "sdpa_ops"]
    mfu = res["checks"]["mfu_tiny_8px"]["result"]
    # tiny model: depth 2, D 32, GELU hidden 64; 8x8 RGB at patch 2: N = 16 tokens of 12 values; batch 4
    D, N, hidden, patch = 32, 16, 64, 12
    fwd = 2 * (2 * (4 * D * D + 2 * D * hidden) * N + 4 * N * N * D + 2 * D * 6 * D) + 2 * 2 * N * D * patch \
        + 2 * (256 * D + D * D) + 2 * D * 2 * D
    assert mfu["tokens_per_step"] == 4 * N and mfu["tflops_per_step"] == pytest.approx(3 * 4 * fwd / 1e12, rel=1e-9)
    perf, steps = mfu["perf"], mfu["step_s"]
    assert len(steps) == 2 and perf["perf/tokens_per_s"] == pytest.approx(2 * 4 * N / sum(steps), rel=1e-6)
    peak = mfu["device_profile"]["peak_flops"]["bf16"]
    assert 0 < mfu["mfu"] == pytest.approx(perf["perf/tflops"] * 1e12 / peak, rel=1e-9)
    assert mfu["predicted"]["peak_gib"] > 0 and mfu["peak_mem_gib"] == perf["perf/peak_mem_gib"] > 0
    assert mfu["memory_measured_over_predicted"] == pytest.approx(mfu["peak_mem_gib"] / mfu["predicted"]["peak_gib"])
    assert (out / "mfu_tiny_8px.log").is_file() and not list(out.glob("*_run"))  # run dirs stay out of OUT


@pytest.mark.slow
def test_bench_cp_quick(bench_quick):
    """``scripts/bench.py --quick``'s ``cp`` section (tiny video generator, N = 64): cp collectives of
    forward + backward equal theory exactly (count and logical bytes per collective, wire bytes per
    rank), the token-sharded saved activations at cp = 2 are about half of cp = 1, and vitp's
    Ulysses attention gives DeepSpeed's DistributedAttention output."""
    res = bench_quick[0]["cp"]
    rows = res["memory_comm"]
    assert set(rows) == {f"{a}/{m}/cp={c}" for a, m in (("full", "ulysses"), ("full", "ring"), ("factorized", "ulysses"))
                         for c in (1, 2, 4) if c > 1 or m == "ulysses"}
    # by hand, full attention Ulysses at cp = 2: T = B (N / cp) D e = 2 * 32 * 32 * 4 bytes; per block
    # all-to-all of 3T and T forward and backward (wire (cp-1)/cp = 1/2 of them), 2 blocks; the
    # prediction's gather B N P e with P = 4 * 4 * 3, wire 1/2
    T = 2 * 32 * 32 * 4
    assert rows["full/ulysses/cp=2"]["comm"]["wire_bytes"] == 2 * 2 * (3 * T + T) // 2 + 2 * 64 * 48 * 4 // 2
    for key, row in rows.items():
        comm = row["comm"]
        assert comm["equal"] and row["comm_equal_all_ranks"], (key, comm)
        assert comm["wire_bytes"] == comm["theory_wire_bytes"] and (comm["wire_bytes"] > 0) == (not key.endswith("=1"))
        for name, c in comm["per_collective"].items():
            assert (c["count"], c["bytes"]) == (c["theory_count"], c["theory_bytes"]), (key, name, c)
        assert row["others"] == 0 and row["loss"] == pytest.approx(rows["full/ulysses/cp=1"]["loss"], rel=1e-5)
    # saved activations: at this size the full-size tensors (pixels, targets) are 7 % of cp = 1's total
    assert 0.5 < rows["factorized/ulysses/cp=2"]["ratio_vs_cp1"]["cp_region"] <= 0.5 * 1.05
    # full attention keeps one more (B, N / cp, D) tensor per block than cp = 1 (measured +5.3 %)
    assert 0.5 < rows["full/ulysses/cp=2"]["ratio_vs_cp1"]["cp_region"] <= 0.5 * 1.06
    assert rows["full/ulysses/cp=2"]["ratio_vs_cp1"]["total"] > rows["full/ulysses/cp=2"]["ratio_vs_cp1"]["cp_region"]
    att = res["attention"]
    assert att["max_abs_diff"]["vitp_ulysses_vs_deepspeed"] < 1e-6 and att["max_abs_diff"]["vitp_ring_vs_unsharded"] < 1e-5
    assert att["first_loss"]["vitp_ulysses"] == pytest.approx(att["first_loss"]["deepspeed_ulysses"], rel=1e-6)
    r = att["vitp_vs_deepspeed"]
    assert r["reps"] == 2 and r["vitp_ulysses_ms"] > 0 and r["min"] <= r["ratio"] <= r["max"]


@pytest.mark.slow
def test_bench_data_small(tmp_path):
    """``scripts/bench_data.py`` in its small mode: 200 images in 2 shards, 6 clips; one repetition."""
    out = tmp_path / "bench_data.json"
    _run(["scripts/bench_data.py", "--work", str(tmp_path / "work"), "--images", "200", "--clips", "6", "--batches",
          "2", "--reps", "1", "--batch", "16", "--image-shard-size", "100", "--no-warm", "--out", str(out)], tmp_path)
    res = json.loads(out.read_text())
    d = res["data"]
    assert (d["images"]["files"], d["clips"]["files"]) == (200, 6) and d["images"]["bytes"] > 0
    assert (d["pack_images"]["samples"], d["pack_images"]["shards"]) == (200, 2)
    assert (d["pack_videos"]["samples"], d["pack_videos"]["shards"]) == (6, 1)
    assert d["pack_images"]["seconds"] > 0 and d["pack_images"]["bytes"] > d["images"]["bytes"]  # tar headers
    runs = {r["case"]: r for r in res["runs"]}
    assert list(runs) == ["image_folder", "image_shards", "video_folder", "video_shards"]
    for case, r in runs.items():
        assert all(r[m] > 0 for m in ("startup_s", "samples_per_s", "peak_pss_mb", "peak_rss_mb", "build_s")), r
        assert r["startup_s"] == pytest.approx(r["build_s"] + r["first_batch_s"], rel=1e-9)
        assert r["peak_rss_mb"] > 0.8 * r["main_hwm_mb"] > 0 and r["peak_pss_mb"] <= r["peak_rss_mb"]
    # the tree (main + 2 forked workers) holds more RSS than the main process ever did alone; the 50 ms
    # poll can miss the short-lived workers of one small case, not of all four
    assert max(r["peak_rss_mb"] / r["main_hwm_mb"] for r in runs.values()) > 1.5
    # the same training split from the folder and from its pack: 2 % held out per class (one of 20
    # images per class; one of 2 clips per class, one 8-frame window per clip)
    assert runs["image_folder"]["train_items"] == runs["image_shards"]["train_items"] == 190
    assert runs["video_folder"]["train_items"] == runs["video_shards"]["train_items"] == 3
    assert runs["image_shards"]["groups"] == 2 and runs["image_folder"]["groups"] is None
    assert runs["image_shards"]["x_shape"] == [16, 3, 1, 32, 32]  # (B, C, T, H, W)
    assert runs["video_shards"]["x_shape"] == [8, 3, 8, 32, 32]
    for kind, (folder, shards) in {"images": ("image_folder", "image_shards"),
                                   "videos": ("video_folder", "video_shards")}.items():
        s = res["summary"]
        assert s[folder]["startup_s"]["min"] <= s[folder]["startup_s"]["median"] <= s[folder]["startup_s"]["max"]
        assert res["ratios_shards_over_folder"][kind]["samples_per_s"] == pytest.approx(
            s[shards]["samples_per_s"]["median"] / s[folder]["samples_per_s"]["median"])


def test_bench_data_startup(tmp_path):
    """``scripts/bench_data.py --startup``: synthetic captioned video packs of 1000 and 5000 samples
    (sparse shards), the training and held-out items each build makes, its seconds and memory."""
    from safetensors.numpy import load_file

    out = tmp_path / "startup.json"
    _run(["scripts/bench_data.py", "--work", str(tmp_path / "work"), "--startup", "1000,5000", "--kind", "video",
          "--captions", "--buckets", "2", "--out", str(out)], tmp_path)
    res = json.loads(out.read_text())
    assert [r["samples"] for r in res["startup"]] == [1000, 5000] and res["captions"] is True and res["buckets"] == 2
    for r in res["startup"]:
        pack = tmp_path / "work" / f"startup_video_{r['samples']}_captions"
        a = load_file(str(pack / "samples.safetensors"))
        windows = (a["frames"].astype(int) - 15) // 15 + 1  # 8 frames at stride 2 span 15; windows every 15
        captioned = np.arange(r["samples"]) % 97 != 0
        held = a["heldout_from"] == 0
        assert (r["train_items"], r["heldout_items"]) == (windows[captioned & ~held].sum(),
                                                          windows[captioned & held].sum())
        wide = a["width"] > a["height"]  # the two buckets split the items by aspect ratio, each item once
        assert r["train_items_per_bucket"] == [windows[captioned & ~held & wide].sum(),
                                               windows[captioned & ~held & ~wide].sum()]
        assert sorted(p.stat().st_blocks for p in pack.glob("shard-*.tar"))[-1] == 0  # sparse: no pixels
        assert 0 < r["build_s"] < 30 and 0 <= r["bytes_per_sample"] < 5000
        assert r["peak_growth_mb"] == pytest.approx(r["bytes_per_sample"] * r["samples"] / 2**20)


@pytest.mark.slow
def test_bench_schedule_quick(tmp_path):
    """``scripts/bench_schedule.py --quick``: vitp's DeepSpeed 1F1B step, torch's ``Schedule1F1B`` and
    ``ScheduleInterleaved1F1B`` on the tiny model at pp=2 train the same model alike and are timed."""
    out = tmp_path / "sched"
    _run(["scripts/bench_schedule.py", "--quick", "--steps", "1", "--out", str(out)], tmp_path)
    res = json.loads(out.with_suffix(".json").read_text())
    from vitp.config import compose
    from vitp.models import Generator

    tiny = compose(["model=tiny", "data.channels=1", "data.resolution=8", "data.num_classes=10", "model.depth=4"])
    n_params = len(list(Generator.from_config(tiny.model).parameters()))
    assert res["pp"] == 2 and res["model"]["depth"] == 4 and set(res["micro_batches"]) == {"2", "4"}
    assert "| m | variant |" in out.with_suffix(".md").read_text()
    for r in res["micro_batches"].values():
        # one stage per rank as DeepSpeed cuts it: [Embed, 2 blocks] | [2 blocks, FinalLayer]; the
        # interleaved chunks [Embed, 1 block], [1 block], [1 block], [1 block, FinalLayer] by rank r, r + 2
        assert r["layers_per_rank"]["torch_1f1b"] == [[0, 3], [3, 6]]
        assert r["layers_per_rank"]["torch_interleaved_1f1b"] == [[[0, 2], [3, 4]], [[2, 3], [4, 6]]]
        assert r["blocks_per_rank"]["torch_interleaved_1f1b"] == r["blocks_per_rank"]["torch_1f1b"] == [2, 2]
        loss = r["first_loss"]
        assert loss["deepspeed_1f1b"] > 0
        for n in SCHEDULES[1:]:
            assert loss[n] == pytest.approx(loss["deepspeed_1f1b"], rel=1e-5)
            p = r["parity"][n]
            assert p["params"] == n_params and p["init_weights_max_abs_diff"] == 0.0
            # 3 steps: at step 1 only the zero-initialised output layer has a gradient; by step 3 every
            # parameter does, so the gradients sent back across the stages are compared too
            steps = p["steps"]
            assert len(steps) == 3 and steps[0]["params_nonzero_grad"] < steps[-1]["params_nonzero_grad"] == n_params
            for st in steps:
                # averaged over the m micro-batches as DeepSpeed does (scale_grads=True): a sum would
                # differ by (m - 1) x the gradient, a relative grad-norm difference of m - 1
                assert st["grads_max_abs_diff"] <= 1e-6 * st["grad_max_abs"]
                assert st["grad_norm_rel_diff"] <= 1e-6 and st["loss_rel_diff"] <= 1e-5
            assert p["weights_after_max_abs_diff"] <= 1e-6
        for n in SCHEDULES:
            t = r["times"][n]
            assert 0 < t["step_ms_min"] <= t["step_ms"] <= t["step_ms_max"] and t["ratio"] > 0
        assert r["times"]["deepspeed_1f1b"]["ratio"] == 1.0


@pytest.mark.slow
def test_bench_checkpoint(tmp_path):
    """The sharded-checkpoint bench at its smallest: 4 ranks (tp=2 x dp=2), then 2 resuming, and one
    async/sync pair; the numbers it prints are consistent with each other."""
    out_file = tmp_path / "ckpt.json"
    out = _json_object(_run(["scripts/bench_checkpoint.py", "--world", "4", "--reps", "1", "--width", "32",
                             "--depth", "2", "--out", str(out_file)], tmp_path), "layout")
    assert json.loads(out_file.read_text()) == out
    lay, stall = out["layout"], out["stall"]
    assert lay["world"] == 4 and len(lay["written_bytes_per_rank"]) == 4 and lay["resume_ranks"] == 2
    assert sum(lay["written_bytes_per_rank"]) == lay["folder_bytes"] > lay["state_once_bytes"]
    assert all(0 < r for r in lay["resume_read_bytes_per_rank"]) and len(lay["resume_share_bytes_per_rank"]) == 2
    assert stall["async"]["n"] == stall["sync"]["n"] == 3 and stall["async_over_sync"] > 0
    assert stall["run_wall"]["async"]["n"] == 1


@pytest.mark.slow
def test_bench_sampling(tmp_path):
    """The sampling bench at its smallest: every layout (1, 2 and 4 processes over cp, tp, dp) gives
    one process's samples, and the rates and efficiencies are consistent with each other."""
    out_file = tmp_path / "sampling.json"
    out = _json_object(_run(["scripts/bench_sampling.py", "--width", "32", "--depth", "2", "--num", "4", "--steps",
                             "1", "--reps", "1", "--out", str(out_file)], tmp_path), "layouts")
    assert json.loads(out_file.read_text()) == out
    rows = {r["layout"]: r for r in out["layouts"]}
    assert sorted(rows) == sorted(["1", "cp2", "tp2", "dp2", "cp2dp2", "tp2dp2", "dp4"])
    assert rows["1"]["speedup"] == 1.0 and rows["1"]["max_abs_diff"] == 0.0
    for r in rows.values():
        assert r["max_abs_diff"] < 1e-5, r  # the same samples in every layout
        assert r["efficiency"] == pytest.approx(r["speedup"] / r["processes"])
        assert r["samples_per_s"]["min"] <= r["samples_per_s"]["median"] <= r["samples_per_s"]["max"]
    cli = _json_object(_run(["scripts/bench_sampling.py", "--cli", "--width", "32", "--depth", "2", "--num", "4",
                             "--steps", "1", "--reps", "1", "--out", str(tmp_path / "cli.json")], tmp_path), "cli")["cli"]
    assert cli["max_pixel_diff"] <= 1  # torchrun at cp=2 writes one process's grid
    assert cli["ratio"] == pytest.approx(cli["torchrun_cp2_s"]["median"] / cli["one_process_s"]["median"])


def test_bench_data_keeps_its_data_sets_out_of_the_current_folder(tmp_path, monkeypatch):
    """A new user's report: ``scripts/bench_data.py`` left ``bench_data_work/`` in the folder it
    ran in. Its data sets now go to the system's temp folder unless ``--work`` says otherwise."""
    import importlib.util
    import tempfile

    spec = importlib.util.spec_from_file_location("bench_data", Path(__file__).parents[2] / "scripts" / "bench_data.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.chdir(tmp_path)
    work = bench.parse_args([]).work
    assert work.is_absolute() and work.parent == Path(tempfile.gettempdir()) and tmp_path not in work.parents
    assert bench.parse_args(["--work", "mine"]).work == Path("mine")


def test_bench_plan_g8(tmp_path):
    """scripts/bench_plan.py on its smallest case with the model's facts on disk (one untimed run
    first), once: it reports the table's 20 rows (times are printed, not checked)."""
    out = _json_object(_run(["scripts/bench_plan.py", "--case", "g8", "--repeats", "1", "--cache", "warm", "--json"],
                            tmp_path), "results")
    (r,) = out["results"]
    assert r["case"] == "g8" and r["cache"] == "warm" and r["rows"] == 20
    assert r["cpu_median_s"] > 0 and r["wall_min_s"] <= r["wall_max_s"]
