"""``parallel=auto`` on 2 gloo ranks: the trainer trains the layout the planner ranks first (on the
CPU profile measured here), records it, and a resume reuses the recorded layout without planning."""
import json
import math
import os
import subprocess
import sys

from omegaconf import OmegaConf

from tests.helpers import compose_cfg, free_port, run_ranks

OVER = ["experiment=smoke", "parallel=auto", "trainer.max_steps=4"]


def _auto_rank(rank, overrides, run_dir, cache_dir):
    os.environ["VITP_CACHE_DIR"] = cache_dir  # a fresh CPU profile, measured once by rank 0
    from vitp.config import compose
    from vitp.train import Trainer

    trainer = Trainer(compose(overrides), run_dir)
    res = trainer.fit()
    lay = trainer.layout
    return {"auto": trainer.auto, "layout": (lay.tp, lay.cp, lay.pp, lay.dp), "losses": res["losses"],
            "stopped_at": res["stopped_at"], "micro": trainer.cfg.trainer.micro_batch_size}


def test_auto_layout_is_the_planners_first_and_a_resume_keeps_it(tmp_path):
    from vitp.plan import AUTO_KEYS, DeviceProfile, plan

    run, cache = tmp_path / "run", str(tmp_path / "cache")
    first = run_ranks(2, _auto_rank, [*OVER, "trainer.exit_at_step=2"], str(run), cache)
    auto = first[0]["auto"]
    assert auto["source"] == "planned" and all(r["auto"] == auto for r in first)  # rank 0's choice everywhere
    profile = DeviceProfile(**auto["choice"]["profile"])
    assert profile.kind == "cpu" and profile.name == "cpu" and profile.cores >= 1
    best = plan(compose_cfg(OVER), 2, profile)[0]  # the planner, run here on the profile the trainer used
    assert best.fits and auto["values"] == {k: getattr(best.layout, f) for k, f in AUTO_KEYS.items()}
    v = auto["values"]
    tp, cp, pp = v["parallel.tp"], v["parallel.cp"], v["parallel.pp"]
    assert first[0]["layout"] == (tp, cp, pp, 2 // (tp * cp * pp))
    assert first[0]["micro"] == v["trainer.micro_batch_size"]
    assert "reproduce with: " + " ".join(best.layout.overrides()) in auto["summary"]
    for r in first:
        assert r["stopped_at"] == 2 and len(r["losses"]) == 2 and all(math.isfinite(x) for x in r["losses"])
    saved = OmegaConf.load(run / ".hydra" / "config.yaml")  # recorded for the resume
    assert saved.parallel.auto is True and {k: OmegaConf.select(saved, k) for k in AUTO_KEYS} == v

    resumed = run_ranks(2, _auto_rank, OVER, str(run), cache)
    assert all(r["auto"]["source"] == "recorded" and r["auto"]["values"] == v for r in resumed)
    assert resumed[0]["layout"] == first[0]["layout"] and resumed[0]["stopped_at"] is None
    assert len(resumed[0]["losses"]) == 2 and all(math.isfinite(x) for x in resumed[0]["losses"])
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]

    # the job comes back as one process: parallel=auto plans again for 1 rank, says so, and the
    # latest checkpoint (step 4, written by 2 ranks) is resharded onto that layout
    back = run_ranks(1, _auto_rank, ["experiment=smoke", "parallel=auto", "trainer.max_steps=6"], str(run), cache)[0]
    assert back["auto"]["source"] == "replanned" and back["layout"] == (1, 1, 1, 1), back["auto"]
    assert (f"the latest checkpoint (step 4) was written at tp={tp}{f' cp={cp}' if cp > 1 else ''} pp={pp} "
            f"dp={2 // (tp * cp * pp)} (2 ranks), this job has 1: re-planned for 1 rank;") in back["auto"]["summary"]
    assert len(back["losses"]) == 2 and all(math.isfinite(x) for x in back["losses"])
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]


def test_no_valid_layout_is_explained_once(tmp_path):
    """``parallel=auto`` with no valid layout (tp=3 fixed on 2 ranks), two ``python -m vitp.train``
    ranks as torchrun starts them: rank 0 prints the explanation, rank 1 does not print it again;
    both exit 2, and rank 1's torchrun error file holds rank 0's explanation."""
    port, procs = free_port(), []
    for r in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
        env.update(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", TORCHELASTIC_ERROR_FILE=str(tmp_path / f"error{r}.json"))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "vitp.train", *OVER, "parallel.tp=3", f"hydra.run.dir={tmp_path / 'run'}"],
            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outs
    why = "parallel.auto: no valid layout of this config on 2 devices with parallel.tp=3"
    assert [o.count(why) for o in outs] == [1, 0], outs
    recorded = json.loads((tmp_path / "error1.json").read_text())["message"]["message"]
    assert f"vitp-train: error: rank 0: {why}" in recorded

