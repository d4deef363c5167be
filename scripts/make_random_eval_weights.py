"""Random-weight files of the feature networks behind the field's quality numbers, so every
evaluation command in docs/evaluation.md runs without downloading weights:

    python scripts/make_random_eval_weights.py OUT

writes ``OUT/inception.pth``: torch-fidelity's ``FeatureExtractorInceptionV3`` (the network
torchmetrics' ``FrechetInceptionDistance(feature_extractor_weights_path=...)`` loads and
``eval.fid.weights`` takes), random convolutions whose batch-norm statistics are set from one
forward of random images, so the pool features vary from image to image (default inits give
features near 1e-9). The numbers they give mean nothing; the real file is
``pt_inception-2015-12-05-6726825d.pth`` (docs/evaluation.md).

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
    p = argparse.ArgumentParser(description="Write random-weight feature networks for FID and FVD "
                                            "(docs/evaluation.md).")
    p.add_argument("out", type=Path, help="folder to write inception.pth (FID) and i3d.pt (FVD) into")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(random_inception(a.out / "inception.pth", a.seed))
    print(random_i3d(a.out / "i3d.pt", a.seed))


if __name__ == "__main__":
    main()
