"""CLIP score of a caption run's samples against their captions, from a local CLIP folder, split
over the data-parallel replicas.

CLIP score (Hessel et al. 2021, arXiv:2104.08718) is the cosine of CLIP's embeddings of an image
and of a caption. vitp computes it as torchmetrics' ``CLIPScore`` does
(``torchmetrics/multimodal/clip_score.py``): the images, as ``(3, H, W)`` uint8 tensors, and the
captions go through the folder's ``CLIPProcessor`` (captions padded to the batch's longest, token
ids cut at the text model's ``max_position_embeddings`` as the library cuts them), then
``CLIPModel.get_image_features`` / ``get_text_features``; a pair scores ``100 cos(E_I, E_C)`` and
the result is ``max(mean, 0)``. (The paper's CLIP-S weights by 2.5 and clamps each pair at 0; the
library's 100 and clamp of the mean are followed here, so the numbers are the library's.)

The pairs are the FID samples (:mod:`vitp.eval.fid`): row ``i`` of the ``.npz`` (``arr_0``) with
the caption of its id ``arr_1[i]`` in the run's caption store (:class:`vitp.text.TextEmbeddings`).
Each replica (:class:`vitp.eval.inference.Share`) scores its own rows and only the sum of the
scores and their count (float64) are added over the replicas; the score of the sums is one
process's. The folder is ``eval.clip.model``, read with local files only (never downloaded).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .inference import Share
from .progress import phase

log = logging.getLogger("vitp")

CLIP_HELP = ("a local transformers CLIP folder (config.json, model.safetensors, the processor's and tokenizer's "
             "files), e.g. openai/clip-vit-large-patch14 downloaded with `hf download openai/clip-vit-large-patch14 "
             "--local-dir DIR` on a machine with internet (docs/evaluation.md), or the random-weight OUT/clip of "
             "scripts/make_random_eval_weights.py OUT")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def check_clip_folder(path: Optional[str]) -> Path:
    """``path`` as a checked CLIP folder: a transformers ``CLIPModel`` config
    (``model_type: clip``), a weights file, tokenizer files and a processor that loads, its
    tokenizer no larger than the text model's vocabulary (local files only; the weights are read
    later by :func:`load_clip`). Raises ``ValueError`` when none is given, the folder holds another
    model or lacks weights, tokenizer or processor files, ``FileNotFoundError`` when it
    is missing or a file; each names ``eval.clip.model`` and how to get the right folder."""
    if not path:
        raise ValueError(f"CLIP score needs eval.clip.model=FOLDER: {CLIP_HELP}")
    p = Path(path).expanduser()
    if not p.is_dir():
        what = "is a file, not a folder" if p.exists() else "no such folder"
        raise FileNotFoundError(f"eval.clip.model={path}: {what}; give {CLIP_HELP}")
    from transformers import AutoConfig, CLIPProcessor

    try:
        config = AutoConfig.from_pretrained(str(p), local_files_only=True)
        kind = config.model_type
    except Exception as e:  # noqa: BLE001 - no or unreadable config.json: the same advice
        raise ValueError(f"eval.clip.model={path} has no readable transformers config.json ({type(e).__name__}); "
                         f"give {CLIP_HELP}") from None
    if kind != "clip":
        raise ValueError(f"eval.clip.model={path} holds a {kind!r} model, not CLIP (model_type 'clip'); give {CLIP_HELP}")
    if not any((p / f).is_file() for f in WEIGHT_FILES):
        raise ValueError(f"eval.clip.model={path} has no weights file ({', '.join(WEIGHT_FILES)}); give {CLIP_HELP}")
    # transformers builds a 3-token CLIP tokenizer when its files are missing: they are looked for here
    if not ((p / "tokenizer.json").is_file() or all((p / f).is_file() for f in ("vocab.json", "merges.txt"))):
        raise ValueError(f"eval.clip.model={path} has no tokenizer files (tokenizer.json, or vocab.json and "
                         f"merges.txt); give {CLIP_HELP}")
    try:
        processor = CLIPProcessor.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - missing or damaged processor files
        raise ValueError(f"eval.clip.model={path}: its CLIPProcessor does not load ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200] if str(e) else ''}); give {CLIP_HELP}") from None
    vocab = int(config.text_config.vocab_size)
    if len(processor.tokenizer) > vocab:
        raise ValueError(f"eval.clip.model={path}: its tokenizer has {len(processor.tokenizer)} tokens, its text model "
                         f"{vocab}: the files are of different models; give {CLIP_HELP}")
    return p


CLASS_RUN = ("eval.clip.model is set, but this run is class-conditional (model.text_dim=0): CLIP score compares each "
             "sample with its caption; unset eval.clip.model (eval.clip.model=null)")


def caption_store(conditioning: Any) -> Any:
    """The caption store (:class:`vitp.text.TextEmbeddings`) of a caption run's ``conditioning``
    (:class:`vitp.data.text.TextConditioning`), from which a caption id's text is read. Raises
    ``ValueError`` for a class-label run (:data:`CLASS_RUN`): CLIP score compares an image with its caption."""
    store = getattr(conditioning, "store", None) if getattr(conditioning, "text", False) else None
    if store is None or not hasattr(store, "caption"):
        raise ValueError(CLASS_RUN)
    return store


def check_clip(cfg: Any, conditioning: Any = None) -> Optional[Path]:
    """Before any sample is drawn: ``None`` when ``eval.clip.model`` is unset, else the checked
    folder (:func:`check_clip_folder`). Raises ``ValueError`` when ``eval.fid.num`` is 0 (the
    score reads the FID samples) or the run is class-conditional (``conditioning``, default
    class labels unless ``model.text_dim > 0``: :func:`caption_store`), and the folder's errors."""
    if not cfg.eval.clip.model:
        return None
    if not cfg.eval.fid.num:
        raise ValueError("eval.clip.model scores the FID samples: set eval.fid.num (and eval.fid.weights), e.g. "
                         "eval.fid.num=1000")
    if conditioning is not None:
        caption_store(conditioning)
    elif not cfg.model.text_dim:
        raise ValueError(CLASS_RUN)
    return check_clip_folder(cfg.eval.clip.model)


def load_clip(path: Any, device: Any = "cpu") -> Tuple[Any, Any]:
    """``(CLIPModel in eval mode, float32, on device, CLIPProcessor)`` of the checked folder
    ``path`` (:func:`check_clip_folder`, same errors), local files only."""
    from transformers import CLIPModel, CLIPProcessor

    p = check_clip_folder(str(path))
    model = CLIPModel.from_pretrained(str(p), local_files_only=True, dtype=torch.float32).eval().to(device)
    return model, CLIPProcessor.from_pretrained(str(p), local_files_only=True)


_warned: List[bool] = []  # whether this process said that captions are cut


def _features(out: Any) -> torch.Tensor:
    # transformers >= 5 returns a ModelOutput whose pooler_output is the projected embedding
    return out if isinstance(out, torch.Tensor) else out.pooler_output


@torch.no_grad()
def pair_scores(model: Any, processor: Any, images: Any, captions: Sequence[str]) -> torch.Tensor:
    """``(B,)`` float32 on the model's device: ``100 cos(E_I, E_C)`` of each image of ``images``
    (``(B, H, W, 3)`` uint8, a tensor or array) with its caption, as torchmetrics'
    ``_clip_score_update`` computes it (unclamped). Captions longer than the text model's
    ``max_position_embeddings`` tokens are cut there, as the library cuts them (a warning, once per
    process). Raises ``ValueError`` when the counts differ."""
    if len(images) != len(captions):
        raise ValueError(f"CLIP score pairs images with captions: {len(images)} images, {len(captions)} captions")
    device = next(model.parameters()).device
    x = images if isinstance(images, torch.Tensor) else torch.from_numpy(np.array(images, dtype=np.uint8))
    x = x.permute(0, 3, 1, 2).contiguous().cpu()  # the library takes (3, H, W) tensors
    pixels = processor(images=list(x), return_tensors="pt", padding=True)["pixel_values"]
    img = _features(model.get_image_features(pixels.to(device)))
    tok = processor(text=list(captions), return_tensors="pt", padding=True)
    ids, mask = tok["input_ids"], tok["attention_mask"]
    limit = int(model.config.text_config.max_position_embeddings)
    if ids.shape[-1] > limit:
        if not _warned:  # once per process: every batch of a long-captioned data set would say it
            _warned.append(True)
            log.warning("CLIP score: captions longer than %d tokens are cut there, as torchmetrics' CLIPScore cuts "
                        "them (%d in this batch)", limit, int((mask.sum(-1) > limit).sum()))
        ids, mask = ids[..., :limit], mask[..., :limit]
    txt = _features(model.get_text_features(ids.to(device), mask.to(device)))
    img, txt = img / img.norm(p=2, dim=-1, keepdim=True), txt / txt.norm(p=2, dim=-1, keepdim=True)
    return 100 * (img * txt).sum(-1)


def score_sums(model: Any, processor: Any, images: Any, captions: Sequence[str], rows: range, batch: int,
               bar: Any = None) -> torch.Tensor:
    """``(2,)`` float64 ``[sum of the scores, count]`` of the pairs ``(images[i], captions[i -
    rows.start])`` for ``i`` in ``rows`` (:func:`pair_scores`), ``batch`` pairs per forward;
    ``captions`` holds the captions of ``rows`` alone."""
    total = torch.zeros(2, dtype=torch.float64)
    for i in range(rows.start, rows.stop, batch):
        j = min(rows.stop, i + batch)
        s = pair_scores(model, processor, images[i:j], captions[i - rows.start:j - rows.start])
        total += torch.tensor([s.double().sum().item(), j - i], dtype=torch.float64)
        if bar is not None:
            bar.update(j - i)
    return total


def clip_of_sums(sums: torch.Tensor) -> float:
    """CLIP score ``max(sum / count, 0)`` of summed :func:`score_sums` (torchmetrics'
    ``CLIPScore.compute``). Raises ``ValueError`` for no pair."""
    if sums[1] < 1:
        raise ValueError("CLIP score of no sample: raise eval.fid.num")
    return max(float(sums[0] / sums[1]), 0.0)


def clip_metrics(cfg: Any, npz: Path, conditioning: Any, share: Optional[Share] = None,
                 device: Any = "cpu") -> Dict[str, Any]:
    """CLIP score of the FID samples in ``npz`` (``arr_0`` ``(N, H, W, 3)`` uint8, ``arr_1`` their
    caption ids) against their captions in the store of ``conditioning`` (:func:`caption_store`),
    with the CLIP folder ``eval.clip.model`` on ``device``, ``eval.clip.batch_size`` pairs per
    forward: each replica of ``share`` scores its rows, the ``[sum, count]`` are added over the
    replicas (collective). Returns ``clip_score`` (0 to 100), ``clip_num_samples`` and
    ``clip_model`` (the folder) on rank 0, ``{}`` elsewhere. Raises as :func:`check_clip` does."""
    from .fid import npz_images

    share = share or Share()
    store = caption_store(conditioning)
    model, processor = load_clip(cfg.eval.clip.model, device)
    images = npz_images(npz)
    with np.load(npz) as z:
        ids = z["arr_1"]
    mine = share.indices(len(images))
    captions: List[str] = [store.caption(int(i)) for i in ids[mine.start:mine.stop]]
    with phase(f"CLIP score of the {len(images)} samples in {npz.name}", len(mine), "CLIP", "img", share.main) as bar:
        sums = share.sum(score_sums(model, processor, images, captions, mine, int(cfg.eval.clip.batch_size), bar))
    if not share.main:
        return {}
    return {"clip_score": clip_of_sums(sums), "clip_num_samples": int(round(float(sums[1]))),
            "clip_model": str(cfg.eval.clip.model)}
