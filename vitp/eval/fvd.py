"""FVD (Frechet Video Distance, Unterthiner et al. 2018, arXiv:1812.01717) of a video run from a
local I3D file, split over the data-parallel replicas.

FVD is the Frechet distance between Gaussians fitted to the features of a video network on real
and generated clips. The network is the field's: I3D trained on Kinetics-400, its 400 logits
averaged over time (the original TF-Hub ``i3d-kinetics-400``; StyleGAN-V's
``i3d_torchscript.pt``, used by FastVideo; the PyTorch port of TATS / cd-fvd). The network and its
preprocessing are the ``cd-fvd`` package's (Ge et al. 2024, arXiv:2404.12391,
github.com/songweige/content-debiased-fvd): ``load_i3d_model`` loads the local state dict
``eval.fvd.weights`` (TATS' ``i3d_pretrained_400.pt``; vitp checks the file exists first, so the
library never downloads) and ``preprocess_i3d`` resizes every frame to 224 x 224 (bilinear,
``align_corners=False``, aspect ratio not kept) and scales [0, 255] to [-1, 1]. Why not the
content-debiased variant, VideoMAE-v2: the library builds only ViT-g (about 1B parameters) for
it, so no small random-weight file can test it here, and I3D is what published FVD numbers use.

I3D needs at least :data:`MIN_FRAMES` (9) frames (three stride-2 temporal stages and a final
2-frame pool): a shorter clip (the tests' 4-frame videos) has each frame repeated
``ceil(9 / T)`` times, real and generated alike (:func:`fit_frames`); any size is resized to 224.
A clip of one frame (an image run) is refused.

The covariances are the biased ones (divided by N) as StyleGAN-V's and cd-fvd's
``FeatureStats.get_mean_cov`` compute them (TF-GAN divides by N - 1; at 2048 clips they differ
by 0.05 %), from :class:`vitp.eval.fid.FeatureSums`: each replica extracts the features of its
own clips, only the sums are added over the replicas. The generated clips are written as FID's
images are (:func:`vitp.eval.fid.write_fid_samples`: seeded by index, resumable blocks) into an
``.npz`` whose ``arr_0`` is uint8 (N, T, H, W, 3); the real side's sums are cached as FID's.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from .fid import (Decode, Draw, FeatureSums, Metric, file_digest, fid_labels, image_sums, npz_images,
                  read_weights_file, real_side, real_statistics, warn_small_counts, write_fid_samples)
from .inference import Share
from .progress import phase

log = logging.getLogger("vitp")

FVD_DIM = 400  # I3D's Kinetics-400 logits
MIN_FRAMES = 9  # I3D's shortest input
WEIGHTS_HELP = ("the I3D (Kinetics-400) state dict cd-fvd loads (i3d_pretrained_400.pt from "
                "github.com/songweige/TATS, tats/fvd/; docs/evaluation.md), or a random-weight one from "
                "scripts/make_random_eval_weights.py OUT (OUT/i3d.pt)")


def check_weights(path: Optional[str]) -> Path:
    """``path`` as a checked I3D weights file (cd-fvd's ``InceptionI3d(400)`` state dict). Raises
    ``ValueError`` when none is given or it is not that state dict, ``FileNotFoundError`` when it
    is missing; each names ``eval.fvd.weights`` and how to get the right file."""
    p, sd = read_weights_file(path, "eval.fvd", WEIGHTS_HELP)
    w = sd.get("logits.conv3d.weight") if isinstance(sd, dict) else None
    shape = tuple(w.shape) if isinstance(w, torch.Tensor) else None
    if shape != (FVD_DIM, 1024, 1, 1, 1) or "Conv3d_1a_7x7.conv3d.weight" not in sd:
        raise ValueError(f"eval.fvd.weights={path} is not cd-fvd's I3D (logits.conv3d.weight {shape}, expected "
                         f"(400, 1024, 1, 1, 1)); give {WEIGHTS_HELP}")
    return p


def check_video_run(cfg: Any) -> None:
    """Raises ``ValueError`` naming ``eval.fvd.num`` for an image run (``model.num_frames < 2``)."""
    if int(cfg.model.num_frames) < 2:
        raise ValueError(f"eval.fvd.num={cfg.eval.fvd.num}: FVD scores videos, but this run makes images "
                         f"(model.num_frames={cfg.model.num_frames}); use eval.fid.num for images")


def check_fvd(cfg: Any) -> Path:
    """The checks of an evaluation with ``eval.fvd.num > 0`` before any sample is drawn: a video
    run (:func:`check_video_run`) and the weights (:func:`check_weights`, whose path it returns).
    Raises ``ValueError`` / ``FileNotFoundError`` naming the key and the fix."""
    check_video_run(cfg)
    return check_weights(cfg.eval.fvd.weights)


def i3d(path: Optional[str], device: Any = "cpu") -> torch.nn.Module:
    """cd-fvd's ``InceptionI3d`` (400 logits) from the checked file ``path`` (:func:`check_weights`;
    so ``load_i3d_model`` never downloads), in eval mode on ``device``: clips ``(B, 3, T, H, W)`` in
    [-1, 1], ``T >= 9``, ``H = W = 224`` -> ``(B, 400)``."""
    from cdfvd.third_party.i3d.utils import load_i3d_model

    return load_i3d_model(torch.device(device), str(check_weights(path))).eval()


def to_clips(x: torch.Tensor) -> torch.Tensor:
    """Samples ``(B, C, T, H, W)`` in [-1, 1] as uint8 clips ``(B, T, H, W, 3)`` (one channel
    repeated), quantised as FID's images are (:func:`vitp.eval.fid.to_uint8`). Raises ``ValueError``
    for channels other than 1 or 3."""
    if x.shape[1] not in (1, 3):
        raise ValueError(f"FVD needs 1- or 3-channel videos, got {x.shape[1]} channels (a latent run's samples are "
                         f"decoded through data.vae first)")
    clips = ((x.float() + 1) * 127.5).clamp(0, 255).to(torch.uint8)
    return clips.expand(-1, 3, -1, -1, -1).permute(0, 2, 3, 4, 1).contiguous()


def fit_frames(clips: torch.Tensor) -> torch.Tensor:
    """Clips ``(B, T, H, W, 3)`` with at least :data:`MIN_FRAMES` frames: a shorter clip has each
    frame repeated ``ceil(MIN_FRAMES / T)`` times (in order; a slowed-down clip), a longer one is
    kept. Raises ``ValueError`` for a clip of one frame (a still image has no motion to score)."""
    t = clips.shape[1]
    if t < 2:
        raise ValueError(f"FVD needs clips of at least 2 frames, got {t}")
    return clips if t >= MIN_FRAMES else clips.repeat_interleave(math.ceil(MIN_FRAMES / t), dim=1)


def clip_features(net: torch.nn.Module, clips: torch.Tensor) -> torch.Tensor:
    """I3D's features ``(B, 400)`` of uint8 clips ``(B, T, H, W, 3)``: :func:`fit_frames`, then
    cd-fvd's ``preprocess_i3d`` (frames resized to 224 x 224, bilinear; [-1, 1]) as its
    ``get_i3d_logits`` does, on the network's device."""
    from cdfvd.third_party.i3d.utils import preprocess_i3d

    p = next(net.parameters())
    x = preprocess_i3d(fit_frames(torch.as_tensor(clips)).numpy())
    return net(x.to(device=p.device, dtype=p.dtype))


PROTOCOL = f"cd-fvd InceptionI3d logits; frames repeated to >= {MIN_FRAMES}; preprocess_i3d (224, [-1, 1])"
FVD = Metric("FVD", "fvd", "I3D weights (eval.fvd.weights)", FVD_DIM, "clip", to_clips, clip_features,
             item_dims=5, protocol=PROTOCOL)


def mean_cov(sums: FeatureSums):
    """``(mean (D,), covariance (D, D))`` of the sums, the covariance divided by N as StyleGAN-V's
    and cd-fvd's ``FeatureStats.get_mean_cov``. Raises ``ValueError`` under 2 clips."""
    if sums.n < 2:
        raise ValueError(f"FVD needs at least 2 clips on each side, got {int(sums.n)}; raise eval.fvd.num / "
                         f"eval.fvd.real_num")
    mean = sums.s / sums.n
    return mean, sums.ss / sums.n - torch.outer(mean, mean)


def frechet_video(real: FeatureSums, fake: FeatureSums) -> float:
    """FVD ``|mu_r - mu_f|^2 + Tr(S_r + S_f - 2 (S_r S_f)^(1/2))`` of the two sums' Gaussians
    (:func:`mean_cov`), the trace of the root from the eigenvalues of ``S_r S_f`` (torchmetrics'
    ``_compute_fid``, float64; cd-fvd takes ``scipy.linalg.sqrtm``)."""
    from torchmetrics.image.fid import _compute_fid

    (mr, cr), (mf, cf) = mean_cov(real), mean_cov(fake)
    return float(_compute_fid(mr, cr, mf, cf))


def fvd_metrics(gen: Any, cfg: Any, train_ds: Any, heldout_ds: Any, run_dir: Path, npz: Path,
                conditioning: Any = None, share: Optional[Share] = None,
                heldout_ids: Optional[torch.Tensor] = None, draw: Optional[Draw] = None,
                decode: Optional[Decode] = None, decoder: str = "") -> Dict[str, Any]:
    """FVD of ``eval.fvd.num`` generated clips against the real ``eval.fvd.real`` clips (the first
    ``eval.fvd.real_num``; their sums cached, :func:`vitp.eval.fid.real_statistics`): clips
    class-balanced (a caption run: the held-out caption ids ``heldout_ids``, cycled), clip ``i``
    from the noise of ``(eval.fvd.seed, i)``, written to ``npz`` in resumable blocks of
    ``eval.fvd.block`` and their features read back from it, each replica its own rows. Returns
    ``fvd``, ``fvd_num_samples``, ``fvd_real_items`` and ``fvd_npz`` on rank 0 (``{}`` elsewhere).
    ``draw``, ``decode``, ``decoder``: another model's sampling and decoding, as
    :func:`vitp.eval.fid.fid_metrics` takes them.
    Raises ``ValueError`` / ``FileNotFoundError`` (:func:`check_video_run`, :func:`i3d`) before any clip
    is drawn. Collective."""
    from .sampling import _device

    share, f = share or Share(), cfg.eval.fvd
    check_video_run(cfg)
    net = i3d(f.weights, _device(gen))  # the file checked (check_weights) before any clip
    real_ds, count, cache = real_side(cfg, FVD, train_ds, heldout_ds, run_dir, share)
    real = real_statistics(net, cfg, real_ds, count, share, cache, file_digest(Path(str(f.weights)).expanduser()), FVD,
                           decode, decoder)
    ids = heldout_ids if heldout_ids is not None else torch.zeros(1, dtype=torch.long)
    write_fid_samples(gen, cfg, fid_labels(cfg, conditioning, ids, f.num), share, npz, conditioning, FVD, draw)
    clips = npz_images(npz, FVD.item_dims)
    mine = share.indices(len(clips))
    with phase(f"FVD features of the {len(clips)} clips in {npz.name}", len(mine), "FVD", "clip", share.main) as bar:
        fake = image_sums(net, clips, mine, f.batch_size, bar, FVD).summed(share)
    if not share.main:
        return {}
    warn_small_counts(FVD, count, len(clips))
    return {"fvd": frechet_video(real, fake), "fvd_num_samples": len(clips), "fvd_real_items": count,
            "fvd_npz": str(npz)}
