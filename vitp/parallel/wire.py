"""Bytes one rank puts on the wire for a collective (a leaf module: the planner reads it without torch)."""
from __future__ import annotations


def wire_bytes(kind: str, nbytes: float, group: int) -> float:
    """Bytes one rank sends for one collective of ``nbytes`` logical bytes (:class:`vitp.parallel.comm.CommRecord`)
    over ``group`` ranks, with ring algorithms (Patarasuk & Yuan 2009): all-reduce
    ``2 (p-1)/p n``, all-gather / reduce-scatter / all-to-all ``(p-1)/p n``, send-recv ``n``."""
    if kind == "send_recv":
        return nbytes
    return (2 if kind == "all_reduce" else 1) * nbytes * (group - 1) / group
