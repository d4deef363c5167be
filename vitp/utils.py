"""Small helpers every layer may use: atomic file writes, safetensors files with the usual mode,
the plain-dict view of a config, the divisors of a size, a free local TCP port,
:class:`RankZeroError` and :data:`RANK_LOCAL`."""
from __future__ import annotations

import os
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Union

PathLike = Union[str, os.PathLike]


def _umask() -> int:
    try:  # Linux: read it; setting it to read it back would race with threads creating files meanwhile
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0)
        os.umask(mask)
        return mask


def default_mode(path: PathLike) -> None:
    """Give the file ``path`` the mode a plain ``open()`` gives (``0666 & ~umask``: 0644 under umask
    022; a folder ``0777 & ~umask``, as ``mkdir``), for writers that create owner-only files
    (safetensors: 0600; ``tempfile.mkdtemp``: 0700), which others sharing the file system could not read."""
    os.chmod(path, (0o777 if os.path.isdir(path) else 0o666) & ~_umask())


def save_safetensors(tensors: Dict[str, Any], path: PathLike, metadata: Optional[Dict[str, str]] = None) -> Path:
    """``safetensors`` ``save_file`` of ``tensors`` (torch tensors, or numpy arrays) with
    ``metadata`` to ``path``, then :func:`default_mode`: every safetensors file vitp writes goes
    through here. Returns ``path``."""
    import numpy as np

    if tensors and all(isinstance(v, np.ndarray) for v in tensors.values()):
        from safetensors.numpy import save_file
    else:
        from safetensors.torch import save_file
    save_file(tensors, str(path), metadata=metadata)
    default_mode(path)
    return Path(path)


@contextmanager
def atomic_write(path: PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path`` (hidden name, same suffix, so writers that pick a
    format by suffix still work); when the body succeeds, ``os.replace`` it onto ``path``; on any
    exception delete it and re-raise. Creates the parent folder.

    A reader therefore sees the old file or the complete new one, never a half-written file
    (``os.replace`` is atomic within one file system).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp{path.suffix}")
    try:
        yield tmp
        default_mode(tmp)  # some writers create owner-only files; match a plain open()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: PathLike, text: str, fsync: bool = False) -> Path:
    """Write ``text`` to ``path`` through :func:`atomic_write`; ``fsync`` flushes it to disk
    before the rename (for files that publish other files, like a checkpoint's ``latest``)."""
    with atomic_write(path) as tmp:
        with open(tmp, "w") as f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    return Path(path)


def on_read_only_fs(path: PathLike) -> bool:
    """Whether ``path`` lies on a file system mounted read-only (``False`` where that cannot be told)."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # no statvfs on Windows
        return False


def unwritable(folder: PathLike) -> Optional[str]:
    """Why this process may not create files in the existing ``folder`` (``"on a read-only file
    system"``, ``"not writable by this user"``), or ``None`` when it may."""
    if os.access(folder, os.W_OK | os.X_OK):
        return None
    return "on a read-only file system" if on_read_only_fs(folder) else "not writable by this user"


def check_output_in_run(out: Optional[PathLike], default: PathLike, run: PathLike, prog: str) -> None:
    """Refuse (``PermissionError``, one line) before any work an output that goes into the folder
    ``run`` (``default`` when ``out`` is ``None``, or an ``out`` inside it) where this process may
    not write: a run bind-mounted read-only failed only when the finished samples were written.
    An ``out`` outside ``run`` is not checked (it is the way around a read-only run)."""
    target, folder = Path(default if out is None else out).absolute(), Path(run).absolute()
    if target != folder and folder not in target.parents:
        return
    nearest = next(p for p in (target, *target.parents) if p.exists())
    if nearest.is_file():
        nearest = nearest.parent  # an output file is replaced by a rename in its folder
    why = unwritable(nearest)
    if why is None:
        return
    where = f"writes into {folder} by default" if out is None else f"would write --out {out} into {folder}"
    raise PermissionError(f"{nearest} is {why}: {prog} {where}; give --out PATH outside it, or {prog} a copy of "
                          f"that folder")


def to_dict(cfg: Any) -> Dict[str, Any]:
    """A config section as a plain ``dict`` (``DictConfig`` resolved, dataclass or mapping)."""
    from dataclasses import asdict, is_dataclass

    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)
    if is_dataclass(cfg):
        return asdict(cfg)
    return dict(cfg)


def divisors(n: int) -> List[int]:
    """The positive divisors of ``n`` in increasing order (``[]`` for ``n < 1``): the valid
    values listed by layout and size errors."""
    return [d for d in range(1, n + 1) if n % d == 0]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a local ``MASTER_PORT``; another
    process may take it before it is bound again)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankZeroError(ValueError):
    """Bad input that rank 0 found, raised on every other rank with rank 0's message (``rank 0:
    ...``), so each rank stops with a clear error while rank 0 alone prints it:
    :func:`vitp.cli.run_cli` does not print this one again on every rank."""


# ``extra=`` of a log record that only this rank emits (a file its own batches failed to decode, its
# node's folder): ranks other than 0 print it too (vitp.train.logger.OwnRecordsOnly)
RANK_LOCAL = {"rank_local": True}


_SCAN = 1 << 24  # bytes per chunk when scanning for newlines (bounds the scan's temporaries)


def line_offsets(buf: "np.ndarray") -> "np.ndarray":
    """int64 ``(lines + 1,)``: the byte where each line of the uint8 text ``buf`` starts, then
    ``len(buf)`` (a last line without its newline counts as a line). Scanned in chunks: the
    temporaries stay a few bytes per line plus 16 MiB."""
    import numpy as np

    ends = [np.flatnonzero(buf[a:a + _SCAN] == ord("\n")) + (a + 1) for a in range(0, len(buf), _SCAN)]
    ends = np.concatenate([np.zeros(1, np.int64), *ends]).astype(np.int64)
    return ends if ends[-1] == len(buf) else np.append(ends, len(buf))


def write_line_offsets(text_file: PathLike, out: PathLike) -> Path:
    """Write :func:`line_offsets` of the file ``text_file`` to ``out`` (a ``.npy``, atomically, in
    the usual mode: :func:`default_mode`); returns ``out``. Readers memory-map it to read one line at a time."""
    import numpy as np

    text_file, out = Path(text_file), Path(out)
    buf = np.memmap(text_file, dtype=np.uint8, mode="r") if text_file.stat().st_size else np.zeros(0, np.uint8)
    with atomic_write(out) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, line_offsets(buf))
    return out


def lazy_exports(package: str, exports: Dict[str, str]):
    """``(__getattr__, __dir__)`` for a package whose names load on first use (PEP 562): ``exports``
    maps a name to the submodule holding it (``".generator"``); any other public name is tried as a
    submodule, as an eagerly imported package would have it. Lets a command that needs none of the
    names (``vitp-plan``, the config check) run without importing torch."""
    import importlib

    def __getattr__(name: str):
        module = sys.modules[package]
        if name in exports:
            value = getattr(importlib.import_module(exports[name], package), name)
            setattr(module, name, value)
            return value
        if not name.startswith("_"):
            try:
                return importlib.import_module(f".{name}", package)
            except ModuleNotFoundError as e:
                if e.name != f"{package}.{name}":
                    raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__


def recorded_config(run_dir: PathLike) -> Path:
    """``run_dir/.hydra/config.yaml``, the config a training recorded (what ``vitp-eval`` and
    ``vitp-sweep`` read). Raises ``FileNotFoundError`` naming a folder that does not exist, or one
    without that file (not a vitp run directory)."""
    path = Path(run_dir) / ".hydra" / "config.yaml"
    if not Path(run_dir).exists():
        raise FileNotFoundError(f"{run_dir} does not exist; give the run directory a training wrote (its 'run dir' "
                                f"log line)")
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {run_dir} is not a vitp run directory")
    return path


def load_run_yaml(path: Any) -> Any:
    """``OmegaConf.load`` of a run's recorded YAML (``.hydra/config.yaml``, ``overrides.yaml``).

    Raises ``ValueError`` naming the file when it is not readable YAML (damaged or edited by hand),
    instead of the parser's traceback."""
    from omegaconf import OmegaConf
    from yaml import YAMLError

    try:
        return OmegaConf.load(path)
    except (YAMLError, UnicodeDecodeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path} is not readable YAML ({first}): the run's recorded config was damaged or edited; "
                         "restore it (from a copy of the run, or with the keys of its launch), or start a new run "
                         "from its checkpoint with trainer.resume=RUN/checkpoints/step_N in a new hydra.run.dir") \
            from None


def shard_groups(sizes: Dict[str, int], max_bytes: int) -> List[List[str]]:
    """The keys of ``sizes`` (key -> bytes) cut, in order, into groups of at most ``max_bytes``
    (one larger tensor alone): the shards of a Hugging Face-style sharded export."""
    groups: List[List[str]] = [[]]
    size = 0
    for key, nbytes in sizes.items():
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes
    return groups
