"""Start-up on one node of 8 ranks: the node's first rank does the per-data-set work, the others map it.

One spawned group of 8 gloo processes (``LOCAL_RANK`` = rank, one node) builds, through
:func:`vitp.train.trainer.node_first` as the trainer does:

- a captioned video pack (sparse shards, a ~3 MiB ``captions.jsonl`` of long captions) with the
  caption ids of a caption store (:class:`vitp.data.text.CaptionIds`): ranks 1-7 must read at
  most 1 MiB of it (bytes passed by ``read`` calls, ``rchar`` of ``/proc/self/io``, plus the
  pages of its memory mapping resident in the process, ``Rss`` of ``/proc/self/smaps``);
- a video folder of 4 clips with a cold probe cache: rank 0 probes every file, ranks 1-7 none.

Every rank gets the same caption ids, and they are the store's ids of the items' captions.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from vitp.parallel.local_group import run_local_group
from vitp.utils import free_port

WORLD, SAMPLES, DISTINCT = 8, 20000, 40
BUDGET = 1 << 20  # bytes of the captions file a rank other than the node's first may read


def _caption(k: int) -> str:
    return f"caption {k}: " + "a long description of a short clip, " * 4


def _pack(out: Path) -> None:
    """A captioned synthetic video pack (metadata written by vitp-pack's writer, sparse shards)."""
    from vitp.data.pack import shard_name, write_metadata

    out.mkdir(parents=True)
    n, per = SAMPLES, 1000
    frames = (np.arange(n) % 8 + 16).astype(np.int32)
    held = np.arange(n) % 10 == 0
    arrays = {"label": (np.arange(n) % 2).astype(np.int64), "heldout": held.astype(np.uint8),
              "height": np.full(n, 16, np.int32), "width": np.full(n, 16, np.int32), "frames": frames,
              "fps": np.full(n, 24.0, np.float32), "heldout_from": np.where(held, 0, frames).astype(np.int32),
              "orientation": np.zeros(n, np.int8)}
    shardlist = []
    for k, a in enumerate(range(0, n, per)):
        with open(out / shard_name(k), "wb") as f:
            f.truncate(1024 * per)
        shardlist.append({"url": shard_name(k), "nsamples": per, "filesize": 1024 * per})
    write_metadata(out, arrays, [_caption(i % DISTINCT) for i in range(n)], shardlist, cfg_data={"name": "synthetic"},
                   seed=0, per_shard=per, kind="video", classes=["a", "b"], skipped={}, orientations=[],
                   text_store=None)


def _kb(field: str, where: str = "/proc/self/status") -> int:
    return int(next(x for x in Path(where).read_text().splitlines() if x.startswith(field)).split()[1])


def _mapped(name: str) -> int:
    """Bytes of the file ``name`` resident in this process's memory mappings (``/proc/self/smaps``)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's header line
            inside = line.endswith(name)
        elif inside and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total


def _rank(rank: int, port: int, tmp: str) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), VITP_CACHE_DIR=f"{tmp}/cache")
    import torch

    from vitp.cli.overrides import compose_checked
    from vitp.data import build_datasets
    from vitp.data.text import CaptionIds
    from vitp.parallel import distributed as dist
    from vitp.text.store import TextEmbeddings
    from vitp.train.trainer import node_first

    dist.init_distributed(torch.device("cpu"))
    pack = compose_checked(["data=shards", f"data.shards={tmp}/pack", "data.num_classes=2", "data.resolution=16",
                            "data.num_frames=8", "data.frame_stride=2"]).data
    rchar = _kb("rchar", "/proc/self/io")
    train, held = node_first(lambda: build_datasets(pack, 0))
    store = TextEmbeddings(f"{tmp}/store")
    train, held = node_first(lambda: [CaptionIds(d, store) for d in (train, held)])
    read = _kb("rchar", "/proc/self/io") - rchar
    mapped = _mapped("pack/captions.jsonl") + _mapped("store/captions.jsonl")
    folder = compose_checked(["data=video_folder", f"data.root={tmp}/clips", "data.num_classes=2",
                              "data.resolution=16", "data.num_frames=4", f"data.cache_dir={tmp}/probes"]).data
    vtrain, _ = node_first(lambda: build_datasets(folder, 0))
    picks = np.arange(0, len(train), 997)
    out = {"read": read, "mapped": mapped, "probes": vtrain.base.probe_count, "ids": np.asarray(train.ids[picks]),
           "captions": [train.captions[int(i)] for i in picks[:5]], "items": (len(train), len(held))}
    dist.barrier()
    return out


def test_ranks_other_than_the_nodes_first_map_what_it_wrote(tmp_path):
    from tests.distributed.test_text_data import _clip
    from vitp.text import TextEncoder
    from vitp.text.store import write_store
    from vitp.text.tiny import make_tiny_encoder

    _pack(tmp_path / "pack")
    assert (tmp_path / "pack" / "captions.jsonl").stat().st_size > 3 * BUDGET
    enc = TextEncoder(str(make_tiny_encoder(tmp_path / "enc")), max_length=8)
    write_store(tmp_path / "store", [_caption(k) for k in range(DISTINCT)], enc, progress=False)
    for k, color in enumerate([(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30)]):
        (tmp_path / "clips" / "ab"[k % 2]).mkdir(parents=True, exist_ok=True)
        _clip(tmp_path / "clips" / "ab"[k % 2] / f"c{k}.mp4", color)
    res = run_local_group(WORLD, _rank, free_port(), str(tmp_path), timeout=600)
    assert res[0]["probes"] == 4 and [r["probes"] for r in res[1:]] == [0] * (WORLD - 1)
    for r in res[1:]:
        assert r["read"] + r["mapped"] <= BUDGET, (r["read"], r["mapped"])
    assert res[0]["read"] + res[0]["mapped"] > 3 * BUDGET  # the first rank read the captions: the bound means something
    store = __import__("vitp.text.store", fromlist=["TextEmbeddings"]).TextEmbeddings(tmp_path / "store")
    for r in res:
        assert np.array_equal(r["ids"], res[0]["ids"]) and r["items"] == res[0]["items"]
    assert [store.caption(int(i)) for i in res[0]["ids"][:5]] == res[0]["captions"]
    print({r_: (r["read"], r["mapped"]) for r_, r in enumerate(res)})
