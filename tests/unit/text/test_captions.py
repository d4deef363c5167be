"""Captions of data files (vitp/text/captions.py): sidecar .txt files, .jsonl and .csv manifests."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from vitp.text import read_captions


@pytest.fixture
def root(tmp_path):
    for name in ("cats/a.jpg", "cats/b.png", "dogs/c.jpg", "dogs/d.jpg"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    return tmp_path


FILES = [Path("cats/a.jpg"), Path("cats/b.png"), Path("dogs/c.jpg"), Path("dogs/d.jpg")]


def test_sidecar_captions(root):
    (root / "cats/a.txt").write_text("  a grey cat\n")
    (root / "cats/b.txt").write_text("")
    (root / "dogs/d.txt").write_text("a dog, running\non grass")
    caps, counts = read_captions(root, [root / FILES[0], *FILES[1:]], "sidecar")  # absolute or relative paths
    assert caps == ["a grey cat", "", None, "a dog, running\non grass"]
    assert counts == {"missing": 1, "unused_entries": 0, "duplicate_entries": 0}


def test_jsonl_manifest(root):
    rows = [{"file": "cats/a.jpg", "caption": " a cat "}, {"path": "dogs/c.jpg", "text": "a dog"},
            {"file": "birds/e.jpg", "caption": "a bird"}, {"file": "cats/a.jpg", "caption": "another"}]
    (root / "captions.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    caps, counts = read_captions(root, FILES, "captions.jsonl")
    assert caps == ["a cat", None, "a dog", None]
    assert counts == {"missing": 2, "unused_entries": 1, "duplicate_entries": 1}
    # an absolute manifest path gives the same
    assert read_captions(root, FILES, str(root / "captions.jsonl"))[0] == caps


def test_csv_manifest(root, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("lists") / "list.csv"
    elsewhere.write_text('path,text,aesthetic\ncats/b.png,"a cat, sitting",5.1\ndogs/d.jpg,"a ""good"" dog",4\n')
    caps, counts = read_captions(root, FILES, str(elsewhere))
    assert caps == [None, "a cat, sitting", None, 'a "good" dog']
    assert counts == {"missing": 2, "unused_entries": 0, "duplicate_entries": 0}


@pytest.mark.parametrize("name, text, error, message", [
    ("m.jsonl", '{"file": "cats/a.jpg", "caption": "x"}\n{"file": "cats/b.png", "caption": \n', ValueError,
     r"m.jsonl:2: not valid JSON"),
    ("m.jsonl", '{"file": "cats/a.jpg"}\n', ValueError, r"m.jsonl:1: no caption \('caption' or 'text'\); keys are "
                                                       r"\['file'\]"),
    ("m.jsonl", '["cats/a.jpg", "x"]\n', ValueError, r"m.jsonl:1: expected a JSON object"),
    ("m.jsonl", '{"file": "cats/a.jpg", "caption": null}\n', ValueError, r"m.jsonl:1: caption must be a string"),
    ("m.csv", "file,label\ncats/a.jpg,3\n", ValueError, r"m.csv:1: the header has no caption column \(caption or "
                                                        r"text\); it has \['file', 'label'\]"),
    ("m.csv", "file,caption\ncats/a.jpg,x\ncats/b.png\n", ValueError, r"m.csv:3: no caption"),
    ("m.tsv", "", ValueError, "captions source 'm.tsv': use sidecar, a .jsonl manifest or a .csv manifest"),
])
def test_bad_manifests(root, name, text, error, message):
    if name != "m.tsv":
        (root / name).write_text(text)
    with pytest.raises(error, match=message):
        read_captions(root, FILES, name)


def test_a_missing_manifest_is_named(root):
    with pytest.raises(FileNotFoundError, match=r"caption manifest .*/nope.jsonl not found \(data.captions=nope.jsonl; a relative path is read "
                                                r"from the data root"):
        read_captions(root, FILES, "nope.jsonl")
