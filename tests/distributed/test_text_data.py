"""Captioned folders end to end, and bad text input refused at training start.

Module-scoped set-ups write, in temporary folders: a tiny local T5 encoder (random weights, byte
tokenizer: nothing downloaded); an image folder of three classes of 16 px PNG shapes with sidecar
``<name>.txt`` captions, two images without one, and a held-out folder with its own sidecars; a
video folder of two classes of short lossless clips captioned by a ``captions.jsonl`` manifest.
``vitp-encode-captions`` encodes each, and ``vitp-train`` trains a few steps on it. The bad-input
cases call :func:`vitp.train.train` in this process and check the message names the file or the
option and the fix.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ENCODE = str(Path(sys.executable).parent / "vitp-encode-captions")
TRAIN = str(Path(sys.executable).parent / "vitp-train")
ENV = dict(os.environ, OMP_NUM_THREADS="1")
COLORS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 230), "yellow": (230, 220, 40),
          "white": (240, 240, 240)}
SHAPES = ("circle", "square", "triangle")
PER_CLASS = 5  # images per class of the training folder
UNCAPTIONED = ("circle/circle_1.png", "triangle/triangle_3.png")  # no sidecar: skipped or empty
TEXT = ["model.text_dim=32"]


def _draw(shape: str, color, k: int):
    """A 16 px RGB image of ``shape`` in ``color`` on a dark background, moved by ``k``."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (16, 16), (10 + 9 * k, 10, 30))
    d = ImageDraw.Draw(im)
    box = (2 + k % 3, 2 + k % 2, 12 + k % 3, 13)
    if shape == "circle":
        d.ellipse(box, fill=color)
    elif shape == "square":
        d.rectangle(box, fill=color)
    else:
        d.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill=color)
    return im


def _image_folder(root: Path, per_class: int, uncaptioned=(), tag: str = "") -> Path:
    """``root/<shape>/<shape>_<k>.png`` with a sidecar caption each, except ``uncaptioned``."""
    names = list(COLORS)
    for shape in SHAPES:
        (root / shape).mkdir(parents=True)
        for k in range(per_class):
            color = names[(k + SHAPES.index(shape)) % len(names)]
            png = root / shape / f"{shape}_{k}.png"
            _draw(shape, COLORS[color], k).save(png)
            if f"{shape}/{png.name}" not in uncaptioned:
                png.with_suffix(".txt").write_text(f"a {color} {shape}{tag}, picture {k}\n")
    return root


def _run(cmd, cwd=None):
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=cwd, timeout=600)


def _encode(enc, out, overrides, *flags):
    r = _run([ENCODE, "--encoder", str(enc), "--out", str(out), "--max-length", "48", "--device", "cpu", *flags,
              *overrides])
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def _losses(run: Path):
    return [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    from vitp.text.tiny import make_tiny_encoder

    return make_tiny_encoder(tmp_path_factory.mktemp("encoder") / "t5")


@pytest.fixture(scope="module")
def images(tmp_path_factory, encoder):
    """``(data overrides, store)``: the captioned image folder with its held-out folder, encoded."""
    base = tmp_path_factory.mktemp("images")
    root = _image_folder(base / "photos", PER_CLASS, UNCAPTIONED)
    held = _image_folder(base / "heldout", 2, tag=" (held out)")
    data = ["data=image_folder", f"data.root={root}", f"data.heldout_root={held}", "data.resolution=16",
            "data.channels=3", "data.num_classes=3", "data.num_workers=0", "data.captions=sidecar"]
    out = _encode(encoder, base / "emb", data)
    return data, base / "emb", out


def _clip(path: Path, color, n: int = 12, side: int = 16, speed: int = 1) -> None:
    """A lossless (FFV1) clip of ``n`` frames: a ``color`` square moving ``speed`` px per frame."""
    import av

    frames = np.zeros((n, side, side, 3), np.uint8)
    for i in range(n):
        x = (i * speed) % (side - 6)
        frames[i, 5:11, x:x + 6] = color
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as c:
        s = c.add_stream("ffv1", rate=10)
        s.width, s.height, s.pix_fmt = side, side, "bgr0"
        for f in frames:
            for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


VIDEO = ["data=video_folder", "data.resolution=8", "data.num_frames=4", "data.frame_stride=1", "data.channels=3",
         "data.num_classes=2", "data.num_workers=0", "data.captions=captions.jsonl", "model.patch_size=2",
         "model.tubelet_size=2", "model.attention=factorized"]


@pytest.fixture(scope="module")
def videos(tmp_path_factory, encoder):
    """``(data overrides, store, encode output)``: two classes of two clips each, captioned by a
    ``captions.jsonl`` manifest of paths relative to the root."""
    base = tmp_path_factory.mktemp("videos")
    root = base / "clips"
    rows = []
    for cls, color in (("left", (230, 40, 40)), ("right", (40, 200, 230))):
        for k in (1, 2):
            rel = f"{cls}/clip{k}.mkv"
            _clip(root / rel, color, speed=k)
            rows.append({"file": rel, "caption": f"a square moving {cls} at speed {k}"})
    (root / "captions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = [*VIDEO, f"data.root={root}", f"data.cache_dir={base / 'cache'}"]
    out = _encode(encoder, base / "emb", data)
    return data, base / "emb", out


# ----------------------------------------------------------------------------------- end to end
def test_image_folder_with_sidecars_trains_and_skips_uncaptioned_files(images, tmp_path):
    data, emb, encoded = images
    # 15 + 6 held-out images, 2 without a sidecar: 19 captions, all distinct, + the empty one
    assert "19 captions from data.name=image_folder: 19 unique + the empty caption (id 0) = 20 stored" in encoded
    assert "0 truncated at 48 tokens" in encoded
    run = tmp_path / "run"
    r = _run([TRAIN, "experiment=smoke", *data, *TEXT, "model.patch_size=4", "trainer.max_steps=3",
              f"data.text_embeddings={emb}", f"hydra.run.dir={run}"])
    assert r.returncode == 0, r.stderr[-3000:]
    losses = _losses(run)
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    log = (run / "train.log").read_text()
    root = data[1].split("=", 1)[1]
    assert (f"2 of 15 files under {root} have no caption (sidecar): 2 item(s) skipped "
            "(data.missing_caption=skip)") in log
    assert "| 13 train / 6 held-out" in log  # data.heldout_root: all of each folder, less the 2
    assert log.count("have no caption") == 1  # the held-out folder's files all have theirs


def _trainer_rank(rank, overrides, run_dir):
    """A :class:`vitp.train.Trainer` built and fitted; its item counts, caption ids and losses."""
    from vitp.config import compose
    from vitp.train import Trainer

    trainer = Trainer(compose(overrides), run_dir)
    train, held = trainer.train_ds, trainer.heldout_ds
    out = {"train": len(train), "held": len(held), "train_captions": list(train.captions),
           "train_ids": train.ids.tolist(), "held_captions": list(held.captions), "held_ids": held.ids.tolist()}
    return {**out, "losses": trainer.fit()["losses"]}


def test_missing_caption_empty_keeps_the_uncaptioned_files(images, tmp_path):
    from tests.helpers import run_ranks

    data, emb, _ = images
    over = ["experiment=smoke", *data, *TEXT, "model.patch_size=4", "trainer.max_steps=2",
            f"data.text_embeddings={emb}", "data.missing_caption=empty"]
    res = run_ranks(1, _trainer_rank, over, str(tmp_path / "run"))[0]
    assert (res["train"], res["held"]) == (15, 6)  # 2 more than with skip (13 / 6)
    assert res["train_captions"].count("") == 2 and res["train_ids"].count(0) == 2  # the empty caption, id 0
    # data.heldout_root: the held-out items carry their own folder's sidecars, encoded in the same store
    assert sorted(res["held_captions"]) == sorted(f"a {c} {s} (held out), picture {k}" for s, k, c in [
        ("circle", 0, "red"), ("circle", 1, "green"), ("square", 0, "green"), ("square", 1, "blue"),
        ("triangle", 0, "blue"), ("triangle", 1, "yellow")])
    assert 0 not in res["held_ids"] and len(set(res["held_ids"])) == 6
    assert len(res["losses"]) == 2 and all(math.isfinite(v) for v in res["losses"])


def test_video_folder_with_a_jsonl_manifest_trains(videos, tmp_path):
    data, emb, encoded = videos
    # one caption per clip window (every window of a file has its file's caption): 4 distinct
    assert re.search(r"\d+ captions from data.name=video_folder: 4 unique \+ the empty caption \(id 0\) = 5 stored",
                     encoded), encoded
    run = tmp_path / "run"
    r = _run([TRAIN, "experiment=smoke", *data, *TEXT, "trainer.max_steps=3", f"data.text_embeddings={emb}",
              f"hydra.run.dir={run}"])
    assert r.returncode == 0, r.stderr[-3000:]
    losses = _losses(run)
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    log = (run / "train.log").read_text()
    assert "no caption" not in log
    m = re.search(r"\| (\d+) train / (\d+) held-out", log)
    assert m and int(m.group(1)) > 0 and int(m.group(2)) > 0, log


# ------------------------------------------------------------------------------------ bad input
def _refused(overrides, run_dir, error=ValueError, monkeypatch=None):
    """The message of the ``error`` :func:`vitp.train.train` raises on ``overrides``. With
    ``monkeypatch``, starting a process group fails the test: the refusal must come before."""
    from vitp.config import compose
    from vitp.parallel import distributed
    from vitp.train import train

    if monkeypatch is not None:
        def started(*a, **k):
            raise AssertionError("a process group was started before the bad input was refused")

        monkeypatch.setattr(distributed, "init_distributed", started)
    with pytest.raises(error) as e:
        train(compose(overrides), run_dir)
    run_dir = Path(run_dir)
    assert not run_dir.exists() or {p.name for p in run_dir.iterdir()} <= {".vitp.lock"}  # nothing written
    return " ".join(str(e.value).split())


@pytest.fixture(scope="module")
def image_run(images):
    data, emb, _ = images
    return ["experiment=smoke", *data, *TEXT, "model.patch_size=4", "trainer.max_steps=1",
            f"data.text_embeddings={emb}"]


def _without(over, prefix):
    return [o for o in over if not o.startswith(prefix)]


def test_text_dim_without_embeddings_is_refused_before_a_process_group(image_run, tmp_path, monkeypatch):
    msg = _refused(_without(image_run, "data.text_embeddings="), tmp_path / "run", monkeypatch=monkeypatch)
    assert msg.startswith("model.text_dim=32 needs the captions' precomputed embeddings, but data.text_embeddings is "
                          "unset: run vitp-encode-captions --encoder")
    assert msg.endswith("then set data.text_embeddings=DIR")


def test_text_dim_without_captions_is_refused_before_a_process_group(image_run, tmp_path, monkeypatch):
    msg = _refused(_without(image_run, "data.captions="), tmp_path / "run", monkeypatch=monkeypatch)
    assert msg.startswith("model.text_dim=32 trains on captions, but data.captions is unset: set data.captions=sidecar")


def test_text_dim_other_than_the_stores_channels_is_refused(images, image_run, tmp_path, monkeypatch):
    msg = _refused([*image_run, "model.text_dim=16"], tmp_path / "run", monkeypatch=monkeypatch)
    assert msg == (f"model.text_dim=16 but the caption embeddings in {images[1]} have 32 channels (encoder t5); "
                   "set model.text_dim=32")


def _copy_store(images, dest):
    import shutil

    return Path(shutil.copytree(images[1], dest))


def test_a_store_missing_a_shard_is_refused(images, image_run, tmp_path, monkeypatch):
    store = _copy_store(images, tmp_path / "emb")
    (store / "shard-00000.safetensors").unlink()
    msg = _refused([*image_run, f"data.text_embeddings={store}"], tmp_path / "run", FileNotFoundError, monkeypatch)
    assert msg == (f"{store}/shard-00000.safetensors (listed in {store}/index.json) is missing; re-run the "
                   f"vitp-encode-captions command that made {store}: it re-encodes missing or damaged shards")


def test_a_truncated_shard_is_refused(images, image_run, tmp_path, monkeypatch):
    store = _copy_store(images, tmp_path / "emb")
    shard = store / "shard-00000.safetensors"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:-100])
    msg = _refused([*image_run, f"data.text_embeddings={store}"], tmp_path / "run", monkeypatch=monkeypatch)
    assert msg == (f"{shard} is {size - 100} bytes, the index records {size} (truncated or replaced); re-run the "
                   f"vitp-encode-captions command that made {store}: it re-encodes missing or damaged shards")


def test_a_store_of_another_encoder_is_refused(encoder, images, image_run, tmp_path, monkeypatch):
    from vitp.text import encoder_record
    from vitp.text.tiny import make_tiny_encoder

    other = make_tiny_encoder(tmp_path / "other", num_layers=1)  # same width, another config
    theirs, ours = encoder_record(encoder)["config_sha256"][:12], encoder_record(other)["config_sha256"][:12]
    assert theirs != ours
    msg = _refused([*image_run, f"data.text_encoder={other}"], tmp_path / "run", monkeypatch=monkeypatch)
    assert msg.startswith(f"{images[1]}: embeddings made by encoder t5 (32 channels, config {theirs}), not by "
                          f"data.text_encoder={other} (32 channels, config {ours}): they differ in config_sha256, "
                          f"weights_fingerprint; "
                          f"set data.text_encoder to the encoder that made them ({encoder}), or encode the captions "
                          f"with data.text_encoder (vitp-encode-captions --encoder {other} --out NEW_DIR")
    # same architecture, other weights (seed 1): the weights fingerprint tells them apart
    reseeded = make_tiny_encoder(tmp_path / "reseeded", seed=1)
    assert encoder_record(reseeded)["config_sha256"][:12] == theirs
    msg = _refused([*image_run, f"data.text_encoder={reseeded}"], tmp_path / "run2", monkeypatch=monkeypatch)
    assert "they differ in weights_fingerprint" in msg
    # the encoder that made the store passes
    from vitp.data.text import open_text_embeddings
    from vitp.config import compose

    assert open_text_embeddings(compose([*image_run, f"data.text_encoder={encoder}"])).dim == 32


def _refused_rank(rank, overrides, run_dir):
    """:func:`_refused` in a fresh process: this refusal comes after the process group starts."""
    return _refused(overrides, run_dir)


def test_captions_not_in_the_store_are_refused(encoder, tmp_path):
    from vitp.config import compose
    from vitp.data.build import dataset_captions
    from vitp.text import TextEncoder, write_store

    digits = ["experiment=smoke", *TEXT, "data.captions=templates", "trainer.max_steps=1"]
    encoded = dataset_captions(compose([digits[2], 'data.caption_templates=["the digit {class}"]']).data)
    write_store(tmp_path / "emb", encoded, TextEncoder(encoder, max_length=48), progress=False)
    from tests.helpers import run_ranks

    msg = run_ranks(1, _refused_rank, [*digits, 'data.caption_templates=["the digit {class}","a handwritten '
                                                '{class_word}"]', f"data.text_embeddings={tmp_path / 'emb'}"],
                    str(tmp_path / "run"))[0]
    assert msg.startswith(f"10 of the data set's 20 distinct captions are not in the caption embeddings at "
                          f"{tmp_path / 'emb'} (data.text_embeddings; e.g. 'a handwritten ")
    assert msg.endswith("and set data.text_embeddings=DIR")


def test_sidecar_captions_on_digits_are_refused_before_a_process_group(images, tmp_path, monkeypatch):
    msg = _refused(["experiment=smoke", *TEXT, "data.captions=sidecar", f"data.text_embeddings={images[1]}"],
                   tmp_path / "run", monkeypatch=monkeypatch)
    assert msg.startswith("data.captions=sidecar reads the captions of files, but data.name=digits has no files: "
                          "use data.captions=templates with data.caption_templates")


def test_a_missing_manifest_ends_vitp_train_in_one_line(images, image_run, tmp_path):
    run = tmp_path / "run"
    r = _run([TRAIN, *_without(image_run, "data.captions="), "data.captions=captions.jsonl", f"hydra.run.dir={run}"])
    root = images[0][1].split("=", 1)[1]
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stdout + r.stderr
    assert r.stderr.strip().splitlines()[-1] == (  # one line on stderr
        f"vitp-train: error: caption manifest {root}/captions.jsonl not found (data.captions=captions.jsonl; a "
        f"relative path is read from the data root {root}): write it, one {{\"file\": ..., \"caption\": ...}} per line "
        "(.jsonl) or a header with file and caption columns (.csv), or give its path")
    assert not (run / "train.log").exists()  # a refused launch writes no log
