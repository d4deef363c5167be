"""Random-weight files of the feature networks behind the field's quality numbers, so every
evaluation command in docs/evaluation.md runs without downloading weights:

    python scripts/make_random_eval_weights.py OUT

writes ``OUT/inception.pth``: torch-fidelity's ``FeatureExtractorInceptionV3`` (the network
torchmetrics' ``FrechetInceptionDistance(feature_extractor_weights_path=...)`` loads and
``eval.fid.weights`` takes), random convolutions whose batch-norm statistics are set from one
forward of random images, so the pool features vary from image to image (default inits give
features near 1e-9), and ``OUT/clip/``: a tiny transformers ``CLIPModel`` folder (32-pixel
images in 8-pixel patches, 2 layers of 32 channels per tower) with its ``CLIPProcessor``, the
folder ``eval.clip.model`` and torchmetrics' ``CLIPScore`` load. Its tokenizer is CLIP's byte-level
BPE with no merges over the 256 byte symbols (and each with CLIP's end-of-word ``</w>``), so it
tokenizes any text, one token per byte. The numbers they give mean nothing; the real files are
``pt_inception-2015-12-05-6726825d.pth`` and a CLIP snapshot such as
``openai/clip-vit-large-patch14`` (docs/evaluation.md).

It also writes ``OUT/i3d.pt``: cd-fvd's ``InceptionI3d(400)`` state dict (``eval.fvd.weights``,
vitp/eval/fvd.py), calibrated the same way; the real file is TATS' ``i3d_pretrained_400.pt``.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch


def random_inception(path: Path, seed: int = 0) -> Path:
    """Write a random-weight Inception-V3 state dict (torch-fidelity's keys) to ``path``."""
    from torchmetrics.image.fid import NoTrainInceptionV3

    class _Random(NoTrainInceptionV3):  # torch-fidelity loads a file in __init__: start from an empty one
        def load_state_dict(self, state_dict, strict=True, assign=False):
            return super().load_state_dict(state_dict, strict) if state_dict else None

    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as tmp:
        torch.save({}, Path(tmp) / "empty.pth")
        net = _Random("inception-v3-compat", ["2048"], str(Path(tmp) / "empty.pth"), antialias=False)

    def calibrate(bn, inputs):  # normalise each batch norm's input over this batch
        x = inputs[0]
        bn.running_mean.copy_(x.mean((0, 2, 3)))
        bn.running_var.copy_(x.var((0, 2, 3)) + 1e-3)

    hooks = [m.register_forward_pre_hook(calibrate) for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    with torch.no_grad():
        net(torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    for h in hooks:
        h.remove()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(net.state_dict(), path)
    return path


def clip_tokenizer():
    """CLIP's tokenizer (transformers' ``CLIPTokenizer``: lower-cased, byte-level, end-of-word
    ``</w>``) over a vocabulary of the 256 byte symbols, each also with ``</w>``, and no merges:
    every text tokenizes, one token per byte. Ids 0 and 1 are ``<|startoftext|>`` and
    ``<|endoftext|>`` (also the padding, as in OpenAI's CLIP)."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for s in symbols + [s + "</w>" for s in symbols]:
        vocab[s] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def random_clip(folder: Path, seed: int = 0) -> Path:
    """Write a tiny random-weight ``CLIPModel`` and its ``CLIPProcessor`` (:func:`clip_tokenizer`,
    OpenAI's image mean and std at 32 pixels) to ``folder`` with ``save_pretrained``; returns it.
    The two towers' final layer-norm biases share one random vector and their projections one
    matrix, so an image and a caption score about 20 to 40 and vary from pair to pair (independent
    random towers give cosines around 0, which the clamp of CLIP score at 0 would hide)."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    tok = clip_tokenizer()
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1, projection_dim=16)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                  patch_size=8, projection_dim=16)
    torch.manual_seed(seed)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).eval()
    with torch.no_grad():
        shared = torch.randn(32, generator=torch.Generator().manual_seed(seed + 1))
        model.vision_model.post_layernorm.bias.copy_(shared)
        model.text_model.final_layer_norm.bias.copy_(shared)
        model.text_projection.weight.copy_(model.visual_projection.weight)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=images, tokenizer=tok).save_pretrained(folder)
    (folder / "README.md").write_text("Random-weight CLIP written by scripts/make_random_eval_weights.py: its scores "
                                      "mean nothing.\n")
    return folder


def random_i3d(path: Path, seed: int = 0) -> Path:
    """Write a random-weight I3D state dict (cd-fvd's ``InceptionI3d(400)`` keys) to ``path``, its
    batch norms calibrated on random 9-frame 64 x 64 clips (default statistics give features that
    barely vary from clip to clip)."""
    from cdfvd.third_party.i3d.pytorch_i3d import InceptionI3d

    torch.manual_seed(seed)
    net = InceptionI3d(400, in_channels=3).eval()

    def calibrate(bn, inputs):  # normalise each batch norm's input over this batch
        x = inputs[0]
        bn.running_mean.copy_(x.mean((0, 2, 3, 4)))
        bn.running_var.copy_(x.var((0, 2, 3, 4)) + 1e-3)

    hooks = [m.register_forward_pre_hook(calibrate) for m in net.modules() if isinstance(m, torch.nn.BatchNorm3d)]
    clips = torch.rand(2, 3, 9, 64, 64, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    with torch.no_grad():
        net.extract_pre_pool_features(clips)
    for h in hooks:
        h.remove()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(net.state_dict(), path)
    return path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Write random-weight feature networks for FID, CLIP score and FVD "
                                            "(docs/evaluation.md).")
    p.add_argument("out", type=Path, help="folder to write inception.pth (FID), clip/ (CLIP score) and i3d.pt (FVD) into")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(random_inception(a.out / "inception.pth", a.seed))
    print(random_clip(a.out / "clip", a.seed))
    print(random_i3d(a.out / "i3d.pt", a.seed))


if __name__ == "__main__":
    main()
