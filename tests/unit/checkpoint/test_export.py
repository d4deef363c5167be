"""Weight files in the export layout: round trip and bad files."""
import pytest
import torch

from tests.helpers import compose_cfg
from vitp.checkpoint import load_generator, save_weights
from vitp.models import Generator


@pytest.fixture(scope="module")
def smoke():
    cfg = compose_cfg(["experiment=smoke"])
    return cfg, Generator.from_config(cfg.model, seed=0).eval(), None


def test_weights_round_trip_and_bad_files(smoke, tmp_path):
    cfg, gen, _ = smoke
    save_weights(tmp_path, cfg, gen.state_dict(), gen.state_dict())
    loaded, cfg2 = load_generator(tmp_path / "model_ema.safetensors")
    assert cfg2.model.width == cfg.model.width
    for k, v in gen.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k])
    assert not list(tmp_path.glob("*.tmp"))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 20)
    with pytest.raises(ValueError, match="bad.safetensors is corrupt"):
        load_generator(bad)
    trunc = tmp_path / "trunc.safetensors"
    trunc.write_bytes((tmp_path / "model.safetensors").read_bytes()[:-100])
    with pytest.raises(ValueError, match="trunc.safetensors is corrupt"):
        load_generator(trunc)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_generator(tmp_path / "missing.safetensors")
    # bytes damaged in place (same size) read as numbers: NaNs are named, not sampled or exported
    from vitp.checkpoint import read_export

    hurt = tmp_path / "hurt.safetensors"
    data = bytearray((tmp_path / "model_ema.safetensors").read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    data[start:start + 64] = b"\xff" * 64  # float32 0xffffffff is a NaN
    hurt.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"hurt.safetensors: 1 tensor\(s\) hold NaN / inf: .* \(16 values\).*"
                                         r"use an earlier checkpoint or export"):
        read_export(hurt)


def test_export_refuses_a_checkpoint_folder_without_its_metadata(smoke, tmp_path, capsys):
    """A checkpoint tag folder whose vitp_meta.json is missing (its save never finished, or the file
    was lost) was exported from its weights file as if complete; now vitp-export stops before
    writing, naming the missing file, the complete checkpoint and the file to pass instead."""
    import json

    from vitp.checkpoint import META
    from vitp.cli.export import main as export_main

    cfg, gen, _ = smoke
    ckpts = tmp_path / "run" / "checkpoints"
    done, broken = ckpts / "step_0000001", ckpts / "step_0000002"
    for tag in (done, broken):
        save_weights(tag, cfg, gen.state_dict(), gen.state_dict())
    (done / META).write_text(json.dumps({"step": 1, "manifest": {}}))
    (broken / "rng_rank00000.pt").write_bytes(b"")
    out = tmp_path / "w.safetensors"
    for folder in (broken, tmp_path / "copied"):  # found by its name, else (a copy) by its rank files
        if not folder.exists():
            broken.rename(folder)
        with pytest.raises(SystemExit) as e:
            export_main([str(folder), "-o", str(out)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and not out.exists()
        fix = (f"pass a complete checkpoint instead ({done}), or, to take this one's weights as they are, the "
               f"weights file itself" if folder == broken else "to take this one's weights as they are, pass the "
               "weights file itself")
        assert err == (f"vitp-export: error: {folder} is a checkpoint folder without its {META} (written last by "
                       f"a save: the save never finished, or the file was removed); {fix} "
                       f"({folder / 'model_ema.safetensors'})\n")
    export_main([str(tmp_path / "copied" / "model_ema.safetensors"), "-o", str(out)])  # the file: exported
    assert out.is_file()


# ----------------------------------------------------------------- exports of a torch distributed checkpoint
def _dcp_checkpoint(tag, cfg, gen, step=7):
    """A new-format checkpoint tag: DCP tensors ``ema/<key>`` (fp32) and ``model/<key>`` (bf16),
    ``vitp_meta.json`` with step, model, config and a manifest of the files."""
    import json
    import warnings

    import torch.distributed.checkpoint as dcp
    from omegaconf import OmegaConf

    state = gen.state_dict()
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process, as intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({**{f"ema/{k}": v.clone() for k, v in state.items()},
                  **{f"model/{k}": v.to(torch.bfloat16) for k, v in state.items()}}, checkpoint_id=str(tag), no_dist=True)
    (tag / "rng_rank00000.pt").write_bytes(b"rng")
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    manifest = {p.name: p.stat().st_size for p in tag.iterdir()}
    (tag / "vitp_meta.json").write_text(json.dumps({"step": step, "model": cfg_dict["model"], "config": cfg_dict,
                                                    "manifest": manifest}))
    return state


def _assert_state(got, want):
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == torch.float32 and torch.equal(got[k], v), k


def test_export_checkpoint_single_file_and_shards_by_two_ranks(smoke, tmp_path):
    """A checkpoint's EMA weights exported as one file (bytes as save_export writes them) and as
    >= 3 shards written by two "ranks" in turn: each writes only its shards k % 2; the index maps
    every export key to its shard; every shard carries the file's metadata; both read back exactly
    (all keys, and a subset from its shards only); a missing shard is named."""
    import json
    import re

    from safetensors import safe_open
    from safetensors.torch import load_file

    from vitp.checkpoint import read_export, save_export
    from vitp.checkpoint.export import _export_order, export_checkpoint
    from vitp.models import to_export_state

    cfg, gen, _ = smoke
    tag = tmp_path / "run" / "checkpoints" / "step_0000007"
    state = _dcp_checkpoint(tag, cfg, gen)
    want_file = to_export_state(state, cfg.model.width, cfg.model.depth)
    ref = save_export(tmp_path / "ref.safetensors", state, cfg, step=7)
    with safe_open(str(ref), framework="pt") as f:
        ref_meta = f.metadata()

    single = export_checkpoint(tag, tmp_path / "single.safetensors", cfg)
    assert single == tmp_path / "single.safetensors"
    got = load_file(single)
    assert sorted(got) == sorted(want_file) and all(torch.equal(got[k], want_file[k]) for k in want_file)
    with safe_open(str(single), framework="pt") as f:
        assert f.metadata() == ref_meta and ref_meta["step"] == "7" and ref_meta["weights"] == "ema"
    assert json.loads((tmp_path / "single.json").read_text()) == {
        **json.loads((tmp_path / "ref.json").read_text()), "tensors": "single.safetensors"}
    _assert_state(read_export(single)[0], state)

    out, limit = tmp_path / "sh" / "w.safetensors", 40_000
    index = export_checkpoint(tag, out, cfg, rank=0, world=2, max_shard_bytes=limit)
    assert index == tmp_path / "sh" / "w.safetensors.index.json" and not out.exists()
    head = json.loads(index.read_text())
    names = sorted(set(head["weight_map"].values()))
    n = len(names)
    assert n >= 3 and names == [f"w-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert sorted(p.name for p in out.parent.glob("w-*")) == names[0::2]  # rank 0: shards 1, 3, ...
    assert export_checkpoint(tag, out, cfg, rank=1, world=2, max_shard_bytes=limit) == index
    assert sorted(p.name for p in out.parent.glob("w-*")) == names
    assert sorted(head["weight_map"]) == sorted(want_file)
    assert head["metadata"]["total_size"] == sum(4 * v.numel() for v in want_file.values()) == 167184
    assert {k: v for k, v in head["metadata"].items() if k != "total_size"} == ref_meta
    assert json.loads((out.parent / "w.json").read_text())["tensors"] == "w.safetensors.index.json"
    for name in names:
        shard = load_file(out.parent / name)
        assert sum(4 * v.numel() for v in shard.values()) <= limit
        assert all(head["weight_map"][k] == name and torch.equal(v, want_file[k]) for k, v in shard.items())
        with safe_open(str(out.parent / name), framework="pt") as f:
            assert f.metadata() == ref_meta
    seq = list(head["weight_map"].values())  # whole tensors cut, in one sorted order, into consecutive shards
    assert list(head["weight_map"]) == sorted(head["weight_map"], key=_export_order) and seq == sorted(seq)
    assert not list(out.parent.glob(".*.tmp*"))

    for path in (out, index):
        got, meta = read_export(path)
        _assert_state(got, state)
        assert meta == ref_meta
    sub = ["blocks.1.attn.qkv.weight", "final.linear.bias"]
    keep = {head["weight_map"]["blocks.1.attn.qkv.weight"], head["weight_map"]["gen.final.linear.bias"]}
    gone = next(name for name in names if name not in keep)
    (out.parent / gone).unlink()
    got, _ = read_export(out, keys=sub)  # reads only the shards holding these
    assert sorted(got) == sorted(sub) and all(torch.equal(got[k], state[k]) for k in sub)
    with pytest.raises(FileNotFoundError, match=re.escape(f"weights shard {out.parent / gone} is missing")):
        read_export(out)
    kept = out.parent / sorted(keep)[0]
    kept.write_bytes(kept.read_bytes()[:-100])
    with pytest.raises(ValueError, match=re.escape(f"weights shard {kept} (of {index}) is corrupt, truncated")):
        read_export(out, keys=sub)


def test_reexport_removes_stale_files_and_shards_are_cut_in_block_order(smoke, tmp_path):
    """Exporting again to the same name leaves only this export's files: a single file removes an
    earlier index and its shards, another shard count removes the other shards; shards follow the
    generator's order with block numbers compared as numbers (blocks.2 before blocks.10)."""
    import json

    from vitp.checkpoint.export import _export_plan, export_checkpoint, shard_groups

    cfg, gen, _ = smoke
    tag = tmp_path / "step_0000007"
    _dcp_checkpoint(tag, cfg, gen)
    out = tmp_path / "w.safetensors"
    export_checkpoint(tag, out, cfg, max_shard_bytes=40_000)
    n5 = sorted(p.name for p in tmp_path.glob("w-*"))
    export_checkpoint(tag, out, cfg, max_shard_bytes=70_000)
    n3 = sorted(p.name for p in tmp_path.glob("w-*"))
    assert len(n5) > len(n3) >= 3 and all(name.endswith(f"-of-{len(n3):05d}.safetensors") for name in n3)
    assert sorted(json.loads((tmp_path / "w.safetensors.index.json").read_text())["weight_map"].values())[-1] == n3[-1]
    export_checkpoint(tag, out, cfg)
    assert out.is_file() and not list(tmp_path.glob("w-*")) and not (tmp_path / "w.safetensors.index.json").exists()

    shapes = {f"blocks.{i}.attn.qkv.weight": ((96, 32), torch.float32) for i in (10, 2, 1)}
    shapes["embed.x_embedder.proj.weight"] = ((32, 4), torch.float32)
    plan = _export_plan(shapes, 32, 0)
    assert list(plan) == ["blocks.1.attn.qkv.weight", "blocks.2.attn.qkv.weight", "blocks.10.attn.qkv.weight",
                          "gen.embed.x_embedder.proj.weight"]
    sizes = {k: nbytes for k, (_, _, nbytes) in plan.items()}
    assert shard_groups(sizes, 96 * 32 * 4 + 1) == [[k] for k in plan]  # one tensor each, none merged
    assert shard_groups(sizes, 10) == [[k] for k in plan]  # larger than the limit: alone in its shard
    assert shard_groups(sizes, 10**6) == [list(plan)]


def test_read_export_of_a_checkpoint_tag_and_vitp_export_shards_it(smoke, tmp_path, capsys):
    """``<tag>/model_ema.safetensors`` / ``model.safetensors`` of a DCP checkpoint read its ema /
    model tensors (fp32) with an export's metadata; resolve_weights points there and to a finished
    run's sharded final weights; vitp-export --max-shard-size writes and names the shards."""
    import json

    from vitp.checkpoint import load_generator, read_export, resolve_weights
    from vitp.cli.export import main as export_main
    from vitp.cli.export import parse_size

    cfg, gen, _ = smoke
    run = tmp_path / "run"
    tag = run / "checkpoints" / "step_0000007"
    state = _dcp_checkpoint(tag, cfg, gen)
    got, meta = read_export(tag / "model_ema.safetensors")
    _assert_state(got, state)
    assert (meta["step"], meta["weights"], meta["format"]) == ("7", "ema", "vitp.export/1")
    assert json.loads(meta["vitp_config"])["model"]["width"] == cfg.model.width == json.loads(meta["vitp_model"])["width"]
    raw, meta = read_export(tag / "model.safetensors", keys=["blocks.0.mlp.fc1.weight"])
    assert meta["weights"] == "raw" and list(raw) == ["blocks.0.mlp.fc1.weight"]
    assert torch.equal(raw["blocks.0.mlp.fc1.weight"], state["blocks.0.mlp.fc1.weight"].to(torch.bfloat16).float())

    assert resolve_weights(tag) == (tag / "model_ema.safetensors", 7, run)
    assert resolve_weights(tag, "raw") == (tag / "model.safetensors", 7, run)
    (run / "checkpoints" / "latest").write_text("step_0000007")
    assert resolve_weights(run) == (tag / "model_ema.safetensors", 7, run)

    assert (parse_size("5GB"), parse_size("500MB"), parse_size("1GiB"), parse_size("123")) == (
        5 * 10**9, 500 * 10**6, 2**30, 123)
    out = tmp_path / "exp" / "w.safetensors"
    export_main([str(tag), "-o", str(out), "--max-shard-size", "40000"])
    printed = capsys.readouterr().out
    shards = sorted((tmp_path / "exp").glob("w-*-of-*.safetensors"))
    assert len(shards) >= 3 and all(str(p) in printed for p in shards)
    assert f"and {out}.index.json and {tmp_path / 'exp' / 'w.json'}" in printed and "31 generator tensors" in printed
    loaded, cfg2 = load_generator(out)
    assert cfg2.model.width == cfg.model.width
    _assert_state(loaded.state_dict(), state)
    with pytest.raises(SystemExit):  # never overwrites without --force
        export_main([str(tag), "-o", str(out)])
    export_main([str(out), "-o", str(tmp_path / "one.safetensors")])  # a sharded export -> one file
    _assert_state(read_export(tmp_path / "one.safetensors")[0], state)

    for f in shards + [out.parent / "w.safetensors.index.json"]:  # a finished run with sharded final weights
        f.rename(run / f.name.replace("w", "model_ema", 1))
    (run / "metrics.jsonl").write_text('{"step": 7}\n')
    index = json.loads((run / "model_ema.safetensors.index.json").read_text())
    index["weight_map"] = {k: v.replace("w", "model_ema", 1) for k, v in index["weight_map"].items()}
    (run / "model_ema.safetensors.index.json").write_text(json.dumps(index))
    assert resolve_weights(run) == (run / "model_ema.safetensors", None, run)
    _assert_state(read_export(run / "model_ema.safetensors")[0], state)

    (tag / "vitp_meta.json").unlink()
    with pytest.raises(FileNotFoundError, match="vitp_meta.json missing"):
        read_export(tag / "model_ema.safetensors")
    with pytest.raises(FileNotFoundError, match="vitp_meta.json missing"):
        resolve_weights(tag)


def test_a_rank_reads_only_its_tp_shards_of_an_export(smoke, tmp_path):
    """``trainer.init_from``'s reader: a tp=2 rank's shards (the fused qkv split per head, stride 3;
    a row-parallel weight; a replicated vector) read from a single file, a sharded export and a
    checkpoint equal the slices of the full tensors; another shape is refused naming the key."""
    import torch.distributed.checkpoint as dcp

    from vitp.checkpoint.export import export_checkpoint, read_export_shards
    from vitp.checkpoint.sharded import Place, piece_tensor
    from vitp.parallel.layers import shard_tensor

    cfg, gen, _ = smoke
    state = gen.state_dict()
    save_weights(tmp_path, cfg, state, state)
    tag = tmp_path / "tag"
    dcp.save({f"ema/{k}": piece_tensor(v.reshape(-1).clone(), Place(tuple(v.shape))) for k, v in state.items()},
             checkpoint_id=str(tag), no_dist=True)
    import json

    from omegaconf import OmegaConf

    (tag / "vitp_meta.json").write_text(json.dumps({"step": 1, "config": OmegaConf.to_container(cfg, resolve=True)}))
    sharded = export_checkpoint(tag, tmp_path / "sh" / "model_ema.safetensors", cfg, max_shard_bytes=20_000)
    assert sharded.name.endswith(".index.json")
    qkv, proj, vec = "blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight", "blocks.0.attn.qkv.bias"
    places = {qkv: Place(tuple(state[qkv].shape), 0, 3, 2, 1), proj: Place(tuple(state[proj].shape), 1, 1, 2, 1),
              vec: Place(tuple(state[vec].shape))}
    want = {qkv: shard_tensor(state[qkv], 0, 3, 2, 1), proj: shard_tensor(state[proj], 1, 1, 2, 1), vec: state[vec]}
    for source in (tmp_path / "model_ema.safetensors", sharded, tag / "model_ema.safetensors"):
        got, meta = read_export_shards(source, places)
        assert "vitp_config" in meta
        for k in places:
            assert torch.equal(got[k].view(want[k].shape), want[k]), (source, k)
    with pytest.raises(ValueError, match=r"blocks.0.attn.proj.weight has shape \(32, 32\) but the model expects"):
        read_export_shards(tmp_path / "model_ema.safetensors", {proj: Place((32, 64), 1, 1, 2, 1)})


def test_a_checkpoint_missing_its_dcp_metadata_names_that_file_and_the_earlier_checkpoint(smoke, tmp_path, capsys):
    """A checkpoint whose torch distributed checkpoint lost its ``.metadata`` was reported by
    vitp-export and vitp-sample as "model_ema.safetensors is missing" (a file no sharded checkpoint
    has), with a training-resume fix. Now both name ``.metadata`` and the earlier complete
    checkpoint to read instead."""
    import json

    from vitp.checkpoint import resolve_weights
    from vitp.cli.export import main as export_main
    from vitp.cli.sample import main as sample_main

    cfg, gen, _ = smoke
    ckpts = tmp_path / "run" / "checkpoints"
    good, broken = ckpts / "step_0000006", ckpts / "step_0000007"
    _dcp_checkpoint(good, cfg, gen, step=6)
    _dcp_checkpoint(broken, cfg, gen, step=7)
    (ckpts / "latest").write_text(broken.name)
    for tag in (good, broken):  # the record of a sharded checkpoint names its format (vitp.checkpoint.sharded)
        meta = json.loads((tag / "vitp_meta.json").read_text())
        (tag / "vitp_meta.json").write_text(json.dumps({**meta, "format": "vitp.sharded/1"}))
    (broken / ".metadata").unlink()
    want = (f"checkpoint file {broken / '.metadata'} is missing; read an earlier complete checkpoint instead: pass "
            f"{good} as the source (complete: {good.name})")
    for source in (broken, tmp_path / "run"):
        with pytest.raises(FileNotFoundError) as e:
            resolve_weights(source)
        assert str(e.value) == want
    for main, args in ((export_main, ["-o", str(tmp_path / "w.safetensors")]), (sample_main, ["--out", str(tmp_path / "s.png")])):
        with pytest.raises(SystemExit) as e:
            main([str(broken), *args])
        assert e.value.code == 2 and want in capsys.readouterr().err
    assert resolve_weights(good) == (good / "model_ema.safetensors", 6, tmp_path / "run")
