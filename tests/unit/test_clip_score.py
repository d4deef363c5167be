"""CLIP score (vitp.eval.clip_score) with the random-weight CLIP folder of
scripts/make_random_eval_weights.py (32-pixel images, 2 layers per tower: each forward takes
milliseconds): the ``[sum, count]`` of a split over 2 and 4 replicas equal one process's and
torchmetrics' ``CLIPScore`` of the same images and captions; a replica counted twice is seen; a
missing or wrong folder and a class-label run are refused naming the key and the fix.

torchmetrics 1.9.0 takes a local folder only through its callable form (a path string must name
an ``openai/...`` hub model), and under transformers 5 its ``_get_features`` gets a ModelOutput
where it expects a tensor (torchmetrics issue 3407, fixed after 1.9.0 by taking ``pooler_output``):
the callable here hands it the folder's model with that fix as a thin wrapper, and the library's
own processor calls, truncation, normalisation, sums and clamp do the rest.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

CAPTIONS = ["a handwritten seven", "the digit 3", "4", "Ünïcode ☃ caption, with punctuation!", "the digit 9",
            "a handwritten zero", "1", "THE DIGIT 3", "a much longer caption about a digit " * 3]


def _script():
    from tests.helpers import eval_weights_script

    return eval_weights_script()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """``OUT/clip`` as ``python scripts/make_random_eval_weights.py OUT`` writes it."""
    return _script().random_clip(tmp_path_factory.mktemp("clipw") / "clip")


def _images(n, seed=0):
    return torch.randint(0, 256, (n, 8, 8, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


class _Unwrapped(torch.nn.Module):
    """A CLIPModel whose ``get_*_features`` return the embedding tensor (torchmetrics' fix of issue 3407)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config

    def get_image_features(self, *a, **k):
        return self.model.get_image_features(*a, **k).pooler_output

    def get_text_features(self, *a, **k):
        return self.model.get_text_features(*a, **k).pooler_output


def _library(folder):
    from torchmetrics.multimodal.clip_score import CLIPScore
    from transformers import CLIPModel, CLIPProcessor

    return CLIPScore(model_name_or_path=lambda: (_Unwrapped(CLIPModel.from_pretrained(str(folder))),
                                                 CLIPProcessor.from_pretrained(str(folder))))


LONG = pytest.mark.filterwarnings("ignore:Encountered caption longer")  # the last caption: cut at 77 tokens


@LONG
def test_split_sums_equal_one_process_and_torchmetrics(folder):
    from vitp.eval.clip_score import clip_of_sums, load_clip, score_sums
    from vitp.eval.inference import Share

    model, processor = load_clip(folder)
    images, n = _images(len(CAPTIONS)), len(CAPTIONS)
    one = score_sums(model, processor, images, CAPTIONS, range(n), 4)

    def split(k, twice=None):  # each replica's [sum, count] of its rows, added as Share.sum adds them
        parts = []
        for r in range(k):
            rows = Share(r, k).indices(n)
            parts.append(score_sums(model, processor, images, CAPTIONS[rows.start:rows.stop], rows, 2))
        return sum(parts) + (parts[twice] if twice is not None else 0)

    for k in (2, 4):
        got = split(k)
        assert got[1] == one[1] == n
        assert float(got[0]) == pytest.approx(float(one[0]), rel=1e-6)
        assert clip_of_sums(got) == pytest.approx(clip_of_sums(one), rel=1e-6)
    lib = _library(folder)
    lib.update(list(images[:5].permute(0, 3, 1, 2)), CAPTIONS[:5])  # two updates, as batches
    lib.update(list(images[5:].permute(0, 3, 1, 2)), CAPTIONS[5:])
    assert int(lib.n_samples) == n and float(lib.score) == pytest.approx(float(one[0]), rel=1e-4)
    score = clip_of_sums(one)
    assert 5 < score < 95 and float(lib.compute()) == pytest.approx(score, rel=1e-4)
    twice = split(2, twice=1)  # a fault: the second replica's rows counted twice
    assert twice[1] != n and clip_of_sums(twice) != pytest.approx(score, rel=1e-6)


@LONG
def test_scores_of_an_npz_and_its_caption_ids(folder, tmp_path):
    """:func:`clip_metrics` reads the images of the FID ``.npz`` and the captions of its ids
    (``arr_1``) from the run's caption store: torchmetrics' score of those pairs."""
    from omegaconf import OmegaConf

    from vitp.eval.clip_score import clip_metrics
    from vitp.eval.fid import write_npz

    images, ids = _images(6, seed=1), np.array([3, 1, 4, 1, 5, 9])
    np.save(tmp_path / "block.npy", images.numpy())
    write_npz(tmp_path / "eval.npz", images.shape, [tmp_path / "block.npy"], ids)

    class Store:  # caption id -> text, as vitp.text.TextEmbeddings.caption
        def caption(self, i):
            return CAPTIONS[i - 1]

    cond = type("Text", (), {"text": True, "store": Store()})()
    cfg = OmegaConf.create({"eval": {"clip": {"model": str(folder), "batch_size": 4}}})
    res = clip_metrics(cfg, tmp_path / "eval.npz", cond)
    lib = _library(folder)
    lib.update(list(images.permute(0, 3, 1, 2)), [CAPTIONS[i - 1] for i in ids])
    assert res["clip_num_samples"] == 6 and res["clip_model"] == str(folder)
    assert res["clip_score"] == pytest.approx(float(lib.compute()), rel=1e-4)


def test_missing_or_wrong_folders_are_refused(folder, tmp_path):
    from vitp.eval.clip_score import check_clip_folder

    with pytest.raises(ValueError, match="CLIP score needs eval.clip.model=FOLDER: a local transformers CLIP folder"):
        check_clip_folder(None)
    with pytest.raises(FileNotFoundError, match=f"eval.clip.model={tmp_path / 'no'}: no such folder; give .*hf download"):
        check_clip_folder(str(tmp_path / "no"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileNotFoundError, match="is a file, not a folder; give .*make_random_eval_weights.py OUT"):
        check_clip_folder(str(tmp_path / "file"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty has no readable transformers config.json"):
        check_clip_folder(str(tmp_path / "empty"))
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="holds a 'bert' model, not CLIP"):
        check_clip_folder(str(tmp_path / "bert"))
    for name, drop, message in [("noweights", "model.safetensors", "has no weights file"),
                                ("notok", "tokenizer.json", "has no tokenizer files"),
                                ("noimages", "processor_config.json", "its CLIPProcessor does not load")]:
        shutil.copytree(folder, tmp_path / name)
        (tmp_path / name / drop).unlink()
        with pytest.raises(ValueError, match=f"eval.clip.model={tmp_path / name}.* {message}"):
            check_clip_folder(str(tmp_path / name))
    shutil.copytree(folder, tmp_path / "small")  # a text model of fewer tokens than the tokenizer's
    config = json.loads((tmp_path / "small" / "config.json").read_text())
    config["text_config"]["vocab_size"] = 100
    (tmp_path / "small" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="its tokenizer has 514 tokens, its text model 100"):
        check_clip_folder(str(tmp_path / "small"))
    assert check_clip_folder(str(folder)) == folder


def test_a_class_label_run_or_no_fid_samples_is_refused(folder):
    """CLIP score needs the FID samples and captions: the config check refuses ``eval.fid.num=0``,
    vitp-train's checks a class-label run (before any process group), and so do vitp-eval's
    (:func:`check_clip`, before the generator is loaded) and the evaluation given class labels."""
    from vitp.config import compose, validate_config, validate_text_run
    from vitp.data.text import ClassConditioning
    from vitp.eval.clip_score import check_clip

    clip = f"eval.clip.model={folder}"
    with pytest.raises(ValueError, match=f"{clip} scores the FID samples: set eval.fid.num"):
        validate_config(compose(["experiment=smoke", clip]))
    cfg = compose(["experiment=smoke", clip, "eval.fid.num=4"])
    validate_config(cfg)  # the config alone: vitp-eval applies it to a run, which may be a caption run
    with pytest.raises(ValueError, match=f"{clip} is set, but this run is class-conditional .* unset eval.clip.model"):
        validate_text_run(cfg)
    for cond in (ClassConditioning(10), None):  # the evaluation's conditioning; vitp-eval's check (the config's)
        with pytest.raises(ValueError, match="this run is class-conditional .* unset eval.clip.model"):
            check_clip(cfg, cond)
    assert check_clip(compose(["experiment=smoke"])) is None  # off by default
