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
