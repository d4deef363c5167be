"""Packed data sets read from ``s3://`` (vitp.data.shards: read_bytes, the listing check, the wids
download handler s3_download), against moto's S3-compatible server on localhost (no AWS, no network):
boto3 reaches it through ``AWS_ENDPOINT_URL`` as it would reach MinIO or another S3 endpoint."""
from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path

import pytest
import torch

pytest.importorskip("moto")
boto3 = pytest.importorskip("boto3")

from moto.server import ThreadedMotoServer  # noqa: E402

from tests.helpers import compose_cfg  # noqa: E402
from vitp.data import shards as shards_mod  # noqa: E402
from vitp.data.base import StorageError  # noqa: E402
from vitp.data.build import build_datasets  # noqa: E402
from vitp.utils import free_port  # noqa: E402

BUCKET, PREFIX = "vitp-data", "packs/digits"
SHARDS = 4  # 1797 digits at 500 samples per shard


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's server with the digits packed locally and uploaded under s3://BUCKET/PREFIX; yields
    ``(client, local pack folder)`` with the AWS variables pointing boto3 at the server."""
    from vitp.cli.pack import run as pack

    local = tmp_path_factory.mktemp("pack") / "digits"
    pack([str(local), "--quiet", "--samples-per-shard", "500"])
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the server's line per request
    with pytest.MonkeyPatch.context() as mp:
        for k in [k for k in os.environ if k.startswith("AWS_")]:
            mp.delenv(k)  # the user's profile / endpoint must not leak in
        mp.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_CONFIG_FILE", os.devnull)
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        client = boto3.client("s3")
        client.create_bucket(Bucket=BUCKET)
        for f in sorted(local.iterdir()):
            client.upload_file(str(f), BUCKET, f"{PREFIX}/{f.name}")
        yield client, local
    server.stop()


def _copy_prefix(client, dst: str) -> str:
    """A copy of the uploaded pack under ``dst`` (server-side), to damage; returns its URL."""
    for o in client.list_objects_v2(Bucket=BUCKET, Prefix=PREFIX + "/")["Contents"]:
        name = o["Key"].rsplit("/", 1)[1]
        client.copy_object(Bucket=BUCKET, Key=f"{dst}/{name}", CopySource={"Bucket": BUCKET, "Key": o["Key"]})
    return f"s3://{BUCKET}/{dst}"


def _data_cfg(url, cache):
    return compose_cfg(["data=shards", f"data.shards={url}", "data.num_classes=10",
                        f"data.shard_cache={cache}"]).data


def _cache_files(cache: Path):
    return sorted(p.name for p in cache.rglob("*") if p.is_file())


def _read(ds, i):
    """Item ``i`` of a dataset pickled and restored, as a DataLoader worker under spawn gets it."""
    return pickle.loads(pickle.dumps(ds))[i]


def test_s3_items_equal_the_local_pack_and_download_each_shard_once(s3, tmp_path):
    client, local = s3
    cache = tmp_path / "cache"
    train, held = build_datasets(_data_cfg(f"s3://{BUCKET}/{PREFIX}", cache), seed=0)
    ref_train, ref_held = build_datasets(_data_cfg(str(local), tmp_path / "unused"), seed=0)
    assert (len(train), len(held)) == (len(ref_train), len(ref_held)) == (1438, 359)
    assert not cache.exists() or _cache_files(cache) == []  # start-up reads the manifest only
    picks = [0, 1, 437, 438, 900, len(train) - 1]  # items in every shard, twice in shard 0
    for i in picks:
        x, y = train[i]
        rx, ry = ref_train[i]
        assert torch.equal(x, rx) and y == ry
    x, y = held[5]
    assert torch.equal(x, ref_held[5][0]) and y == ref_held[5][1]
    files = _cache_files(cache)
    assert files == [f"shard-{k:06d}.tar" for k in range(SHARDS)], files  # no .part / .lock left
    for f in cache.rglob("*.tar"):
        assert f.stat().st_size == (local / f.name).stat().st_size
    mtimes = {f: f.stat().st_mtime_ns for f in cache.rglob("*.tar")}
    train2, _ = build_datasets(_data_cfg(f"s3://{BUCKET}/{PREFIX}", cache), seed=0)  # a new reader
    assert torch.equal(train2[900][0], ref_train[900][0])
    assert {f: f.stat().st_mtime_ns for f in cache.rglob("*.tar")} == mtimes  # read from the cache
    stale = next(cache.rglob("shard-000001.tar"))
    stale.write_bytes(stale.read_bytes()[:4096])  # e.g. an earlier pack at the same URL
    train3, _ = build_datasets(_data_cfg(f"s3://{BUCKET}/{PREFIX}", cache), seed=0)
    assert torch.equal(train3[437][0], ref_train[437][0])  # downloaded again, not read short
    assert stale.stat().st_size == (local / stale.name).stat().st_size


def test_s3_reader_in_a_dataloader_worker(s3, tmp_path):
    _, local = s3
    cache = tmp_path / "cache"
    train, _ = build_datasets(_data_cfg(f"s3://{BUCKET}/{PREFIX}", cache), seed=0)
    ref, _ = build_datasets(_data_cfg(str(local), tmp_path / "unused"), seed=0)
    assert torch.equal(train[3][0], ref[3][0])  # the parent's reader is open: it must not travel
    restored = pickle.loads(pickle.dumps(train))
    assert restored.base._reader is None and train.base._reader is not None
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(train, [700, 1200]), batch_size=2,
                                         num_workers=1, multiprocessing_context="spawn")
    (x, y), = list(loader)
    assert torch.equal(x, torch.stack([ref[700][0], ref[1200][0]]))
    assert y.tolist() == [ref[700][1], ref[1200][1]]


@pytest.mark.parametrize("url,error,expect", [
    # a bucket that is not there: the store refuses, the fix is the name / credentials / endpoint
    (f"s3://no-such-bucket/{PREFIX}", StorageError, r"data.shards=s3://no-such-bucket/packs/digits: cannot read "
                                                    r".*NoSuchBucket.*check the credentials.*the bucket name and "
                                                    r"AWS_ENDPOINT_URL"),
    # no manifest under the prefix: nothing was packed there
    (f"s3://{BUCKET}/packs/digitz", FileNotFoundError, r"no packed data set at data.shards=s3://vitp-data/packs/digitz "
                                                       r"\(s3://vitp-data/packs/digitz/index.json does not exist\); "
                                                       r"write one with vitp-pack OUT"),
])
def test_s3_wrong_bucket_or_prefix_names_the_url(s3, tmp_path, url, error, expect):
    with pytest.raises(error, match=expect):
        build_datasets(_data_cfg(url, tmp_path / "cache"), seed=0)


def test_s3_missing_or_truncated_shard_fails_at_start_up(s3, tmp_path):
    client, local = s3
    url = _copy_prefix(client, "damaged/digits")
    client.delete_object(Bucket=BUCKET, Key="damaged/digits/shard-000001.tar")
    head = (local / "shard-000002.tar").read_bytes()[:100_000]
    client.put_object(Bucket=BUCKET, Key="damaged/digits/shard-000002.tar", Body=head)
    cache = tmp_path / "cache"
    with pytest.raises(FileNotFoundError) as e:
        build_datasets(_data_cfg(url, cache), seed=0)
    msg = str(e.value)
    assert msg.startswith("2 of the 4 shards of data.shards=s3://vitp-data/damaged/digits are unusable: "), msg
    assert "s3://vitp-data/damaged/digits/shard-000001.tar is missing" in msg
    assert "s3://vitp-data/damaged/digits/shard-000002.tar has 100000 bytes, packed with 1546240 " \
           "(truncated or replaced)" in msg
    assert msg.endswith("copy the shards again or re-run the same vitp-pack command (it repairs the pack)")
    assert not cache.exists() or _cache_files(cache) == []


def test_s3_download_failing_mid_run_leaves_no_partial_shard(s3, tmp_path, monkeypatch):
    client, local = s3
    url = _copy_prefix(client, "vanishing/digits")
    cache = tmp_path / "cache"
    train, _ = build_datasets(_data_cfg(url, cache), seed=0)  # all shards listed: start-up passes
    assert train[0][1] == build_datasets(_data_cfg(str(local), tmp_path / "u"), seed=0)[0][0][1]

    real = shards_mod._s3_client

    class Dropping:  # the connection drops after half of the object arrived
        def download_file(self, bucket, key, path):
            body = real().get_object(Bucket=bucket, Key=key)["Body"].read()
            Path(path).write_bytes(body[: len(body) // 2])
            raise ConnectionError("connection reset by peer")

    monkeypatch.setattr(shards_mod, "_s3_client", Dropping)
    with pytest.raises(StorageError, match=r"shard s3://vitp-data/vanishing/digits/shard-000003.tar could "
                                                r"not be downloaded \(ConnectionError: connection reset by peer\)"):
        _read(train, len(train) - 1)
    assert _cache_files(cache) == ["shard-000000.tar"]  # no truncated shard-000003.tar, no .part
    monkeypatch.setattr(shards_mod, "_s3_client", real)
    client.delete_object(Bucket=BUCKET, Key="vanishing/digits/shard-000002.tar")  # gone after start-up
    with pytest.raises(StorageError, match=r"shard s3://vitp-data/vanishing/digits/shard-000002.tar could "
                                                r"not be downloaded \(ClientError: .*404.*\); check that"):
        _read(train, 1000)
    assert _cache_files(cache) == ["shard-000000.tar"]
    x, _ = _read(train, len(train) - 1)  # the connection is back: the shard downloads whole
    assert _cache_files(cache) == ["shard-000000.tar", "shard-000003.tar"]
    assert (next(cache.rglob("shard-000003.tar"))).stat().st_size == (local / "shard-000003.tar").stat().st_size


def _train_from_s3(rank, env, overrides, run_dir):
    """:func:`tests.helpers.train_rank` with the test's AWS variables (the ranks fork from a server
    started before this module set them)."""
    os.environ.update(env)
    from tests.helpers import train_rank

    return train_rank(rank, overrides, run_dir)


@pytest.mark.slow  # a trainer subprocess
def test_training_reads_the_shards_from_s3(s3, tmp_path):
    """Three steps of the real trainer (one rank, a DataLoader worker) on data.shards=s3://...:
    finite losses, the shards it read in the cache (the items equal the folder's: tests above)."""
    from tests.helpers import run_ranks

    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    over = ["experiment=smoke", "trainer.max_steps=3", "data=shards", "data.num_classes=10", "data.num_workers=1",
            f"data.shards=s3://{BUCKET}/{PREFIX}", f"data.shard_cache={tmp_path / 'cache'}"]
    res = run_ranks(1, _train_from_s3, env, over, tmp_path / "run")[0]
    assert res["stopped_at"] is None and len(res["losses"]) == 3 and all(0 < x < 10 for x in res["losses"])
    files = _cache_files(tmp_path / "cache")
    assert files and all(f.startswith("shard-") and f.endswith(".tar") for f in files), files
