"""Reading a file from a local path or an object store (``s3://``, ``http(s)://``), for packs'
manifests and per-sample files (:mod:`vitp.data.shards`); no vitp imports, so config-time code
(:mod:`vitp.latents.config`) can read a manifest too."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Tuple
from urllib.parse import urlparse

REMOTE_SCHEMES = ("s3", "http", "https", "gs")


class StorageError(OSError):
    """The storage holding a file failed (e.g. a shard's download from an object store), not the
    file itself: :meth:`vitp.data.base.FileDataset.__getitem__` raises it instead of skipping the file, since a skip
    would silently drop every item of a shard from training."""


def is_remote(url: str) -> bool:
    """Whether ``url`` names an object store / web location (``s3://``, ``http(s)://``, ``gs://``)."""
    return urlparse(str(url)).scheme in REMOTE_SCHEMES


def join_url(base: str, name: str) -> str:
    """``name`` inside the folder or prefix ``base`` (a path or a URL)."""
    return f"{str(base).rstrip('/')}/{name}" if is_remote(base) else str(Path(base) / name)


def _s3_client():
    try:
        import boto3
    except ImportError as e:  # pragma: no cover - boto3 is a dependency
        raise ImportError("reading s3:// shards needs boto3: pip install boto3") from e
    logging.getLogger("botocore").setLevel(logging.WARNING)  # "Found credentials in ..." on every client
    return boto3.client("s3")  # endpoint from AWS_ENDPOINT_URL (boto3 >= 1.28), credentials as the AWS CLI


def _split_s3(url: str) -> Tuple[str, str]:
    u = urlparse(url)
    return u.netloc, u.path.lstrip("/")


def read_bytes(url: str) -> bytes:
    """The bytes at a local path, ``s3://bucket/key`` or ``http(s)://`` URL.

    Raises ``FileNotFoundError`` naming ``url`` when nothing is there, and
    :class:`~vitp.data.base.StorageError` when the store cannot be reached or refuses (credentials,
    bucket, endpoint: the message says which to check)."""
    scheme = urlparse(url).scheme
    try:
        if scheme == "s3":
            bucket, key = _split_s3(url)
            return _s3_client().get_object(Bucket=bucket, Key=key)["Body"].read()
        if scheme in ("http", "https"):
            import urllib.request

            with urllib.request.urlopen(url, timeout=60) as r:
                return r.read()
        return Path(urlparse(url).path if scheme == "file" else url).read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{url} does not exist") from None
    except Exception as e:  # noqa: BLE001 - botocore / urllib errors carry the reason
        code = str(getattr(e, "response", {}).get("Error", {}).get("Code", getattr(e, "code", "")))
        if code in ("NoSuchKey", "404"):
            raise FileNotFoundError(f"{url} does not exist") from None
        raise StorageError(f"cannot read {url}: {type(e).__name__}: {e}; check the credentials (AWS_ACCESS_KEY_ID / "
                           f"AWS_PROFILE or the instance's role), the bucket name and AWS_ENDPOINT_URL") from None
