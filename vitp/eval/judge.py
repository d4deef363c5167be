"""A small digit classifier ("judge") for evaluating generated samples offline.

vitp trains class-conditional generators of the real handwritten digits of
``sklearn.datasets.load_digits`` (8x8 pixels, 10 classes, tensors scaled to ``[-1, 1]``).
Nothing can be downloaded at evaluation time, so samples are scored with a small CNN that is
trained here on the real training digits:

(a) its accuracy on real held-out digits (:func:`judge_metrics`) says how much to trust it;
(b) the fraction of class-conditional samples it labels as the requested class
    (:func:`judge_metrics` on ``(samples, requested_labels)``) measures conditioning;
(c) the Frechet distance between real and generated samples in its penultimate feature
    space (:func:`judge_features` + :func:`frechet_distance`) measures sample quality and
    diversity. We call this **FD-digits**; it is *not* FID, whose features come from an
    ImageNet Inception-v3 network, and its values are not comparable to FID values.

Sources
-------
Heusel, Ramsauer, Unterthiner, Nessler, Hochreiter (2017), "GANs Trained by a Two Time-Scale
Update Rule Converge to a Local Nash Equilibrium" (NeurIPS), arXiv:1706.08500 -- the Frechet
distance between Gaussians fitted to network features (FID). The numerical fallback for singular
covariances follows the reference implementation ``mseitzer/pytorch-fid``.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Union

import numpy as np
import scipy.linalg
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitp.utils import atomic_write

from .progress import phase

__all__ = [
    "DigitsJudge",
    "train_judge",
    "load_or_train_judge",
    "judge_metrics",
    "judge_features",
    "frechet_distance",
]

ArrayLike = Union[np.ndarray, Tensor]


def _to_4d(x: Tensor) -> Tensor:
    """Return ``x`` as ``(B, C, H, W)``, taking the single frame of a ``(B, C, 1, H, W)`` input."""
    if x.dim() == 5:
        if x.shape[2] != 1:
            raise ValueError(
                f"DigitsJudge expects a single frame (T == 1) for 5-D (B, C, T, H, W) inputs, "
                f"got shape {tuple(x.shape)}"
            )
        return x[:, :, 0]
    if x.dim() == 4:
        return x
    raise ValueError(
        f"DigitsJudge expects (B, C, T, H, W) or (B, C, H, W) inputs, got shape {tuple(x.shape)}"
    )


class DigitsJudge(nn.Module):
    """Small CNN classifier for digit images in ``[-1, 1]``.

    Two 3x3 conv blocks (32, 32 channels) at full resolution, a 2x2 max-pool, a third conv
    block (64 channels), then an adaptive average pool to 4x4 so that any ``H = W >= 8`` works, a linear layer to the
    ``feature_dim``-wide penultimate features and a linear classifier. There is no dropout or
    batch norm, so train and eval mode compute the same function.

    Parameters
    ----------
    in_channels : int, default 1
        Pixel channels ``C``.
    num_classes : int, default 10
        Number of classes (logit width).
    feature_dim : int, default 64
        Width ``F`` of the penultimate feature space used for FD-digits.

    Notes
    -----
    Inputs are ``(B, C, T, H, W)`` with ``T == 1`` (the frame ``x[:, :, 0]`` is used) or
    ``(B, C, H, W)``; any other rank, or ``T != 1``, raises ``ValueError``.
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, feature_dim: int = 64):
        super().__init__()
        self.in_channels = int(in_channels)
        self.num_classes = int(num_classes)
        self.feature_dim = int(feature_dim)
        self.body = nn.Sequential(
            nn.Conv2d(self.in_channels, 32, 3, padding=1),
            nn.GELU(),
            nn.Conv2d(32, 32, 3, padding=1),
            nn.GELU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.GELU(),
            nn.AdaptiveAvgPool2d(4),
            nn.Flatten(),
        )
        self.fc = nn.Linear(64 * 4 * 4, self.feature_dim)
        self.head = nn.Linear(self.feature_dim, self.num_classes)

    def features(self, x: Tensor) -> Tensor:
        """Penultimate features.

        Parameters
        ----------
        x : Tensor
            ``(B, C, 1, H, W)`` or ``(B, C, H, W)`` images in ``[-1, 1]``, ``H = W >= 8``.

        Returns
        -------
        Tensor
            ``(B, feature_dim)`` features (after the GELU of the hidden linear layer).
        """
        return F.gelu(self.fc(self.body(_to_4d(x))))

    def forward(self, x: Tensor) -> Tensor:
        """Class logits.

        Parameters
        ----------
        x : Tensor
            ``(B, C, 1, H, W)`` or ``(B, C, H, W)`` images in ``[-1, 1]``.

        Returns
        -------
        Tensor
            ``(B, num_classes)`` logits.
        """
        return self.head(self.features(x))


def _random_shift(x: Tensor, generator: torch.Generator, max_shift: int = 1) -> Tensor:
    """Translate each image by a random integer offset in ``[-max_shift, max_shift]`` per axis.

    Uncovered pixels get the background value ``-1``.

    Parameters
    ----------
    x : Tensor
        ``(B, C, H, W)`` images.
    generator : torch.Generator
        Source of the offsets (keeps training deterministic).

    Returns
    -------
    Tensor
        ``(B, C, H, W)`` shifted images.
    """
    b, _, h, w = x.shape
    s = max_shift
    padded = F.pad(x, (s, s, s, s), value=-1.0)
    offsets = torch.randint(0, 2 * s + 1, (b, 2), generator=generator)
    out = torch.empty_like(x)
    for dy in range(2 * s + 1):
        for dx in range(2 * s + 1):
            idx = ((offsets[:, 0] == dy) & (offsets[:, 1] == dx)).nonzero(as_tuple=True)[0]
            if idx.numel():
                out[idx] = padded[idx, :, dy : dy + h, dx : dx + w]
    return out


def _check_xy(x: Tensor, y: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    x = _to_4d(torch.as_tensor(x)).float()
    y = torch.as_tensor(y).long().reshape(-1)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x has {x.shape[0]} samples but y has {y.shape[0]} labels")
    if x.shape[0] == 0:
        raise ValueError("need at least one training sample")
    if int(y.min()) < 0 or int(y.max()) >= num_classes:
        raise ValueError(f"labels must lie in [0, {num_classes}), got range [{int(y.min())}, {int(y.max())}]")
    return x, y


def _judge_epoch(model: nn.Module, opt: Any, sched: Any, x: Tensor, y: Tensor, gen: torch.Generator,
                 batch_size: int) -> None:
    """One pass over ``(x, y)`` in a shuffled order, with random 1-pixel shifts (:func:`train_judge`)."""
    n = x.shape[0]
    perm = torch.randperm(n, generator=gen)
    for i in range(0, n, batch_size):
        idx = perm[i : i + batch_size]
        xb = _random_shift(x[idx], gen)
        loss = F.cross_entropy(model(xb), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()


def train_judge(
    x: Tensor,
    y: Tensor,
    *,
    epochs: int = 30,
    seed: int = 0,
    batch_size: int = 64,
    num_classes: int = 10,
    lr: float = 2e-3,
) -> DigitsJudge:
    """Train a :class:`DigitsJudge` on real digits, deterministically on the CPU.

    Adam with a cosine learning-rate decay, cross-entropy loss and random 1-pixel shifts
    (background ``-1`` fills the uncovered border) as augmentation. All randomness
    (initialisation, shuffling, shifts) comes from ``seed``; the global torch RNG state is
    restored afterwards. Training runs with one intra-op thread (``torch.set_num_threads(1)``,
    restored afterwards; this is process-wide, so do not train concurrently with other torch work
    in another Python thread). About 5 s for 1400 8x8 digits and 30 epochs.

    Parameters
    ----------
    x : Tensor
        ``(N, C, 1, H, W)`` or ``(N, C, H, W)`` real images in ``[-1, 1]``.
    y : Tensor
        ``(N,)`` integer labels in ``[0, num_classes)``.
    epochs : int, default 30
        Passes over the data.
    seed : int, default 0
        Seed; the same seed and data give bit-identical weights (same torch build and CPU
        kernels).
    batch_size : int, default 64
        Minibatch size.
    num_classes : int, default 10
        Number of classes.
    lr : float, default 2e-3
        Peak Adam learning rate.

    Returns
    -------
    DigitsJudge
        The trained model on the CPU, in eval mode. ``in_channels`` is taken from ``x``.

    Raises
    ------
    ValueError
        If ``x`` and ``y`` disagree in length, labels are out of range, or ``x`` has a bad shape.
    """
    x, y = _check_xy(x, y, num_classes)
    x, y = x.cpu(), y.cpu()
    n = x.shape[0]
    steps_per_epoch = (n + batch_size - 1) // batch_size
    total_steps = max(1, epochs * steps_per_epoch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DigitsJudge(in_channels=x.shape[1], num_classes=num_classes)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: 0.5 * (1.0 + np.cos(np.pi * min(step, total_steps) / total_steps))
    )
    model.train()
    # One intra-op thread: the model is tiny, so this is about as fast as more threads on an idle
    # machine, far faster on a busy one (spinning OpenMP workers), and makes the float reduction
    # order, hence the weights, independent of the machine's core count.
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with phase(f"training the digits judge ({epochs} epochs on {n} real digits; cached for later evaluations)",
                   epochs, "judge", "epoch") as bar:
            for _ in range(epochs):
                _judge_epoch(model, opt, sched, x, y, gen, batch_size)
                bar.update(1)
    finally:
        torch.set_num_threads(prev_threads)
    return model.eval()


def load_or_train_judge(
    path: Union[str, os.PathLike],
    x: Tensor,
    y: Tensor,
    *,
    epochs: int = 30,
    seed: int = 0,
    num_classes: int = 10,
) -> DigitsJudge:
    """Load a cached judge from ``path``, or train one with :func:`train_judge` and cache it.

    The cache is a ``.safetensors`` file of the state dict. It is written atomically: to a
    temporary file in the same directory, then ``os.replace``\\ d onto ``path``, so an
    interrupted run never leaves a half-written cache. An existing file is loaded as is; its
    ``epochs``/``seed`` are not checked (delete the file to retrain).

    Parameters
    ----------
    path : str or os.PathLike
        Cache file (``.safetensors``); parent directories are created when saving.
    x, y : Tensor
        Training data as for :func:`train_judge`; ``x`` also fixes ``in_channels``.
    epochs, seed, num_classes
        Passed to :func:`train_judge` when there is no cache.

    Returns
    -------
    DigitsJudge
        The model on the CPU, in eval mode.

    Raises
    ------
    ValueError
        If ``path`` exists but is not a readable safetensors file or its tensors do not match
        the model's names/shapes; the message names the file and suggests deleting it.
    """
    from safetensors.torch import load_file

    from vitp.utils import save_safetensors

    path = Path(path)
    in_channels = _to_4d(torch.as_tensor(x)).shape[1]
    if path.exists():
        model = DigitsJudge(in_channels=in_channels, num_classes=num_classes)
        try:
            state = load_file(str(path))
        except Exception as e:  # safetensors raises its own SafetensorError, or OSError
            raise ValueError(
                f"judge cache {str(path)!r} is not a readable safetensors file ({e}); "
                f"delete it to retrain the judge"
            ) from e
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise ValueError(
                f"judge cache {str(path)!r} does not match DigitsJudge(in_channels={in_channels}, "
                f"num_classes={num_classes}): {e}; delete it to retrain the judge"
            ) from e
        return model.eval()

    model = train_judge(x, y, epochs=epochs, seed=seed, num_classes=num_classes)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    with atomic_write(path) as tmp:
        save_safetensors(state, str(tmp), metadata={"epochs": str(epochs), "seed": str(seed)})
    return model


def _batches(judge: nn.Module, x: Tensor, batch_size: int):
    device = next(judge.parameters()).device
    x = torch.as_tensor(x)
    for i in range(0, x.shape[0], batch_size):
        yield i, x[i : i + batch_size].to(device=device, dtype=torch.float32)


@torch.no_grad()
def judge_metrics(judge: DigitsJudge, x: Tensor, y: Tensor, *, batch_size: int = 512) -> dict:
    """Classification accuracy of ``judge`` on ``(x, y)``.

    On real held-out digits this is the judge's accuracy; on class-conditional samples with
    ``y`` the *requested* classes it is the fraction of samples recognised as that class.

    Parameters
    ----------
    judge : DigitsJudge
        The classifier (used as is; keep it in eval mode).
    x : Tensor
        ``(N, C, 1, H, W)`` or ``(N, C, H, W)`` images in ``[-1, 1]``.
    y : Tensor
        ``(N,)`` integer labels.
    batch_size : int, default 512
        Inference batch size.

    Returns
    -------
    dict
        ``{"accuracy": float}``, the fraction of ``argmax(logits) == y``.

    Raises
    ------
    ValueError
        If ``x`` and ``y`` have different lengths or ``N == 0``.
    """
    y = torch.as_tensor(y).long().reshape(-1)
    n = torch.as_tensor(x).shape[0]
    if n != y.shape[0]:
        raise ValueError(f"x has {n} samples but y has {y.shape[0]} labels")
    if n == 0:
        raise ValueError("judge_metrics needs at least one sample")
    correct = 0
    for i, xb in _batches(judge, x, batch_size):
        pred = judge(xb).argmax(dim=1).cpu()
        correct += int((pred == y[i : i + xb.shape[0]]).sum())
    return {"accuracy": correct / n}


@torch.no_grad()
def judge_features(judge: DigitsJudge, x: Tensor, *, batch_size: int = 512) -> np.ndarray:
    """Penultimate judge features of ``x``, batched, for :func:`frechet_distance`.

    Parameters
    ----------
    judge : DigitsJudge
        The classifier.
    x : Tensor
        ``(N, C, 1, H, W)`` or ``(N, C, H, W)`` images in ``[-1, 1]``.
    batch_size : int, default 512
        Inference batch size.

    Returns
    -------
    numpy.ndarray
        ``(N, feature_dim)`` float64 features.
    """
    out = [judge.features(xb).cpu().double() for _, xb in _batches(judge, x, batch_size)]
    if not out:
        return np.zeros((0, judge.feature_dim))
    return torch.cat(out).numpy()


def _as_feats(f: ArrayLike, name: str) -> np.ndarray:
    if isinstance(f, Tensor):
        f = f.detach().cpu().double().numpy()
    f = np.asarray(f, dtype=np.float64)
    if f.ndim != 2:
        raise ValueError(f"{name} must be a 2-D (N, F) feature array, got shape {f.shape}")
    if f.shape[0] < 2:
        raise ValueError(
            f"{name} has N={f.shape[0]} samples; the Frechet distance needs N >= 2 to estimate a covariance"
        )
    if not np.all(np.isfinite(f)):
        raise ValueError(f"{name} contains NaN or inf: the features of non-finite images (weights holding NaN, "
                         "or a sampler that diverged); check the weights (vitp-export reads and checks them)")
    return f


def frechet_distance(feats_a: ArrayLike, feats_b: ArrayLike, *, eps: float = 1e-6) -> float:
    """Frechet distance between Gaussians fitted to two feature sets.

    ``FD = ||mu_a - mu_b||^2 + Tr(S_a + S_b - 2 sqrtm(S_a S_b))`` with sample means ``mu`` and
    unbiased sample covariances ``S`` (``N - 1`` denominator), computed in float64 with
    ``scipy.linalg.sqrtm``. Tiny imaginary parts of the matrix square root (numerical noise)
    are dropped; if the square root is not finite (singular product), ``eps * I`` is added to
    both covariances as in pytorch-fid. Tiny negative results from rounding are clipped to 0.
    With judge features this is FD-digits, not FID.

    Parameters
    ----------
    feats_a, feats_b : numpy.ndarray or Tensor
        ``(N_a, F)`` and ``(N_b, F)`` features; ``N_a`` and ``N_b`` may differ.
    eps : float, default 1e-6
        Diagonal offset used only when ``sqrtm`` fails.

    Returns
    -------
    float
        The distance (>= 0); symmetric in its arguments up to rounding.

    Raises
    ------
    ValueError
        If an input is not 2-D, has fewer than 2 rows, contains NaN/inf, or the feature
        dimensions differ.

    References
    ----------
    Heusel et al. (2017), "GANs Trained by a Two Time-Scale Update Rule Converge to a Local
    Nash Equilibrium", arXiv:1706.08500; Dowson & Landau (1982) for the closed form.
    """
    a = _as_feats(feats_a, "feats_a")
    b = _as_feats(feats_b, "feats_b")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"feature dimensions differ: feats_a has F={a.shape[1]}, feats_b has F={b.shape[1]}")
    mu_a, mu_b = a.mean(axis=0), b.mean(axis=0)
    cov_a = np.atleast_2d(np.cov(a, rowvar=False))
    cov_b = np.atleast_2d(np.cov(b, rowvar=False))

    def _sqrtm(m: np.ndarray) -> np.ndarray:
        # a singular product (fewer samples than features, or collapsed samples) is handled below
        # as pytorch-fid does (non-finite: offset); scipy's LinAlgWarning would only reach the console
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", scipy.linalg.LinAlgWarning)
            r = scipy.linalg.sqrtm(m)
        return r[0] if isinstance(r, tuple) else r

    covmean = _sqrtm(cov_a @ cov_b)
    if not np.all(np.isfinite(covmean)):
        offset = np.eye(cov_a.shape[0]) * eps
        covmean = _sqrtm((cov_a + offset) @ (cov_b + offset))
    if np.iscomplexobj(covmean):
        imag = np.abs(np.diagonal(covmean).imag).max()
        scale = max(1.0, np.abs(np.trace(covmean.real)))
        if imag > 1e-3 * scale:
            warnings.warn(
                f"frechet_distance: sqrtm has a non-negligible imaginary component ({imag:.3g}); "
                f"keeping the real part",
                RuntimeWarning,
                stacklevel=2,
            )
        covmean = covmean.real
    diff = mu_a - mu_b
    fd = float(diff @ diff + np.trace(cov_a) + np.trace(cov_b) - 2.0 * np.trace(covmean))
    return max(fd, 0.0)
