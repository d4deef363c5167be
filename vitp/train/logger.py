"""What a run reports: ``metrics.jsonl`` and TensorBoard scalars/images (rank 0), loss per
``t`` bin over all ranks, the per-stage parameter and memory table (``stages.json``), and the
console of the other ranks (:func:`quiet_other_ranks`: a line every rank logs appears once).

``stages.json`` is written atomically (:func:`vitp.utils.atomic_write_text`); ``metrics.jsonl``
is an append-only log, one flushed line per logged step (a crash can leave a partial last line,
which the next attempt's :func:`vitp.train.rundir.drop_failed_attempt` drops)."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from vitp.parallel import distributed as dist
from vitp.utils import atomic_write_text

from .telemetry import peak_memory_gib

log = logging.getLogger("vitp")

T_BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
STRIP_GAP = 2  # white pixels between the frame strips of a TensorBoard image (RunLogger.images)


class RunLogger:
    """Rank-0 metrics: ``metrics.jsonl`` (one object per logged step) and TensorBoard events."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard_dir: Optional[str] = None, start_step: int = 0,
                 log_every: int = 1, max_steps: int = 0):
        self.enabled, self.log_every, self.max_steps = enabled, log_every, max_steps
        self.tb = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides events a crashed attempt logged after the step we start from (all of
            # them on a fresh start, whose step-0 evaluation is redone)
            self.tb = SummaryWriter(tensorboard_dir or str(run_dir / "tb"), purge_step=start_step + 1 if start_step else 0)
            self.jsonl = open(run_dir / "metrics.jsonl", "a")

    def should_log(self, step: int) -> bool:
        """Training metrics are logged at step 1, every ``log_every`` steps and at the last step."""
        return step % self.log_every == 0 or step == self.max_steps or step == 1

    def scalars(self, step: int, values: Dict[str, float], jsonl: bool = True) -> None:
        """TensorBoard scalars at ``step`` and (with ``jsonl``) one ``metrics.jsonl`` line."""
        if not self.enabled:
            return
        for k, v in values.items():
            self.tb.add_scalar(k, v, step)
        if jsonl:
            self.jsonl.write(json.dumps({"step": step, **values}) + "\n")
            self.jsonl.flush()

    def text(self, tag: str, text: str, step: int) -> None:
        """Text (a sample grid's prompts, one per row) in TensorBoard's Text tab."""
        if self.enabled:
            self.tb.add_text(tag, text, step)

    def image(self, tag: str, img: torch.Tensor, step: int) -> None:
        """One image ``(3, H, W)`` in [0, 1] (a sample grid)."""
        if self.enabled:
            self.tb.add_image(tag, img, step)

    def images(self, tag: str, imgs: torch.Tensor, step: int) -> None:
        """A batch ``(N, 3, H, W)`` in [0, 1] (video frame strips, one per class) as one image of
        ``N`` rows, ``STRIP_GAP`` white pixels around and between them: ``(3, N * (H + 2) + 2,
        W + 4)``. (``add_images`` tiles a batch side by side with no gap: two classes' strips read
        as one.)"""
        if self.enabled:
            from torchvision.utils import make_grid

            self.tb.add_image(tag, make_grid(imgs, nrow=1, padding=STRIP_GAP, pad_value=1.0), step)

    def close(self) -> None:
        """Flush and close the event file and ``metrics.jsonl``."""
        if self.enabled:
            self.tb.close()
            self.jsonl.close()


class OwnRecordsOnly(logging.Filter):
    """The console filter of ranks other than 0: errors and records marked rank-local
    (``extra=RANK_LOCAL``, :data:`vitp.utils.RANK_LOCAL`) pass; the rest is what every rank logs
    alike (config notes, data-set scans), which rank 0 prints once."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or bool(getattr(record, "rank_local", False))


# DeepSpeed's INFO lines; its op probe's compiler commands (gcc ... -laio); matplotlib's first-use
# "generated new fontManager" (a text run's first grid of captions)
QUIET_LOGGERS = ("DeepSpeed", "compilers", "matplotlib")
QUIET_WARNINGS = (r"`torch\.distributed\.all_gather_into_tensor` is deprecated",)  # DeepSpeed's ZeRO calls it


def quiet_third_party() -> None:
    """Keep what libraries print about themselves off the console (and ``train.log``): the
    loggers :data:`QUIET_LOGGERS` below WARNING (DeepSpeed's op probe logs every compiler command it
    tries, under ``compilers.C.base``), and the :data:`QUIET_WARNINGS` (torch deprecates a
    collective DeepSpeed calls). Call it before the process group starts: that start probes."""
    import warnings

    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for message in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)


def quiet_other_ranks() -> None:
    """On ranks other than 0, put :class:`OwnRecordsOnly` on every root-logger handler (the console
    that ``vitp-train`` gives those ranks) and route Python warnings (a library's deprecation
    notes) through it: without it, each warning every rank logs (a key without effect, a class
    folder without images) was printed once per rank. Rank 0 keeps its console and ``train.log``
    as they are."""
    if dist.is_main():
        return
    for handler in logging.getLogger().handlers:
        handler.addFilter(OwnRecordsOnly())
    logging.captureWarnings(True)


def binned_loss(t: torch.Tensor, loss: torch.Tensor) -> Dict[str, float]:
    """Mean loss per ``t`` bin over all ranks (ranks without records contribute zeros)."""
    n = len(T_BINS) - 1
    idx = torch.bucketize(t, torch.tensor(T_BINS[1:-1]), right=True)
    sums = torch.zeros(2, n, dtype=torch.float64)
    sums[0].index_add_(0, idx, loss.double())
    sums[1].index_add_(0, idx, torch.ones_like(loss, dtype=torch.float64))
    if dist.world_size() > 1:
        torch.distributed.all_reduce(sums)
    return {
        f"loss_t/{T_BINS[i]:.1f}-{T_BINS[i + 1]:.1f}": (sums[0, i] / sums[1, i]).item()
        for i in range(n) if sums[1, i] > 0
    }


def log_stages(module: torch.nn.Module, state: Any, device: torch.device, run_dir: Path) -> None:
    """Gather per-rank (stage, tp rank) parameter counts (all, and ``trainable``: a LoRA run's
    adapters) and peak memory; rank 0 logs them and writes ``stages.json``."""
    peak = peak_memory_gib(device) * 2**10  # MiB
    row = {"rank": dist.rank(), "stage": state.pp_rank, "tp_rank": state.tp_rank,
           "cp_rank": state.cp_rank, "dp_rank": state.dp_rank,
           "parameters": sum(p.numel() for p in module.parameters()),
           "trainable": sum(p.numel() for p in module.parameters() if p.requires_grad),  # LoRA: the adapters
           "peak_memory_mib": round(peak, 1)}
    rows = [row]
    if dist.world_size() > 1:
        rows = [None] * dist.world_size()
        torch.distributed.all_gather_object(rows, row)
    if dist.is_main():
        for r in rows:
            if r["dp_rank"] == 0 and r["cp_rank"] == 0:
                frozen = r["parameters"] - r["trainable"]
                log.info("stage %d tp %d: %.3fM parameters%s, peak memory %.0f MiB", r["stage"], r["tp_rank"],
                         r["parameters"] / 1e6, f" ({r['trainable'] / 1e6:.3f}M trained, {frozen / 1e6:.3f}M frozen)"
                         if frozen else "", r["peak_memory_mib"])
        atomic_write_text(run_dir / "stages.json", json.dumps(rows, indent=1) + "\n")
