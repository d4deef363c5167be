"""LoRA files (vitp.models.lora_files) against diffusers' own loaders: a tiny perturbed Wan with
hand-built adapters in vitp's convention (random non-zero A and B, alpha != rank) loads through
``load_lora_adapter`` / ``WanPipeline.load_lora_weights`` with no key warning and gives the output
of the merged weights (diffusers' model and vitp's); the ComfyUI file converts back through
diffusers' converter; files read back equal their input; a LoRA of another base is refused. CPU,
tiny models, a few seconds."""
from __future__ import annotations

import json
import logging
import warnings
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import make_tiny_wan
from vitp.models import WanModel
from vitp.models import lora_files as lf
from vitp.models.wan import WanConfig
from vitp.models.wan_keys import key_map, to_diffusers_state

# tests/distributed/parallel/wan_workers.py CONFIG's sizes (D = 48, 2 blocks)
CONFIG = dict(patch_size=[1, 2, 2], num_attention_heads=4, attention_head_dim=12, in_channels=4, out_channels=4,
              text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2)
RANK, ALPHA = 4, 6.0
# vitp linear -> targeted pieces (None: all); "partial": q and v of attn.qkv, v of cross_attn.kv
TARGETS = {
    "all": {"attn.qkv": None, "attn.proj": None, "cross_attn.q": None, "cross_attn.kv": None,
            "cross_attn.proj": None, "mlp.fc1": None, "mlp.fc2": None, "@final.linear": None,
            "@embed.time_proj.1": None},
    "partial": {"attn.qkv": [0, 2], "cross_attn.kv": [1], "mlp.fc2": None},
}


@pytest.fixture(scope="module")
def tiny():
    script = make_tiny_wan()
    wan = {**script.TINY, **CONFIG}
    ref = script.tiny_transformer(seed=0, noise=0.2, **CONFIG)
    cfg = WanConfig.from_dict(wan)
    sd = ref.state_dict()
    state = {v: torch.cat([sd[d] for d in ds]) for v, ds in key_map(cfg).items()}
    g = torch.Generator().manual_seed(3)
    inputs = (torch.randn(2, 4, 3, 4, 8, generator=g), torch.rand(2, generator=g) * 1000,
              torch.randn(2, 5, 16, generator=g))
    return SimpleNamespace(script=script, wan=wan, cfg=cfg, ref=ref, state=state, inputs=inputs)


def make_adapters(state, targets, rank=RANK, alpha=ALPHA, rslora=False, layers=2, seed=0):
    """Adapters in vitp's convention on ``targets`` (``@`` marks a linear outside the blocks) and
    their config, A and B random non-zero."""
    g = torch.Generator().manual_seed(seed)
    lin = {k[:-len(".weight")]: len(v) for k, v in key_map(WanConfig.from_dict({**CONFIG, "num_layers": layers})).items()
           if k.endswith(".weight") and state.get(k) is not None and state[k].dim() == 2}
    names = [(t[1:], js) for t, js in targets.items() if t.startswith("@")]
    names += [(f"blocks.{i}.{t}", js) for i in range(layers) for t, js in targets.items() if not t.startswith("@")]
    adapters, pieces = {}, {}
    for m, js in names:
        w, P = state[f"{m}.weight"], lin[m]
        js = list(range(P)) if js is None else js
        out = w.shape[0] // P
        adapters[f"{m}.lora_A"] = 0.3 * torch.randn(len(js) * rank, w.shape[1], generator=g)
        adapters[f"{m}.lora_B"] = 0.3 * torch.randn(len(js) * out, rank, generator=g)
        pieces[m] = js
    config = {"rank": rank, "alpha": alpha, "rslora": rslora, "dropout": 0.0, "targets": sorted(targets),
              "pieces": pieces, "base": {"folder": "/models/tiny", "hash": "abc123"}}
    return adapters, config


@contextmanager
def no_key_warnings():
    """Fails if diffusers or peft log a warning or Python warns about keys while the body runs."""
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    loggers = [logging.getLogger(n) for n in ("diffusers", "peft")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    msgs = [r.getMessage() for r in records] + [str(w.message) for w in caught
                                                if any(s in str(w.message).lower() for s in ("key", "lora", "adapter"))]
    assert not msgs, msgs


def diffusers_model(tiny, state=None):
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(**CONFIG).eval()
    model.load_state_dict(to_diffusers_state(state, tiny.cfg) if state is not None else tiny.ref.state_dict())
    return model


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@torch.no_grad()
def run(model, inputs, vitp=False):
    return model(*inputs) if vitp else model(*inputs, return_dict=False)[0]


@pytest.mark.parametrize("case", ["all", "partial", "rslora"])
def test_diffusers_file_loads_as_merged_weights(tiny, tmp_path, case):
    adapters, config = make_adapters(tiny.state, TARGETS["partial" if case == "partial" else "all"],
                                     rslora=case == "rslora")
    tensors, meta = lf.to_diffusers_lora(adapters, config, tiny.cfg)
    path = lf.save_lora_file(tmp_path, tensors, meta)
    assert path.name == "pytorch_lora_weights.safetensors"
    peft = json.loads(meta["lora_adapter_metadata"])  # the scaling is in B: alpha = r for every loader
    assert peft["transformer.r"] == RANK and peft["transformer.lora_alpha"] == RANK
    assert peft["transformer.use_rslora"] is False and meta[lf.FOLDED_KEY] == "1"
    if case == "partial":
        assert sorted(k for k in tensors if "blocks.0" in k and "lora_A" in k) == [
            f"transformer.blocks.0.{m}.lora_A.weight" for m in ("attn1.to_q", "attn1.to_v", "attn2.to_v", "ffn.net.2")]
    merged = lf.merge_lora(tiny.state, adapters, config)
    want = run(diffusers_model(tiny, merged), tiny.inputs)
    assert rel(run(diffusers_model(tiny), tiny.inputs), want) > 1e-2  # the LoRA changes the output
    for where in ({"pretrained_model_name_or_path_or_dict": str(tmp_path), "weight_name": path.name},
                  {"pretrained_model_name_or_path_or_dict": str(path)}):  # a path: diffusers reads no metadata
        model = diffusers_model(tiny)
        with no_key_warnings():
            model.load_lora_adapter(**where, prefix="transformer")
        assert model.blocks[0].attn1.to_v.scaling["default_0"] == 1.0
        assert rel(run(model, tiny.inputs), want) < 1e-5, where
    vitp = WanModel(tiny.cfg).eval()
    vitp.load_state_dict(merged)
    assert rel(run(vitp, tiny.inputs, vitp=True), want) < 1e-5


def test_pipeline_loads_diffusers_and_comfyui_files(tiny, tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    adapters, config = make_adapters(tiny.state, TARGETS["all"])
    want = run(diffusers_model(tiny, lf.merge_lora(tiny.state, adapters, config)), tiny.inputs)
    for kind, writer in (("diffusers", lf.to_diffusers_lora), ("comfyui", lf.to_comfyui_lora)):
        path = lf.save_lora_file(tmp_path / kind / "lora.safetensors", *writer(adapters, config, tiny.cfg))
        pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=diffusers_model(tiny),
                           scheduler=FlowMatchEulerDiscreteScheduler())
        with no_key_warnings():
            pipe.load_lora_weights(str(path.parent), weight_name=path.name)
        assert rel(run(pipe.transformer, tiny.inputs), want) < 1e-5, kind


@pytest.mark.parametrize("alpha", [float(RANK), ALPHA])
def test_comfyui_file_converts_back_to_the_diffusers_file(tiny, alpha):
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_wan_lora_to_diffusers

    adapters, config = make_adapters(tiny.state, TARGETS["partial"], alpha=alpha)
    comfy, meta = lf.to_comfyui_lora(adapters, config, tiny.cfg)
    ours, _ = lf.to_diffusers_lora(adapters, config, tiny.cfg)
    assert "lora_adapter_metadata" not in meta
    assert all(k.startswith("diffusion_model.blocks.") and k.endswith((".lora_A.weight", ".lora_B.weight", ".alpha"))
               for k in comfy)
    assert {k for k in comfy if k.startswith("diffusion_model.blocks.0.")} == {
        f"diffusion_model.blocks.0.{m}.{x}" for m in ("self_attn.q", "self_attn.v", "cross_attn.v", "ffn.2")
        for x in ("lora_A.weight", "lora_B.weight", "alpha")}
    assert torch.equal(comfy["diffusion_model.blocks.1.self_attn.v.lora_A.weight"],
                       ours["transformer.blocks.1.attn1.to_v.lora_A.weight"])
    assert comfy["diffusion_model.blocks.0.ffn.2.alpha"].item() == alpha
    back = _convert_non_diffusers_wan_lora_to_diffusers(dict(comfy))
    assert sorted(back) == sorted(ours)
    for k in (k for k in ours if ".lora_A." in k):  # ours holds the scaling in B, the converter folds .alpha in
        kb = k.replace(".lora_A.", ".lora_B.")
        assert torch.allclose(back[kb] @ back[k], ours[kb] @ ours[k], rtol=1e-6, atol=1e-6)
        if alpha == RANK:  # scale 1: diffusers' converter leaves the tensors as they are
            assert torch.equal(back[k], ours[k]) and torch.equal(back[kb], ours[kb])


@pytest.mark.parametrize("kind", ["diffusers", "comfyui"])
@pytest.mark.parametrize("targets", ["all", "partial"])
def test_read_lora_file_round_trip(tiny, tmp_path, kind, targets):
    adapters, config = make_adapters(tiny.state, TARGETS[targets])
    writer = lf.to_diffusers_lora if kind == "diffusers" else lf.to_comfyui_lora
    path = lf.save_lora_file(tmp_path / "x.safetensors", *writer(adapters, config, tiny.cfg))
    shapes = lf.wan_state_shapes(tiny.cfg)
    got, got_config = lf.read_lora_file(path, shapes, tiny.cfg, base_hash="abc123")
    assert sorted(got) == sorted(adapters)
    for k in adapters:  # B holding the scaling (diffusers; ComfyUI outside the blocks) is divided on reading
        exact = k.endswith("lora_A") or kind == "comfyui" and k.startswith("blocks.")
        assert torch.equal(got[k], adapters[k]) if exact else torch.allclose(got[k], adapters[k], rtol=1e-6, atol=0)
    assert got_config == config


def test_read_lora_file_without_vitp_metadata(tiny, tmp_path):
    """A file of another trainer: the config comes from diffusers' LoraConfig metadata (or a
    ComfyUI file's .alpha); the merged weights are the same."""
    adapters, config = make_adapters(tiny.state, TARGETS["partial"])
    for writer in (lf.to_diffusers_lora, lf.to_comfyui_lora):
        tensors, meta = writer(adapters, config, tiny.cfg)
        meta.pop(lf.CONFIG_KEY)
        path = lf.save_lora_file(tmp_path / f"{writer.__name__}.safetensors", tensors, meta)
        got, got_config = lf.read_lora_file(path, lf.wan_state_shapes(tiny.cfg), tiny.cfg)
        alpha = ALPHA if writer is lf.to_comfyui_lora else RANK  # vitp's diffusers file: the scaling is in B
        assert got_config["rank"] == RANK and got_config["alpha"] == alpha and not got_config["rslora"]
        assert got_config["pieces"] == {f"blocks.{i}.{m}": js for i in range(2)
                                        for m, js in (("attn.qkv", [0, 2]), ("cross_attn.kv", [1]))}
        merged, want = lf.merge_lora(tiny.state, got, got_config), lf.merge_lora(tiny.state, adapters, config)
        assert all(torch.allclose(merged[k], want[k], rtol=0, atol=1e-6) for k in want)


def test_other_trainers_files_kohya_names_and_a_run_directory_are_named(tiny, tmp_path, caplog):
    """A file without vitp's record of its base loads with a warning that its base cannot be
    checked; kohya-ss / musubi-tuner key names are refused as such (not as another base), with how
    to convert them; ``trainer.lora.init_from=RUN`` (a LoRA run's directory) names ``RUN/lora``."""
    from vitp.models.lora import lora_file

    adapters, config = make_adapters(tiny.state, TARGETS["partial"])
    tensors, meta = lf.to_diffusers_lora(adapters, config, tiny.cfg)
    meta.pop(lf.CONFIG_KEY)
    path = lf.save_lora_file(tmp_path / "theirs.safetensors", tensors, meta)
    with caplog.at_level(logging.WARNING, logger="vitp"):
        lf.read_lora_file(path, lf.wan_state_shapes(tiny.cfg), tiny.cfg, base_hash="ffff")
    assert "theirs.safetensors records no base" in caplog.text and "cannot be checked" in caplog.text
    kohya = {"lora_unet_blocks_0_self_attn_q.lora_down.weight": torch.zeros(4, 48),
             "lora_unet_blocks_0_self_attn_q.lora_up.weight": torch.zeros(48, 4),
             "lora_unet_blocks_0_self_attn_q.alpha": torch.tensor(4.0)}
    path = lf.save_lora_file(tmp_path / "kohya.safetensors", kohya, {})
    with pytest.raises(ValueError, match=r"kohya\.safetensors uses kohya-ss / musubi-tuner key names "
                                         r"\('lora_unet_blocks_0_self_attn_q\..*convert_lora.py --target other"):
        lf.read_lora_file(path, lf.wan_state_shapes(tiny.cfg), tiny.cfg)
    odd = {"diffusion_model.blocks.0.self_attn.z.lora_A.weight": torch.zeros(4, 48),
           "diffusion_model.blocks.0.self_attn.z.lora_B.weight": torch.zeros(48, 4)}
    path = lf.save_lora_file(tmp_path / "odd.safetensors", odd, {})
    with pytest.raises(ValueError, match=r"odd\.safetensors: 'diffusion_model\.blocks\.0\.self_attn\.z\.lora_A\.weight'"
                                         r": 'blocks\.0\.self_attn\.z' is not an original Wan linear name"):
        lf.read_lora_file(path, lf.wan_state_shapes(tiny.cfg), tiny.cfg)
    run = tmp_path / "run"
    (run / "lora").mkdir(parents=True)
    (run / "lora" / lf.WEIGHT_NAME).write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=rf"trainer.lora.init_from={run} is a run directory: its adapters are "
                                                rf"in {run / 'lora'}; give trainer.lora.init_from={run / 'lora'}"):
        lora_file(run)


def test_base_hash_follows_the_tensors_not_the_shards(tiny, tmp_path):
    """The same transformer saved in one file and in 40 kB shards has one base hash; changing the
    first value of one tensor changes it."""
    from safetensors.torch import load_file, save_file

    from vitp.models.lora import base_hash

    one = tiny.script.write_transformer(tiny.ref, tmp_path / "one")
    shards = tiny.script.write_transformer(tiny.ref, tmp_path / "shards", sharded=True)
    assert len(list(shards.glob("*.safetensors"))) > 2 and len(list(one.glob("*.safetensors"))) == 1
    assert base_hash(one) == base_hash(shards)
    f = next(one.glob("*.safetensors"))
    state = load_file(str(f))
    k = sorted(state)[3]
    state[k] = state[k].clone()
    state[k].view(-1)[0] += 1
    save_file(state, str(f), metadata={"format": "pt"})
    assert base_hash(one) != base_hash(shards)


def test_read_lora_file_refuses_another_base(tiny, tmp_path):
    adapters, config = make_adapters(tiny.state, TARGETS["partial"])
    path = lf.save_lora_file(tmp_path / "lora.safetensors", *lf.to_diffusers_lora(adapters, config, tiny.cfg))
    one_layer = {**tiny.wan, "num_layers": 1}
    with pytest.raises(ValueError, match=r"lora\.safetensors: a LoRA of another base: it adapts .*blocks\.1.*"
                                         r"num_layers=1"):
        lf.read_lora_file(path, lf.wan_state_shapes(one_layer), one_layer)
    wide = {**tiny.wan, "attention_head_dim": 16}
    with pytest.raises(ValueError, match=r"lora\.safetensors: a LoRA of another base: blocks\.0\.attn\.qkv has "
                                         r"lora_A \(8, 48\).*weight \(192, 64\).*/models/tiny"):
        lf.read_lora_file(path, lf.wan_state_shapes(wide), wide)
    with pytest.raises(ValueError, match=r"lora\.safetensors: a LoRA of another base: its base hash is abc123, "
                                         r"this model's is ffff; load it on the base it was trained for"):
        lf.read_lora_file(path, lf.wan_state_shapes(tiny.cfg), tiny.cfg, base_hash="ffff")


def test_continued_lora_takes_the_files_settings_and_refuses_conflicts_and_another_base(tiny, tmp_path):
    """``trainer.lora.init_from`` = vitp's diffusers file of adapters on the base folder: the config
    check takes rank, alpha and targets from the file (the targets adapt exactly its pieces), the
    initial factors equal the adapters (B unfolded: 1e-6), a rank set otherwise is refused naming
    both, and the same file on another base folder is refused by its base hash, naming the file."""
    from tests.helpers import compose_cfg
    from vitp.config import validate_config
    from vitp.models.lora import base_hash, check_lora_config, initial_factors, run_record

    def check(cfg):
        validate_config(cfg)  # the Wan folder's sizes
        check_lora_config(cfg)

    pipe = tiny.script.write_pipeline(tmp_path / "pipe", sharded=True, vae=False, transformer=tiny.ref)
    other = tiny.script.write_pipeline(tmp_path / "other", sharded=True, vae=False,
                                       transformer=tiny.script.tiny_transformer(seed=1, noise=0.2, **CONFIG))
    adapters, config = make_adapters(tiny.state, TARGETS["partial"])
    config["base"] = {"folder": str(pipe / "transformer"), "hash": base_hash(pipe / "transformer")}
    path = lf.save_lora_file(tmp_path / "lora", *lf.to_diffusers_lora(adapters, config, tiny.cfg))
    over = ["experiment=wan_smoke", "trainer.lora.enabled=true", f"trainer.lora.init_from={path}"]
    cfg = compose_cfg([*over, f"trainer.init_from={pipe}"])
    check(cfg)
    lo = cfg.trainer.lora
    assert (lo.rank, lo.alpha, lo.rslora) == (RANK, ALPHA, False)
    assert run_record(cfg)["pieces"] == config["pieces"]
    init = initial_factors(cfg)
    assert sorted(init) == sorted(k[:-len(".lora_A")] for k in adapters if k.endswith(".lora_A"))
    for m, (A, B) in init.items():
        assert torch.equal(A, adapters[f"{m}.lora_A"])
        torch.testing.assert_close(B, adapters[f"{m}.lora_B"], rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match=r"trainer.lora.rank=8 but the file's is 4; trainer.lora.targets=\['to_q'\] "
                                         r"adapt 4 module\(s\).*the file 8 module\(s\).*leave those keys unset"):
        check(compose_cfg([*over, f"trainer.init_from={pipe}", "trainer.lora.rank=8", "trainer.lora.targets=[to_q]"]))
    with pytest.raises(ValueError, match=rf"trainer.lora.init_from: {path}: a LoRA of another base: its base hash is "
                                         rf"{config['base']['hash']}, this model's is {base_hash(other / 'transformer')}"
                                         rf"; load it on the base it was trained for \({pipe / 'transformer'}\).*"
                                         rf"the base here: trainer.init_from={other}"):
        check(compose_cfg([*over, f"trainer.init_from={other}"]))


def test_generator_file_and_merge_match_per_piece_lora():
    """vitp's own file (the generator's keys) reads back; merging a fused qkv's q and v adapters
    equals a timm Attention whose q and v outputs get ``scaling * x A^T B^T`` added."""
    from timm.layers import Attention

    torch.manual_seed(0)
    D, r = 16, 2
    attn = Attention(D, num_heads=2, qkv_bias=True).eval()
    A, B = torch.randn(2 * r, D), torch.randn(2 * D, r)
    adapters = {"blocks.0.attn.qkv.lora_A": A, "blocks.0.attn.qkv.lora_B": B}
    config = {"rank": r, "alpha": 3.0, "rslora": False, "dropout": 0.0, "targets": ["attn.qkv"],
              "pieces": {"blocks.0.attn.qkv": [0, 2]}, "base": {"folder": "x.safetensors", "hash": None}}
    base = {f"blocks.0.attn.{k}": v for k, v in attn.state_dict().items()}
    merged = lf.merge_lora(base, adapters, config)
    x = torch.randn(2, 5, D)
    with torch.no_grad():
        qkv = attn.qkv(x)
        delta = torch.cat([1.5 * x @ A[:r].T @ B[:D].T, torch.zeros(2, 5, D), 1.5 * x @ A[r:].T @ B[D:].T], -1)
        hook = attn.qkv.register_forward_hook(lambda m, i, o: o + delta)
        want = attn(x)
        hook.remove()
        attn.load_state_dict({k.removeprefix("blocks.0.attn."): v for k, v in merged.items()})
        assert (attn(x) - want).abs().max().item() < 1e-5 and (qkv - attn.qkv(x)).abs().max() > 0.1
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        path = lf.save_lora_file(Path(d) / "g.safetensors", *lf.to_vitp_lora(adapters, config))
        got, got_config = lf.read_lora_file(path, {k: tuple(v.shape) for k, v in base.items()})
    assert got_config == config and all(torch.equal(got[k], adapters[k]) for k in adapters)


def test_vitp_export_lora_and_merge_through_the_hook(tiny, tmp_path, monkeypatch):
    """``vitp-export RUN --format lora [--lora-format comfyui]`` and ``--format diffusers --merge`` on
    a LoRA run's checkpoint, the adapters from the hook (``_full_lora_state``, stubbed here: the
    checkpoint is a stub folder; tests/distributed/parallel/test_wan_parallel.py reads a real one): the files equal the pure functions', and the merged folder
    loads in diffusers with the merged weights' output."""
    from diffusers import WanTransformer3DModel
    from omegaconf import OmegaConf

    from tests.helpers import compose_cfg
    from vitp.cli import export as cli

    pipe = tiny.script.write_pipeline(tmp_path / "pipe", sharded=True, vae=False, transformer=tiny.ref)
    cfg = compose_cfg(["experiment=wan_smoke", f"trainer.init_from={pipe}", "trainer.lora.enabled=true",
                       "trainer.lora.rank=4", "trainer.lora.alpha=6"])
    tag = tmp_path / "run" / "checkpoints" / "step_0000004"
    tag.mkdir(parents=True)
    (tag / ".metadata").write_bytes(b"")
    adapters, config = make_adapters(tiny.state, TARGETS["partial"])
    (tag / "vitp_meta.json").write_text(json.dumps({"step": 4, "config": OmegaConf.to_container(cfg, resolve=True),
                                                    "lora": config}))
    monkeypatch.setattr(cli, "_full_lora_state", lambda t, c, kind: (adapters, config))
    monkeypatch.setattr(cli.ckpt, "resolve_weights", lambda s, w: (tag / "model_ema.safetensors", None, tag.parents[1]))
    out = cli.run([str(tag), "--format", "lora", "-o", str(tmp_path / "d")])
    assert out == tmp_path / "d" / "pytorch_lora_weights.safetensors"
    got, _ = lf.read_lora_file(out, lf.wan_state_shapes(tiny.cfg), tiny.cfg)
    assert all(torch.allclose(got[k], adapters[k], rtol=1e-6, atol=0) for k in adapters)
    out = cli.run([str(tag), "--format", "lora", "--lora-format", "comfyui", "-o", str(tmp_path / "c")])
    assert out.name == "c.safetensors"
    merged = cli.run([str(tag), "--format", "diffusers", "--merge", "-o", str(tmp_path / "m")])
    with no_key_warnings():
        model = WanTransformer3DModel.from_pretrained(str(merged)).eval()
    want = run(diffusers_model(tiny, lf.merge_lora(tiny.state, adapters, config)), tiny.inputs)
    assert rel(run(model, tiny.inputs), want) < 1e-6
