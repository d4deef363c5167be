"""The caption-embedding store (vitp/text/store.py): round trip, ids, resuming, the checks at open."""
from __future__ import annotations

import json
import logging
import pickle

import numpy as np
import pytest
import torch

from tests.unit.text.conftest import MAX_LENGTH
from vitp.text import TextEmbeddings, TextEncoder, make_tiny_encoder, write_store
from vitp.text.store import INDEX, PARTIAL

CAPTIONS = ["a red cube", "two cats", "a red cube", "", "a dog on a skateboard", "snow", "two cats", "sunset",
            "a very long caption that is cut"]
UNIQUE = ["", "a red cube", "two cats", "a dog on a skateboard", "snow", "sunset", "a very long caption that is cut"]


def _shard(path):
    """A shard's metadata and tensors as plain values (the header's key order is not fixed)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.metadata(), {k: f.get_tensor(k).float().tolist() for k in f.keys()}


def _shard_bytes(data, tmp_path):
    (tmp_path / "copy.safetensors").write_bytes(data)
    return _shard(tmp_path / "copy.safetensors")


@pytest.fixture
def store(tmp_path, tiny):
    out = tmp_path / "emb"
    return out, write_store(out, CAPTIONS, tiny, batch_size=2, shard_size=3, progress=False)


def test_round_trip_ids_and_the_null_caption(store, tiny):
    out, index = store
    assert json.loads((out / INDEX).read_text()) == index and not (out / PARTIAL).exists()
    assert index["num_captions"] == 7 and index["null_id"] == 0 and index["num_truncated"] == 2
    assert [(s["file"], s["first"], s["count"]) for s in index["shards"]] == [
        ("shard-00000.safetensors", 0, 3), ("shard-00001.safetensors", 3, 3), ("shard-00002.safetensors", 6, 1)]
    lines = [json.loads(x) for x in (out / "captions.jsonl").read_text().splitlines()]
    assert lines == [{"id": i, "caption": c} for i, c in enumerate(UNIQUE)]
    emb = TextEmbeddings(out)
    assert (len(emb), emb.dim, emb.max_length, emb.null_id, emb.dtype) == (7, 32, MAX_LENGTH, 0, "float32")
    assert emb.encoder == tiny.record and emb.caption(3) == "a dog on a skateboard"
    assert emb.ids_of(CAPTIONS).tolist() == [1, 2, 1, 0, 3, 4, 2, 5, 6]
    ids = [6, 0, 2, 2, 5]
    got, mask = emb.get(torch.tensor(ids))
    ref, ref_mask = tiny.encode([UNIQUE[i] for i in ids])
    assert got.dtype == torch.float32 and got.shape == (5, MAX_LENGTH, 32)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(mask, ref_mask) and mask[1].sum() == 1  # id 0: the encoded "" (</s> alone)
    with pytest.raises(KeyError, match=r"caption 'a blue cube' is not in the text embeddings at .*emb \(7 captions\); "
                                       r"re-run vitp-encode-captions"):
        emb.id_of("a blue cube")
    with pytest.raises(IndexError, match=r"caption ids \[7\] are outside \[0, 7\)"):
        emb.get([1, 7])


def test_bfloat16_store(tmp_path, tiny):
    index = write_store(tmp_path / "bf", CAPTIONS[:3], tiny, progress=False, dtype="bfloat16")
    emb = TextEmbeddings(tmp_path / "bf")
    got, _ = emb.get([1])
    ref, _ = tiny.encode(["a red cube"])
    assert index["dtype"] == emb.dtype == "bfloat16" and got.dtype == torch.float32
    assert torch.equal(got, ref.bfloat16().float())
    with pytest.raises(ValueError, match="dtype 'float16': a store holds bfloat16 or float32"):
        write_store(tmp_path / "f16", CAPTIONS, tiny, progress=False, dtype="float16")


def test_lookup_reads_lines_not_the_whole_captions_file(store, monkeypatch):
    """A reader finds ids and captions through the offset and hash files (one line read per
    lookup), never loading the captions file whole; a store without them (an older vitp's) is
    read whole and gives the same answers, and a rerun of the encode adds them."""
    from vitp.text.store import HASHES, HASH_IDS, OFFSETS

    out, _ = store
    emb = TextEmbeddings(out)
    monkeypatch.setattr(TextEmbeddings, "_load_captions", lambda self: pytest.fail("read every caption"))
    assert [emb.id_of(c) for c in UNIQUE] == list(range(len(UNIQUE))) and emb.caption(3) == UNIQUE[3]
    assert "no such caption" not in emb and "" in emb and emb.ids_of(UNIQUE[::-1]).tolist() == list(range(7))[::-1]
    with pytest.raises(KeyError, match="caption 'no such caption' is not in the text embeddings"):
        emb.id_of("no such caption")
    monkeypatch.undo()
    for name in (OFFSETS, HASHES, HASH_IDS):
        (out / name).unlink()
    old = TextEmbeddings(out)
    assert [old.id_of(c) for c in UNIQUE] == list(range(len(UNIQUE))) and old.caption(3) == UNIQUE[3]


def test_a_cut_short_captions_file_is_one_line_naming_it(store, tmp_path):
    """A store whose captions.jsonl was cut short: the lookup files no longer fit it (read whole
    instead, with a warning) and reading it whole stops with one line naming the file and the fix."""
    import shutil

    out, _ = store
    cut = tmp_path / "cut"
    shutil.copytree(out, cut)
    data = (cut / "captions.jsonl").read_bytes()
    (cut / "captions.jsonl").write_bytes(data[:len(data) - 10])
    emb = TextEmbeddings(cut)
    with pytest.raises(ValueError, match=r"cut/captions.jsonl is damaged \(JSONDecodeError: .*\); re-run "
                                         r"vitp-encode-captions with --overwrite"):
        emb.id_of("two cats")


def test_resume_after_a_kill_keeps_finished_shards(tmp_path, tiny, monkeypatch, store):
    out, full = store
    part = tmp_path / "part"
    encode, seen = tiny.encode, []

    def dies_in_the_second_shard(caps):
        if "a dog on a skateboard" in caps:
            raise KeyboardInterrupt  # stands for the kill
        seen.extend(caps)
        return encode(caps)

    monkeypatch.setattr(tiny, "encode", dies_in_the_second_shard)
    with pytest.raises(KeyboardInterrupt):
        write_store(part, CAPTIONS, tiny, batch_size=2, shard_size=3, progress=False)
    assert seen == UNIQUE[:3] and not (part / INDEX).exists() and (part / PARTIAL).exists()
    assert sorted(p.name for p in part.iterdir()) == ["captions.hash.npy", "captions.hash_ids.npy", "captions.idx.npy",
                                                      "captions.jsonl", INDEX.replace(".json", ".partial.json"),
                                                      "shard-00000.safetensors"]
    with pytest.raises(FileNotFoundError, match=r"index.json not found: run vitp-encode-captions --encoder ENCODER "
                                                r"--out .*part first; .*index.partial.json shows an interrupted encode"):
        TextEmbeddings(part)
    first_shard = (part / "shard-00000.safetensors").stat().st_mtime_ns
    seen.clear()
    monkeypatch.setattr(tiny, "encode", lambda caps: (seen.extend(caps), encode(caps))[1])
    resumed = write_store(part, CAPTIONS, tiny, batch_size=2, shard_size=3, progress=False)
    assert seen == UNIQUE[3:]  # the first shard was not encoded again
    assert (part / "shard-00000.safetensors").stat().st_mtime_ns == first_shard
    assert resumed == full and not (part / PARTIAL).exists()
    for s in full["shards"]:
        assert _shard(part / s["file"]) == _shard(out / s["file"])


def test_rerun_is_a_no_op_and_other_settings_are_refused(store, tiny, tiny_path, tmp_path, caplog, monkeypatch):
    out, index = store
    monkeypatch.setattr(tiny, "encode", lambda caps: pytest.fail("a complete store was encoded again"))
    with caplog.at_level(logging.INFO, logger="vitp.text.store"):
        assert write_store(out, CAPTIONS, tiny, shard_size=3, progress=False) == index
    assert "is complete (7 captions, the same captions and encoder): nothing to encode" in caplog.text
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"emb holds embeddings of another caption list \(7 captions stored, 3 given, "
                                         r"counting the empty caption\); pick another output folder or replace "
                                         r"it \(vitp-encode-captions --overwrite\)"):
        write_store(out, ["a", "b"], tiny, shard_size=3, progress=False)
    with pytest.raises(ValueError, match="shard_size 3, not 4096"):
        write_store(out, CAPTIONS, tiny, progress=False)
    other = TextEncoder(make_tiny_encoder(tmp_path / "wide", d_model=48), max_length=MAX_LENGTH)
    with pytest.raises(ValueError, match=r"embeddings made by encoder tiny-t5 \(32 channels, config [0-9a-f]{12}\), "
                                         r"not by wide \(48 channels"):
        write_store(out, CAPTIONS, other, shard_size=3, progress=False)
    index2 = write_store(out, ["a", "b"], other, progress=False, overwrite=True)
    assert index2["num_captions"] == 3 and TextEmbeddings(out).dim == 48
    assert sorted(p.name for p in out.iterdir()) == ["captions.hash.npy", "captions.hash_ids.npy", "captions.idx.npy",
                                                     "captions.jsonl", "index.json", "shard-00000.safetensors"]


def test_a_damaged_shard_is_refused_at_open_and_re_encoded_by_a_rerun(store, tiny, tmp_path):
    out, index = store
    shard = out / "shard-00001.safetensors"
    good = shard.read_bytes()
    shard.write_bytes(good[:-100])
    with pytest.raises(ValueError, match=r"shard-00001.safetensors is \d+ bytes, the index records \d+ \(truncated or "
                                         r"replaced\); re-run the vitp-encode-captions command that made"):
        TextEmbeddings(out)
    shard.write_bytes(b"\xff" * len(good))  # the right size, an unreadable header
    with pytest.raises(ValueError, match="shard-00001.safetensors cannot be read as safetensors"):
        TextEmbeddings(out)
    assert write_store(out, CAPTIONS, tiny, batch_size=2, shard_size=3, progress=False) == index
    assert _shard(shard) == _shard_bytes(good, tmp_path)
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=r"shard-00001.safetensors \(listed in .*index.json\) is missing"):
        TextEmbeddings(out)


def test_format_version_and_encoder_checks(store, tiny, tmp_path):
    out, index = store
    with pytest.raises(FileNotFoundError, match=r"nowhere/index.json not found: run vitp-encode-captions "
                                                r"--encoder ENCODER --out .*nowhere first \(if the store moved, point "
                                                r"data.text_embeddings at its new folder\)$"):
        TextEmbeddings(tmp_path / "nowhere")
    (out / INDEX).write_text(json.dumps({**index, "version": 2}))
    with pytest.raises(ValueError, match="version 2, this vitp reads version 1; re-encode"):
        TextEmbeddings(out)
    (out / INDEX).write_text(json.dumps({**index, "format": "something-else"}))
    with pytest.raises(ValueError, match="format 'something-else' is not 'vitp-text-embeddings'"):
        TextEmbeddings(out)
    (out / INDEX).write_text(json.dumps(index))
    assert TextEmbeddings(out, expect={"hidden_size": 32, "config_sha256": tiny.record["config_sha256"]}).dim == 32
    with pytest.raises(ValueError, match=r"emb: embeddings made by encoder tiny-t5 \(32 channels, config "
                                         r"[0-9a-f]{12}\), not by the run's encoder t5-v1_1-xxl \(4096 channels\): "
                                         r"they differ in hidden_size, name"):
        TextEmbeddings(out, expect={"name": "t5-v1_1-xxl", "hidden_size": 4096})
    with pytest.raises(ValueError, match=r"unknown keys \['width'\]"):
        TextEmbeddings(out, expect={"width": 32})


def test_it_pickles_for_dataloader_workers(store):
    out, _ = store
    emb = TextEmbeddings(out)
    ref = emb.get([1, 4, 6])
    assert emb._handles  # open shards are not pickled: each process opens its own
    copy = pickle.loads(pickle.dumps(emb))
    assert copy._handles == {} and copy.caption(4) == "snow"
    got = copy.get([1, 4, 6])
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    loader = torch.utils.data.DataLoader(np.arange(7), batch_size=4, num_workers=2,
                                         collate_fn=lambda ids: emb.get(ids)[0])
    batches = list(loader)
    torch.testing.assert_close(torch.cat(batches), emb.get(np.arange(7))[0], rtol=0, atol=0)


def test_a_data_folder_is_never_used_as_the_store(tmp_path, tiny):
    """--out at a folder holding other files (a data root with its captions.jsonl manifest) is
    refused, even with overwrite, and nothing there changes."""
    (tmp_path / "captions.jsonl").write_text('{"file": "a.png", "caption": "a cat"}\n')
    with pytest.raises(ValueError, match="holds other files and no text-embedding store; give an empty or new folder"):
        write_store(tmp_path, ["a cat"], tiny, progress=False, overwrite=True)
    assert (tmp_path / "captions.jsonl").read_text() == '{"file": "a.png", "caption": "a cat"}\n'
