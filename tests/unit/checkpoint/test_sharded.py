"""The pieces of a sharded checkpoint (vitp.checkpoint.sharded): every element of a rank's TP
shard or ZeRO fragment lands at its place in the full tensor, DCP reads them back into another
split, and replicated pieces are written once, spread over their holders."""
import math
import random

import pytest
import torch

from vitp.checkpoint.sharded import Place, balanced_dedup, boxes, flat_boxes, piece_tensor, piece_view, read_full
from vitp.parallel.layers import shard_tensor


def test_flat_ranges_are_cut_into_contiguous_boxes():
    rng = random.Random(1)
    for _ in range(500):
        shape = [rng.randint(1, 4) for _ in range(rng.randint(1, 4))]
        n = math.prod(shape)
        a = rng.randint(0, n)
        b = rng.randint(a, n)
        covered = []
        full = torch.arange(n).view(shape)
        for off, size in flat_boxes(shape, a, b):
            idx = full[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1).tolist()
            assert idx == list(range(idx[0], idx[0] + len(idx)))  # contiguous
            covered += idx
        assert covered == list(range(a, b))
        assert len(flat_boxes(shape, a, b)) <= max(1, 2 * len(shape) - 1)


@pytest.mark.parametrize("seed", range(3))
def test_every_element_of_a_tp_shard_fragment_lands_at_its_place(seed):
    """Shards of timm's fused qkv (stride 3), a packed GLU (stride 2) and row-parallel weights, cut
    into random flat fragments (ZeRO partitions), fill the full tensor exactly once."""
    rng = random.Random(seed)
    for _ in range(150):
        nd = rng.randint(1, 3)
        full = [rng.randint(1, 4) for _ in range(nd)]
        tp, stride, dim = rng.choice([2, 3, 4]), rng.choice([1, 2, 3]), rng.randrange(nd)
        full[dim] *= tp * stride * rng.randint(1, 2)
        F = torch.arange(math.prod(full)).view(full)
        out = torch.full_like(F, -1)
        for r in range(tp):
            local = shard_tensor(F, dim, stride, tp, r).reshape(-1)
            n = local.numel()
            edges = [0, *sorted(rng.sample(range(1, n), min(3, n - 1))), n] if n > 1 else [0, n]
            for a, b in zip(edges, edges[1:]):
                for g, z, where in boxes(Place(tuple(full), dim, stride, tp, r), a, b - a):
                    region = out[tuple(slice(o, o + k) for o, k in zip(g, z))]
                    assert (region == -1).all()  # written once
                    region.copy_(piece_view(local[a:b], where))
        assert torch.equal(out, F), (full, tp, stride, dim)


def test_a_contiguous_split_of_qkv_is_not_what_the_pieces_describe():
    """The guard of invariant 1 (timm's qkv is [Q | K | V]): rank 1's qkv shard taken as the
    second contiguous half of the rows lands on the wrong rows."""
    full = torch.arange(6 * 2).view(6, 2)  # Q, K, V of 2 rows each
    wrong = full.chunk(2, 0)[1].reshape(-1)  # rows 3..5: not rank 1's heads
    right = shard_tensor(full, 0, 3, 2, 1).reshape(-1)
    place = Place((6, 2), 0, 3, 2, 1)
    rebuilt = torch.full_like(full, -1)
    for g, z, where in boxes(place):
        rebuilt[g[0]:g[0] + z[0]] = piece_view(wrong, where)
    assert not torch.equal(rebuilt[rebuilt >= 0], full[rebuilt >= 0])
    for g, z, where in boxes(place):
        rebuilt[g[0]:g[0] + z[0]] = piece_view(right, where)
    assert torch.equal(rebuilt[rebuilt >= 0], full[rebuilt >= 0])


def test_a_tp_shard_fragment_is_read_back_through_dcp(tmp_path):
    """One process saves a full qkv-like tensor (DCP, no process group); reading the fragment
    [5, 17) of tp rank 1's shard (stride 3, tp 2) returns exactly those elements of the shard,
    and reads a few hundred bytes, not the whole tensor."""
    import torch.distributed.checkpoint as dcp

    from vitp.checkpoint.sharded import load_pieces

    F = torch.randn(12, 8)
    dcp.save({"ema/qkv": piece_tensor(F.reshape(-1).clone(), Place((12, 8)))}, checkpoint_id=str(tmp_path),
             no_dist=True)
    assert torch.equal(read_full(tmp_path, "ema")["qkv"], F)
    buf = torch.zeros(12)
    nbytes = load_pieces(tmp_path, {"ema/qkv": piece_tensor(buf, Place((12, 8), 0, 3, 2, 1), 5)})
    assert torch.equal(buf, shard_tensor(F, 0, 3, 2, 1).reshape(-1)[5:17])
    from vitp.checkpoint.sharded import read_metadata

    stored = [info.length for info in read_metadata(tmp_path).storage_data.values()]
    assert len(boxes(Place((12, 8), 0, 3, 2, 1), 5, 12)) > 1 and nbytes == sum(stored)  # the stored piece once


def test_replicated_pieces_are_written_once_and_spread():
    """Four ranks; ranks 0/1 and 2/3 hold the same two 1000-byte pieces (replicas), each rank has a
    unique 100-byte piece: every replicated piece goes to one holder, and the writers stay balanced
    (DCP's own dedup walks the plans in order and gives rank 1 both of ranks 0/1's pieces here)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    def item(fqn, numel):
        chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([numel]))
        props = TensorProperties.create_from_tensor(torch.zeros(1, dtype=torch.uint8))
        return WriteItem(index=MetadataIndex(fqn, torch.Size([0])), type=WriteItemType.SHARD,
                         tensor_data=TensorWriteData(chunk=chunk, properties=props, size=torch.Size([numel])))

    plans = [SavePlan([item(f"own{r}", 100), item(f"w{r // 2}a", 1000), item(f"w{r // 2}b", 1000)]) for r in range(4)]
    out = balanced_dedup(plans)
    written = [sum(w.tensor_storage_size() for w in p.items) for p in out]
    assert written == [1100, 1100, 1100, 1100]
    fqns = [w.index.fqn for p in out for w in p.items]
    assert sorted(fqns) == sorted(["own0", "own1", "own2", "own3", "w0a", "w0b", "w1a", "w1b"])


def test_a_damaged_file_of_the_same_size_is_refused_naming_it(tmp_path):
    """Bytes overwritten in a data file or in .metadata (sizes unchanged, so the manifest check
    passes): reading refuses, naming the file (not torch's unpickling advice)."""
    import torch.distributed.checkpoint as dcp

    F = torch.randn(8, 8)
    dcp.save({"ema/w": piece_tensor(F.reshape(-1).clone(), Place((8, 8)))}, checkpoint_id=str(tmp_path), no_dist=True)
    data = next(tmp_path.glob("__0_*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[:64] = bytes(range(64))
    data.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=rf"checkpoint file {data} is corrupt: its piece of ema/w .*does not load"):
        read_full(tmp_path, "ema")
    meta = tmp_path / ".metadata"
    meta.write_bytes(bytes(len(meta.read_bytes())))
    with pytest.raises(ValueError, match=rf"checkpoint file {meta} is corrupt or not a checkpoint's metadata"):
        read_full(tmp_path, "ema")


@pytest.mark.parametrize("damage", [False, True])
def test_compressed_pieces_read_back_exactly_and_drop_the_framing(tmp_path, damage):
    """``trainer.checkpoint_compress`` (on for LoRA runs): 48 adapter-sized pieces (8 x 512 fp32,
    a rank-8 LoRA's A of a 512-wide linear) written through DCP's ZStandard extension read back
    bit for bit through vitp's reader; the data file is at most 1.01x the tensor bytes, where
    the same pieces uncompressed carry ``torch.save``'s framing (over 1.09x). A damaged compressed
    piece is refused naming the file."""
    import torch.distributed.checkpoint as dcp

    from vitp.checkpoint.training import _compression

    g = torch.Generator().manual_seed(0)
    full = {f"model/b{i}.lora_A": 0.02 * torch.randn(8, 512, generator=g) for i in range(48)}
    sizes = {}
    for name, ext in (("plain", None), ("zstd", _compression())):
        out = tmp_path / name
        writer = dcp.FileSystemWriter(str(out), _extensions=ext)
        dcp.save({k: piece_tensor(v.reshape(-1).clone(), Place((8, 512))) for k, v in full.items()},
                 storage_writer=writer, no_dist=True)
        sizes[name] = sum(p.stat().st_size for p in out.glob("*.distcp"))
    tensor_bytes = 48 * 8 * 512 * 4
    assert sizes["plain"] > 1.09 * tensor_bytes and sizes["zstd"] <= 1.01 * tensor_bytes, sizes
    data = next((tmp_path / "zstd").glob("__0_*.distcp"))
    if damage:
        raw = bytearray(data.read_bytes())
        raw[40:104] = bytes(range(64))
        data.write_bytes(bytes(raw))
        with pytest.raises(ValueError, match=rf"checkpoint file {data} is corrupt"):
            read_full(tmp_path / "zstd", "model")
        return
    got = read_full(tmp_path / "zstd", "model")
    assert got.keys() == {k[len("model/"):] for k in full}
    assert all(torch.equal(got[k[len("model/"):]], v) for k, v in full.items())
