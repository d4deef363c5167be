"""The training state of one rank as sharded pieces (:mod:`.sharded`): what it saves, and how it
loads its pieces back at any layout.

Each rank's share: its TP shard of the weights (``model``, written once over the dp/cp replicas)
and its ZeRO fragment of the EMA, AdamW's ``exp_avg`` / ``exp_avg_sq`` and (bf16) the fp32
``master`` weights, read from and written to DeepSpeed's flat partitions through each
parameter's ``_hp_mapping`` (no communication; ``deepspeed/utils/tensor_fragment.py``). Under
ZeRO stage 0 (fp32 at dp = 1) the fragment is the whole shard, in torch AdamW's own state.
AdamW's step, the LR schedule and DeepSpeed's counters are small and go into ``vitp_meta.json``
(:func:`vitp.checkpoint.reshard.engine_counters`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

import vitp.deepspeed_adapter as ds
from vitp.models import generator_key

from . import reshard
from .sharded import MOMENTS, load_pieces, piece_tensor, place_of

Fragment = Tuple[int, int]  # (first element, elements) of a parameter's flattened TP shard


def trained(module: torch.nn.Module):
    """``[(name, parameter)]`` of the parameters a run trains and keeps: every one, or with LoRA
    only the adapters (a frozen base gets no optimizer state, EMA or checkpoint piece: the run
    records its folder and hash instead)."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def fragments(engine: Any) -> Optional[Dict[str, Fragment]]:
    """``{pipeline parameter name: (start, numel)}``: the flat range of each parameter's TP shard
    whose optimizer state this rank holds (its ZeRO partition; ``(0, 0)`` where it holds none), or
    ``None`` when the optimizer is not partitioned (ZeRO stage 0: every rank holds its whole shard)."""
    if not ds.is_partitioned(engine.optimizer):
        return None
    return {name: ds.param_fragment(p) or (0, 0) for name, p in engine.module.named_parameters()}


def _bf16(engine: Any) -> bool:
    return any(p.dtype != torch.float32 for p in engine.module.parameters())


def _optimizer_fragment(engine: Any, p: torch.nn.Parameter, kind: str, zero: bool, create: bool = False
                        ) -> Optional[torch.Tensor]:
    """The live 1-D fp32 tensor holding ``kind`` (a moment, or ``master``) of this rank's
    fragment of ``p``; under ZeRO stage 0 before the first step zeros (``create``: made part of
    torch AdamW's state)."""
    if zero:
        return None if ds.param_fragment(p) is None else ds.hp_fragment(p, None if kind == "master" else kind)
    states = reshard._torch_optimizer(engine).state
    st = states.get(p, {})
    if kind not in st:
        if not create:
            return torch.zeros(p.numel())
        st = states.setdefault(p, {})
        st[kind] = torch.zeros_like(p, dtype=torch.float32)
    return st[kind].view(-1)


def kinds(engine: Any) -> Tuple[str, ...]:
    """The fragment kinds this engine's state holds."""
    return ("ema", *MOMENTS, *(("master",) if _bf16(engine) else ()))


def stage(engine: Any, ema: Any, state: Any, depth: int) -> Dict[str, torch.Tensor]:
    """This rank's pieces as CPU copies ``{<kind>/<generator key>: piece tensor}`` (the host
    buffer an asynchronous save writes from while training goes on). Links AdamW's state to the
    parameters first (:func:`vitp.deepspeed_adapter.link_optimizer_state`)."""
    zero = reshard._zero_optimizer(engine) is not None
    frags = ema.fragments
    out: Dict[str, torch.Tensor] = {}
    for name, p in trained(engine.module):
        key, place = generator_key(name, depth), place_of(p, state)
        out[f"model/{key}"] = piece_tensor(p.detach().reshape(-1).to("cpu", copy=True), place)
        start, n = frags[name]
        if n == 0:
            continue
        out[f"ema/{key}"] = piece_tensor(ema.params[name].to("cpu", copy=True), place, start)
        for kind in kinds(engine)[1:]:
            live = _optimizer_fragment(engine, p, kind, zero)
            out[f"{kind}/{key}"] = piece_tensor(live.detach().to("cpu", copy=True), place, start)
    return out


def load(engine: Any, ema: Any, state: Any, depth: int, folder: Path, meta: Dict[str, Any], group=None) -> int:
    """Restore weights, fp32 master weights, AdamW moments and step, EMA, LR schedule and
    DeepSpeed's counters of this rank's pieces from a sharded checkpoint written at any layout
    (collective over ``group``); returns the bytes this rank read.

    Raises ``FileNotFoundError`` / ``ValueError`` naming the checkpoint when a file is missing
    or damaged or it lacks a tensor of this model."""
    zero = reshard._zero_optimizer(engine) is not None
    frags = ema.fragments
    bf16 = _bf16(engine)
    dest: Dict[str, torch.Tensor] = {}
    bufs: Dict[Tuple[str, str], torch.Tensor] = {}
    named = trained(engine.module)
    for name, p in named:
        key, place = generator_key(name, depth), place_of(p, state)
        bufs["model", name] = torch.empty(p.numel(), dtype=p.dtype)
        dest[f"model/{key}"] = piece_tensor(bufs["model", name], place)
        start, n = frags[name]
        if n == 0:
            continue
        for kind in kinds(engine):
            bufs[kind, name] = torch.empty(n, dtype=torch.float32)
            dest[f"{kind}/{key}"] = piece_tensor(bufs[kind, name], place, start)
    nbytes = load_pieces(folder, dest, group=group)
    t = int(meta.get("adam_step", 0))
    with torch.no_grad():
        for name, p in named:
            p.copy_(bufs["model", name].view(p.shape))
            start, n = frags[name]
            if n == 0:
                continue
            ema.params[name].copy_(bufs["ema", name])
            master = bufs["master", name] if bf16 else bufs["model", name].narrow(0, start, n).float()
            if zero:
                ds.hp_fragment(p).copy_(master)
            for kind in MOMENTS:
                _optimizer_fragment(engine, p, kind, zero, create=True).copy_(bufs[kind, name])
    for s in reshard._base_states(engine):
        if "step" in s:
            s["step"] = torch.tensor(float(t)) if torch.is_tensor(s["step"]) else t
        elif not zero:
            s["step"] = torch.tensor(float(t))
    reshard._restore_counters(engine, meta)
    return nbytes


def state_bytes(engine: Any, ema: Any) -> Dict[str, int]:
    """Bytes of this rank's share by kind (what :func:`stage` copies to host memory)."""
    out = {"model": sum(p.numel() * p.element_size() for _, p in trained(engine.module))}
    frag = sum(n for _, n in ema.fragments.values()) * 4
    for kind in kinds(engine):
        out[kind] = frag
    return out
