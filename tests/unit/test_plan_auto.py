"""``parallel=auto``: the selection function (vitp.plan.auto) and the launch-side pieces that need no
process group (vitp.train.autolayout). The 2-rank run is in tests/distributed/test_auto_layout.py."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers import PLAN_MODELS, compose_cfg
from vitp.plan import AUTO_KEYS, PRESETS, DeviceProfile, choose_layout, fixed_keys, format_bytes, layout_of, plan

CPU = DeviceProfile("cpu-test", "cpu", {"fp32": 1e11, "bf16": 1e11}, 16.0, 1e10, 1e9, 1e9, devices_per_node=64,
                    efficiency=1.0, latency_s=1e-4, layer_overhead_s=1e-4, reserve_gib=0.0, cores=2)
S8 = [*PLAN_MODELS["S"], "trainer.global_batch_size=8", "parallel=auto"]


@pytest.fixture(scope="module")
def ranked():
    """The planner's rows for model S (depth 4, 4 heads, global batch 8) on 4 CPU-test processes."""
    cfg = compose_cfg(S8)
    return cfg, plan(cfg, 4, CPU)


def test_auto_takes_the_planners_first_row_and_its_overrides_reproduce_it(ranked):
    cfg, preds = ranked
    choice = choose_layout(cfg, 4, CPU)
    assert cfg.parallel.auto is True and choice.best.layout == preds[0].layout
    assert choice.candidates == len(preds) == 100 and choice.fitting == sum(p.fits for p in preds) == 100
    fitting = [p.time["step_s"] for p in preds if p.fits]
    assert choice.best.time["step_s"] == min(fitting)
    # on this profile: no TP, two stages, two replicas, micro-batch 4, one micro-batch per step
    assert choice.values() == {"parallel.tp": 1, "parallel.cp": 1, "parallel.cp_mode": "ulysses", "parallel.pp": 2,
                               "parallel.sequence_parallel": False, "parallel.activation_checkpoint_interval": 0,
                               "trainer.micro_batch_size": 4}
    again = compose_cfg([*S8, *choice.best.layout.overrides()])
    assert layout_of(again, 4) == choice.best.layout
    line = choice.summary()
    assert "tp=1 cp=1 pp=2 dp=2 sp=off ac=0 micro=4 x 1 per step, first of 100 valid layouts (100 fit)" in line
    # what each prediction counts, so that no one reads the run's process RSS, first steps or
    # perf/mfu as a mismatch with it
    assert (f"predicted per rank: {format_bytes(choice.best.peak.total)} peak of parameters, gradients, optimizer "
            f"state and activations (not the process's RSS), {choice.best.time['step_s']:.4g} s/step of compute and "
            f"communication (no data loading or warm-up), MFU {choice.best.mfu:.2g} at that step time; ") in line
    assert "\n" not in line
    assert line.endswith("reproduce with: " + " ".join(choice.best.layout.overrides()))
    assert choose_layout(cfg, 4, CPU).as_dict() == choice.as_dict()  # deterministic


def test_fixed_keys_constrain_the_search(ranked):
    _, preds = ranked
    cfg = compose_cfg([*S8, "parallel.tp=2"])
    choice = choose_layout(cfg, 4, CPU, fixed=["parallel.tp"])
    tp2 = [p for p in preds if p.layout.tp == 2]
    assert choice.best.layout == tp2[0].layout and choice.candidates == len(tp2) and choice.fixed == {
        "parallel.tp": 2}
    cfg = compose_cfg([*S8, "parallel.sequence_parallel=true", "parallel.activation_checkpoint_interval=2"])
    choice = choose_layout(cfg, 4, CPU, fixed=["parallel.sequence_parallel",
                                               "parallel.activation_checkpoint_interval"])
    lay = choice.best.layout
    assert lay.sp and lay.tp > 1 and lay.ac == 2  # an interval outside the default (0, 1) search
    with pytest.raises(ValueError, match=r"no valid layout .* on 4 devices with parallel.tp=3"):
        choose_layout(compose_cfg([*S8, "parallel.tp=3"]), 4, CPU, fixed=["parallel.tp"])
    with pytest.raises(ValueError, match="cannot fix"):
        choose_layout(cfg, 4, CPU, fixed=["model.depth"])


def test_no_layout_names_the_fixed_value_the_rule_it_fails_and_the_fix():
    """parallel.pp=4 on one process once said only "check heads, MLP hidden units, depth ...": the
    refusal names each fixed value, the rule it fails and how to fix it."""
    def refusal(over, world):
        with pytest.raises(ValueError) as e:
            choose_layout(compose_cfg(over), world, CPU, fixed=fixed_keys(over))
        return str(e.value)

    msg = refusal(["experiment=smoke", "parallel=auto", "parallel.pp=4"], 1)  # model.depth 2
    assert msg.startswith("parallel.auto: no valid layout of this config on 1 device with parallel.pp=4: ")
    assert ("parallel.pp=4 needs at least 4 processes and this run has 1: launch 4 processes or a multiple (e.g. "
            "torchrun --nproc_per_node 4 -m vitp.train ...; docs/launching.md), or drop parallel.pp=4") in msg
    assert "model.depth=2 < parallel.pp=4" in msg and "use parallel.pp <= 2" in msg and "check heads" not in msg
    assert "parallel.tp=8 does not divide model.num_heads=4; valid tp degrees" in refusal([*S8, "parallel.tp=8"], 8)
    msg = refusal([*S8, "parallel.tp=2", "parallel.pp=3"], 8)
    assert "parallel.tp=2 x parallel.pp=3 = 6 does not divide the 8 processes: launch 6 processes" in msg
    assert "drop parallel.tp=2 parallel.pp=3" in msg
    assert ("trainer.micro_batch_size=3 x dp divides trainer.global_batch_size=8 for no data-parallel degree of this "
            "run (dp in [1, 2, 4]): use trainer.micro_batch_size in [1, 2, 4, 8]") in refusal(
        [*S8, "trainer.micro_batch_size=3"], 4)
    msg = refusal([*S8, "parallel.sequence_parallel=true"], 1)
    assert "with parallel.sequence_parallel=true: parallel.sequence_parallel=true splits tokens over tensor" in msg
    assert "launch more processes (tp > 1), or drop parallel.sequence_parallel=true" in msg
    assert "64 tokens (grid 1x8x8) do not split over parallel.cp=3" in refusal([*S8, "parallel.cp=3"], 3)


def test_fixed_keys_from_the_command_line():
    over = ["parallel=auto", "parallel.tp=2", "+trainer.micro_batch_size=4", "model.depth=3", "~parallel.pp"]
    assert fixed_keys(over) == ["parallel.tp", "trainer.micro_batch_size"]
    assert fixed_keys([]) == [] and set(AUTO_KEYS) == set(fixed_keys([f"{k}=1" for k in AUTO_KEYS]))


def test_refuses_when_nothing_fits():
    cfg = compose_cfg(["experiment=img256", "data.root=x", "parallel=auto"])
    small = replace(PRESETS["h100"], memory_gib=4.0)
    with pytest.raises(ValueError, match=r"none of the \d+ valid layouts fits 8 x h100 \(1.00 GiB per rank\); the "
                                         r"smallest, parallel.tp=.*, needs \d\.\d\d GiB\..*parallel.auto_memory_gib"):
        choose_layout(cfg, 8, small)
    choice = choose_layout(cfg, 8, PRESETS["h100"], micro_options=(32, 128))
    assert choice.best.fits and choice.best.layout.micro in (32, 128)


def test_cpu_plans_count_zero_buckets_only_as_far_as_gradients_fill_them():
    """On CPU ZeRO-1's two 5e8-element buckets (3.73 GiB in fp32, whatever the model) are resident
    only where gradients are written (first touch), as the start-up check counts them: a
    71k-parameter model at dp=2 fits 1 GiB per rank (2 GiB for 2 processes), the plan's bucket
    term is the rank's gradient bytes; on a GPU the whole allocation counts."""
    from vitp.plan import stage_memory

    cfg = compose_cfg(["experiment=smoke", "model.depth=4", "parallel=auto"])
    preds = plan(cfg, 2, replace(CPU, memory_gib=2.0))
    dp2 = [p for p in preds if p.layout.dp * p.layout.cp == 2]
    assert len(dp2) == 14 and len(preds) == 38 and all(p.fits for p in preds)
    for p in dp2:  # 71,044 fp32 gradients
        assert p.peak.zero_buckets == p.peak.grads == 71_044 * 4 and p.peak.total < 3 * 2**20
    lay = choose_layout(cfg, 2, replace(CPU, memory_gib=2.0)).best.layout
    assert (lay.tp, lay.cp, lay.pp, lay.dp) == (1, 1, 1, 2) and lay == preds[0].layout  # not pp=2 for lack of memory
    assert [m.zero_buckets for m in stage_memory(cfg.model, replace(lay, device="cuda"))] == [2 * 500_000_000 * 4]


def test_profile_override_and_recorded_layout(tmp_path):
    from vitp.train.autolayout import _decide, detect_profile, recorded_layout

    cfg = compose_cfg([*S8, "parallel.auto_device=h200", "parallel.auto_memory_gib=100"])
    prof = detect_profile(cfg, torch.device("cpu"), 8)
    assert prof.name == "h200" and prof.memory_gib == 100.0 and prof.peak_flops == PRESETS["h200"].peak_flops
    with pytest.raises(ValueError, match="auto_memory_gib=-1"):
        from vitp.config import validate_config

        validate_config(compose_cfg([*S8, "parallel.auto_memory_gib=-1"]))
    assert recorded_layout(tmp_path) is None
    (tmp_path / ".hydra").mkdir()
    saved = compose_cfg([*S8, "parallel.tp=2", "parallel.pp=1", "trainer.micro_batch_size=2"])
    (tmp_path / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    assert recorded_layout(tmp_path) == {"parallel.tp": 2, "parallel.cp": 1, "parallel.cp_mode": "ulysses",
                                         "parallel.pp": 1, "parallel.sequence_parallel": False,
                                         "parallel.activation_checkpoint_interval": 0, "trainer.micro_batch_size": 2}
    # a relaunch reuses the recorded layout (no new plan); command-line keys still win
    out = _decide(compose_cfg([*S8, "trainer.micro_batch_size=1"]), tmp_path, torch.device("cpu"), 4,
                  ["trainer.micro_batch_size"])
    assert out["source"] == "recorded" and out["choice"] is None
    assert out["values"]["parallel.tp"] == 2 and out["values"]["trainer.micro_batch_size"] == 1
    assert "parallel.tp=2 parallel.cp=1 parallel.cp_mode=ulysses parallel.pp=1 parallel.sequence_parallel=false" in out[
        "summary"]
    saved.parallel.auto = False  # a folder of a run without parallel=auto records nothing to reuse
    (tmp_path / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    assert recorded_layout(tmp_path) is None


@pytest.mark.parametrize("value", ["1e300", "inf", "2e6", "0", "-1"])
def test_auto_memory_gib_outside_0_to_1_pib_is_refused_by_config_validation(value):
    """An absurd memory per device is refused with the key and the range, before any planning
    (1e300 GiB once reached format_bytes(inf) and named no key)."""
    from vitp.config import MAX_DEVICE_MEMORY_GIB, validate_config

    with pytest.raises(ValueError, match=r"^parallel.auto_memory_gib=.*: must be a number in \(0, 1048576\] "
                                         r"\(GiB per device; 1048576 GiB = 1 PiB\), or null"):
        validate_config(compose_cfg([*S8, f"parallel.auto_memory_gib={value}"]))
    assert MAX_DEVICE_MEMORY_GIB * 2**30 == 2**50  # 1 PiB
    validate_config(compose_cfg([*S8, f"parallel.auto_memory_gib={MAX_DEVICE_MEMORY_GIB}"]))


def test_auto_picks_context_parallelism_when_nothing_else_fits():
    """A long video (256 frames at 512 px: 128 x 32 x 32 tokens, factorized attention) on 8 GPUs
    with 4 heads: tp stops at 4, so no layout without cp holds one sample's activations in a
    budget between the two minima; auto then trains a cp > 1 layout, and its values carry
    parallel.cp (the memory model divides every token-proportional tensor by cp)."""
    cfg = compose_cfg(["experiment=video512", "data.root=x", "data.num_classes=10", "data.num_frames=256",
                       "model.depth=4", "model.num_heads=4", "trainer.global_batch_size=1", "parallel=auto"])
    roomy = replace(PRESETS["h100"], memory_gib=1e4, reserve_gib=0.0)
    preds = plan(cfg, 8, roomy, ac_options=(0, 1))
    least = {cp: min(p.peak.total for p in preds if p.layout.cp == cp) for cp in (1, 2, 4, 8)}
    assert least[2] < 0.9 * least[1]  # cp=2 x tp=4 halves what tp=4 alone keeps per rank
    budget = replace(roomy, memory_gib=(least[1] + least[2]) / 2 / 2**30)
    choice = choose_layout(cfg, 8, budget)
    lay = choice.best.layout
    assert lay.cp > 1 and choice.best.fits and choice.values()["parallel.cp"] == lay.cp
    assert not any(p.fits for p in plan(cfg, 8, budget, ac_options=(0, 1)) if p.layout.cp == 1)
    assert f"parallel.cp={lay.cp}" in lay.overrides() and f"cp={lay.cp}" in choice.summary()
    fixed = choose_layout(compose_cfg([*S8, "parallel.cp=2"]), 4, CPU, fixed=["parallel.cp"])
    assert fixed.best.layout.cp == 2 and fixed.fixed == {"parallel.cp": 2}


@pytest.mark.parametrize("profile", ["cpu", "h100"])
def test_auto_leaves_sequence_parallelism_off_unless_memory_needs_it(profile):
    """The size threshold for SP is the planner's: SP moves TP's bytes in twice the collectives (an
    all-gather and a reduce-scatter for each all-reduce), so with each collective's latency charged
    it predicts SP slower at every size here (measured on the 2-core machine: 1.17x plain TP at the
    demo size, 1.03x at the larger bench size, docs/performance.md) and picks it only where its
    smaller activations are what fits. Demo model (16 tokens) and the bench's larger one (256), tp=2 fixed."""
    prof = CPU if profile == "cpu" else PRESETS["h100"]
    sizes = [[], ["model.width=384", "model.num_heads=6", "data.channels=3", "data.resolution=32",
                  "trainer.global_batch_size=16"]]
    for size in sizes:
        cfg = compose_cfg([*size, "parallel=auto", "parallel.tp=2", "parallel.activation_checkpoint_interval=0"])
        fixed = ["parallel.tp", "parallel.activation_checkpoint_interval"]
        roomy = replace(prof, memory_gib=1e3, reserve_gib=0.0)
        choice = choose_layout(cfg, 2, roomy, fixed=fixed)
        assert choice.best.layout.tp == 2 and not choice.best.layout.sp, size
        rows = [p for p in plan(cfg, 2, roomy, ac_options=(0,)) if p.layout.tp == 2]
        least = {sp: min(p.peak.total for p in rows if p.layout.sp == sp) for sp in (False, True)}
        assert least[True] < least[False]
        per_gib = rows[0].limit_bytes / roomy.memory_gib  # a profile's usable bytes per rank and GiB it has
        budget = replace(roomy, memory_gib=(least[True] + least[False]) / 2 / per_gib)
        tight = choose_layout(cfg, 2, budget, fixed=fixed)
        assert tight.best.layout.sp and tight.best.fits, size


def test_a_job_plans_once_rank_0_decides_for_every_rank(tmp_path, monkeypatch):
    """``parallel=auto`` in a 4-rank job (a fake world, ranks run in turn): the planner and the
    device detection run on rank 0 only, and every rank gets rank 0's layout (issue 54 item 2)."""
    import vitp.plan
    from vitp.train import autolayout

    calls, box, rank = {"plan": 0, "profile": 0}, [], [0]
    real_choose = vitp.plan.choose_layout

    def choose(*a, **k):
        calls["plan"] += 1
        return real_choose(*a, **k)

    def profile(cfg, device, world):
        calls["profile"] += 1
        return CPU

    def broadcast(obj, group=None):  # rank 0 sends, the others receive what it sent
        if rank[0] == 0:
            box.append(obj)
        return box[0]

    monkeypatch.setattr(vitp.plan, "choose_layout", choose)
    monkeypatch.setattr(autolayout, "detect_profile", profile)
    monkeypatch.setattr(autolayout.dist, "init_distributed", lambda *a, **k: None)
    monkeypatch.setattr(autolayout.dist, "world_size", lambda: 4)
    monkeypatch.setattr(autolayout.dist, "is_main", lambda: rank[0] == 0)
    monkeypatch.setattr(autolayout.dist, "broadcast_object", broadcast)
    decisions = []
    for r in range(4):
        rank[0] = r
        cfg = compose_cfg(S8)
        decisions.append(autolayout.apply_auto_layout(cfg, tmp_path, torch.device("cpu"), []))
        assert {k: OmegaConf.select(cfg, k) for k in AUTO_KEYS} == decisions[0]["values"]
    assert calls == {"plan": 1, "profile": 1} and all(d == decisions[0] for d in decisions)
    assert decisions[0]["source"] == "planned"


def test_a_text_run_plans_its_caption_stores_tokens_when_model_text_len_is_unset():
    """vitp-train fills ``model.text_len`` from the caption store for its telemetry; the start-up
    check and ``parallel=auto`` planned 0 caption tokens before (20.9 MiB / 0.009379 s instead of
    24.5 MiB / 0.0106 s on a 16-token store): they plan ``with_text_len(cfg, store tokens)``."""
    from vitp.cli.overrides import compose_checked
    from vitp.plan import choose_layout, get_profile
    from vitp.train.preflight import with_text_len

    base = ["experiment=smoke", "model.width=64", "model.depth=4", "model.num_heads=4", "model.text_dim=32"]
    cfg = compose_checked([*base, "model.text_len=0"])
    planned = with_text_len(cfg, 16)
    assert planned.model.text_len == 16 and cfg.model.text_len == 0  # a copy: the run config stays as given
    assert with_text_len(cfg, 0) is cfg
    given = compose_checked([*base, "model.text_len=8"])
    assert with_text_len(given, 16) is given  # a text_len the user set is planned as set
    klass = compose_checked(base[:-1])
    assert with_text_len(klass, 16) is klass  # a class-conditional model has no captions
    prof = get_profile("h100")
    peak = {n: choose_layout(c, 1, prof, fixed=["trainer.micro_batch_size"]).best.peak.total for n, c in
            (("unset", cfg), ("store", planned), ("16", compose_checked([*base, "model.text_len=16"])))}
    assert peak["store"] == peak["16"] > peak["unset"]
