"""Sample images TensorBoard shows of a video run (vitp.train.logger.RunLogger.images)."""
from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image


def test_tensorboard_frame_strips_are_rows_with_gaps(tmp_path):
    """``samples/frames`` of a 2-class video run: one row per class with white gaps (TensorBoard's
    ``add_images`` had put both classes' strips side by side, seamless, as one 526x32 strip)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from vitp.train.logger import STRIP_GAP, RunLogger

    strips = torch.zeros(2, 3, 32, 263)
    strips[1] += 0.5
    logger = RunLogger(tmp_path, True)
    logger.images("samples/frames", strips, 3)
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    (event,) = acc.Images("samples/frames")
    g = STRIP_GAP
    assert (event.step, event.height, event.width) == (3, 2 * (32 + g) + g, 263 + 2 * g)
    img = np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB"))
    assert (img[32 + g:32 + 2 * g] == 255).all() and (img[g:32 + g, g:263 + g] == 0).all()
    assert (abs(img[32 + 2 * g:64 + 2 * g, g:263 + g].astype(int) - 128) <= 1).all()
