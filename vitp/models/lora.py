"""Which linears of vitp's models take a LoRA adapter, by the names users know, and how a model
gets its adapters in any layout (the layer itself: :mod:`vitp.parallel.lora`).

Targets are matched as peft matches ``LoraConfig.target_modules`` given as a list: a target names a
module when it equals the module's full name or is a suffix of it starting at a dot. A module is
named both by vitp's name (``blocks.3.attn.qkv``) and by the names of the pieces it fuses:

- Wan: diffusers' names (:data:`vitp.models.wan_keys._LINEARS`): ``attn1.to_q`` / ``to_k`` /
  ``to_v`` (pieces of ``attn.qkv``), ``attn1.to_out.0`` (``attn.proj``), ``attn2.to_q``
  (``cross_attn.q``), ``attn2.to_k`` / ``to_v`` (pieces of ``cross_attn.kv``), ``attn2.to_out.0``,
  ``ffn.net.0.proj`` (``mlp.fc1``), ``ffn.net.2`` (``mlp.fc2``). So ``to_q`` targets the q pieces of
  both attentions, ``attn1.to_q`` self-attention's only.
- the generator: timm's ``attn.qkv`` (pieces ``attn.q``, ``attn.k``, ``attn.v``), ``attn.proj``,
  ``mlp.fc1``, ``mlp.fc2``, and with text ``cross_attn.q``, ``cross_attn.kv`` (pieces
  ``cross_attn.k``, ``cross_attn.v``), ``cross_attn.proj``.

Initialisation is layout independent: each linear's full factors are drawn from a generator seeded
by ``(seed, its canonical name)`` and every rank keeps its share.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from vitp.parallel.lora import attach_lora, init_lora, is_lora_key, lora_linears, lora_scaling

from .wan_keys import _LINEARS as _WAN_LINEARS

# (vitp module under blocks.<i>, the pieces it fuses along its output rows, in row order)
GENERATOR_LINEARS = (
    ("attn.qkv", ("attn.q", "attn.k", "attn.v")),
    ("attn.proj", ("attn.proj",)),
    ("cross_attn.q", ("cross_attn.q",)),
    ("cross_attn.kv", ("cross_attn.k", "cross_attn.v")),
    ("cross_attn.proj", ("cross_attn.proj",)),
    ("mlp.fc1", ("mlp.fc1",)),
    ("mlp.fc2", ("mlp.fc2",)),
)
LINEARS = {"wan": _WAN_LINEARS, "vit": GENERATOR_LINEARS}
DEFAULT_TARGETS = {"wan": ("to_q", "to_k", "to_v", "to_out.0"), "vit": ("qkv", "proj")}


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA configuration (peft ``LoraConfig`` semantics): ``rank`` r >= 1, ``alpha`` (scaling
    ``alpha / r``, or ``alpha / sqrt(r)`` with ``rslora``), ``dropout`` on the adapter's input,
    ``targets`` (module names, module docstring), ``b_std`` (0: B starts at zero as peft's; tests
    draw it normal to make every path matter)."""

    rank: int
    alpha: float
    targets: Tuple[str, ...]
    dropout: float = 0.0
    rslora: bool = False
    b_std: float = 0.0
    family: str = "wan"

    def meta(self) -> Dict[str, object]:
        """The JSON record of the adapters (without pieces and base)."""
        return {"rank": self.rank, "alpha": self.alpha, "rslora": self.rslora, "dropout": self.dropout,
                "targets": list(self.targets)}


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def block_linears(family: str, depth: int) -> List[Tuple[str, Tuple[str, ...]]]:
    """``[(vitp module name, full piece names)]`` of every adaptable linear of a model of ``depth``
    blocks (a generator without text lists its cross-attention too: a target naming only those
    matches nothing when applied)."""
    return [(f"blocks.{i}.{v}", tuple(f"blocks.{i}.{p}" for p in ps)) for i in range(depth)
            for v, ps in LINEARS[family]]


def targeted_pieces(module: str, pieces: Sequence[str], targets: Sequence[str]) -> Tuple[int, ...]:
    """Indices of the pieces of ``module`` (its vitp name and its pieces' names) the ``targets`` name."""
    if any(_matches(module, t) for t in targets):
        return tuple(range(len(pieces)))
    return tuple(j for j, p in enumerate(pieces) if any(_matches(p, t) for t in targets))


def check_targets(family: str, depth: int, targets: Sequence[str]) -> None:
    """Raises ``ValueError`` when ``targets`` is empty or one of them names no linear of the model,
    listing the names it takes."""
    names = [n for v, ps in block_linears(family, depth) for n in (v, *ps)]
    bad = [t for t in targets if not any(_matches(n, t) for n in names)]
    if not targets or bad:
        kinds = sorted({n.split(".", 2)[2] for n in names})
        raise ValueError(f"trainer.lora.targets={list(targets)}: {'empty' if not targets else f'{bad} match(es) no '}"
                         f"{'' if not targets else 'linear of the model'}; give module names such as {kinds} "
                         f"(a suffix of a full name like blocks.0.{LINEARS[family][0][1][0]}, as peft matches "
                         "target_modules)")


def spec_of(cfg) -> Optional[LoraSpec]:
    """The :class:`LoraSpec` of a run config's ``trainer.lora`` (``None`` when not enabled)."""
    lo = cfg.trainer.lora
    if not lo.enabled:
        return None
    family = str(cfg.model.family)
    return LoraSpec(rank=int(lo.rank), alpha=float(lo.alpha), targets=tuple(lo.targets) or DEFAULT_TARGETS[family],
                    dropout=float(lo.dropout), rslora=bool(lo.rslora), b_std=float(lo.b_init_std), family=family)


def check_lora_config(cfg) -> None:
    """The cross-field checks of ``trainer.lora`` (after the Wan folder's sizes were adopted).

    Raises ``ValueError`` naming the problem and the fix: LoRA training of another family than Wan,
    a rank <= 0, targets that name no linear of the model (listing those it has)."""
    spec = spec_of(cfg)
    if spec is None:
        return
    if spec.family != "wan":
        raise ValueError(f"trainer.lora.enabled=true with model.family={spec.family}: vitp-train fine-tunes LoRA "
                         "adapters on a Wan folder (model.family=wan trainer.init_from=FOLDER); the generator takes "
                         "adapters in code (vitp.models.lora.apply_lora), not in vitp-train yet")
    lora_scaling(spec.rank, spec.alpha, spec.rslora)
    check_targets(spec.family, int(cfg.model.depth), spec.targets)


SAMPLE = 1 << 20  # bytes of tensor data hashed at each end of every weight file


def base_hash(folder) -> str:
    """A fingerprint of the base weights of a Wan transformer folder: sha256 over each safetensors
    file (sorted by name) of its name, size, whole header (every tensor's name, dtype, shape and
    offsets) and the first and last :data:`SAMPLE` bytes of its tensor data. Cheap (about 2 MiB
    read per file, whatever the model's size) and independent of where the folder lies or when it
    was copied; another architecture changes the headers, another fine-tune of the same one its
    data. Raises as :func:`vitp.models.wan_keys.weight_locations`."""
    import struct
    from pathlib import Path

    from .wan_keys import weight_locations

    h = hashlib.sha256()
    for f in sorted(set(weight_locations(Path(folder)).values()), key=lambda q: q.name):
        size = f.stat().st_size
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = fh.read(n)
            head = fh.read(SAMPLE)
            fh.seek(max(8 + n, size - SAMPLE))
            tail = fh.read(SAMPLE)
        for part in (f.name.encode(), str(size).encode(), header, head, tail):
            h.update(len(part).to_bytes(8, "little") + part)
    return h.hexdigest()


def run_record(cfg) -> Optional[Dict[str, object]]:
    """The adapters' record of a LoRA run (``None`` without LoRA): :meth:`LoraSpec.meta`, the
    targeted ``pieces`` of every adapted linear of the whole model and the ``base`` it trains on
    (``{"folder": trainer.init_from's transformer folder, "hash": base_hash(...)}``)."""
    from .wan_run import wan_source

    spec = spec_of(cfg)
    if spec is None:
        return None
    folder, _ = wan_source(cfg)
    pieces = {m: list(targeted_pieces(m, ps, spec.targets)) for m, ps in block_linears(spec.family, cfg.model.depth)}
    return {**spec.meta(), "pieces": {m: p for m, p in pieces.items() if p},
            "base": {"folder": str(folder), "hash": base_hash(folder)}}


def check_same_base(record: Optional[Dict[str, object]], saved: Optional[Dict[str, object]], tag) -> None:
    """Raises ``ValueError`` naming both when a checkpoint's LoRA record ``saved`` and this run's
    ``record`` (:func:`run_record`) disagree: one is a LoRA run and the other not, or the adapters
    were trained on another base (its hash), which they would not fit."""
    if record is None and saved is None:
        return
    if record is None or saved is None:
        what = "LoRA adapters" if saved is not None else "every weight (no LoRA)"
        fix = "trainer.lora.enabled=true with its trainer.lora settings" if saved is not None else \
            "trainer.lora.enabled=false"
        raise ValueError(f"checkpoint {tag} trained {what}, this run does not: resume it with {fix}, or start a new "
                         "run (another hydra.run.dir)")
    old, new = saved["base"], record["base"]
    if old["hash"] != new["hash"]:
        raise ValueError(f"checkpoint {tag} holds LoRA adapters trained on the base {old['folder']} (weights hash "
                         f"{old['hash'][:16]}), but trainer.init_from gives {new['folder']} (hash {new['hash'][:16]}): "
                         f"adapters fit only their own base; resume with trainer.init_from={old['folder']}, or start "
                         "a new run (another hydra.run.dir)")
    diffs = [f"{k}: {saved.get(k)!r} in the checkpoint vs {record[k]!r} now" for k in ("rank", "pieces")
             if saved.get(k) != record[k]]
    if diffs:
        raise ValueError(f"checkpoint {tag} holds other LoRA adapters ({'; '.join(diffs)}): resume with its "
                         "trainer.lora settings, or start a new run (another hydra.run.dir)")


def seed_of(seed: int, key: str) -> int:
    """A 63-bit seed of ``(seed, key)``, the same on every rank and layout."""
    return int(hashlib.sha256(f"lora/{seed}/{key}".encode()).hexdigest()[:15], 16)


def apply_lora(model: nn.Module, spec: LoraSpec, state=None, key_of: Callable[[str], str] = lambda n: n,
               seed: int = 0, init: Optional[Dict[str, Tuple[torch.Tensor, torch.Tensor]]] = None,
               freeze: bool = True) -> Dict[str, Tuple[int, ...]]:
    """Attach adapters (:func:`vitp.parallel.lora.attach_lora`) to the targeted linears of
    ``model`` (a model, a pipeline stage, sharded or not), each from its full factors: ``init[key]``
    when given (``{canonical module name: (A, B)}``), else drawn by :func:`init_lora` seeded by
    :func:`seed_of`. ``key_of`` maps a module name of ``model`` to its canonical name
    (``blocks.<i>.<...>``). With ``freeze`` every other parameter stops requiring a gradient.
    Returns ``{canonical module name: targeted pieces}`` of this model's adapters.

    Raises ``ValueError`` as :func:`check_targets`, ``TypeError`` for a targeted module that is not
    a linear vitp can adapt.
    """
    lora_scaling(spec.rank, spec.alpha, spec.rslora)  # a rank <= 0 is refused before anything is drawn
    table = {v: ps for v, ps in LINEARS[spec.family]}
    out: Dict[str, Tuple[int, ...]] = {}
    for name, m in list(model.named_modules()):
        key = key_of(name)
        parts = key.split(".", 2)
        if len(parts) < 3 or parts[0] != "blocks" or parts[2] not in table:
            continue
        piece_names = tuple(f"blocks.{parts[1]}.{p}" for p in table[parts[2]])
        pieces = targeted_pieces(key, piece_names, spec.targets)
        if not pieces:
            continue
        if init is not None:
            A, B = init[key]
        else:
            g = torch.Generator().manual_seed(seed_of(seed, key))
            A, B = init_lora(m.in_features, m.out_features // len(piece_names), len(pieces), spec.rank, g, spec.b_std)
        attach_lora(m, A, B, pieces=pieces, num_pieces=len(piece_names), rank=spec.rank, alpha=spec.alpha,
                    rslora=spec.rslora, dropout=spec.dropout, state=state)
        out[key] = pieces
    if freeze:
        for n, p in model.named_parameters():
            p.requires_grad_(is_lora_key(n))
    return out


def lora_factors(model: nn.Module, key_of: Callable[[str], str] = lambda n: n
                 ) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """``{canonical module name: (lora_A, lora_B)}`` of a one-process model (detached clones)."""
    return {key_of(n): (m.lora_A.detach().clone(), m.lora_B.detach().clone()) for n, m in lora_linears(model)}


__all__ = ["base_hash", "check_same_base", "run_record", "check_lora_config", "spec_of", "DEFAULT_TARGETS", "GENERATOR_LINEARS", "LINEARS", "LoraSpec", "apply_lora", "block_linears",
           "check_targets", "lora_factors", "seed_of", "targeted_pieces"]
