"""LoRA on vitp's generator in ``vitp-train`` (docs/finetuning.md, LoRA), riding on the reference
groups (``reference_runs``, :func:`tests.helpers.lora_cases`): 4 steps of adapters on the frozen
perturbed export (B drawn non-zero) at tp2 + SP equal one process (loss, grad norm, live and EMA
adapters); the checkpoint holds the adapters alone and records its base file and hash; ``vitp-export
--format lora`` writes vitp's LoRA file and ``--merge`` vitp's export of the merged weights, whose
output is the base's with the adapters (1e-5); ``vitp-sample`` / ``vitp-eval`` of the run merge its
adapters into its base as ``--merge`` does (the same grid), refusing a base that moved or changed;
``trainer.lora.init_from=RUN/lora`` starts from the run's adapters exactly."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import GEN_LORA, PERTURBED

TOL = 1e-5


def _adapters(run: Path) -> dict:
    """The final EMA adapters (``RUN/lora/lora.safetensors``) and the last checkpoint's live ones."""
    from vitp.train.lora import full_lora_state

    tag = sorted((run / "checkpoints").glob("step_*"))[-1]
    return {"ema": load_file(str(run / "lora" / "lora.safetensors")), "model": full_lora_state(tag, "model")[0]}


def test_generator_lora_tp2_sp_matches_one_process(reference_runs):
    ref_dir, ref = reference_runs["lora_tp1pp1"]
    run_dir, res = reference_runs["lora_tp2sp"]
    assert len(ref["losses"]) == 4 and len(set(round(x, 6) for x in ref["losses"])) == 4
    assert res["losses"] == pytest.approx(ref["losses"], rel=TOL)
    assert res["grad_norms"] == pytest.approx(ref["grad_norms"], rel=TOL)
    got, want = _adapters(run_dir), _adapters(ref_dir)
    for kind in ("ema", "model"):  # blocks x (qkv, proj, fc2) x (A, B)
        assert got[kind].keys() == want[kind].keys() and len(want[kind]) == 2 * 3 * 2, kind
        for k, v in want[kind].items():
            torch.testing.assert_close(got[kind][k], v, rtol=TOL, atol=1e-6 * float(v.abs().max()), msg=k)


def test_generator_lora_checkpoint_holds_adapters_and_records_its_base(reference_runs):
    from vitp.checkpoint.sharded import tensor_shapes
    from vitp.models.lora import base_hash

    run_dir, _ = reference_runs["lora_tp1pp1"]
    tag = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    for kind in ("model", "ema", "exp_avg", "exp_avg_sq"):
        keys = list(tensor_shapes(tag, kind))
        assert keys and all(k.endswith((".lora_A", ".lora_B")) for k in keys), (kind, keys)
    record = json.loads((tag / "vitp_meta.json").read_text())["lora"]
    assert record["base"] == {"folder": str(PERTURBED), "hash": base_hash(PERTURBED)} and record["family"] == "vit"
    assert record["pieces"]["blocks.0.attn.qkv"] == [0, 2] and "blocks.0.mlp.fc2" in record["pieces"]


def test_generator_lora_exports_and_merged_export_equals_base_plus_adapters(reference_runs, tmp_path):
    """``vitp-export RUN --format lora`` (vitp's file, read back by ``read_lora_file``) and
    ``vitp-export RUN --merge`` (a vitp export, loaded as ``vitp-sample`` loads weights): the merged
    generator's output equals the base generator with the adapters (1e-5 relative) and differs
    from the base's."""
    from vitp.checkpoint.export import load_generator, read_export
    from vitp.cli.export import run as export
    from vitp.models import Generator
    from vitp.models.lora import LoraSpec, apply_lora
    from vitp.models.lora_files import read_lora_file

    run_dir, _ = reference_runs["lora_tp1pp1"]
    file = export([str(run_dir), "--format", "lora", "-o", str(tmp_path / "lora.safetensors")])
    in_folder = export([str(run_dir), "--format", "lora", "-o", str(tmp_path / "folder")])
    # vitp's keys, not diffusers': not named as diffusers' pytorch_lora_weights.safetensors
    assert in_folder == tmp_path / "folder" / "lora.safetensors"
    one, two = load_file(str(file)), load_file(str(in_folder))
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    merged, cfg = load_generator(export([str(run_dir), "--merge", "-o", str(tmp_path / "merged.safetensors")]))
    base_state, _ = read_export(PERTURBED)
    gen = Generator.from_config(cfg.model)
    gen.load_state_dict(base_state)
    base = Generator.from_config(cfg.model)
    base.load_state_dict(base_state)
    ema = load_file(str(run_dir / "lora" / "lora.safetensors"))
    adapters, conf = read_lora_file(file, {k: tuple(v.shape) for k, v in gen.state_dict().items()})
    assert adapters.keys() == ema.keys() and all(torch.equal(adapters[k], ema[k]) for k in ema)
    spec = LoraSpec(rank=conf["rank"], alpha=conf["alpha"], targets=tuple(conf["targets"]), family="vit")
    apply_lora(gen, spec, init={k[:-len(".lora_A")]: (v, adapters[k[:-1] + "B"]) for k, v in adapters.items()
                                if k.endswith(".lora_A")})
    g = torch.Generator().manual_seed(0)
    x, t, y = torch.randn(4, cfg.model.in_channels, 1, 8, 8, generator=g), torch.rand(4, generator=g), torch.arange(4)
    with torch.no_grad():
        want, got, plain = (m.eval()(x, t, y)[0] for m in (gen, merged, base))
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) / scale < TOL
    assert float((plain - want).abs().max()) / scale > 100 * TOL  # the adapters change the output


def test_continued_generator_lora_starts_from_the_runs_adapters(reference_runs):
    """``trainer.lora.init_from=RUN/lora`` with no rank, alpha or targets given, one step at lr 0:
    the settings are the file's and the adapters (live and EMA) are the run's, bit for bit."""
    ref_dir, _ = reference_runs["lora_tp1pp1"]
    run_dir, res = reference_runs["lora_cont"]
    got, want = _adapters(run_dir), _adapters(ref_dir)
    assert len(res["losses"]) == 1
    for kind in ("ema", "model"):
        assert got[kind].keys() == want["ema"].keys()
        assert all(torch.equal(got[kind][k], want["ema"][k]) for k in want["ema"]), kind
    record = json.loads((run_dir / "lora" / "lora.json").read_text())
    assert (record["rank"], record["alpha"], record["targets"]) == (4, 6.0, ["q", "v", "attn.proj", "fc2"])
    assert record["init_from"] == str(ref_dir / "lora" / "lora.safetensors")


def test_vitp_sample_and_eval_of_a_generator_lora_run_merge_its_adapters_into_its_base(reference_runs, tmp_path,
                                                                                        monkeypatch):
    """A new user's report: ``vitp-sample RUN`` / ``vitp-eval RUN`` of a generator LoRA run ended in a
    ``load_state_dict`` traceback (its checkpoints hold the adapters alone). They now sample the
    base with the run's adapters merged: the grid of ``vitp-export RUN --merge``'s file, pixel for
    pixel, not the base's. A base that is gone or whose weights changed is refused in one line, and
    tp / cp / pp sampling of the adapters names the merged export instead."""
    import numpy as np
    from PIL import Image
    from safetensors.torch import save_file

    from vitp.checkpoint import resolve_weights
    from vitp.checkpoint.export import load_generator, read_export, with_lora_merged
    from vitp.cli.eval import load_generator_for
    from vitp.cli.export import run as export
    from vitp.cli.sample import run as sample
    from vitp.config import compose
    from vitp.eval import launch

    run_dir, _ = reference_runs["lora_tp1pp1"]
    merged = export([str(run_dir), "--merge", "-o", str(tmp_path / "merged.safetensors")])
    grids = {}
    for name, src in (("run", run_dir), ("merged", merged)):
        out = tmp_path / f"{name}.png"
        sample([str(src), "--classes", "3", "--num", "2", "--out", str(out), "sampler.steps=2"])
        grids[name] = np.asarray(Image.open(out)).astype(int)
    assert np.array_equal(grids["run"], grids["merged"]) and grids["run"].std() > 0
    weights = resolve_weights(run_dir)[0]
    gen, cfg = load_generator(merged)
    got = load_generator_for(weights, cfg)  # vitp-eval's reader of the run's weights
    assert all(torch.equal(a, b) for a, b in zip(gen.state_dict().values(), got.state_dict().values()))
    base_state, base_meta = read_export(PERTURBED)  # the adapters moved the targeted weights, and only those
    moved_keys = {k for k, v in got.state_dict().items() if not torch.equal(v, base_state[k])}
    assert moved_keys == {f"blocks.{i}.{m}.weight" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.fc2")}
    state, meta = read_export(weights)
    saved = json.loads(meta["vitp_config"])
    moved = dict(meta, vitp_config=json.dumps({**saved, "trainer": {**saved["trainer"],
                                                                    "init_from": str(tmp_path / "gone.safetensors")}}))
    with pytest.raises(FileNotFoundError, match=r"adapters of the base .*gone.safetensors, which no longer exists: put "
                                                r"that base back there, or export merged weights .*--merge"):
        with_lora_merged(state, moved, weights)
    changed_file = tmp_path / "changed.safetensors"
    save_file({k: v * 1.01 for k, v in base_state.items()}, str(changed_file), metadata=base_meta)
    changed = dict(meta, vitp_config=json.dumps({**saved, "trainer": {**saved["trainer"],
                                                                      "init_from": str(changed_file)}}))
    with pytest.raises(ValueError, match=r"trained on the base .*changed.safetensors, whose weights have changed since"):
        with_lora_merged(state, changed, weights)
    monkeypatch.setattr(launch.dist, "world_size", lambda: 2)
    lora_cfg = compose([*GEN_LORA, "parallel.tp=2"])
    with pytest.raises(ValueError, match=r"holds a LoRA run's adapters, which vitp-sample runs in data-parallel "
                                         r"replicas only .*vitp-export RUN --merge -o X.safetensors"):
        launch.build_sharded(lora_cfg, weights)

