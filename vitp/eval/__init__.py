"""Offline evaluation: held-out loss, the digits judge (accuracy, FD-digits), video temporal
statistics, and sampling with the run's sampler settings."""
from .metrics import bucket_heldout_loss, digits_metrics, evaluate, heldout_loss, video_metrics
from .sampling import at_size, class_grid_labels, generate, heldout_label_samples, write_bucket_grids, write_sample_grid
from .temporal import temporal_consistency, temporal_metrics

__all__ = ["at_size", "bucket_heldout_loss", "class_grid_labels", "digits_metrics", "evaluate", "generate",
           "heldout_label_samples", "heldout_loss", "temporal_consistency", "temporal_metrics", "video_metrics", "write_bucket_grids", "write_sample_grid"]
