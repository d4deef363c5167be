"""The layout planner (vitp.plan) and the training telemetry, in one process: parameter counts,
FLOPs, saved activations of one block against autograd, layouts, step time, the CLI.
Measured multi-process bytes are checked in tests/distributed/test_plan_validation.py."""
from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch

from tests.helpers import PLAN_MODELS, compose_cfg, plan_case
from vitp.config import validate_layout
from vitp.models import Generator
from vitp.plan import (PRESETS, DeviceProfile, LayoutSpec, ModelShape, block_saved, candidate_layouts, get_profile,
                       layer_params, layer_params_per_rank, layout_of, model_flops_per_step, plan, predict,
                       stage_memory, step_comm, step_time)
from vitp.plan.memory import ACT_BYTES, embed_saved, final_saved, loss_saved
from vitp.utils import to_dict

CPU = DeviceProfile("cpu-test", "cpu", {"fp32": 1e11, "bf16": 1e11}, 16.0, 1e10, 1e9, 1e9, devices_per_node=64,
                    efficiency=1.0, latency_s=1e-4, layer_overhead_s=1e-4, reserve_gib=0.0, cores=2)


@pytest.fixture(scope="module")
def models():
    return {k: compose_cfg(v).model for k, v in PLAN_MODELS.items()}


def _saved_bytes(fn, params) -> int:
    """Distinct storages autograd saves while ``fn()`` runs (parameters excluded)."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("name", ["S", "V"])
def test_parameter_counts_match_the_built_generator(models, name):
    gen = Generator.from_config(models[name], seed=0)
    counted = layer_params(models[name])
    built = [gen.embed] + list(gen.blocks) + [gen.final]
    assert [sum(layer.values()) for layer in counted] == [sum(p.numel() for p in m.parameters()) for m in built]
    # TP keeps qkv, fc1 (weight, bias) and the proj / fc2 weights sharded; the rest whole
    blk = counted[1]
    sharded = sum(n for k, n in blk.items() if k.startswith(("attn.qkv", "mlp.fc1")) or k in
                  ("attn.proj.weight", "mlp.fc2.weight"))
    assert layer_params_per_rank(models[name], 2, adaln_sharded=False)[1] == sum(blk.values()) - sharded // 2
    adaln = blk["adaLN_modulation.1.weight"] + blk["adaLN_modulation.1.bias"]
    assert layer_params_per_rank(models[name], 2)[1] == sum(blk.values()) - (sharded + adaln) // 2  # as trained
    fin = counted[-1]
    fin_adaln = sum(n for k, n in fin.items() if k.startswith("adaLN_modulation."))
    assert fin_adaln and layer_params_per_rank(models[name], 2)[-1] == sum(fin.values()) - fin_adaln // 2


def test_flops_by_hand_and_factorized_attention(models):
    # S: depth 4, D 64, GELU hidden 256, N 64, patch 2*2*3 = 12 values per token
    D, N, h, P, L = 64, 64, 256, 12, 4
    block = 2 * N * (4 * D * D + 2 * D * h) + 4 * N * N * D + 2 * D * 6 * D
    fwd = L * block + 2 * N * D * P + 2 * (256 * D + D * D) + 2 * N * D * P + 2 * D * 2 * D
    assert model_flops_per_step(models["S"], 8) == pytest.approx(3 * 8 * fwd, rel=1e-12)
    # V: grid (2, 3, 3): spatial blocks attend over 9 keys, temporal over 2
    m = to_dict(models["V"])
    full = model_flops_per_step({**m, "attention": "full"}, 1)
    fact = model_flops_per_step(m, 1)
    D, N = 96, 18
    assert full - fact == pytest.approx(3 * (4 * 4 * N * N * D - 2 * 4 * N * 9 * D - 2 * 4 * N * 2 * D), rel=1e-12)


@pytest.mark.parametrize("name,kind,precision", [("S", "full", "fp32"), ("V", "spatial", "fp32"),
                                                 ("V", "temporal", "fp32"), ("V", "temporal", "bf16")])
def test_block_saved_activations_match_autograd(models, name, kind, precision):
    """One block, one process: the predicted saved bytes are what autograd keeps (tp = 1)."""
    from vitp.models import layer_specs

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    spec = dict(layer_specs(**to_dict(models[name]))[1][1], attention=kind)
    blk = type(Generator.from_config(models[name]).blocks[0])(**spec).to(dtype)
    shape = ModelShape.from_config(models[name])
    B = 3
    x = torch.randn(B, shape.tokens, shape.width, dtype=dtype, requires_grad=True)
    c = torch.randn(B, shape.width, dtype=dtype, requires_grad=True)
    measured = _saved_bytes(lambda: blk(x, c), list(blk.parameters()))
    predicted = B * sum(r.bytes(precision, "cpu") for r in block_saved(shape, kind, 1, False))
    assert measured == B * shape.width * ACT_BYTES[precision] + predicted  # + c, counted once per stage


def test_whole_generator_and_loss_saved_bytes(models):
    from vitp.objectives import FlowMatchingLoss

    gen = Generator.from_config(models["V"], seed=0)
    shape = ModelShape.from_config(models["V"])
    B, m = 2, models["V"]
    z = torch.randn(B, m.in_channels, m.num_frames, m.image_size, m.image_size)
    t, y = torch.rand(B), torch.randint(0, 10, (B,))
    loss = FlowMatchingLoss(0.05)
    measured = _saved_bytes(lambda: loss(gen(z, t, y), (z, z, t)), list(gen.parameters()))
    lay = LayoutSpec(1, 1, 1, False, 0, B, 1)
    per_sample = (sum(r.bytes("fp32") for r in embed_saved(shape) + final_saved(shape, 1, False) + loss_saved(shape))
                  + sum(sum(r.bytes("fp32") for r in block_saved(shape, shape.block_kind(i), 1, False))
                        for i in range(shape.depth)) + shape.width * 4)
    assert measured == B * per_sample
    mem = stage_memory(to_dict(m), lay)[0]
    assert mem.activations == B * per_sample and mem.pipe_buffers == B * shape.pixels * 4  # the prediction held


def test_candidate_layouts_are_exactly_the_valid_ones(models):
    cfg = compose_cfg(PLAN_MODELS["S"] + ["trainer.global_batch_size=8"])
    lays = candidate_layouts(cfg, 4, "cpu", ac_options=(0,), micro_options=(1, 2))
    got = {(x.tp, x.cp, x.cp_mode if x.cp > 1 else "-", x.pp, x.dp, x.sp, x.micro) for x in lays}
    # heads 4 and hidden 256 allow tp 1, 2, 4; depth 4 allows pp up to 4; batch 8 = micro x accum x dp;
    # 64 tokens split over cp 1, 2, 4: Ulysses where tp x cp divides the 4 heads, else (only then) the ring
    want = {(tp, cp, "-" if cp == 1 else "ulysses" if 4 % (tp * cp) == 0 else "ring", pp, 4 // (tp * pp * cp), sp, mb)
            for cp in (1, 2, 4) for tp in (1, 2, 4) for pp in (1, 2, 4) if tp * pp * cp <= 4
            for sp in ([False, True] if tp > 1 else [False]) for mb in (1, 2)}
    assert ModelShape.from_config(cfg.model).tokens == 64 and got == want
    assert len(lays) == len(got) and {x.cp_mode for x in lays if x.cp > 1} == {"ulysses"}
    two = candidate_layouts(compose_cfg(PLAN_MODELS["S"] + ["trainer.global_batch_size=8", "model.num_heads=2"]), 4,
                            "cpu", ac_options=(0,), micro_options=(2,))
    modes = {(x.tp, x.cp, x.cp_mode) for x in two if x.cp > 1}  # 2 heads: Ulysses only at tp x cp <= 2
    assert modes == {(1, 2, "ulysses"), (2, 2, "ring"), (1, 4, "ring")}
    ring = next(x for x in two if x.cp_mode == "ring")
    assert "parallel.cp_mode=ring" in ring.overrides()
    for x in lays:
        c = compose_cfg(PLAN_MODELS["S"] + ["trainer.global_batch_size=8", *x.overrides()])
        assert layout_of(c, 4) == x and validate_layout(c, 4).dp == x.dp


def test_memory_moves_the_right_way(models):
    m = to_dict(models["S"])
    base = LayoutSpec(2, 1, 1, False, 0, 4, 4)
    act = stage_memory(m, base)[0].activations
    assert stage_memory(m, replace(base, sp=True))[0].activations < act
    ac = stage_memory(m, replace(base, ac=1))[0]
    assert ac.activations + ac.recompute < act
    # 1F1B: stage s of p holds min(p - s, accum) micro-batches
    pp4 = stage_memory(m, LayoutSpec(1, 4, 1, False, 0, 2, 8))
    assert [s.in_flight for s in pp4] == [4, 3, 2, 1]
    assert [s.in_flight for s in stage_memory(m, LayoutSpec(1, 4, 1, False, 0, 2, 2))] == [2, 2, 2, 1]
    z = stage_memory(m, LayoutSpec(1, 1, 4, False, 0, 2, 1))[0]
    assert z.optimizer == pytest.approx(z.params * 12 / 4) and z.weights == z.grads == z.params * 4
    with pytest.raises(ValueError, match="no memory model"):
        stage_memory(m, LayoutSpec(1, 1, 1, False, 0, 2, 1, zero_stage=2))


def test_comm_and_step_time(models):
    m = to_dict(models["S"])
    assert step_comm(m, LayoutSpec(1, 1, 1, False, 0, 2, 4))[0].tp_bytes == 0
    c = step_comm(m, LayoutSpec(2, 2, 2, False, 0, 2, 4))
    T = 2 * 64 * 64 * 4  # one (b, N, D) fp32 activation
    mod, cond = 2 * 6 * 64 * 4, 2 * 64 * 4  # a block's (b, 6D) modulation; c's (b, D) gradient
    # 4 micro x (2 blocks x (4 all-reduces + 1 modulation all-gather) + 2 all-reduces of c's gradient), ring
    assert c[0].tp_bytes == pytest.approx(4 * (2 * (4 * T * 2 * 0.5 + mod * 0.5) + 2 * cond * 2 * 0.5))
    assert c[0].pp_bytes == c[1].pp_bytes == 4 * 2 * (64 + 1) * 64 * 4  # (tokens, c) one way per micro-batch
    t1 = step_time(m, LayoutSpec(1, 2, 1, False, 0, 2, 1), CPU)
    t8 = step_time(m, LayoutSpec(1, 2, 1, False, 0, 2, 8), CPU)
    assert t1["bubble"] > t8["bubble"] > 0  # the 1F1B bubble shrinks with more micro-batches
    slow = replace(CPU, intra_bw=1e6, inter_bw=1e6, cores=0)
    assert step_time(m, LayoutSpec(2, 1, 1, False, 0, 2, 4), slow)["step_s"] > \
        step_time(m, LayoutSpec(2, 1, 1, False, 0, 2, 4), replace(CPU, cores=0))["step_s"]


def test_presets_and_plan_ranking():
    assert {"h100", "h200", "a100"} <= set(PRESETS) and PRESETS["h200"].memory_gib == 141.0
    assert get_profile("h100", memory_gib=40).memory_gib == 40
    with pytest.raises(ValueError, match="unknown device profile"):
        get_profile("tpu")
    cfg = compose_cfg(["experiment=img256", "data.root=x"])
    preds = plan(cfg, 8, PRESETS["h100"], ac_options=(0,), micro_options=(8, 32, 128))
    fits = [p for p in preds if p.fits]
    assert fits and all(a.time["step_s"] <= b.time["step_s"] for a, b in zip(fits, fits[1:]))
    tiny = plan(cfg, 8, replace(PRESETS["h100"], memory_gib=4.0), ac_options=(0, 1), micro_options=(128,))
    assert not tiny[-1].fits and predict(cfg.model, tiny[0].layout, PRESETS["h100"]).fits


def test_vitp_plan_cli(capsys):
    from vitp.cli.plan import main, run

    rows = run(["--gpus", "4", "--device", "a100", "--json", "--top", "3", "--ac", "0", *PLAN_MODELS["S"]])
    out = json.loads(capsys.readouterr().out)
    assert out["world"] == 4 and len(out["layouts"]) == 3 and rows[0]["overrides"][0].startswith("parallel.tp=")
    assert {"memory_gib", "comm_bytes_per_step", "time", "fits", "mfu"} <= set(out["layouts"][0])
    run(["--gpus", "4", "--device", "h200", "--top", "2", *PLAN_MODELS["S"]])
    text = capsys.readouterr().out
    assert "4 x h200 (141 GiB, 8/node)" in text and "fits" in text.splitlines()[1]
    with pytest.raises(SystemExit) as e:
        main(["--gpus", "4", "trainer.max_step=3"])
    assert e.value.code == 2 and "did you mean trainer.max_steps" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a bad value: one line, as vitp-train's composition says it
        main(["--gpus", "4", "sampler.method=foo"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == ("vitp-plan: error: Error merging override sampler.method=foo; Invalid value "
                                         "'foo', expected one of [heun, euler]\n")


def test_sizes_print_with_three_significant_digits():
    """One formatter for every size the planner prints: three significant digits, binary units."""
    from vitp.plan import format_bytes

    cases = {0: "0 B", 12: "12 B", 999: "999 B", 1000: "0.977 KiB", 1024: "1.00 KiB", 1536: "1.50 KiB",
             41_500 * 4: "162 KiB", 2**20 - 1: "1.00 MiB", 33.4e6: "31.9 MiB", 141 * 2**30: "141 GiB",
             3.2e12: "2.91 TiB", 2**50: "1024 TiB"}
    assert {n: format_bytes(n) for n in cases} == cases
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="a size is a finite number of bytes >= 0"):
            format_bytes(bad)


def test_vitp_plan_prints_a_small_model_in_fitting_units(capsys):
    """A small model's memory is printed in KiB with three significant digits (it read 0.00 GiB),
    and the JSON holds exact bytes beside GiB with four significant digits (it held 4 decimals)."""
    from vitp.cli.plan import run
    from vitp.plan import format_bytes

    rows = run(["--gpus", "1", "--device", "h100", "--top", "1", "--ac", "0", "--micro", "8", "experiment=smoke"])
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("model: 41.5k parameters,") and "1 x h100 (80.0 GiB, 8/node)" in table[0]
    mem = rows[0]["memory_bytes"]
    cells = table[2 + 1].split("|")[1].split()  # row 1, the memory columns: six "<number> <unit>" pairs
    assert [" ".join(cells[i:i + 2]) for i in (0, 10)] == [format_bytes(mem["weights"]), format_bytes(mem["total"])]
    assert cells[1] == "KiB" and 100 <= float(cells[0]) < 1000 and len(cells[0].replace(".", "")) == 3
    assert rows[0]["memory_gib"]["total"] == float(f"{mem['total'] / 2**30:.4g}") > 0
    assert rows[0]["limit_bytes"] == 80 * 2**30 - int(PRESETS["h100"].reserve_gib * 2**30)


def test_telemetry_metrics_and_timed_iterator(models, monkeypatch):
    import vitp.train.telemetry as tel
    from vitp.config import Layout
    from vitp.parallel import CommRecord

    monkeypatch.setattr(tel, "_profile", lambda device, precision: (1e12, "test"))
    cfg = compose_cfg(plan_case("S", 1, 1, 1))
    t = tel.Telemetry(cfg, Layout(1, 1, 1, "fp32"), torch.device("cpu"))
    it = t.timed(iter([1, 2]))
    assert list(it) == [1, 2] and it.wait_s >= 0
    t.counter.add(CommRecord("all_reduce", 2, 1000, (250,), "fwd", "tp"))
    t.counter.add(CommRecord("all_gather", 2, 1000, (250,), "fwd", "export"))  # not training traffic
    out = t.metrics(steps=2, elapsed_s=0.5)
    flops = model_flops_per_step(cfg.model, 8)
    assert out["perf/tflops"] == pytest.approx(2 * flops / 0.5 / 1e12) and out["perf/mfu"] == pytest.approx(
        out["perf/tflops"])
    assert out["perf/tokens_per_s"] == 2 * 8 * 64 / 0.5 and out["comm/tp_bytes"] == 1000 / 2
    assert out["perf/peak_mem_gib"] > 0 and out["comm/pp_bytes"] == 0 and out["comm/dp_bytes"] == 0
    assert t.metrics(steps=1, elapsed_s=1.0)["comm/tp_bytes"] == 0  # counters reset at each log


def test_telemetry_counts_each_steps_bucket(monkeypatch):
    """With data.buckets, perf/* count each step's own grid and batch (not data.resolution's)."""
    import vitp.train.telemetry as tel
    from vitp.config import Layout

    monkeypatch.setattr(tel, "_profile", lambda device, precision: (1e12, "test"))
    buckets = ("data.buckets=[{resolution: 16x16, batch_size: 8}, {resolution: 8x16, batch_size: 8}, "
               "{resolution: 8x8, batch_size: 16}]")
    cfg = compose_cfg(plan_case("S", 1, 2, 1, extra=[buckets]))  # pp=2: pipeline bytes follow the shape
    t = tel.Telemetry(cfg, Layout(1, 2, 1, "fp32"), torch.device("cpu"))
    # patch 2: 8 x 8 = 64, 4 x 8 = 32 and 4 x 4 = 16 tokens per sample
    assert [t.counts[i].tokens for i in (None, 0, 1, 2)] == [8 * 64, 8 * 64, 8 * 32, 16 * 16]
    same = compose_cfg(plan_case("S", 1, 2, 1, extra=["data.resolution=8x16"]))  # bucket 1 as a whole run
    assert t.counts[1].flops == model_flops_per_step(same.model, 8) < t.counts[0].flops
    assert t.counts[2].flops == model_flops_per_step(compose_cfg(plan_case("S", 1, 2, 1, extra=[
        "data.resolution=8"])).model, 16)
    D = 64  # (tokens + c) x D fp32 per sample, sent once forward and its gradient once back, per step
    assert [t.counts[i].pp_bytes for i in (0, 1, 2)] == [8 * 65 * D * 4, 8 * 33 * D * 4, 16 * 17 * D * 4]
    for b in (0, 1, 1):
        t.count_step(b)
    out = t.metrics(steps=3, elapsed_s=2.0)
    assert out["perf/tokens_per_s"] == (512 + 256 + 256) / 2.0
    flops = t.counts[0].flops + 2 * t.counts[1].flops
    assert out["perf/tflops"] == pytest.approx(flops / 2.0 / 2 / 1e12, rel=1e-12)  # world 2
    assert out["perf/mfu"] == pytest.approx(out["perf/tflops"], rel=1e-12)  # against 1 TFLOP/s
    assert out["comm/pp_bytes"] == pytest.approx((8 * 65 + 2 * 8 * 33) * D * 4 / 3, rel=1e-12)
    t.count_step(2)  # counters reset at each log; a step not counted is taken at data.resolution
    out = t.metrics(steps=2, elapsed_s=1.0)
    assert out["perf/tokens_per_s"] == 16 * 16 + 8 * 64
    with pytest.raises(KeyError):
        t.count_step(3)


@pytest.mark.parametrize("sp", [False, True])
def test_partial_sync_block_traffic(models, sp):
    """``parallel.partial_sync``: the block linears (tag ``tp``) move ``int(p D) / D`` of exact TP
    (with SP ``0.8 p``: no backward re-gather); layout_of keeps tokens unsharded at ``p < 1``."""
    from vitp.plan import tp_collectives

    m = to_dict(models["S"])

    def tp_bytes(p):
        lay = LayoutSpec(2, 2, 1, sp and p == 1, 0, 2, 4, partial_sync=p, partial_sp=sp and p < 1)
        return sum(c.count * c.nbytes for s in (0, 1) for c in tp_collectives(m, lay, s) if c.tag == "tp")

    for p in (0.5, 0.25):
        assert tp_bytes(p) / tp_bytes(1.0) == pytest.approx(p * (0.8 if sp else 1.0), abs=1e-12)
    cfg = compose_cfg(plan_case("S", 2, 1, 2, sp=sp, extra=["parallel.partial_sync=0.5"]))
    lay = layout_of(cfg, 4)
    assert (lay.sp, lay.partial_sp, lay.partial_sync) == (False, sp, 0.5)
    assert "parallel.partial_sync=0.5" in lay.overrides()
    assert f"parallel.sequence_parallel={str(sp).lower()}" in lay.overrides()


def test_vitp_plan_json_stdout_is_json_in_a_fresh_process():
    """``vitp-plan --json | jq``: nothing else reaches stdout (DeepSpeed's accelerator probe
    printed a warning there when vitp-plan ran on a machine without CUDA)."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "vitp.cli.plan", "--gpus", "2", "--device", "h100", "--json", "--top",
                        "1", "experiment=smoke"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["world"] == 2


def test_vitp_plan_shows_the_parallel_plan_of_a_row(capsys):
    """``--show-plan ROW``: the rows of GENERATOR_PLAN applied at that row's layout, per stage, with
    the collectives the planner counts (those of vitp.plan.tp_collectives, one line each)."""
    from vitp.cli.plan import main, run
    from vitp.plan import cp_collectives, plan_collectives, tp_collectives

    rows = run(["--gpus", "4", "--device", "h100", "--top", "0", "--ac", "0", "--micro", "2", "experiment=smoke",
                "model.qk_norm=true"])
    row = next(i for i, r in enumerate(rows) if r["tp"] == 2 and r["pp"] == 2 and not r["sp"]) + 1
    capsys.readouterr()
    run(["--gpus", "4", "--device", "h100", "--top", "0", "--ac", "0", "--micro", "2", "--show-plan", str(row),
         "experiment=smoke", "model.qk_norm=true"])
    text = capsys.readouterr().out.split("parallel plan at ")[1]
    assert text.startswith("tp=2 cp=1 pp=2 dp=1")
    assert "on stage 0 (mode tp)" in text and "on stage 1 (mode tp)" in text
    assert re.search(r"blocks\.\*\.attn +-> HeadParallelAttention\(partial=False\): 1 module", text)
    cfg = compose_cfg(["experiment=smoke", "model.qk_norm=true", "parallel.tp=2", "parallel.pp=2",
                       "trainer.micro_batch_size=2"])
    lay = layout_of(cfg, 4)
    listed = sum(1 for line in text.splitlines() if " x all_" in line or " x reduce_" in line)
    assert listed == len(tp_collectives(cfg.model, lay, 0)) + len(tp_collectives(cfg.model, lay, 1))
    # cp > 1 (smoke has 2 heads: Ulysses at tp=1 x cp=2, the ring at tp=2 x cp=2, shown "2r"): the cp rows
    # and their collectives over the cp group (Ulysses all-to-alls, the gathered prediction)
    assert {(r["tp"], r["cp"], r["cp_mode"]) for r in rows if r["cp"] > 1} == {
        (1, 2, "ulysses"), (1, 4, "ring"), (2, 2, "ring")}
    row = next(i for i, r in enumerate(rows) if r["cp"] == 2 and r["tp"] == 1) + 1
    assert "parallel.cp=2" in rows[row - 1]["overrides"] and rows[row - 1]["comm_bytes_per_step"]["cp_bytes"] > 0
    capsys.readouterr()
    run(["--gpus", "4", "--device", "h100", "--top", "0", "--ac", "0", "--micro", "2", "--show-plan", str(row),
         "experiment=smoke", "model.qk_norm=true"])
    table, text = capsys.readouterr().out.split("parallel plan at ")
    assert re.search(r"\n +\d+ +2 +2r +1 +1 +- ", table) and re.search(rf"\n +{row} +1 +2 +1 +2 +- ", table)
    assert text.startswith("tp=1 cp=2 (ulysses) pp=1 dp=2 sp=off")
    assert re.search(r"blocks\.\* +-> ContextParallelAttention\(\): 2 module", text)
    assert "(context parallelism at tp=1: no parameter sharded)" in text and "(mode tp)" not in text  # not "0 sharded"
    model = compose_cfg(["experiment=smoke", "model.qk_norm=true"]).model
    lay = layout_of(compose_cfg(["experiment=smoke", "model.qk_norm=true", "parallel.cp=2",
                                 "trainer.micro_batch_size=2"]), 4)
    lines = [x for x in text.splitlines() if " per micro-batch" in x or " per step" in x]
    assert all("over the cp group (2)" in x for x in lines) and {x.split()[2] for x in lines} == {
        "all_to_all", "all_gather"}
    assert len(lines) == len(plan_collectives(model, lay, 0)) == len(cp_collectives(model, lay, 0)) == 5  # 2 x 2 + 1
    with pytest.raises(SystemExit) as e:  # refused before planning (it printed the whole table first)
        main(["--gpus", "4", "--top", "2", "--show-plan", "3", "experiment=smoke"])
    out = capsys.readouterr()
    assert e.value.code == 2 and "--show-plan 3: give a row of the table, 1 to 2 (or raise --top)" in out.err
    assert out.out == ""
    with pytest.raises(SystemExit) as e:  # --top 0: only the planned table knows its length
        main(["--gpus", "4", "--top", "0", "--ac", "0", "--micro", "2", "--show-plan", "999", "experiment=smoke"])
    assert e.value.code == 2 and "--show-plan 999: the table has rows 1 to" in capsys.readouterr().err


def test_cpu_profile_source_names_processes_only_where_links_were_measured(tmp_path, monkeypatch):
    """A single-process run's MFU line said "(2 thread(s) per process, 2 processes)": the process
    count describes the links measured between processes, so it appears only with them (also for a
    profile cached with the old text)."""
    import json
    import os
    import socket

    import torch

    from vitp.plan.devices import PRESETS, cpu_profile

    monkeypatch.setenv("VITP_CACHE_DIR", str(tmp_path))
    entry = dict(PRESETS["h100"].as_dict(), name="cpu", source="measured here (2 thread(s) per process, 2 processes)")
    key = f"{socket.gethostname()}|{os.cpu_count()}|{torch.__version__}|2|0|0"
    (tmp_path / "cpu_profile.json").write_text(json.dumps({key: entry}))
    assert cpu_profile(threads=2, links=False).source == "measured here (2 thread(s) per process)"
    entry["source"] = "anything"
    key = f"{socket.gethostname()}|{os.cpu_count()}|{torch.__version__}|1|1|4"
    (tmp_path / "cpu_profile.json").write_text(json.dumps({key: entry}))
    assert cpu_profile(threads=1, links=True, procs=4).source == "measured here (1 thread(s) per process, links " \
                                                                 "between 4 processes)"


def test_gloo_links_of_an_odd_process_count_measure_pairs_and_the_whole_group():
    """``vitp-plan --gpus 3 --device cpu`` and ``parallel=auto`` on 3 ranks stopped with "no median for
    empty data": the links were measured only in groups dividing the process count (3: none of 2),
    but the bandwidth and the pipeline sends' latency are a pair's. Every group size from 2 to the
    count is measured now, the last ``count % g`` ranks waiting (3 real processes, about 10 s)."""
    from vitp.plan.devices import _gloo_links

    link = _gloo_links(3)
    assert sorted(link["latency_by_group"]) == [2, 3]
    assert link["latency_s"] == link["latency_by_group"][2] and all(v > 0 for v in link["latency_by_group"].values())
    assert 0 < link["bw"] < float("inf")


def test_vitp_plan_cpu_measures_links_among_at_most_4_processes_once_and_says_so(tmp_path, monkeypatch, capsys):
    """``vitp-plan --gpus N --device cpu`` started N interpreters to measure the links, silently (N =
    8: 20 s on 2 cores; 1024 would start 1024). It starts at most LINK_PROCS_MAX = 4 (groups of 2, 3
    and 4), says so once on stderr with the cache file, and keys the cache by what it measured: a
    plan for 1024 processes, and the start-up check of a run of 8, reuse it. Larger groups' latency
    is scaled from the 4-group as a ring all-reduce's steps, (g - 1) / 3."""
    import json

    import vitp.plan.devices as devices
    from vitp.cli.plan import main

    monkeypatch.setenv("VITP_CACHE_DIR", str(tmp_path))
    started = []

    def links(procs):  # the gloo measurement, without its processes
        started.append(procs)
        lat = {g: [1e-4, 4e-4, 9e-4][g - 2] for g in range(2, procs + 1)}  # an IndexError past 4
        return {"latency_s": lat[2], "latency_by_group": lat, "bw": 1e9}

    monkeypatch.setattr(devices, "_gloo_links", links)
    monkeypatch.setattr(devices, "_matmul_flops", lambda dtype: 1e11)
    monkeypatch.setattr(devices, "_memcpy_bw", lambda: 1e10)
    monkeypatch.setattr(devices, "_layer_overhead", lambda: 1e-4)
    main(["--gpus", "8", "--device", "cpu", "--top", "1", "--json", "experiment=smoke"])
    out = capsys.readouterr()
    assert started == [4] and devices.LINK_PROCS_MAX == 4
    notice = [x for x in out.err.splitlines() if "measuring" in x]
    assert notice == [f"vitp-plan: measuring this machine once (gloo links between 4 processes; groups over 4 ranks "
                      f"scaled from them, matmul, memory copy and layer dispatch with 1 thread(s) per process; a few "
                      f"seconds), cached in {tmp_path / 'cpu_profile.json'}"]
    device = json.loads(out.out)["device"]
    assert device["latency_by_group"] == {"2": 1e-4, "3": 4e-4, "4": 9e-4}
    assert device["source"] == "measured here (1 thread(s) per process, links between 4 processes)"
    assert list(json.loads((tmp_path / "cpu_profile.json").read_text()))[0].endswith("|1|1|4")
    prof = devices.cached_cpu_profile(threads=1, links=True, procs=8)  # the start-up check of 8 ranks finds it
    assert prof is not None and prof.latency(4) == 9e-4 and prof.latency(8) == pytest.approx(9e-4 * 7 / 3)
    assert prof.latency(1) == prof.latency_s == 1e-4
    assert devices.cached_cpu_profile(threads=1, links=True, procs=1024) is not None
    main(["--gpus", "16", "--device", "cpu", "--top", "1", "--json", "experiment=smoke",
          "trainer.global_batch_size=16"])
    assert started == [4] and "measuring" not in capsys.readouterr().err  # cached: measured once
    assert devices.link_processes(3) == 3 and devices.link_processes(1) == 2


@pytest.mark.parametrize("flag, value, message", [
    ("--micro", "0", "use comma-separated integers >= 1, e.g. 1,2,4"), ("--ac", "-1", "integers >= 0, e.g. 0,1"),
    ("--mem-gib", "-5", "'-5': use a finite number > 0 and at most 1048576 (1 PiB)"),
    ("--mem-gib", "0", "'0': use a finite number > 0 and at most 1048576 (1 PiB)"),
    ("--mem-gib", "inf", "'inf': use a finite number > 0 and at most 1048576 (1 PiB)"),  # was an OverflowError
    ("--mem-gib", "1e300", "'1e300': use a finite number > 0 and at most 1048576 (1 PiB)"),  # OverflowError
    ("--mem-gib", "1e20", "'1e20': use a finite number > 0 and at most 1048576 (1 PiB)"),  # was "97656250000000000 TiB"
    ("--mem-gib", "1048576.5", "'1048576.5': use a finite number > 0 and at most 1048576 (1 PiB)"),
    ("--gpus-per-node", "0", "'0': use a whole number > 0, e.g. 8"), ("--gpus", "0", "'0': use a whole number > 0"),
    ("--gpus", "-1", "'-1': use a whole number > 0"), ("--gpus-per-node", "-8", "'-8': use a whole number > 0"),
    ("--gpus", "8.5", "'8.5': use a whole number > 0, e.g. 8"),  # said "a finite number > 0": 8.5 is one
    ("--gpus", "1e3", "'1e3': use a whole number > 0, e.g. 8"), ("--gpus-per-node", "2.5", "use a whole number > 0")])
def test_vitp_plan_refuses_bad_flag_values(flag, value, message, capsys):
    """Each was a traceback (--micro 0: ZeroDivisionError; --mem-gib 1e300: OverflowError in
    Prediction.as_dict), a message not naming the flag or the rule (--gpus 8.5: "a finite number"),
    or accepted (--mem-gib 1e20: a header of 97656250000000000 TiB)."""
    from vitp.cli.plan import main

    with pytest.raises(SystemExit) as e:
        main(["--gpus", "2", flag, value, "experiment=smoke"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"vitp-plan: error: argument {flag}: " in err and message in err, err


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "8", "--gpus-per-node", "3"],
     "--gpus 8 is not a multiple of --gpus-per-node 3: a job fills whole nodes, the same number of processes on each "
     "(torchrun, the deepspeed launcher, SageMaker); use --gpus 6 or 9, or the devices your nodes have as "
     "--gpus-per-node (a divisor of 8, e.g. 1, 2, 4, 8)"),
    (["--gpus", "12", "--device", "h100"],
     "--gpus 12 is not a multiple of the h100 profile's 8 devices per node: a job fills whole nodes, the same number "
     "of processes on each (torchrun, the deepspeed launcher, SageMaker); use --gpus 8 or 16, or the devices your "
     "nodes have as --gpus-per-node (a divisor of 12, e.g. 1, 2, 3, 4, 6, 12)")])
def test_vitp_plan_refuses_devices_that_fill_no_whole_nodes(argv, message, capsys):
    """``--gpus 8 --gpus-per-node 3`` was planned (a new user's trial): no cluster of equal nodes has
    8 devices in nodes of 3. Refused in one line naming both numbers and the fix, exit status 2."""
    from vitp.cli.plan import main

    with pytest.raises(SystemExit) as e:
        main([*argv, "experiment=smoke"])
    assert e.value.code == 2 and capsys.readouterr().err == f"vitp-plan: error: {message}\n"


def test_vitp_plan_plans_whole_nodes_and_one_node_partly_used(capsys):
    """Devices filling whole nodes (16 in nodes of 4) and fewer than a node has (2 of a 4-device
    node, as ``torchrun --nproc_per_node 2`` on it) are planned with the nodes given."""
    import json

    from vitp.cli.plan import main

    for gpus, per in (("16", "4"), ("2", "4")):
        main(["--gpus", gpus, "--gpus-per-node", per, "--device", "h100", "--top", "1", "--json", "experiment=smoke"])
        out = json.loads(capsys.readouterr().out)
        assert (out["world"], out["device"]["devices_per_node"]) == (int(gpus), int(per)) and out["layouts"]


def test_mfu_is_never_above_1_the_peak_is_measured_again_and_flagged(monkeypatch, caplog):
    """The demo logged perf/mfu 2.54 against a CPU peak cached while another job loaded the machine:
    a step faster than the peak makes the CPU peak be measured again; the peak becomes the larger of
    that and the achieved rate (MFU <= 1), with a warning, and the rows are flagged."""
    import logging

    import vitp.plan as plan
    import vitp.train.telemetry as tel
    from vitp.config import Layout

    monkeypatch.setattr(tel, "_profile", lambda device, precision: (1e9, "cpu, measured here (busy)"))
    measured = []

    class Again:
        def peak(self, precision):
            return 1.5e9

    def remeasure(**kw):
        measured.append(kw)
        return Again()

    monkeypatch.setattr(plan, "cpu_profile", remeasure)
    cfg = compose_cfg(plan_case("S", 1, 1, 1))
    t = tel.Telemetry(cfg, Layout(1, 1, 1, "fp32"), torch.device("cpu"))
    achieved = model_flops_per_step(cfg.model, 8) / 0.1  # one step in 0.1 s, world 1
    assert achieved > 1.5e9
    with caplog.at_level(logging.WARNING, logger="vitp"):
        out = t.metrics(steps=1, elapsed_s=0.1)
    assert measured and measured[0]["remeasure"] is True
    assert out["perf/mfu"] == pytest.approx(1.0) and out["perf/mfu_peak_raised"] == 1.0
    assert t.peak_flops == pytest.approx(achieved)
    assert [r.getMessage().split(";")[0] for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"perf/mfu: the steps achieved {achieved / 1e12:.4g} TFLOP/s per device, above the peak MFU was taken "
        "against (0.001 TFLOP/s: a profile measured while the machine was busy, or a wrong preset)"]
    slower = t.metrics(steps=1, elapsed_s=0.2)  # half the rate: half the raised peak, still flagged
    assert slower["perf/mfu"] == pytest.approx(0.5) and slower["perf/mfu_peak_raised"] == 1.0 and len(measured) == 1


def test_vitp_plan_keeps_the_layout_keys_the_overrides_fix(capsys):
    """parallel.tp=3 on a 4-head model printed the full table as if it were not there (a new user's
    trial): layout keys among the overrides filter the table as parallel=auto holds them, and no
    valid layout with them is refused, naming them."""
    from vitp.cli.plan import main, run

    base = ["--gpus", "4", "--device", "h100", "--top", "0", "--json", "experiment=smoke"]
    every = run(base)
    capsys.readouterr()
    fixed = run([*base, "parallel.tp=2", "trainer.micro_batch_size=2"])
    capsys.readouterr()
    assert fixed and all(r["tp"] == 2 and r["micro"] == 2 for r in fixed)
    assert [r for r in every if r["tp"] == 2 and r["micro"] == 2] == fixed
    with pytest.raises(SystemExit) as e:
        main(["--gpus", "4", "--device", "h100", "experiment=smoke", "parallel.tp=3"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "no valid layout of this config on 4 devices with parallel.tp=3" in err
    # the refusal names each fixed value, the rule it fails and the fix, in vitp-plan's terms
    assert ("parallel.tp=3 does not divide the 4 devices: plan 3 devices or a multiple (--gpus 3), or drop "
            "parallel.tp=3") in err and "parallel.tp=3 does not divide model.num_heads=2" in err, err
    assert "torchrun" not in err
    with pytest.raises(SystemExit) as e:
        main(["--gpus", "8", "--device", "h100", "experiment=smoke", "parallel.pp=8"])
    assert "model.depth=2 < parallel.pp=8" in capsys.readouterr().err
    # --micro filters as a fixed key does, and is named the same way (a user's --micro 3 was not)
    with pytest.raises(SystemExit) as e:
        main(["--gpus", "4", "--device", "h100", "--micro", "3", "experiment=smoke", "parallel.tp=2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and ("no valid layout of this config on 4 devices with parallel.tp=2 --micro 3 (drop "
                                  "those to list every layout)") in err, err


def test_vitp_plan_exits_2_after_the_table_when_nothing_fits(capsys):
    """``vitp-plan --mem-gib 1`` printed "16 valid layouts, 0 fit" and every phase "does NOT fit",
    then exited 0: a script took the plan as usable. The table stays; a last line and status 2 follow."""
    from vitp.cli.plan import main

    argv = ["--gpus", "1", "--device", "h100", "--mem-gib", "3.0001", "--micro", "2,4", "--ac", "0", "experiment=smoke"]
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out.splitlines()[0].endswith("1 x h100 (3.00 GiB, 8/node); 2 valid layouts, 0 fit")
    assert "does NOT fit" in out and err.count("\n") == 1, err
    assert err.startswith("vitp-plan: error: nothing fits: none of the 2 valid layouts fits 1 x h100 (3.00 GiB, ")
    assert err.endswith("Use a device with more memory (--mem-gib 4 or more, or another --device), more --gpus than 1, "
                        "a smaller micro-batch (--micro 1, then trainer.micro_batch_size=1) or activation "
                        "checkpointing (--ac 0,1), or a smaller model\n"), err
    main([*argv[:5], "80", *argv[6:]])  # the same model with room: exits normally
    assert "0 fit" not in capsys.readouterr().out


def test_vitp_plan_accepts_memory_up_to_1_pib(capsys):
    """The largest --mem-gib, 1 PiB, is planned and printed (1024 TiB)."""
    from vitp.cli.plan import run

    rows = run(["--gpus", "1", "--device", "h100", "--top", "1", "--mem-gib", "1048576", "experiment=smoke"])
    assert "1 x h100 (1024 TiB, 8/node)" in capsys.readouterr().out and rows[0]["limit_bytes"] == (2**20 - 3) * 2**30


def test_vitp_plan_notes_a_text_model_planned_without_text_len(capsys):
    """``model.text_dim=4096`` without ``model.text_len`` planned 0 caption tokens in silence (row 1's
    activations as without text, a user's trial). Training fills text_len from the caption store, so
    the plan is not refused: a note on stderr names model.text_len; with it, no note and more memory."""
    from vitp.cli.plan import run

    base = ["--gpus", "1", "--device", "h100", "--top", "1", "--ac", "0", "--micro", "8", "experiment=smoke"]
    plain = run(base)
    assert capsys.readouterr().err == ""
    unset = run([*base, "model.text_dim=64"])
    err = capsys.readouterr().err
    assert err.startswith("vitp-plan: note: model.text_dim=64 but model.text_len=0: this plan counts no caption tokens")
    assert err.count("\n") == 1 and "model.text_len=77 for CLIP, 512 for T5 / umT5" in err, err
    with_len = run([*base, "model.text_dim=64", "model.text_len=77"])
    assert capsys.readouterr().err == ""
    act = [r["memory_bytes"]["activations"] for r in (plain, unset, with_len) for r in r[:1]]
    assert act[0] <= act[1] < act[2]  # the caption tokens are counted only with text_len


def test_vitp_plan_json_with_show_plan_is_one_json_document(capsys):
    """``--json --show-plan N`` printed the plan text after the JSON (``json.load``: Extra data); the
    text is now the document's ``show_plan`` field, the same as the table's mode prints."""
    from vitp.cli.plan import parse_args, run

    argv = ["--gpus", "4", "--device", "h100", "--top", "3", "--ac", "0", "--micro", "2", "--show-plan", "1",
            "experiment=smoke", "parallel.tp=2"]
    run(argv)
    text = "parallel plan at " + capsys.readouterr().out.split("parallel plan at ")[1]
    run(["--json", *argv])
    doc = json.loads(capsys.readouterr().out)
    assert doc["show_plan"] == text.rstrip("\n") and doc["show_plan"].startswith("parallel plan at tp=2 ")
    run(["--json", *argv[:10], *argv[12:]])  # no --show-plan: no field
    assert "show_plan" not in json.loads(capsys.readouterr().out)
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    assert 'with --json, the same text is the JSON\'s "show_plan" field' in " ".join(capsys.readouterr().out.split())


def test_vitp_plan_help_and_docs_say_what_show_plan_costs(capsys):
    """``--show-plan`` at tp or cp > 1 builds the model on torch's meta device (torch and timm
    imports, about 4-5 s on a plan of about 1 s): the help and the docs' timings say so."""
    from pathlib import Path

    from vitp.cli.plan import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "At tp or cp > 1 it builds the model on torch's meta device: the torch and timm imports add about 4-5 s" \
        in help_text
    docs = " ".join((Path(__file__).resolve().parents[2] / "docs" / "planner-and-telemetry.md").read_text().split())
    assert "`--show-plan ROW` at a row with tp or cp > 1 does import torch and timm" in docs
    assert "it builds the model on torch's meta device: the torch and timm imports add about 4-5 s" in docs


def test_vitp_plan_on_cpu_shows_the_memory_each_rank_gets(monkeypatch, capsys):
    """On ``--device cpu`` the memory is the machine's, shared by the ranks: the header showed the
    machine's 23.5 GiB beside rows whose limit was 11.75 GiB per rank. It says both now; the help,
    the docs and parallel.auto_memory_gib's comment say what the number means on CPU."""
    from pathlib import Path

    import vitp.plan.devices as devices
    from vitp.cli.plan import parse_args, run

    monkeypatch.setattr(devices, "cpu_profile", lambda **kw: replace(devices.default_cpu_profile(), memory_gib=23.5))
    rows = run(["--gpus", "2", "--device", "cpu", "--top", "1", "experiment=smoke"])
    assert "; 2 x cpu (23.5 GiB shared: 11.8 GiB per rank, 1024/node); " in capsys.readouterr().out
    assert rows[0]["limit_gib"] == 11.75
    rows = run(["--gpus", "2", "--device", "cpu", "--top", "1", "--mem-gib", "11.76", "experiment=smoke"])
    assert "; 2 x cpu (11.8 GiB shared: 5.88 GiB per rank, 1024/node); " in capsys.readouterr().out
    assert rows[0]["limit_gib"] == 5.88
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "on --device cpu the machine's memory (default: its RAM), split among the --gpus ranks on it" in help_text
    root = Path(__file__).resolve().parents[2]
    docs = " ".join((root / "docs" / "planner-and-telemetry.md").read_text().split())
    assert "on `--device cpu` it is the machine's memory (default: its RAM), split among the `--gpus` ranks" in docs
    assert "`parallel.auto_memory_gib` on CPU: the machine's memory, split among the ranks on it" in docs
    assert "on CPU the machine's memory, split among its ranks" in (root / "vitp" / "config.py").read_text()
