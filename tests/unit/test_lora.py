"""LoRA on vitp's models at one process (:mod:`vitp.models.lora`, :mod:`vitp.parallel.lora`): the
adapters follow peft's ``LoraConfig`` on diffusers' own Wan model (same factors, same output), the
targets are matched by the names users know, and bad input is refused naming the fix. The layouts
(tp, SP, cp, pp) are checked against one process in ``tests/distributed/parallel/test_wan_parallel.py``."""
from __future__ import annotations

import math
import re

import pytest
import torch

from tests.distributed.parallel.wan_workers import CONFIG, LORA_TARGETS, lora_spec


def _wan():
    from vitp.models import WanModel

    torch.manual_seed(0)
    model = WanModel(CONFIG)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def _inputs(B=2):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, 4, 3, 4, 8, generator=g)
    return x, torch.rand(B, generator=g) * 1000, torch.randn(B, 5, CONFIG["text_dim"], generator=g)


@pytest.mark.parametrize("rslora", [False, True])
def test_adapters_equal_peft_on_diffusers_wan(tmp_path, rslora):
    """vitp's adapters (one per targeted piece of the fused qkv / kv) give diffusers'
    ``WanTransformer3DModel`` with peft's LoRA of the same factors the same output; rsLoRA too."""
    from dataclasses import replace

    from diffusers import WanTransformer3DModel
    from peft import LoraConfig

    from vitp.models.lora import apply_lora
    from vitp.models.wan_keys import _LINEARS, save_pretrained

    model = _wan()
    ref = WanTransformer3DModel.from_pretrained(str(save_pretrained(model, tmp_path / "t"))).eval()
    spec = replace(lora_spec(b_std=0.2), rslora=rslora)
    pieces = apply_lora(model, spec)
    ref.add_adapter(LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(LORA_TARGETS),
                               use_rslora=rslora))
    peft_keys = {k for k in ref.state_dict() if ".lora_" in k}
    table, copied = dict(_LINEARS), set()
    with torch.no_grad():
        for key, idx in pieces.items():
            m = model.get_submodule(key)
            block, local = key.split(".", 2)[1], key.split(".", 2)[2]
            r, out_piece = spec.rank, m.lora_B.shape[0] // len(idx)
            for j, p in enumerate(idx):
                name = f"blocks.{block}.{table[local][p]}"
                ref.get_submodule(f"{name}.lora_A.default").weight.copy_(m.lora_A[j * r:(j + 1) * r])
                ref.get_submodule(f"{name}.lora_B.default").weight.copy_(m.lora_B[j * out_piece:(j + 1) * out_piece])
                copied |= {f"{name}.lora_A.default.weight", f"{name}.lora_B.default.weight"}
    assert copied == peft_keys  # the same modules adapted, piece by piece
    x, t, text = _inputs()
    with torch.no_grad():
        got, want = model(x, t, text), ref(x, t, text, return_dict=False)[0]
        base = WanTransformer3DModel.from_pretrained(str(tmp_path / "t")).eval()(x, t, text, return_dict=False)[0]
    assert (want - base).abs().max() > 1e-2  # the adapters change the output
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert model.blocks[0].attn.qkv.lora_scaling == pytest.approx(3.0 / (math.sqrt(2) if rslora else 2))
    _files_equal_peft(model, spec, pieces, tmp_path, (x, t, text), want)


def _files_equal_peft(model, spec, pieces, tmp_path, inputs, want):
    """The adapters written as each file vitp exports (diffusers, ComfyUI, merged weights) give
    peft's output ``want`` once loaded by diffusers (``WanPipeline.load_lora_weights``): the file's
    scaling (rsLoRA's alpha / sqrt(r) included) is checked against peft, not vitp's own merge."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    from vitp.models import lora_files as lf
    from vitp.models.wan import WanConfig
    from vitp.models.wan_keys import to_diffusers_state

    state = model.state_dict()
    adapters = {k: v for k, v in state.items() if ".lora_" in k}
    base = {k: v for k, v in state.items() if ".lora_" not in k}
    config = {"rank": spec.rank, "alpha": spec.alpha, "rslora": spec.rslora, "dropout": 0.0,
              "targets": sorted(spec.targets), "pieces": {k: list(v) for k, v in pieces.items()}}
    cfg = WanConfig.from_dict(CONFIG)
    for kind, writer in (("diffusers", lf.to_diffusers_lora), ("comfyui", lf.to_comfyui_lora)):
        path = lf.save_lora_file(tmp_path / kind / "lora.safetensors", *writer(adapters, config, cfg))
        ref = WanTransformer3DModel.from_pretrained(str(tmp_path / "t")).eval()
        pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=ref,
                           scheduler=FlowMatchEulerDiscreteScheduler())
        pipe.load_lora_weights(str(path.parent), weight_name=path.name)
        with torch.no_grad():
            torch.testing.assert_close(ref(*inputs, return_dict=False)[0], want, rtol=1e-5, atol=1e-5, msg=kind)
    merged = WanTransformer3DModel(**CONFIG).eval()
    merged.load_state_dict(to_diffusers_state(lf.merge_lora(base, adapters, config), cfg))
    with torch.no_grad():
        torch.testing.assert_close(merged(*inputs, return_dict=False)[0], want, rtol=1e-5, atol=1e-5)


def test_keys_init_and_frozen_base():
    """Adapters are parameters ``lora_A`` / ``lora_B`` of the linear itself (base keys unchanged),
    A kaiming-uniform within 1 / sqrt(in) and B zero by default (the output is the base's), and
    only adapters require a gradient."""
    from vitp.models.lora import apply_lora

    model = _wan()
    before = set(model.state_dict())
    x, t, text = _inputs()
    with torch.no_grad():
        base = model(x, t, text)
    pieces = apply_lora(model, lora_spec())
    added = set(model.state_dict()) - before
    assert before <= set(model.state_dict()) and added == {f"{k}.lora_{f}" for k in pieces for f in "AB"}
    qkv = model.blocks[1].attn.qkv
    assert pieces["blocks.1.attn.qkv"] == (0, 2) and qkv.lora_pieces == (0, 2) and qkv.lora_num_pieces == 3
    assert qkv.lora_A.shape == (2 * 2, 48) and qkv.lora_B.shape == (2 * 48, 2)
    assert pieces["blocks.0.cross_attn.kv"] == (0, 1) and pieces["blocks.0.mlp.fc2"] == (0,)
    assert "blocks.0.cross_attn.kv" in pieces and 0 < qkv.lora_A.abs().max() <= 1 / math.sqrt(48)
    assert all(bool((m.lora_B == 0).all()) for m in model.modules() if hasattr(m, "lora_B"))
    with torch.no_grad():
        assert torch.equal(model(x, t, text), base)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == added


def test_generator_takes_timm_names():
    """The generator's timm ``qkv`` pieces by q / k / v, and ``proj`` / ``fc1`` / ``fc2``; from the
    perturbed weights (adaLN gates non-zero) with B drawn non-zero, the adapted generator equals one
    whose weights hold ``W + alpha / r * B_j A_j`` on exactly the targeted pieces (q and v of
    ``qkv``, not k), and every adapter gets a non-zero gradient."""
    from vitp.checkpoint.export import load_generator
    from vitp.config import parse_resolution
    from vitp.models.lora import LoraSpec, apply_lora

    from tests.helpers import PERTURBED

    gen, cfg = load_generator(PERTURBED)
    ref, _ = load_generator(PERTURBED)
    spec = LoraSpec(rank=4, alpha=6.0, targets=("attn.q", "v", "fc2"), family="vit", b_std=0.3)
    pieces = apply_lora(gen, spec)
    assert pieces == {f"blocks.{i}.{k}": p for i in range(2) for k, p in (("attn.qkv", (0, 2)), ("mlp.fc2", (0,)))}
    with torch.no_grad():  # the merge by hand: piece j of the fused qkv is rows j D .. (j + 1) D
        for key, idx in pieces.items():
            m, w = gen.get_submodule(key), ref.get_submodule(key).weight
            out = m.lora_B.shape[0] // len(idx)
            for j, p in enumerate(idx):
                A, B = m.lora_A[j * 4:(j + 1) * 4], m.lora_B[j * out:(j + 1) * out]
                w[p * out:(p + 1) * out] += 6.0 / 4 * B @ A
    h, w = parse_resolution(cfg.model.image_size)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, cfg.model.in_channels, 1, h, w, generator=g)
    t, y = torch.rand(2, generator=g), torch.tensor([0, 1])
    with torch.no_grad():
        base, _ = load_generator(PERTURBED)
        assert (ref.eval()(x, t, y) - base.eval()(x, t, y)).abs().max() > 1e-2  # the adapters matter
        torch.testing.assert_close(gen.eval()(x, t, y), ref(x, t, y), rtol=1e-5, atol=1e-5)
    gen.train()(x, t, y).float().pow(2).mean().backward()
    grads = {n: p.grad for n, p in gen.named_parameters() if ".lora_" in n}
    assert len(grads) == 8 and all(gr is not None and gr.abs().max() > 0 for gr in grads.values())


def test_bad_input_is_refused_naming_the_fix():
    from vitp.models.lora import LoraSpec, apply_lora, check_targets
    from vitp.parallel.lora import lora_scaling

    with pytest.raises(ValueError, match=r"rank 0: must be a positive integer \(trainer.lora.rank=16"):
        lora_scaling(0, 8.0)
    with pytest.raises(ValueError, match=r"\['to_x'\] match\(es\) no linear.*attn1.to_q.*ffn.net.2"):
        check_targets("wan", 2, ["to_q", "to_x"])
    with pytest.raises(ValueError, match="empty"):
        check_targets("wan", 2, [])
    with pytest.raises(ValueError, match="rank -1"):
        apply_lora(_wan(), LoraSpec(rank=-1, alpha=1.0, targets=("to_q",)))


def test_vitp_train_refuses_lora_without_a_base_or_a_continued_file_without_lora():
    from tests.helpers import PERTURBED
    from vitp.config import compose
    from vitp.models.lora import check_lora_config

    with pytest.raises(ValueError, match="trains adapters on a frozen base: set trainer.init_from to a vitp export"):
        check_lora_config(compose(["experiment=smoke", "trainer.lora.enabled=true"]))
    with pytest.raises(ValueError, match=r"trainer.init_from_timm cannot be a LoRA base"):
        check_lora_config(compose(["experiment=smoke", "trainer.lora.enabled=true", "trainer.init_from_timm=x.pth"]))
    check_lora_config(compose(["experiment=smoke"]))  # off: nothing to check
    with pytest.raises(ValueError, match=r"trainer.lora.init_from=x continues a LoRA: add trainer.lora.enabled=true"):
        check_lora_config(compose(["experiment=smoke", f"trainer.init_from={PERTURBED}", "trainer.lora.init_from=x"]))
    with pytest.raises(ValueError, match=r"trainer.lora.init_from=x needs the base it was trained on: set "
                                         r"trainer.init_from"):
        check_lora_config(compose(["experiment=smoke", "trainer.lora.enabled=true", "trainer.lora.init_from=x"]))
    cfg = compose(["experiment=smoke", "trainer.lora.enabled=true", f"trainer.init_from={PERTURBED}"])
    check_lora_config(cfg)  # nulls resolved to the defaults
    assert (cfg.trainer.lora.rank, cfg.trainer.lora.alpha, cfg.trainer.lora.rslora) == (16, 16.0, False)


def test_a_resume_refuses_other_scaling_another_lora_file_and_a_changed_base():
    """``check_same_base``: a resume with another alpha, rsLoRA or ``trainer.lora.init_from`` than the
    checkpoint's is refused, naming both values; a base whose folder holds other weights than at
    the checkpoint says the weights changed there; the same record passes."""
    from vitp.models.lora import check_same_base

    saved = {"rank": 4, "alpha": 8.0, "rslora": False, "init_from": None, "pieces": {"blocks.0.attn.qkv": [0, 2]},
             "base": {"folder": "/m/base", "hash": "a" * 64}}
    check_same_base(dict(saved), saved, "T")
    for key, value in (("alpha", 32.0), ("rslora", True), ("init_from", "/x/lora.safetensors")):
        with pytest.raises(ValueError, match=rf"{key}: .* in the checkpoint vs {value!r} now.*trainer.lora.init_from "
                                             "only starts a run"):
            check_same_base({**saved, key: value}, saved, "T")
    with pytest.raises(ValueError, match=r"trained on the base in /m/base, whose weights have changed since"):
        check_same_base({**saved, "base": {"folder": "/m/base", "hash": "b" * 64}}, saved, "T")


def test_lora_settings_without_lora_enabled_are_refused():
    """``trainer.lora.rank=4`` (or alpha, dropout, targets) without ``trainer.lora.enabled=true``
    would fine-tune every weight with the settings ignored: refused, naming the keys and the fix."""
    from omegaconf import OmegaConf

    from vitp.config import compose
    from vitp.models.lora import adopt_lora_file

    for over, shown in ((["trainer.lora.rank=4"], "trainer.lora.rank=4"),
                        (["trainer.lora.targets=[to_q]"], "trainer.lora.targets=['to_q']")):
        cfg = compose(["experiment=smoke", *over])
        with pytest.raises(ValueError, match=rf"{re.escape(shown)} set, but trainer.lora.enabled=false: .*add "
                                             "trainer.lora.enabled=true"):
            adopt_lora_file(cfg)
    cfg = compose(["experiment=smoke"])
    adopt_lora_file(cfg)
    assert cfg.trainer.lora.rank is None and OmegaConf.select(cfg, "trainer.lora.alpha") is None
