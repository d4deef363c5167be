"""``vitp-encode-captions`` (vitp/cli/encode_captions.py) on the tiny T5, captions from ``--captions FILE``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vitp.cli.encode_captions import main
from vitp.text import TextEmbeddings, TextEncoder

REPO = Path(__file__).resolve().parents[3]


def _run(capsys, *args):
    """``(exit status, stdout, stderr)`` of ``vitp-encode-captions args``."""
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_encode_a_caption_file_then_rerun(tiny_path, tmp_path, capsys):
    caps = tmp_path / "caps.txt"
    caps.write_text("a red cube\n two cats \na red cube\n\n" + "a caption longer than twenty bytes\n")
    out = tmp_path / "emb"
    code, stdout, _ = _run(capsys, "--encoder", tiny_path, "--captions", caps, "--out", out, "--max-length", 20,
                           "--shard-size", 2, "--batch-size", 1, "--device", "cpu")
    assert code == 0
    lines = stdout.splitlines()
    assert lines[0] == (f"5 captions from {caps}: 3 unique + the empty caption (id 0) = 4 stored; 1 truncated at "
                        f"20 tokens")
    assert lines[1].startswith("2 shards, ") and "(float32, 32 channels, encoder tiny-t5); encoded 4 captions in" in lines[1]
    assert lines[2:] == [f"store: {out}", f"train with: data.text_embeddings={out}"]
    emb = TextEmbeddings(out)
    assert [emb.caption(i) for i in range(len(emb))] == ["", "a red cube", "two cats",
                                                          "a caption longer than twenty bytes"]
    ref, _ = TextEncoder(tiny_path, max_length=20).encode(["two cats"])
    torch.testing.assert_close(emb.get([2])[0], ref, rtol=1e-5, atol=1e-6)
    code, stdout, err = _run(capsys, "--encoder", tiny_path, "--captions", caps, "--out", out, "--max-length", 20,
                             "--shard-size", 2)
    assert code == 0 and "nothing to encode: the store was already complete" in stdout
    assert "is complete (4 captions, the same captions and encoder): nothing to encode" in err


def test_jsonl_bfloat16_and_overwrite(tiny_path, tmp_path, capsys):
    caps = tmp_path / "caps.jsonl"
    caps.write_text(json.dumps({"caption": "snow", "file": "a.jpg"}) + "\n\n" + json.dumps({"caption": "sun"}) + "\n")
    out = tmp_path / "emb"
    assert _run(capsys, "--encoder", tiny_path, "--captions", caps, "--out", out, "--dtype", "bfloat16")[0] == 0
    emb = TextEmbeddings(out)
    assert (len(emb), emb.dtype, emb.max_length) == (3, "bfloat16", 120)
    caps.write_text(json.dumps({"caption": "rain"}) + "\n")
    code, _, err = _run(capsys, "--encoder", tiny_path, "--captions", caps, "--out", out)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"vitp-encode-captions: error: {out} holds embeddings of another caption list (3 captions "
                          f"stored, 2 given, counting the empty caption); dtype bfloat16, not float32; pick another")
    assert _run(capsys, "--encoder", tiny_path, "--captions", caps, "--out", out, "--overwrite")[0] == 0
    assert TextEmbeddings(out).caption(1) == "rain"


@pytest.mark.parametrize("args, message", [
    (["--captions", "{tmp}/caps.csv", "--out", "{tmp}/o"], "--captions {tmp}/caps.csv: use a .txt file"),
    (["--captions", "{tmp}/bad.jsonl", "--out", "{tmp}/o"], "{tmp}/bad.jsonl:2: not valid JSON"),
    (["--captions", "{tmp}/none.txt", "--out", "{tmp}/o"], "--captions {tmp}/none.txt not found"),
    (["--captions", "{tmp}/bad.jsonl"], "no output folder: pass --out DIR or set data.text_embeddings=DIR"),
    (["--captions", "{tmp}/bad.jsonl", "--out", "{tmp}/o", "--batch-size", "0"], "--batch-size 0: use a positive"),
    # a store of the null caption alone was written, and named to train with
    (["--captions", "{tmp}/blank.txt", "--out", "{tmp}/o"], "--captions {tmp}/blank.txt holds no caption (empty"),
])
def test_bad_input_is_one_line(tiny_path, tmp_path, capsys, args, message):
    (tmp_path / "bad.jsonl").write_text('{"caption": "a"}\n{"caption": \n')
    (tmp_path / "blank.txt").write_text("\n  \n")
    code, _, err = _run(capsys, "--encoder", tiny_path, *[a.format(tmp=tmp_path) for a in args])
    assert code == 2 and err.startswith(f"vitp-encode-captions: error: {message.format(tmp=tmp_path)}")
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_missing_encoder_exits_2_with_one_line(tmp_path):
    (tmp_path / "caps.txt").write_text("a cat\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "vitp.cli.encode_captions", "--encoder", str(tmp_path / "t5-v1_1-xxl"),
                        "--captions", str(tmp_path / "caps.txt"), "--out", str(tmp_path / "emb")],
                       capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == (f"vitp-encode-captions: error: text encoder {tmp_path / 't5-v1_1-xxl'} does not exist: give "
                        f"a local folder saved with save_pretrained or a downloaded snapshot (e.g. hf "
                        f"download google/t5-v1_1-xxl --local-dir {tmp_path / 't5-v1_1-xxl'}); vitp never downloads\n")
    assert not (tmp_path / "emb").exists()
