"""Where a non-finite (NaN or infinite) training loss came from, and the fix that fits that place.

The check runs after the step (its update included), so it reads what is still telling then,
in the order the places arise:

1. the **gradients** of the step before: its loss was finite but its global grad norm was not
   (the backward pass overflowed), and its update wrote them into the weights;
2. the **input batch** the step read holds NaN/Inf: the data do;
3. otherwise the **forward pass** made the loss non-finite from a finite batch (an overflow: the
   learning rate is too high for the model; at the first step of a run, possibly weights loaded
   with NaN/Inf).

A run that resumed from a checkpoint and has written none since (:func:`resumed_checkpoint_note`)
may have resumed from a damaged one (bytes overwritten, size unchanged: the size check passes, the
weights or AdamW moments are garbage, and the NaN can come steps later): until this attempt's first
checkpoint, every step derives from that one, so the messages of places 1 and 3 and of a non-finite
grad norm name it and the one before it to resume from.

:func:`nonfinite_loss_error` builds the ``FloatingPointError`` that stops the run (``vitp-train``
exits with status 3, :data:`vitp.cli.EXIT_NON_FINITE`); :class:`StepBatches` keeps what the
step read, so nothing is checked while the loss is finite. A step whose loss is finite but whose
global grad norm is not stops the run at that step (:func:`nonfinite_grad_error`): a diverging
run's loss can stay finite (1e28) for many steps while clipping by an infinite norm zeroes or
poisons every update (Megatron-LM checks the grad norm the same way, ``check_for_nan_in_grad``).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterator, List, Optional

import torch

from vitp.parallel import distributed as dist


class StepBatches:
    """An iterator over ``it`` that keeps the items read since :meth:`new_step` in :attr:`read`
    (the micro-batches of the current step; only the ranks that read data, the first and the last
    pipeline stage, read any)."""

    def __init__(self, it: Iterator):
        self.it, self.read = it, []

    def __iter__(self) -> "StepBatches":
        return self

    def __next__(self):
        item = next(self.it)
        self.read.append(item)
        return item

    def new_step(self) -> None:
        """Forget the previous step's items."""
        self.read.clear()


def _tensors(obj: Any) -> List[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return []


def holds_nonfinite(batches: Any) -> bool:
    """Whether any floating-point tensor in ``batches`` (nested lists / tuples) holds NaN or Inf."""
    return any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in _tensors(batches))


def _gather(local: Any) -> List[Any]:
    if dist.world_size() == 1:
        return [local]
    out: List[Any] = [None] * dist.world_size()
    torch.distributed.all_gather_object(out, local)
    return out


def resumed_checkpoint_note(resume_tag: Optional[Path], saved_since: bool, command: str) -> str:
    """The clause that names the checkpoint ``resume_tag`` this attempt resumed from as a possible
    cause and the complete checkpoint before it to resume from instead (``command``: what
    continues the run, :func:`vitp.train.rundir.resume_command`), or ``""`` when the attempt did
    not resume or has written a checkpoint since (``saved_since``: the rule of the module doc)."""
    from vitp.checkpoint.training import TAG_RE, published_tags

    if resume_tag is None or saved_since:
        return ""
    tag = Path(resume_tag)
    named = TAG_RE.match(tag.name.removesuffix(".partial"))  # trainer.resume may name a .partial folder
    earlier = [t for t in published_tags(tag.parent) if named and int(TAG_RE.match(t).group(1)) < int(named.group(1))]
    fix = (f"resume from the one before with {command} trainer.resume={tag.parent / earlier[-1]}" if earlier
           else f"no earlier checkpoint is in {tag.parent}")
    return f"no checkpoint since this run resumed from {tag}: if that one is damaged, {fix}"


def nonfinite_loss_error(loss: float, step: int, *, batches: Any, prev_grad_norm: float, first_step: bool,
                         grad_clip: float, precision: str, resumed: str = "") -> FloatingPointError:
    """The error for the non-finite ``loss`` of ``step``: the place it first appeared in (module
    docstring) and the fix for that place.

    ``batches``: what this rank read in the step (:attr:`StepBatches.read`); ``prev_grad_norm``:
    the global grad norm of the step before (NaN if there was none in this attempt: pass
    ``first_step``); ``first_step``: ``step`` is the first of this attempt (fresh start or
    resume); ``resumed``: :func:`resumed_checkpoint_note`, added to the gradients' and the forward
    pass's message. Collective when the world has more than one rank: every rank must call it
    (they all see the same loss).
    """
    bad_input = any(_gather(holds_nonfinite(batches)))
    head = f"loss is {loss} at step {step}"
    fp32 = "" if precision == "fp32" else ", or use trainer.precision=fp32"
    clip = "keep optim.grad_clip > 0" if grad_clip > 0 else "set optim.grad_clip > 0 (it is 0: no clipping)"
    also = f" ({resumed})" if resumed else ""
    if not first_step and not math.isfinite(prev_grad_norm):
        return FloatingPointError(f"{head}: the gradients of step {step - 1} were already non-finite (grad norm "
                                  f"{prev_grad_norm}) though its loss was finite{also}: {clip} and lower "
                                  f"optim.lr{fp32}")
    if bad_input:
        return FloatingPointError(f"{head}: the input batch of that step already holds NaN/Inf, so the data do: check "
                                  f"data.root / the dataset (its files and transforms)")
    start = also or ((" (the first step of this run: if the weights it started from hold NaN/Inf, fix "
                      "trainer.init_from, trainer.init_from_timm or the resumed checkpoint)") if first_step else "")
    return FloatingPointError(f"{head}: the forward pass made it from a finite input batch{start}: lower optim.lr or "
                              f"{clip}{fp32}")


def nonfinite_grad_error(grad_norm: float, loss: float, step: int, *, grad_clip: float,
                         precision: str, resumed: str = "") -> FloatingPointError:
    """The error for a non-finite global grad norm ``grad_norm`` at ``step`` whose ``loss`` is
    finite: the backward pass overflowed (a learning rate too high for the model, or a diverging
    run; ``resumed``: :func:`resumed_checkpoint_note`). Every rank sees the same global norm, so
    every rank raises it."""
    fp32 = "" if precision == "fp32" else ", or use trainer.precision=fp32"
    clip = "keep optim.grad_clip > 0" if grad_clip > 0 else "set optim.grad_clip > 0 (it is 0: no clipping)"
    also = f"; {resumed}" if resumed else ""
    return FloatingPointError(f"grad norm is {grad_norm} at step {step} though its loss ({loss:.4g}) is finite: the "
                              f"backward pass overflowed (the run diverges{also}): lower optim.lr and {clip}{fp32}")
