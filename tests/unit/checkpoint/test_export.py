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
