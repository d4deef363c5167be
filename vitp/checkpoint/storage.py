"""Node-local checkpoint folders: which ranks share a folder, and which checkpoint every rank resumes.

Without a shared file system (SageMaker: each host's ``/opt/ml/checkpoints`` synced to one S3
prefix; Slurm with node-local NVMe) each node's launcher names its own run directory, which the
other nodes cannot see. :func:`detect_storage_groups` finds the ranks that see the same folder (a
*storage group*; one group when the folder is shared, the common case); the save
(:func:`vitp.checkpoint.training.write_checkpoint`) then copies to every group the files
its ranks load, and :func:`choose_resume_tag` picks the newest checkpoint that every rank finds
complete in its own folder.
"""
from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from vitp.parallel import distributed as dist

PROBE_PREFIX = ".vitp-probe-"  # a probe file lives only while detect_storage_groups runs


@dataclass(frozen=True)
class StorageGroups:
    """The ranks that share a checkpoints folder: ``groups`` (sorted ranks, groups ordered by their
    lowest rank, so rank 0's group comes first) and this process's ``rank``. The lowest rank of a
    group is its leader: it creates, publishes and deletes the group's checkpoint folders."""

    groups: Tuple[Tuple[int, ...], ...]
    rank: int

    @classmethod
    def single(cls, world: int, rank: int) -> "StorageGroups":
        """Every rank in one folder (a shared file system, or one node)."""
        return cls((tuple(range(world)),), rank)

    def index(self, rank: int) -> int:
        """The group of ``rank`` (position in ``groups``)."""
        return next(i for i, g in enumerate(self.groups) if rank in g)

    @property
    def leader(self) -> int:
        """The lowest rank of this process's group."""
        return self.groups[self.index(self.rank)][0]

    @property
    def is_leader(self) -> bool:
        return self.leader == self.rank

    @property
    def shared(self) -> bool:
        """One folder for every rank."""
        return len(self.groups) == 1


def _make_dirs(folder: Path) -> List[Path]:
    """Create ``folder`` and missing parents; returns those created, deepest last."""
    missing = []
    p = folder
    while not p.exists():
        missing.append(p)
        p = p.parent
    folder.mkdir(parents=True, exist_ok=True)
    return list(reversed(missing))


def detect_storage_groups(folder: Path) -> StorageGroups:
    """Which ranks see the same ``folder`` (collective; every rank passes its own run directory).

    Ranks with the same host name and resolved path share it for sure; one rank of each such
    (host, path) pair writes an empty probe file named by a random nonce into ``folder``, all wait,
    each of them looks for the others' probes by name, and deletes its own: two paths are one
    folder exactly when each sees the other's probe (a shared file system, or two paths to one
    folder). Nothing is left behind: the probes are deleted, and so are the folders made for them
    (``folder`` and missing parents) when still empty.
    """
    world, me = dist.world_size(), dist.rank()
    if world == 1:
        return StorageGroups.single(1, 0)
    key = (socket.gethostname(), os.path.realpath(folder))
    keys = dist.gather_objects((key, secrets.token_hex(8)))
    first: Dict[tuple, int] = {}
    for r, (k, _) in enumerate(keys):
        first.setdefault(k, r)
    probers = sorted(set(first.values()))
    probe = Path(folder) / f"{PROBE_PREFIX}{keys[me][1]}"
    made: List[Path] = []
    if me in probers:
        made = _make_dirs(Path(folder))
        probe.write_bytes(b"")
    dist.barrier()
    seen = [r for r in probers if (Path(folder) / f"{PROBE_PREFIX}{keys[r][1]}").exists()] if me in probers else []
    dist.barrier()  # every prober has looked before any probe goes
    if me in probers:
        probe.unlink(missing_ok=True)
        for d in reversed(made):
            try:
                d.rmdir()
            except OSError:
                break
    views = dist.gather_objects(seen)
    label = {k: min(views[r]) for k, r in first.items()}
    groups: Dict[int, List[int]] = {}
    for r, (k, _) in enumerate(keys):
        groups.setdefault(label[k], []).append(r)
    return StorageGroups(tuple(tuple(g) for _, g in sorted(groups.items())), me)


# A rank's view of a checkpoints folder: {tag: None when complete for that rank's needs, else
# (exception class name, message)} over the tags published there (their completion record present).
View = Dict[str, Optional[Tuple[str, str]]]


def _step(tag: str) -> int:
    return int(tag.rsplit("_", 1)[1])


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def choose_resume_tag(views: Sequence[View], where: Sequence[str]) -> Tuple[Optional[str], List[str]]:
    """The checkpoint every rank resumes from: the newest tag published in every rank's folder
    (``views[r]``, :data:`View`; ``where[r]`` names rank r's folder in messages, e.g. ``host:path``).

    Returns ``(tag, notes)``: ``tag`` ``None`` when no rank's folder holds a checkpoint (start at
    step 0); ``notes`` says why newer tags some folders hold were passed over (their save never
    finished on every node). Raises ``ValueError`` / ``FileNotFoundError`` (the type the check
    raised) when the chosen tag is damaged in a rank's folder, naming the rank, its folder, the
    file and the fix; ``FileNotFoundError`` when some folders hold checkpoints but none is in every
    rank's folder (a node's folder was lost or replaced, or the ranks moved to other nodes).
    """
    tags = set().union(*views)
    if not tags:
        return None, []
    common = set.intersection(*(set(v) for v in views))
    if not common:
        having = [r for r, v in enumerate(views) if v]
        lacking = [r for r, v in enumerate(views) if not v]
        newest = max(tags, key=_step)
        raise FileNotFoundError(
            f"no checkpoint is in every rank's folder: ranks {_ranks(having)} hold some (newest {newest}, "
            f"{where[having[0]]}), ranks {_ranks(lacking)} none ({where[lacking[0]]}); with node-local checkpoint "
            f"folders every node needs its own part: relaunch each node with the folder it wrote (the same node "
            f"order), or copy every node's checkpoints folder into each (a merged folder resumes on any node); "
            f"if a node's files are lost, start a new run dir from the weights (trainer.init_from="
            f"<checkpoint>/model.safetensors)")
    chosen = max(common, key=_step)
    for r, v in enumerate(views):
        if v[chosen] is not None:
            kind, msg = v[chosen]
            exc = FileNotFoundError if kind == "FileNotFoundError" else ValueError
            raise exc(f"rank {r} ({where[r]}): {msg}")
    notes = []
    for tag in sorted(tags - common, key=_step):
        if _step(tag) > _step(chosen):
            missing = [r for r, v in enumerate(views) if tag not in v]
            notes.append(f"{tag} was not published in the folder of ranks {_ranks(missing)} "
                         f"({where[missing[0]]}): its save did not finish on every node")
    return chosen, notes
