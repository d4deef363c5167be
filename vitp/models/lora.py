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

import contextlib
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

from .wan_config import _LINEARS as _WAN_LINEARS

if TYPE_CHECKING:  # torch is imported where adapters are built: the config check runs without it
    import torch
    import torch.nn as nn

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
DEFAULT_RANK, DEFAULT_ALPHA = 16, 16.0  # trainer.lora.rank / alpha when null and no trainer.lora.init_from


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


def block_linears(family: str, depth: int, text: bool = True) -> List[Tuple[str, Tuple[str, ...]]]:
    """``[(vitp module name, full piece names)]`` of every adaptable linear of a model of ``depth``
    blocks (with ``text``, a generator's cross-attention too; a target naming only those matches
    nothing when applied to a model without)."""
    return [(f"blocks.{i}.{v}", tuple(f"blocks.{i}.{p}" for p in ps)) for i in range(depth)
            for v, ps in LINEARS[family] if text or not v.startswith("cross_attn.")]


def model_linears(cfg) -> List[Tuple[str, Tuple[str, ...]]]:
    """:func:`block_linears` of the model of a run config (the generator's cross-attention only
    with ``model.text_dim``)."""
    family = str(cfg.model.family)
    return block_linears(family, int(cfg.model.depth), family == "wan" or bool(cfg.model.get("text_dim")))


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
    return LoraSpec(rank=int(_or(lo.rank, DEFAULT_RANK)), alpha=float(_or(lo.alpha, DEFAULT_ALPHA)),
                    targets=tuple(lo.targets) or DEFAULT_TARGETS[family], dropout=float(lo.dropout),
                    rslora=bool(lo.rslora), b_std=float(lo.b_init_std), family=family)


def _or(value, default):
    return default if value is None else value


def check_lora_config(cfg) -> None:
    """The cross-field checks of ``trainer.lora`` (after the Wan folder's sizes were adopted), once
    its nulls are resolved (:func:`adopt_lora_file`: the defaults, or ``trainer.lora.init_from``'s).

    Raises ``ValueError`` naming the problem and the fix: LoRA without a base (``trainer.init_from``),
    the generator's base given as a timm file (``trainer.init_from_timm``) or with
    ``parallel.partial_sync < 1``, a rank <= 0, targets that name no linear of the model (listing
    those it has)."""
    adopt_lora_file(cfg)
    spec = spec_of(cfg)
    if spec is None:
        return
    tr = cfg.trainer
    if not tr.init_from:
        what = "a Wan folder" if spec.family == "wan" else "a vitp export (.safetensors, from vitp-export or a run's model_ema.safetensors)"
        raise ValueError(f"trainer.lora.enabled=true trains adapters on a frozen base: set trainer.init_from to {what}"
                         + (" (trainer.init_from_timm cannot be a LoRA base)" if tr.get("init_from_timm") else ""))
    if spec.family == "vit" and float(cfg.parallel.partial_sync) < 1:
        raise ValueError(f"trainer.lora.enabled=true with parallel.partial_sync={cfg.parallel.partial_sync}: LoRA "
                         "trains on fully synchronized linears; set parallel.partial_sync=1")
    from vitp.parallel.lora import lora_scaling

    lora_scaling(spec.rank, spec.alpha, spec.rslora)
    check_targets(spec.family, int(cfg.model.depth), spec.targets)


def base_path(cfg) -> Path:
    """The base weights a LoRA run adapts: a Wan run's transformer folder
    (:func:`vitp.models.wan_run.wan_source`), the generator's vitp export ``trainer.init_from``."""
    if str(cfg.model.family) == "wan":
        from .wan_run import wan_source

        return Path(wan_source(cfg)[0])
    return Path(cfg.trainer.init_from)


def base_shapes(cfg) -> Dict[str, Tuple[int, ...]]:
    """``{vitp key: shape}`` of the model of a (checked) run config, built on the meta device: the
    ``base_shapes`` :func:`vitp.models.lora_files.read_lora_file` checks a LoRA against."""
    import torch

    if str(cfg.model.family) == "wan":
        from .lora_files import wan_state_shapes
        from .wan_run import wan_source

        return wan_state_shapes(wan_source(cfg)[1])

    from . import Generator

    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in Generator.from_config(cfg.model).state_dict().items()}


def lora_file(path) -> Path:
    """The LoRA file ``trainer.lora.init_from`` names: the file itself, or in a folder (a run's
    ``RUN/lora``, a ``vitp-export --format lora`` folder) its ``lora.safetensors`` (vitp's exact
    fp32 adapters) or else ``pytorch_lora_weights.safetensors``. Raises ``FileNotFoundError``
    naming the path and what it should hold."""
    from .lora_files import STATE, WEIGHT_NAME

    p = Path(path)
    for f in ((p / STATE, p / WEIGHT_NAME) if p.is_dir() else (p,)):
        if f.is_file():
            return f
    if p.is_dir() and any((p / "lora" / name).is_file() for name in (STATE, WEIGHT_NAME)):  # a LoRA run's folder
        raise FileNotFoundError(f"trainer.lora.init_from={path} is a run directory: its adapters are in "
                                f"{p / 'lora'}; give trainer.lora.init_from={p / 'lora'}")
    what = f"the folder holds neither {STATE} nor {WEIGHT_NAME}" if p.is_dir() else "no such file"
    raise FileNotFoundError(f"trainer.lora.init_from={path}: {what}; give a LoRA file (vitp's, diffusers' or "
                            "ComfyUI's .safetensors) or a LoRA run's RUN/lora folder")


class OtherBaseError(ValueError):
    """:func:`read_init_lora`'s refusal of a LoRA file that does not fit the base: ``reason`` (the
    file, the mismatch, the fix) and ``base`` (``trainer.init_from=...``), so a command that sets
    ``trainer.lora.init_from`` itself (a run's adapters) can name the key its user set instead."""

    def __init__(self, reason: str, base: str):
        super().__init__(f"trainer.lora.init_from: {reason}; the base here: {base}")
        self.reason, self.base = reason, base


def read_init_lora(cfg) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(adapters, config)`` of ``trainer.lora.init_from`` in vitp's convention (fp32, full tp = 1
    tensors: :func:`vitp.models.lora_files.read_lora_file`), checked against the base
    ``trainer.init_from``: its shapes and its :func:`base_hash`. Raises ``ValueError`` naming the
    file, both bases and the fix for a LoRA of another base; ``FileNotFoundError`` as :func:`lora_file`."""
    from .lora_files import read_lora_file

    path, base = lora_file(cfg.trainer.lora.init_from), base_path(cfg)
    wan = None
    if str(cfg.model.family) == "wan":
        from .wan_run import wan_source

        wan = wan_source(cfg)[1]
    try:
        return read_lora_file(path, base_shapes(cfg), wan, base_hash(base))
    except ValueError as e:
        here = f"trainer.init_from={cfg.trainer.init_from}" + (f" ({base})" if Path(cfg.trainer.init_from) != base else "")
        raise OtherBaseError(str(e), here) from None


def file_pieces(linears, adapters, config) -> Dict[str, List[int]]:
    """``{vitp linear: targeted piece indices}`` of a LoRA file's adapters (``pieces`` absent: all),
    ``linears`` the model's (:func:`model_linears`). Raises ``ValueError`` for an adapter on a
    linear vitp's LoRA training does not adapt."""
    table = {m: len(ps) for m, ps in linears}
    mods = sorted({k.rsplit(".", 1)[0] for k in adapters})
    extra = [m for m in mods if m not in table]
    if extra:
        raise ValueError(f"trainer.lora.init_from adapts {extra[:3]}: vitp trains adapters on the blocks' linears "
                         f"only ({sorted({n.split('.', 2)[2] for n in table})}); give a LoRA of those")
    given = config.get("pieces") or {}
    return {m: [int(j) for j in given.get(m, range(table[m]))] for m in mods}


def _targets_pieces(linears, targets: Sequence[str]) -> Dict[str, List[int]]:
    out = {m: list(targeted_pieces(m, ps, targets)) for m, ps in linears}
    return {m: p for m, p in out.items() if p}


def _show_pieces(linears, pieces: Dict[str, List[int]]) -> str:
    names = [ps[j] for m, ps in linears for j in pieces.get(m, [])]
    return f"{len(names)} module(s) {names[:4]}{' ...' if len(names) > 4 else ''}"


def adopt_lora_file(cfg) -> None:
    """Resolve ``trainer.lora``'s null ``rank`` / ``alpha`` / ``rslora`` and empty ``targets``: from
    ``trainer.lora.init_from`` when set (its config; targets: the file's, or the full names of
    the modules it adapts), else the defaults (:data:`DEFAULT_RANK`, :data:`DEFAULT_ALPHA`, no
    rsLoRA; targets stay ``[]`` = :data:`DEFAULT_TARGETS`). Writes them into ``cfg``.

    Raises ``ValueError`` naming the key and the fix: ``trainer.lora.init_from`` without
    ``trainer.lora.enabled`` or without a base ``trainer.init_from``; a value set here that differs
    from the file's (rank, alpha, rslora, the modules the targets adapt; both named); a LoRA of
    another base (:func:`read_init_lora`)."""
    lo = cfg.trainer.lora
    set_keys = [f"trainer.lora.{k}={lo[k]}" for k, unset in (("rank", None), ("alpha", None), ("rslora", None),
                                                              ("dropout", 0.0), ("b_init_std", 0.0))
                if lo[k] != unset] + ([f"trainer.lora.targets={list(lo.targets)}"] if lo.targets else [])
    if set_keys and not lo.enabled:  # else a full fine-tuning would run with the LoRA settings ignored
        raise ValueError(f"{', '.join(set_keys)} set, but trainer.lora.enabled=false: this would fine-tune every "
                         "weight; add trainer.lora.enabled=true for LoRA (or drop the trainer.lora keys)")
    if not lo.init_from:
        if lo.enabled:  # a full fine-tuning's record keeps them unset (checked above when it is re-read)
            lo.rank, lo.alpha, lo.rslora = _or(lo.rank, DEFAULT_RANK), _or(lo.alpha, DEFAULT_ALPHA), bool(lo.rslora)
        return
    if not lo.enabled:
        raise ValueError(f"trainer.lora.init_from={lo.init_from} continues a LoRA: add trainer.lora.enabled=true "
                         "(or drop trainer.lora.init_from)")
    if not cfg.trainer.init_from:
        raise ValueError(f"trainer.lora.init_from={lo.init_from} needs the base it was trained on: set "
                         "trainer.init_from (a Wan folder, or the generator's vitp export)")
    adapters, conf = read_init_lora(cfg)
    linears = model_linears(cfg)
    have = file_pieces(linears, adapters, conf)
    clash = [f"trainer.{k}={v} but the file's is {conf_v}" for k, v, conf_v, same in (
        ("lora.rank", lo.rank, conf["rank"], lo.rank is None or int(lo.rank) == int(conf["rank"])),
        ("lora.alpha", lo.alpha, float(conf.get("alpha", conf["rank"])),
         lo.alpha is None or abs(float(lo.alpha) - float(conf.get("alpha", conf["rank"]))) <= 1e-9 * float(lo.alpha)),
        ("lora.rslora", lo.rslora, bool(conf.get("rslora", False)),
         lo.rslora is None or bool(lo.rslora) == bool(conf.get("rslora", False)))) if not same]
    if lo.targets and _targets_pieces(linears, lo.targets) != have:
        clash.append(f"trainer.lora.targets={list(lo.targets)} adapt "
                     f"{_show_pieces(linears, _targets_pieces(linears, lo.targets))}, the file "
                     f"{_show_pieces(linears, have)}")
    if clash:
        raise ValueError(f"trainer.lora.init_from={lo.init_from}: {'; '.join(clash)}: leave those keys unset (null; "
                         "targets []) to continue the file's adapters as they are, or train new ones without "
                         "trainer.lora.init_from")
    lo.rank, lo.alpha, lo.rslora = int(conf["rank"]), float(conf.get("alpha", conf["rank"])), bool(conf.get("rslora"))
    if not lo.targets:
        theirs = [str(t) for t in conf.get("targets") or []]
        names = [ps[j] for m, ps in linears for j in have.get(m, [])]
        lo.targets = theirs if theirs and _targets_pieces(linears, theirs) == have else names


def initial_factors(cfg) -> Dict[str, Tuple[Any, Any]]:
    """``{canonical linear: (A, B)}`` of ``trainer.lora.init_from`` (:func:`read_init_lora`): the
    ``init`` of :func:`apply_lora`, full tensors each rank slices its share of."""
    adapters, _ = read_init_lora(cfg)
    return {k[:-len(".lora_A")]: (v, adapters[k[:-1] + "B"]) for k, v in adapters.items() if k.endswith(".lora_A")}


SAMPLE = 4096  # bytes of data hashed at each end of every tensor


def _tensor_entries(files) -> Dict[str, Tuple[Path, int, int, str, list]]:
    """``{tensor name: (file, data start, data end, dtype, shape)}`` of safetensors ``files``, read
    from their headers. Raises ``ValueError`` naming a file whose header is damaged."""
    import json
    import struct

    out = {}
    for f in files:
        with open(f, "rb") as fh:
            try:
                n = struct.unpack("<Q", fh.read(8))[0]
                header = json.loads(fh.read(n))
            except (struct.error, ValueError, UnicodeDecodeError):
                raise ValueError(f"{f} is not a safetensors file (damaged header); copy it again") from None
        for name, info in header.items():
            if name != "__metadata__":
                a, b = info["data_offsets"]
                out[name] = (f, 8 + n + a, 8 + n + b, info["dtype"], info["shape"])
    return out


def base_hash(path) -> str:
    """A fingerprint of base weights: a Wan transformer folder, or the generator's vitp export (a
    ``.safetensors`` file, or a sharded export's file / ``.index.json``). sha256 over every tensor,
    sorted by name whichever file holds it, of its name, dtype, shape and the first and last
    :data:`SAMPLE` bytes of its data: the same tensors in other shards (saved with another
    ``max_shard_size``, merged into one file, renamed, copied) give the same hash; another
    architecture changes names or shapes, another fine-tune of the same one its data. Cheap (about
    8 KiB read per tensor, whatever the model's size). Raises as
    :func:`vitp.models.wan_keys.weight_locations`, ``FileNotFoundError`` for an export that is
    not there, ``ValueError`` for a damaged file."""
    import json

    from .wan_keys import weight_locations

    path = Path(path)
    if path.is_dir():
        files = sorted(set(weight_locations(path).values()))
    else:
        index = path if path.name.endswith(".index.json") else path.with_name(path.name + ".index.json")
        if path.is_file() and path != index:
            files = [path]
        elif index.is_file():
            files = [index.parent / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        else:
            raise FileNotFoundError(f"base weights {path} do not exist (a LoRA base is a Wan folder or a vitp export "
                                    "file written by vitp-export)")
    entries, h = _tensor_entries(files), hashlib.sha256()
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(open(f, "rb")) for f in files}
        for name in sorted(entries):
            f, a, b, dtype, shape = entries[name]
            fh = handles[f]
            fh.seek(a)
            head = fh.read(min(SAMPLE, b - a))
            fh.seek(max(a, b - SAMPLE))
            tail = fh.read(min(SAMPLE, b - a))
            for part in (json.dumps([name, dtype, shape]).encode(), head, tail):
                h.update(len(part).to_bytes(8, "little") + part)
    return h.hexdigest()


def run_record(cfg) -> Optional[Dict[str, object]]:
    """The adapters' record of a LoRA run (``None`` without LoRA): :meth:`LoraSpec.meta`, the
    ``family``, the targeted ``pieces`` of every adapted linear of the whole model, the ``base``
    it trains on (``{"folder": the Wan transformer folder or the generator's export file
    (:func:`base_path`), "hash": base_hash(...)}``) and the LoRA file it continued
    (``init_from``, ``None`` for new adapters)."""
    spec = spec_of(cfg)
    if spec is None:
        return None
    folder = base_path(cfg)
    pieces = {m: list(targeted_pieces(m, ps, spec.targets)) for m, ps in model_linears(cfg)}
    return {**spec.meta(), "family": spec.family, "pieces": {m: p for m, p in pieces.items() if p},
            "base": {"folder": str(folder), "hash": base_hash(folder)},
            "init_from": str(lora_file(cfg.trainer.lora.init_from)) if cfg.trainer.lora.get("init_from") else None}


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
    if old["hash"] != new["hash"] and old["folder"] == new["folder"]:
        raise ValueError(f"checkpoint {tag} holds LoRA adapters trained on the base in {old['folder']}, whose weights "
                         f"have changed since (hash {old['hash'][:16]} then, {new['hash'][:16]} now): adapters fit "
                         "only their own base; put that base's files back there, or start a new run (another "
                         "hydra.run.dir)")
    if old["hash"] != new["hash"]:
        from .wan_run import pipeline_folder

        # a pipeline's transformer/ is given as the pipeline, which also brings its scheduler and VAE
        given = pipeline_folder(Path(old["folder"])) or old["folder"]
        raise ValueError(f"checkpoint {tag} holds LoRA adapters trained on the base {old['folder']} (weights hash "
                         f"{old['hash'][:16]}), but trainer.init_from gives {new['folder']} (hash {new['hash'][:16]}): "
                         f"adapters fit only their own base; resume with trainer.init_from={given}, "
                         "or start a new run (another hydra.run.dir)")
    def same(k: str) -> bool:  # init_from: a checkpoint of before paths were recorded absolute, as read then
        a, b = saved.get(k), record[k]
        return os.path.abspath(a) == os.path.abspath(b) if k == "init_from" and a and b else a == b

    diffs = [f"{k}: {saved.get(k)!r} in the checkpoint vs {record[k]!r} now" for k in ("rank", "pieces", "alpha",
                                                                                         "rslora", "init_from")
             if k in saved and not same(k)]  # alpha and rslora scale the trained adapters
    if diffs:
        raise ValueError(f"checkpoint {tag} holds other LoRA adapters ({'; '.join(diffs)}): resume with its "
                         "trainer.lora settings (trainer.lora.init_from only starts a run: a resumed run's adapters "
                         "come from its checkpoint), or start a new run (another hydra.run.dir)")


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
    import torch

    from vitp.parallel.lora import attach_lora, init_lora, is_lora_key, lora_scaling

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
    from vitp.parallel.lora import lora_linears

    return {key_of(n): (m.lora_A.detach().clone(), m.lora_B.detach().clone()) for n, m in lora_linears(model)}


__all__ = ["adopt_lora_file", "base_hash", "base_path", "base_shapes", "check_same_base", "file_pieces",
           "initial_factors", "lora_file", "OtherBaseError", "model_linears", "read_init_lora", "run_record", "check_lora_config", "spec_of",
           "DEFAULT_ALPHA", "DEFAULT_RANK", "DEFAULT_TARGETS", "GENERATOR_LINEARS", "LINEARS", "LoraSpec", "apply_lora", "block_linears",
           "check_targets", "lora_factors", "seed_of", "targeted_pieces"]
