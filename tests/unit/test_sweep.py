"""vitp-sweep (vitp/cli/sweep.py): override expansion, key checks, and a sampler sweep on a run
made here (perturbed smoke weights, no training) that leaves the run's eval.json alone."""
import csv
import json

import pytest
from omegaconf import OmegaConf

from tests.fixtures.record_reference import write_perturbed
from tests.helpers import compose_cfg
from vitp.cli.sweep import (_check_combinations, check_eval_keys, check_train_keys, collect, eval_sweep, main,
                            parse_overrides, slug)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_cartesian_expansion_in_hydra_grammar():
    sw = parse_overrides(["sampler.cfg_scale=1,1.5,2", "sampler.cfg_interval=[0.1,1]", "sampler.steps=10,20",
                          "sampler.method=euler"])
    assert sw.fixed == ["sampler.cfg_interval=[0.1,1]", "sampler.method=euler"]  # a list value is one value
    assert sw.keys == ["sampler.cfg_scale", "sampler.steps"]
    assert len(sw.combos) == 6 and sw.combos[:2] == [["sampler.cfg_scale=1", "sampler.steps=10"],
                                                     ["sampler.cfg_scale=1", "sampler.steps=20"]]
    assert sw.labels[-1] == {"sampler.cfg_scale": "2", "sampler.steps": "20"}
    # a sweep over list values; a list quoted twice for the shell; range(); group choices; + prefix
    sw = parse_overrides(["sampler.cfg_interval=[0.1,1],[0,1]", "objective.P_mean=-0.8,0", "seed=range(0,2)"])
    assert [c[0] for c in sw.combos[::4]] == ["sampler.cfg_interval=[0.1,1]", "sampler.cfg_interval=[0,1]"]
    assert {lab["objective.P_mean"] for lab in sw.labels} == {"-0.8", "0"} and len(sw.combos) == 8
    # a quoted list is a string, as vitp-train reads it (no special case)
    assert parse_overrides(["sampler.cfg_interval='[0.1,1]'"]).fixed == ["sampler.cfg_interval='[0.1,1]'"]
    sw = parse_overrides(["model=tiny,dit_digits", "+trainer.foo=1"])
    assert sw.keys == ["model"] and sw.fixed == ["+trainer.foo=1"]
    assert parse_overrides([]).combos == [[]]
    label = {"objective.P_mean": "-0.8", "sampler.cfg_interval": "[0.1,1]"}
    assert slug(label, 3) == "003_P_mean_-0.8_cfg_interval_0.1_1"
    for bad, msg in (("sampler.steps", "is not an override"), ("sampler.steps=interval(1,2)", "continuous"),
                     ("sampler.steps=[1,", "cannot parse"), ("model=glob(nothing*)", "has no combination")):
        with pytest.raises(ValueError, match=msg):
            parse_overrides([bad])
    with pytest.raises(ValueError, match="sampler.steps is given twice"):
        parse_overrides(["sampler.steps=1", "sampler.steps=2,3"])


def test_hydra_sweep_functions_expand_as_a_multirun():
    """choice(), range() with a step, sort(), glob() over a config group and quoted strings with
    commas expand as Hydra's basic sweeper expands them (the same value strings)."""
    sw = parse_overrides(["sampler.steps=range(10,31,10)", "sampler.method=choice(euler,heun)",
                          "sampler.cfg_scale=sort(2,1.5,1)", "model=glob(t*)"])
    assert sw.keys == ["sampler.steps", "sampler.method", "sampler.cfg_scale"] and sw.fixed == ["model=tiny"]
    assert len(sw.combos) == 18 and sw.combos[0] == ["sampler.steps=10", "sampler.method=euler", "sampler.cfg_scale=1"]
    assert [lab["sampler.steps"] for lab in sw.labels[::6]] == ["10", "20", "30"]
    assert [lab["sampler.cfg_scale"] for lab in sw.labels[:3]] == ["1", "1.5", "2"]
    assert parse_overrides(["model=glob(*)"]).labels[:2] == [{"model": "dit_digits"}, {"model": "jit_b"}]
    sw = parse_overrides(["data.root='a,b','c d'", "choice_sweep_of_one=choice(1)"])
    assert sw.labels == [{"data.root": "'a,b'"}, {"data.root": "'c d'"}] and sw.fixed == ["choice_sweep_of_one=1"]


def test_keys_refused_with_one_line_messages():
    with pytest.raises(ValueError, match=r"unknown config key sampler.cfg_scal \(did you mean sampler.cfg_scale\?\)"):
        check_eval_keys(parse_overrides(["sampler.cfg_scal=1,2"]))
    with pytest.raises(ValueError, match=r"model.depth: vitp-sweep eval can change sampler.\*, eval.\*, .*fixed by the "
                                         r"trained weights; sweep recipes with vitp-sweep train"):
        check_eval_keys(parse_overrides(["model.depth=4,6"]))
    with pytest.raises(ValueError, match="sampler= picks a config file when vitp-train composes a run"):
        check_eval_keys(parse_overrides(["sampler=euler,heun"]))
    with pytest.raises(ValueError, match=r"\+sampler.x=1: vitp-sweep eval sets keys of the run's config; it does "
                                         r"not add"):
        check_eval_keys(parse_overrides(["+sampler.x=1"]))
    check_eval_keys(parse_overrides(["sampler.steps=1,2", "eval.num_samples=20", "objective.t_eps=0.05"]))
    with pytest.raises(ValueError, match=r"unknown config key model.dept \(did you mean model.depth\?\)"):
        check_train_keys(parse_overrides(["model.dept=4,6"]))
    with pytest.raises(ValueError, match="sets eval.enabled itself"):
        check_train_keys(parse_overrides(["eval.enabled=false"]))
    check_train_keys(parse_overrides(["experiment=smoke", "model=tiny,dit_digits", "objective.P_mean=-0.8,0"]))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished-looking run: the smoke config (1-epoch judge, 30 samples) and perturbed weights
    (non-zero adaLN gates, so the sampler settings change the samples), plus an eval.json."""
    run = tmp_path_factory.mktemp("run")
    over = ["experiment=smoke", "eval.classifier_epochs=1", "eval.num_samples=30", "sampler.batch_size=64"]
    (run / ".hydra").mkdir()
    OmegaConf.save(compose_cfg(over), run / ".hydra" / "config.yaml")
    write_perturbed(run / "model_ema.safetensors", over, scale=0.2)
    (run / "eval.json").write_text('{"sample_accuracy": 0.5}\n')
    return run


def test_eval_sweep_writes_its_own_files_and_keeps_eval_json(run_dir, capsys):
    before = (run_dir / "eval.json").read_bytes()
    paths = eval_sweep(run_dir, ["sampler.cfg_scale=1,3", "sampler.cfg_interval=[0,1]", "sampler.steps=1,2"],
                       name="s1")
    assert (run_dir / "eval.json").read_bytes() == before
    out = run_dir / "sweeps" / "s1"
    assert paths == {"csv": out / "comparison.csv", "md": out / "comparison.md", "png": out / "comparison.png"}
    rows = list(csv.DictReader(paths["csv"].open()))
    assert [(r["sampler.cfg_scale"], r["sampler.steps"]) for r in rows] == [("1", "1"), ("1", "2"), ("3", "1"),
                                                                            ("3", "2")]
    for r in rows:
        ev = json.loads((out / r["run"] / "eval.json").read_text())
        assert ev["sampler"]["cfg_scale"] == float(r["sampler.cfg_scale"]) and ev["sampler"]["cfg_interval"] == [0, 1]
        assert ev["sampler"]["steps"] == int(r["sampler.steps"]) and ev["num_samples"] == 30
        for col in ("sample_accuracy", "fd_digits", "fd_digits_ratio", "heldout_loss"):
            assert float(r[col]) == ev[col]
        assert float(r["wall_s"]) > 0
    assert len({r["fd_digits"] for r in rows}) == 4  # each setting gave other samples
    assert len({r["heldout_loss"] for r in rows}) == 1  # the held-out loss does not depend on the sampler
    assert paths["png"].read_bytes()[:8] == PNG_MAGIC
    plan = json.loads((out / "sweep.json").read_text())
    assert plan["fixed"] == ["sampler.cfg_interval=[0,1]"] and len(plan["settings"]) == 4
    table = paths["csv"].read_bytes()
    with pytest.raises(ValueError, match=f"{out} holds another sweep .*choose another --out \\(--name for vitp-sweep "
                                         "eval\\)"):  # its table was replaced, silently
        eval_sweep(run_dir, ["sampler.steps=3"], name="s1")
    assert paths["csv"].read_bytes() == table and json.loads((out / "sweep.json").read_text()) == plan
    # collect reads the run's own eval.json and labels nothing (one run)
    assert list(csv.DictReader(collect([run_dir], out=run_dir / "c")["csv"].open()))[0]["sample_accuracy"] == "0.5"


@pytest.mark.parametrize("argv, msg", [
    (["eval", "{missing}"], "does not exist"),
    (["eval", "{run}", "model.depth=1,2"], "model.depth: vitp-sweep eval can change sampler.*"),
    (["eval", "{run}", "sampler.steps=0,1"], "sampler.steps=0: must be an integer >= 1; e.g. sampler.steps=20"),
    (["eval", "{run}", "sampler.method=euler,foo"], "Error merging override sampler.method=foo; Invalid value 'foo', "
                                                   "expected one of [heun, euler]"),
    (["eval", "{run}", "sampler.cfg_interval='[0,1]'"],  # a quoted list is a string, as in vitp-train
     "sampler.cfg_interval='[0,1]'; Invalid value assigned: str is not a ListConfig"),
    (["eval", "{run}", "--sort", "speed"], "--sort speed: unknown column"),
    (["collect", "{missing}"], "does not exist"),
    (["collect", "{run}/sweeps"], "neither a vitp run directory nor a folder of run directories"),
    (["train", "model.dept=1,2"], "unknown config key model.dept"),
    (["train", "experiment=smoke", "model.width=31,32"], "combination {'model.width': '31'}: model.width=31"),
    (["train", "experiment=smoke", "model.mlp=gelu,relu"], "combination {'model.mlp': 'relu'}: Error merging override "
                                                           "model.mlp=relu; Invalid value 'relu'"),
    (["train", "experiment=smoke", "model=tiny,nosuch"], "Could not find 'model/nosuch'"),
    (["sweep"], "the first argument is the mode, one of eval, train, collect"),
])
def test_cli_bad_input_is_one_line_and_status_2(run_dir, tmp_path, capsys, argv, msg):
    (run_dir / "sweeps").mkdir(exist_ok=True)
    argv = [a.format(run=run_dir, missing=tmp_path / "missing") for a in argv]
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("vitp-sweep: error: ") and msg in err and err.count("\n") == 1


def test_train_refuses_a_layout_its_runs_cannot_start_before_any_run(tmp_path, capsys, monkeypatch):
    """``vitp-sweep train parallel.tp=2,1`` (one process per run, no launcher) trained tp=1, failed
    tp=2 at its launch and ended with exit status 1; the layout is now checked against the world
    each run gets (the sweep's environment: WORLD_SIZE, 1 without a launcher) before any run."""
    from vitp.cli.sweep import run_world_size

    for var in ("WORLD_SIZE", "RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    assert run_world_size() == 1
    out = tmp_path / "sweep"
    with pytest.raises(SystemExit) as e:
        main(["train", "--out", str(out), "experiment=smoke", "parallel.tp=2,1", "trainer.max_steps=3"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and not out.exists()  # nothing written, nothing trained
    assert err == ("vitp-sweep: error: combination {'parallel.tp': '2'}: parallel.tp=2 x parallel.cp=1 x "
                   "parallel.pp=1 needs a multiple of 2 processes, and vitp-sweep train starts each run as one "
                   "process (python -m vitp.cli.train): sweep layouts one process trains (parallel.tp=1 parallel.cp=1 "
                   "parallel.pp=1), or train this one under a launcher (torchrun --nproc_per_node 2 -m vitp.train ... "
                   "parallel.tp=2; docs/launching.md) and compare the runs with vitp-sweep collect; nothing was "
                   "trained\n")
    # under parallel=auto only the degrees the combination fixes count; in a launch of 4 processes tp=2 fits
    sw = parse_overrides(["experiment=smoke", "parallel=auto", "model.depth=2,3"])
    _check_combinations(sw)
    with pytest.raises(ValueError, match=r"^combination \{'parallel.tp': '2'\}: .* needs a multiple of 2 processes"):
        _check_combinations(parse_overrides(["experiment=smoke", "parallel=auto", "parallel.tp=1,2"]))
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    assert run_world_size() == 4
    _check_combinations(parse_overrides(["experiment=smoke", "parallel.tp=2,1", "trainer.micro_batch_size=2"]))
    # vitp-train's other layout rules at that world: 8 samples over dp=4 at micro-batch 4 do not split
    with pytest.raises(ValueError, match=r"^combination \{'parallel.tp': '1'\}: trainer.global_batch_size=8 must be a "
                                         r"multiple of trainer.micro_batch_size \(4\) x dp \(4\)"):
        _check_combinations(parse_overrides(["experiment=smoke", "parallel.tp=2,1"]))
    with pytest.raises(ValueError, match=r"^combination \{'parallel.pp': '4'\}: parallel.tp=2 x parallel.cp=1 x "
                                         r"parallel.pp=4 needs a multiple of 8 processes, and vitp-sweep train starts "
                                         r"each run in this launch's WORLD_SIZE=4 .*whose tp x cp x pp divides 4"):
        _check_combinations(parse_overrides(["experiment=smoke", "parallel.tp=2", "parallel.pp=1,4"]))
