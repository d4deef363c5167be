"""The local text encoder (vitp/text/encoder.py) and the tiny random T5 (vitp/text/tiny.py)."""
from __future__ import annotations

import hashlib
import json

import pytest
import torch

from tests.unit.text.conftest import MAX_LENGTH
from vitp.text import TextEncoder, encoder_record, make_tiny_encoder
from vitp.text.encoder import T5_MAX_LENGTH


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_tiny_encoder_is_the_same_for_the_same_seed(tiny_path, tmp_path):
    again = make_tiny_encoder(tmp_path / "again", seed=0)
    other = make_tiny_encoder(tmp_path / "other", seed=1)
    rec = encoder_record(tiny_path)
    assert rec["config_sha256"] == encoder_record(again)["config_sha256"] == encoder_record(other)["config_sha256"]
    assert _sha(tiny_path / "model.safetensors") == _sha(again / "model.safetensors")
    assert _sha(tiny_path / "model.safetensors") != _sha(other / "model.safetensors")
    assert {k: rec[k] for k in ("name", "model_type", "class", "hidden_size")} == {
        "name": "tiny-t5", "model_type": "t5", "class": "T5EncoderModel", "hidden_size": 32}
    assert rec["path"] == str(tiny_path.absolute())
    # the hash ignores the folder and the transformers version, not the architecture
    cfg = json.loads((again / "config.json").read_text())
    (again / "config.json").write_text(json.dumps({**cfg, "transformers_version": "0.0.1"}))
    assert encoder_record(again)["config_sha256"] == rec["config_sha256"]
    for written, name in (("google/t5-v1_1-xxl", "google/t5-v1_1-xxl"), ("/home/someone/t5", "again")):
        (again / "config.json").write_text(json.dumps({**cfg, "_name_or_path": written}))
        assert encoder_record(again)["name"] == name and encoder_record(again)["config_sha256"] == rec["config_sha256"]
    (again / "config.json").write_text(json.dumps({**cfg, "d_ff": 65}))
    assert encoder_record(again)["config_sha256"] != rec["config_sha256"]


def test_encode_pads_to_max_length_with_a_mask_and_counts_truncation(tiny):
    caps = ["a cat", "", "x" * 40]
    emb, mask = tiny.encode(caps)
    assert emb.shape == (3, MAX_LENGTH, 32) and emb.dtype == torch.float32 and emb.device.type == "cpu"
    # ByT5: one token per byte plus </s>; the empty caption is </s> alone; 40 bytes are cut at 16
    assert mask.dtype == torch.bool and mask.sum(1).tolist() == [6, 1, MAX_LENGTH]
    assert mask[0, :6].all() and not mask[0, 6:].any()
    assert tiny.last_truncated == 1
    # the same caption alone gives the same embeddings (padding is masked inside the encoder)
    alone, _ = tiny.encode(["a cat"])
    torch.testing.assert_close(alone[0, :6], emb[0, :6], rtol=1e-5, atol=1e-5)
    ids = tiny.tokenizer(["a cat"], padding="max_length", max_length=MAX_LENGTH, return_tensors="pt")
    ref = tiny.model(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"]).last_hidden_state
    torch.testing.assert_close(alone, ref, rtol=0, atol=0)
    assert not torch.equal(emb[0], emb[1])


def test_defaults_bf16_and_bad_settings(tiny_path, tiny):
    enc = TextEncoder(tiny_path, dtype="bfloat16")
    assert enc.max_length == T5_MAX_LENGTH == 120 and enc.device.type == "cpu"
    assert next(enc.model.parameters()).dtype == torch.bfloat16
    emb, mask = enc.encode(["a cat", "a dog"])
    assert emb.dtype == torch.float32 and emb.shape == (2, 120, 32) and mask.sum().item() == 12
    ref, _ = tiny.encode(["a cat", "a dog"])
    err = (emb[:, :6] - ref[:, :6]).abs().max().item()
    assert 0 < err < 0.1 * ref.abs().max().item()  # bf16 rounding, not another computation
    with pytest.raises(ValueError, match="dtype 'int8': use one of float32, bfloat16, float16"):
        TextEncoder(tiny_path, dtype="int8")
    with pytest.raises(ValueError, match="max_length=0"):
        TextEncoder(tiny_path, max_length=0)
    with pytest.raises(TypeError, match="captions must be strings; got int 3"):
        tiny.encode(["a", 3])


def test_unsupported_or_missing_encoders_are_refused(tiny_path, tmp_path):
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 32}))
    with pytest.raises(ValueError, match=r"model_type 'bert' is not supported; supported: t5, umt5, mt5, clip, "
                                         r"clip_text_model"):
        TextEncoder(bert)
    with pytest.raises(FileNotFoundError, match=r"text encoder .*/nope does not exist: give a local folder saved "
                                                r"with save_pretrained .*vitp never downloads"):
        encoder_record(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        encoder_record(tmp_path)


def _tiny_clip(path):
    """A random CLIP (text + vision towers) with a 28-symbol BPE vocabulary, saved to ``path``."""
    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer

    vocab = {c: i for i, c in enumerate([chr(c) for c in range(97, 123)] + [" "])}
    vocab.update({c + "</w>": len(vocab) + i for i, c in enumerate(list(vocab))})
    vocab.update({"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1})
    tok = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=12)
    text = dict(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=12, bos_token_id=vocab["<|startoftext|>"],
                eos_token_id=vocab["<|endoftext|>"], pad_token_id=vocab["<|endoftext|>"])
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=16)
    torch.manual_seed(0)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8)).eval()
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return model, tok


def test_a_full_clip_checkpoint_encodes_with_its_text_tower(tmp_path):
    model, tok = _tiny_clip(tmp_path / "clip")
    enc = TextEncoder(tmp_path / "clip")
    assert enc.record["class"] == "CLIPTextModel" and enc.record["model_type"] == "clip"
    assert enc.dim == 16 and enc.max_length == 12  # the tokenizer's model_max_length
    emb, mask = enc.encode(["a cat", ""])
    ids = tok(["a cat", ""], padding="max_length", max_length=12, return_tensors="pt")
    with torch.no_grad():
        ref = model.text_model(**ids).last_hidden_state
    torch.testing.assert_close(emb, ref, rtol=0, atol=0)
    assert mask.tolist() == ids["attention_mask"].bool().tolist() and mask[1].sum() == 2  # <start> <end>


def test_a_checkpoint_missing_encoder_weights_or_tokenizer_is_refused(tiny_path, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_path, broken)
    state = load_file(broken / "model.safetensors")
    state.pop("encoder.block.1.layer.1.DenseReluDense.wo.weight")
    save_file(state, broken / "model.safetensors", metadata={"format": "pt"})
    enc = TextEncoder(broken)  # the weights load on first use
    with pytest.raises(ValueError, match=r"broken: the checkpoint lacks 1 T5EncoderModel weights \(missing_keys: "
                                         r"encoder.block.1.layer.1.DenseReluDense.wo.weight\); it is not a complete t5"):
        enc.encode(["a cat"])
    sp = tmp_path / "spiece"
    sp.mkdir()
    shutil.copy(tiny_path / "config.json", sp)
    (sp / "spiece.model").write_bytes(b"not a sentencepiece model")
    (sp / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "T5Tokenizer"}))
    with pytest.raises(ValueError, match=r"spiece: cannot load its tokenizer \(.*\); its tokenizer is a SentencePiece "
                                         r".model file without tokenizer.json"):
        TextEncoder(sp)
