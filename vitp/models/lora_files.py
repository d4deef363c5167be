"""LoRA files: vitp's adapters as the files diffusers and ComfyUI load, merged weights, and back.

LoRA (Hu et al. 2021, arXiv:2106.09685) adds ``scaling * B A`` to a frozen linear weight ``W``
``(out, in)``, ``A (r, in)``, ``B (out, r)``, ``scaling = alpha / r`` (rsLoRA, Kalajdzievski 2023,
arXiv:2312.03732: ``alpha / sqrt(r)``), peft's semantics.

vitp's adapters (the convention of the LoRA layers): parameters ``<linear>.lora_A`` and
``<linear>.lora_B`` beside the base ``<linear>.weight``. A linear that stacks ``P`` pieces along its
output rows (Wan's ``attn.qkv`` = diffusers' ``to_q, to_k, to_v``; ``cross_attn.kv`` = ``to_k,
to_v``; the generator's timm ``qkv``) has one LoRA per targeted piece, in piece order:
``lora_A (n r, in)`` (piece ``k``'s A = rows ``k r:(k+1) r``), ``lora_B (n out_piece, r)``, and
``config["pieces"][<linear>]`` the ascending indices of the ``n`` targeted pieces among the ``P``
(absent: all ``P``, which is ``[0]`` for a plain linear). Piece ``j``'s update goes to its own
rows of ``W`` only. ``config``: ``{"rank", "alpha", "rslora", "dropout", "targets", "pieces",
"base": {"folder", "hash"}}``.

Files (one safetensors file each, vitp's ``config`` as JSON under :data:`CONFIG_KEY` in the metadata):

- diffusers (:func:`to_diffusers_lora`): the keys ``WanPipeline.save_lora_weights`` writes,
  ``transformer.<diffusers module>.lora_A.weight`` / ``.lora_B.weight``, and the peft
  ``LoraConfig`` (``r``, ``lora_alpha``, ``use_rslora``, ``target_modules``, ...) under
  :data:`ADAPTER_METADATA_KEY` with the ``transformer.`` prefix, as diffusers'
  ``LoraBaseMixin.write_lora_layers`` writes it and ``load_lora_adapter`` reads it
  (``diffusers/loaders/lora_base.py``, ``loaders/peft.py``);
- ComfyUI (:func:`to_comfyui_lora`): ``diffusion_model.<original Wan module>.lora_A.weight`` /
  ``.lora_B.weight`` / ``.alpha`` (``alpha = scaling * r``), the names of the original Wan
  checkpoint (``self_attn.q`` ... ``ffn.2``) that ComfyUI's ``comfy/lora.py`` maps (its generic
  ``diffusion_model.<key>`` entries, ``lora_B``/``lora_A`` pairs and ``.alpha``) and that
  diffusers' ``_convert_non_diffusers_wan_lora_to_diffusers`` converts back;
- vitp (:func:`to_vitp_lora`, the generator): ``<vitp linear>.lora_A.weight`` / ``.lora_B.weight``,
  whole fused tensors, the config in the metadata (a run's ``RUN/lora/lora.safetensors``, keys
  ``<vitp linear>.lora_A`` / ``.lora_B``, reads the same).

:func:`merge_lora` adds the adapters to a base state; :func:`read_lora_file` reads any of the
three back into the convention, refusing a LoRA of another base.
"""
from __future__ import annotations

import json
import logging
import math
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

PathLike = Union[str, Path]
FORMAT = "vitp.lora/1"
WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
STATE = "lora.safetensors"  # a run's RUN/lora adapters in vitp's keys (vitp.train.lora)
FOLDED_KEY = "vitp_scaling_in_b"  # metadata: "1" when lora_B holds alpha / r (vitp's diffusers files)
ADAPTER_METADATA_KEY = "lora_adapter_metadata"  # diffusers' LORA_ADAPTER_METADATA_KEY
CONFIG_KEY = "vitp_lora"
PREFIX = "transformer."  # diffusers' WanLoraLoaderMixin.transformer_name
COMFY_PREFIX = "diffusion_model."
# diffusers module -> original Wan module (ComfyUI's names), per block and at the top
_BLOCK_ORIGINAL = (("attn1.to_q", "self_attn.q"), ("attn1.to_k", "self_attn.k"), ("attn1.to_v", "self_attn.v"),
                   ("attn1.to_out.0", "self_attn.o"), ("attn2.to_q", "cross_attn.q"), ("attn2.to_k", "cross_attn.k"),
                   ("attn2.to_v", "cross_attn.v"), ("attn2.to_out.0", "cross_attn.o"),
                   ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"))
_TOP_ORIGINAL = (("condition_embedder.time_proj", "time_projection.1"),
                 ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
                 ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
                 ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
                 ("condition_embedder.text_embedder.linear_2", "text_embedding.2"), ("proj_out", "head.head"))
_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")
Pieces = Dict[Tuple[str, int], Tuple[torch.Tensor, torch.Tensor]]


def lora_scaling(config: Mapping[str, Any]) -> float:
    """``alpha / rank``, or ``alpha / sqrt(rank)`` with ``config["rslora"]`` (peft's ``scaling``).
    Raises ``ValueError`` naming the value for a rank that is not a positive integer."""
    rank = config.get("rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"LoRA config rank={rank!r} must be a positive integer")
    alpha = float(config.get("alpha", rank))
    return alpha / math.sqrt(rank) if config.get("rslora") else alpha / rank


def _module_pairs(adapters: Mapping[str, torch.Tensor]) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """``{linear: (lora_A, lora_B)}`` of a convention state. Raises ``KeyError`` naming a key that
    is not ``<linear>.lora_A`` / ``.lora_B`` or an A without its B (or the reverse)."""
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    for k, v in adapters.items():
        m, _, kind = k.rpartition(".")
        if kind not in ("lora_A", "lora_B") or not m:
            raise KeyError(f"{k!r} is not an adapter key (<linear>.lora_A or <linear>.lora_B)")
        out.setdefault(m, {})[kind] = v
    lone = sorted(m for m, d in out.items() if len(d) != 2)
    if lone:
        raise KeyError(f"adapters of {lone[:4]} have lora_A without lora_B or the reverse; pass both of every linear")
    return {m: (d["lora_A"], d["lora_B"]) for m, d in sorted(out.items())}


def _targeted(config: Mapping[str, Any], module: str, A: torch.Tensor) -> int:
    """How many pieces of ``module`` are targeted: ``len(pieces[module])``, else ``A`` rows over the rank."""
    pieces = config.get("pieces") or {}
    return len(pieces[module]) if module in pieces else max(1, A.shape[0] // config["rank"])


def target_pieces(linear: str, pieces: Sequence[str], targets: Sequence[str]) -> List[int]:
    """Indices of the pieces of ``linear`` (full name; ``pieces``: the names of its stacked pieces,
    ``(linear,)`` for a plain one) that ``targets`` select, with peft's rule (a target matches a
    name equal to it or ending in ``.<target>``): all of them when a target names the linear
    (``attn.qkv``), else those a target names (diffusers' ``to_q`` selects ``attn1.to_q`` and
    ``attn2.to_q``). ``[]``: not targeted."""
    def hit(name: str) -> bool:
        return any(name == t or name.endswith(f".{t}") for t in targets)

    return list(range(len(pieces))) if hit(linear) else [j for j, d in enumerate(pieces) if hit(d)]


def split_pieces(adapters: Mapping[str, torch.Tensor], config: Mapping[str, Any],
                 n_pieces: Mapping[str, int]) -> Pieces:
    """``{(linear, piece j): (A_j (r, in), B_j (out_piece, r))}`` of a convention state.

    ``n_pieces``: ``{linear: P}``, the pieces each targeted linear stacks. Raises ``KeyError`` for
    a linear it lacks, ``ValueError`` naming the linear when the shapes do not follow the
    convention (``A`` rows not ``n r``, ``B`` rows not ``n`` equal pieces, ``pieces`` not ascending
    indices below ``P``).
    """
    r, pieces = config["rank"], config.get("pieces") or {}
    out: Pieces = {}
    for m, (A, B) in _module_pairs(adapters).items():
        if m not in n_pieces:
            raise KeyError(f"adapter {m!r} is not a linear of this model; known: {sorted(n_pieces)[:6]} ...")
        P = n_pieces[m]
        js = list(pieces.get(m, range(P)))
        n = len(js)
        if js != sorted(set(js)) or not js or js[-1] >= P or js[0] < 0:
            raise ValueError(f"{m}: pieces {js} must be ascending indices among its {P} pieces")
        if A.dim() != 2 or B.dim() != 2 or A.shape[0] != n * r or B.shape[1] != r or B.shape[0] % n:
            raise ValueError(f"{m}: lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)} are not {n} piece(s) of "
                             f"rank {r} (A ({n} x {r}, in), B ({n} x out_piece, {r}))")
        o = B.shape[0] // n
        out.update({(m, j): (A[k * r:(k + 1) * r], B[k * o:(k + 1) * o]) for k, j in enumerate(js)})
    return out


@lru_cache(maxsize=16)
def _wan_linears(frozen: Tuple) -> Tuple[Tuple[str, Tuple[str, ...]], ...]:
    from .wan import WanConfig, WanModel
    from .wan_keys import key_map

    config = WanConfig.from_dict(dict(frozen))
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in WanModel(config).state_dict().items()}
    return tuple((v[:-len(".weight")], tuple(d[:-len(".weight")] for d in ds))
                 for v, ds in key_map(config).items() if v.endswith(".weight") and len(shapes[v]) == 2)


def _config_dict(wan_config: Any) -> Dict[str, Any]:
    return wan_config.to_dict() if hasattr(wan_config, "to_dict") else dict(wan_config)


def wan_linears(wan_config: Any) -> Dict[str, Tuple[str, ...]]:
    """``{vitp linear: diffusers modules stacked along its output rows}`` of every linear of a Wan
    model (a :class:`~vitp.models.wan.WanConfig` or diffusers ``config.json`` dict), from
    :func:`vitp.models.wan_keys.key_map`: ``blocks.0.attn.qkv -> (blocks.0.attn1.to_q, ...to_k, ...to_v)``."""
    frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                          for k, v in _config_dict(wan_config).items() if not k.startswith("_")))
    return dict(_wan_linears(frozen))


def original_name(module: str) -> str:
    """The original Wan checkpoint's name (ComfyUI's) of a diffusers Wan linear:
    ``blocks.3.attn1.to_q -> blocks.3.self_attn.q``, ``proj_out -> head.head``. Raises ``KeyError``
    for a module without one."""
    m = _BLOCK.match(module)
    table = dict(_BLOCK_ORIGINAL if m else _TOP_ORIGINAL)
    rest = m.group(2) if m else module
    if rest not in table:
        raise KeyError(f"diffusers module {module!r} has no original Wan name")
    return f"blocks.{m.group(1)}.{table[rest]}" if m else table[rest]


def diffusers_name(original: str) -> str:
    """Inverse of :func:`original_name`. Raises ``KeyError`` for a name it does not know."""
    m = _BLOCK.match(original)
    table = {o: d for d, o in (_BLOCK_ORIGINAL if m else _TOP_ORIGINAL)}
    rest = m.group(2) if m else original
    if rest not in table:
        raise KeyError(f"{original!r} is not an original Wan linear name (self_attn.q/k/v/o, cross_attn.q/k/v/o, "
                       "ffn.0, ffn.2, time_projection.1, ...)")
    return f"blocks.{m.group(1)}.{table[rest]}" if m else table[rest]


def _wan_pieces(adapters: Mapping[str, torch.Tensor], config: Mapping[str, Any],
                wan_config: Any) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """``{diffusers module: (A, B)}`` of a Wan convention state (contiguous copies)."""
    lin = wan_linears(wan_config)
    parts = split_pieces(adapters, config, {m: len(ds) for m, ds in lin.items()})
    return {lin[m][j]: (a.detach().cpu().contiguous().clone(), b.detach().cpu().contiguous().clone())
            for (m, j), (a, b) in parts.items()}


def _metadata(config: Mapping[str, Any], **extra: str) -> Dict[str, str]:
    lora_scaling(config)  # checks the rank
    return {"format": "pt", "vitp_format": FORMAT, CONFIG_KEY: json.dumps(dict(config), sort_keys=True), **extra}


def peft_config(config: Mapping[str, Any], target_modules: Sequence[str]) -> Dict[str, Any]:
    """The peft ``LoraConfig`` keyword arguments of a vitp LoRA config on ``target_modules`` (full
    module paths, so no other module matches): ``r``, ``lora_alpha``, ``use_rslora``,
    ``lora_dropout``, one rank and alpha for all (empty patterns), no bias, no DoRA."""
    return {"r": int(config["rank"]), "lora_alpha": float(config.get("alpha", config["rank"])),
            "use_rslora": bool(config.get("rslora", False)), "lora_dropout": float(config.get("dropout", 0.0)),
            "target_modules": sorted(target_modules), "rank_pattern": {}, "alpha_pattern": {}, "bias": "none",
            "use_dora": False, "lora_bias": False, "init_lora_weights": True}


def to_diffusers_lora(adapters: Mapping[str, torch.Tensor], config: Mapping[str, Any],
                      wan_config: Any) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """``(tensors, metadata)`` of the diffusers LoRA file of Wan adapters (write with
    :func:`save_lora_file` as :data:`WEIGHT_NAME`): ``transformer.<module>.lora_A.weight (r, in)``
    and ``.lora_B.weight (out, r)`` per targeted diffusers module, and the metadata
    ``WanPipeline.save_lora_weights(..., transformer_lora_adapter_metadata=...)`` writes:
    :data:`ADAPTER_METADATA_KEY` = JSON of ``{"transformer.<LoraConfig key>": value}``
    (:func:`peft_config`), which ``load_lora_adapter`` turns into the ``LoraConfig``. The scaling
    (``alpha / r``) is folded into ``lora_B`` and the metadata says ``lora_alpha = r``: diffusers
    0.42 reads that metadata only when it finds the file in a folder itself (``load_lora_weights(
    FOLDER)``), not from a file path, where it would scale by 1; folded, every call gives the
    trained model. vitp's own config (:data:`CONFIG_KEY`, with the true alpha) and
    :data:`FOLDED_KEY` let :func:`read_lora_file` unfold it.

    Raises ``KeyError`` / ``ValueError`` as :func:`split_pieces` (an adapter on no Wan linear,
    shapes off the convention).
    """
    mods = _wan_pieces(adapters, config, wan_config)
    sc = lora_scaling(config)  # folded into B: diffusers reads lora_alpha only when it resolves the file itself
    tensors = {f"{PREFIX}{d}.lora_{x}.weight": (t if x == "A" else (t.float() * sc).to(t.dtype))
               for d, ab in mods.items() for x, t in zip("AB", ab)}
    unit = {**config, "alpha": float(config["rank"]), "rslora": False}  # scaling 1 for every loader
    kwargs = {f"{PREFIX}{k}": v for k, v in peft_config(unit, list(mods)).items()}
    return tensors, _metadata(config, **{ADAPTER_METADATA_KEY: json.dumps(kwargs, indent=2, sort_keys=True),
                                         FOLDED_KEY: "1"})


def to_comfyui_lora(adapters: Mapping[str, torch.Tensor], config: Mapping[str, Any],
                    wan_config: Any) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """``(tensors, metadata)`` of the ComfyUI LoRA file of Wan adapters:
    ``diffusion_model.<original module>.lora_A.weight (r, in)``, ``.lora_B.weight (out, r)`` and
    ``.alpha`` (a 0-d fp32 tensor, ``scaling * r``: ComfyUI and diffusers' converter scale by
    ``alpha / r``) per targeted block module; a module outside the blocks (``head.head``,
    ``time_projection.1``, ...) has ``scaling`` folded into ``lora_B`` and no ``.alpha`` (diffusers'
    converter reads none there; both then scale by 1). No :data:`ADAPTER_METADATA_KEY`: diffusers'
    converter folds the alpha into A and B, so a LoraConfig alpha would apply it twice.

    Raises as :func:`to_diffusers_lora`, and ``KeyError`` for a module without an original name.
    """
    mods = _wan_pieces(adapters, config, wan_config)
    s = lora_scaling(config)
    alpha = torch.tensor(s * config["rank"], dtype=torch.float32)
    tensors: Dict[str, torch.Tensor] = {}
    for d, (a, b) in mods.items():
        o = f"{COMFY_PREFIX}{original_name(d)}"
        if _BLOCK.match(d):
            tensors.update({f"{o}.lora_A.weight": a, f"{o}.lora_B.weight": b, f"{o}.alpha": alpha.clone()})
        else:  # diffusers' converter takes no .alpha outside the blocks: scaling folded into B
            tensors.update({f"{o}.lora_A.weight": a, f"{o}.lora_B.weight": (b.float() * s).to(b.dtype)})
    return tensors, _metadata(config)


def to_vitp_lora(adapters: Mapping[str, torch.Tensor], config: Mapping[str, Any]
                 ) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """``(tensors, metadata)`` of vitp's own LoRA file (the generator's ``--format lora``):
    ``<linear>.lora_A.weight`` / ``.lora_B.weight`` in vitp's keys, fused linears whole as in the
    convention, the config (with ``pieces``) in the metadata. Raises as :func:`split_pieces`
    (``P`` taken as the targeted count where ``pieces`` does not say)."""
    pairs = _module_pairs(adapters)
    pieces = (config.get("pieces") or {})
    split_pieces(adapters, config, {m: max(pieces.get(m, [0])) + 1 for m in pairs})  # checks the shapes
    tensors = {f"{m}.lora_{x}.weight": t.detach().cpu().contiguous().clone() for m, ab in pairs.items()
               for x, t in zip("AB", ab)}
    return tensors, _metadata(config)


def save_lora_file(path: PathLike, tensors: Dict[str, torch.Tensor], metadata: Dict[str, str]) -> Path:
    """Write ``tensors`` with ``metadata`` as one safetensors file, atomically; a folder ``path``
    gets :data:`WEIGHT_NAME` inside. Returns the file."""
    from vitp.utils import atomic_write, save_safetensors

    path = Path(path)
    if path.is_dir() or not path.suffix:
        path = path / WEIGHT_NAME
    with atomic_write(path) as tmp:
        save_safetensors(tensors, str(tmp), metadata=metadata)
    return path


def merge_lora(base_state: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor],
               config: Mapping[str, Any]) -> Dict[str, torch.Tensor]:
    """A copy of ``base_state`` (vitp keys) with every adapter merged: rows ``j out_piece :
    (j+1) out_piece`` of ``<linear>.weight`` plus ``scaling * B_j A_j`` per targeted piece ``j``
    (computed in fp32, cast back to the weight's dtype); other tensors shared, not copied.

    ``P`` of a linear is its weight's rows over ``out_piece`` (``B`` rows / targeted pieces).
    Raises ``KeyError`` naming an adapter whose ``<linear>.weight`` the base lacks, ``ValueError``
    when shapes disagree (:func:`split_pieces`; ``in`` or ``out_piece`` not the weight's).
    """
    s, n_pieces = lora_scaling(config), {}
    for m, (A, B) in _module_pairs(adapters).items():
        w = base_state.get(f"{m}.weight")
        if w is None:
            raise KeyError(f"the base has no {m}.weight for the adapter {m}.lora_A: another base?")
        o = B.shape[0] // _targeted(config, m, A)
        if w.dim() != 2 or w.shape[1] != A.shape[1] or not o or w.shape[0] % o:
            raise ValueError(f"{m}: lora_A {tuple(A.shape)} / lora_B {tuple(B.shape)} do not fit its weight "
                             f"{tuple(w.shape)}: a LoRA of another base")
        n_pieces[m] = w.shape[0] // o
    out = dict(base_state)
    for (m, j), (a, b) in split_pieces(adapters, config, n_pieces).items():
        w = out[f"{m}.weight"]
        if w is base_state[f"{m}.weight"]:
            w = out[f"{m}.weight"] = w.detach().clone()
        o = b.shape[0]
        with torch.no_grad():
            w[j * o:(j + 1) * o] = (w[j * o:(j + 1) * o].float() + s * (b.float() @ a.float())).to(w.dtype)
    return out


def wan_state_shapes(wan_config: Any) -> Dict[str, Tuple[int, ...]]:
    """``{vitp key: shape}`` of a Wan model's state (built on the meta device): the ``base_shapes``
    :func:`read_lora_file` checks a Wan LoRA against."""
    from .wan import WanConfig, WanModel

    config = wan_config if isinstance(wan_config, WanConfig) else WanConfig.from_dict(_config_dict(wan_config))
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in WanModel(config).state_dict().items()}


KOHYA_PREFIXES = ("lora_unet_", "lora_te")  # kohya-ss / musubi-tuner key names: lora_unet_blocks_0_self_attn_q...


def _kind(keys: Sequence[str]) -> str:
    if any(k.startswith(KOHYA_PREFIXES) for k in keys):
        return "kohya"
    if any(k.startswith(COMFY_PREFIX) for k in keys):
        return "comfyui"
    return "diffusers" if any(k.startswith(PREFIX) for k in keys) else "vitp"


def _pairs_of_file(tensors: Dict[str, torch.Tensor], kind: str, path: Path
                   ) -> Tuple[Dict[str, Tuple[torch.Tensor, torch.Tensor]], Dict[str, float]]:
    """``({module: (A, B)}, {module: alpha})`` of a file's tensors: diffusers modules for the
    diffusers and ComfyUI files (original names translated), vitp linears for vitp's own."""
    pre = {"comfyui": COMFY_PREFIX, "diffusers": PREFIX, "vitp": ""}[kind]
    parts: Dict[str, Dict[str, torch.Tensor]] = {}
    alphas: Dict[str, float] = {}
    for k, v in tensors.items():
        m = re.match(rf"^{re.escape(pre)}(.+?)\.(lora_A\.weight|lora_B\.weight|lora_down\.weight|lora_up\.weight|alpha"
                     rf"{'|lora_A|lora_B' if kind == 'vitp' else ''})$", k)  # vitp: also a run's lora.safetensors
        if not m:
            raise ValueError(f"{path}: {k!r} is not a LoRA key of a {kind} file (<module>.lora_A.weight, "
                             ".lora_B.weight, .alpha); vitp reads plain LoRA files (no DoRA, LoKr, biases)")
        try:
            mod = diffusers_name(m.group(1)) if kind == "comfyui" else m.group(1)
        except KeyError as e:  # a ComfyUI-prefixed key of a module Wan does not have
            raise ValueError(f"{path}: {k!r}: {e.args[0]}; vitp reads LoRAs of Wan's linears") from None
        if m.group(2) == "alpha":
            alphas[mod] = float(v.item())
        else:
            parts.setdefault(mod, {})["A" if m.group(2)[5] in "Ad" else "B"] = v
    lone = sorted(m for m, d in parts.items() if len(d) != 2)
    if lone:
        raise ValueError(f"{path}: {lone[:4]} have lora_A without lora_B or the reverse: the file is incomplete")
    return {m: (d["A"], d["B"]) for m, d in parts.items()}, alphas


def _file_config(path: Path, meta: Dict[str, str], pairs: Dict[str, Tuple[torch.Tensor, torch.Tensor]],
                 alphas: Dict[str, float], kind: str) -> Dict[str, Any]:
    """vitp's config of a file: its :data:`CONFIG_KEY` metadata, else diffusers' LoraConfig
    metadata, else the tensors' rank and ``.alpha`` (ComfyUI; alpha = rank without one). The
    ranks of a vitp file's fused tensors are checked later (:func:`_check_base`)."""
    ranks = sorted({a.shape[0] for a, _ in pairs.values()})
    if CONFIG_KEY in meta:
        config = json.loads(meta[CONFIG_KEY])
    elif ADAPTER_METADATA_KEY in meta:
        peft = {k.removeprefix(PREFIX): v for k, v in json.loads(meta[ADAPTER_METADATA_KEY]).items()}
        if peft.get("rank_pattern") or peft.get("alpha_pattern") or peft.get("use_dora"):
            raise ValueError(f"{path}: per-module ranks or alphas (rank_pattern / alpha_pattern) or DoRA: vitp's "
                             "LoRA has one rank and alpha")
        config = {"rank": int(peft["r"]), "alpha": float(peft.get("lora_alpha", peft["r"])),
                  "rslora": bool(peft.get("use_rslora", False)), "dropout": float(peft.get("lora_dropout", 0.0))}
    else:
        if len(ranks) != 1 or len(set(alphas.values())) > 1:
            raise ValueError(f"{path}: ranks {ranks} and alphas {sorted(set(alphas.values()))} vary by module: "
                             "vitp's LoRA has one rank and alpha")
        config = {"rank": ranks[0], "alpha": next(iter(alphas.values()), float(ranks[0])), "rslora": False,
                  "dropout": 0.0}
    want = lora_scaling(config) * config["rank"]
    bad = sorted(m for m, a in alphas.items() if abs(a - want) > 1e-6 * abs(want))
    if (kind != "vitp" and ranks != [config["rank"]]) or bad:
        raise ValueError(f"{path}: tensors of rank {ranks} and alphas of {bad[:3]} disagree with its metadata "
                         f"(rank {config['rank']}, alpha x scaling {want}): the file is damaged or edited")
    return config


def _fuse(path: Path, pairs: Dict[str, Tuple[torch.Tensor, torch.Tensor]], wan_config: Any
          ) -> Tuple[Dict[str, torch.Tensor], Dict[str, List[int]], Dict[str, int]]:
    """Diffusers modules back into vitp's fused linears: ``(adapters, pieces, {linear: P})``.
    Raises ``ValueError`` naming the file for a module this Wan lacks."""
    where = {d: (m, j) for m, ds in wan_linears(wan_config).items() for j, d in enumerate(ds)}
    missing = sorted(d for d in pairs if d not in where)
    if missing:
        layers = _config_dict(wan_config).get("num_layers")
        raise ValueError(f"{path}: a LoRA of another base: it adapts {missing[:3]}, which this Wan (num_layers="
                         f"{layers}) lacks; load it on the model it was trained for, or train one for this model")
    by: Dict[str, List[Tuple[int, str]]] = {}
    for d in pairs:
        by.setdefault(where[d][0], []).append((where[d][1], d))
    adapters, pieces = {}, {}
    for m, js in sorted(by.items()):
        js.sort()
        adapters[f"{m}.lora_A"] = torch.cat([pairs[d][0] for _, d in js])
        adapters[f"{m}.lora_B"] = torch.cat([pairs[d][1] for _, d in js])
        pieces[m] = [j for j, _ in js]
    counts = {m: len(ds) for m, ds in wan_linears(wan_config).items()}
    return adapters, pieces, counts


def _check_base(path: Path, adapters: Dict[str, torch.Tensor], config: Dict[str, Any],
                base_shapes: Mapping[str, Sequence[int]], base_hash: Optional[str]) -> None:
    """Raises ``ValueError`` naming the file, what differs and the fix when the adapters do not fit
    ``base_shapes`` or the file's base hash is not ``base_hash``."""
    fix = "load it on the base it was trained for"
    base = config.get("base") or {}
    if base.get("folder"):
        fix += f" ({base['folder']})"
    fix += ", or train a LoRA for this base"
    theirs = base.get("hash")
    if base_hash and theirs and theirs != base_hash:
        raise ValueError(f"{path}: a LoRA of another base: its base hash is {theirs}, this model's is {base_hash}; {fix}")
    if base_hash and not theirs:  # another trainer's file: shapes are all there is to check
        logging.getLogger("vitp").warning(
            "%s records no base (a file of another trainer, or not vitp's): its shapes fit this model, but whether it "
            "was trained on these weights cannot be checked", path)
    pieces, counts = config.get("pieces") or {}, {}
    for m, (A, B) in _module_pairs(adapters).items():
        w = base_shapes.get(f"{m}.weight")
        n = _targeted(config, m, A)
        o = B.shape[0] // n
        P = w[0] // o if w is not None and len(w) == 2 and o and w[0] % o == 0 else 0
        if not P or w[1] != A.shape[1] or max(pieces.get(m, [0])) >= P:
            have = f"weight {tuple(w)}" if w is not None else "no such linear"
            raise ValueError(f"{path}: a LoRA of another base: {m} has lora_A {tuple(A.shape)}, lora_B "
                             f"{tuple(B.shape)} but this model has {have}; {fix}")
        counts[m] = P if m in pieces else n
    try:
        split_pieces(adapters, config, counts)
    except ValueError as e:
        raise ValueError(f"{path}: {e}: the file is damaged or edited") from None


def read_lora_file(path: PathLike, base_shapes: Mapping[str, Sequence[int]], wan_config: Any = None,
                   base_hash: Optional[str] = None) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """``(adapters, config)`` in vitp's convention (fp32) of a LoRA file: vitp's diffusers or
    ComfyUI file of a Wan model (``wan_config`` given; a folder holding :data:`WEIGHT_NAME`
    also) or vitp's own file, for ``trainer.init_from=<lora file>`` on a base.

    The config is the file's vitp config when it has one, else diffusers' LoraConfig metadata,
    else its tensors' rank and ``.alpha``; ``pieces`` always follow the file's modules. Files of
    other trainers (diffusers, ComfyUI keys) read the same way when they hold plain LoRAs.

    Raises ``FileNotFoundError`` naming a missing file; ``ValueError`` naming the file for a
    damaged one, kohya-ss / musubi-tuner key names (with how to convert them), keys that are not LoRA keys, ranks or alphas that vary by module, and a LoRA of
    another base (a module or shape ``base_shapes``, ``{vitp key: shape}``, does not have, or a
    base hash in its metadata other than ``base_hash``), with the fix.
    """
    from .wan_keys import open_safetensors

    path = Path(path)
    if path.is_dir():
        path = path / WEIGHT_NAME
    if not path.is_file():
        raise FileNotFoundError(f"LoRA file {path} does not exist")
    with open_safetensors(path) as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    kind = _kind(list(tensors))
    if kind == "kohya":
        key = next(k for k in tensors if k.startswith(KOHYA_PREFIXES))
        raise ValueError(f"{path} uses kohya-ss / musubi-tuner key names ({key!r}), which vitp does not read; convert "
                         "it to diffusers' or ComfyUI's names with the tool that wrote it (musubi-tuner: "
                         "convert_lora.py --target other), then give the converted file")
    if kind != "vitp" and wan_config is None:
        raise ValueError(f"{path} is a {kind} LoRA file of a Wan model; pass wan_config (the base's config)")
    pairs, alphas = _pairs_of_file(tensors, kind, path)
    if not pairs:
        raise ValueError(f"{path} holds no LoRA tensors")
    config = _file_config(path, meta, pairs, alphas, kind)
    if kind == "comfyui" and alphas:  # modules outside the blocks carry the scaling in B
        s = lora_scaling(config)
        pairs = {d: (a, b if d in alphas else b.float() / s) for d, (a, b) in pairs.items()}
    if meta.get(FOLDED_KEY) == "1" and CONFIG_KEY in meta:  # vitp's diffusers file: B holds the scaling
        s = lora_scaling(config)
        pairs = {d: (a, b.float() / s) for d, (a, b) in pairs.items()}
    if kind == "vitp":
        adapters = {f"{m}.lora_{x}": t.float() for m, ab in pairs.items() for x, t in zip("AB", ab)}
    else:
        adapters, pieces, counts = _fuse(path, pairs, wan_config)
        adapters = {k: v.float() for k, v in adapters.items()}
        config["pieces"] = {m: js for m, js in pieces.items() if js != list(range(counts[m]))
                            or m in (config.get("pieces") or {})}
    _check_base(path, adapters, config, base_shapes, base_hash)
    return adapters, config


def merge_into_folder(base_folder: PathLike, adapters: Mapping[str, torch.Tensor], config: Mapping[str, Any],
                      out: PathLike, max_shard_bytes: int = 5 * 10**9) -> Path:
    """Write the Wan transformer of ``base_folder`` (a diffusers transformer or pipeline folder)
    with the adapters merged (:func:`merge_lora`) as a diffusers transformer folder ``out``
    (``config.json``, shards of at most ``max_shard_bytes`` and their index), one shard's tensors
    at a time, in the base's dtypes. Returns ``out``. Raises as :func:`merge_lora` and
    :func:`vitp.models.wan_keys.load_state`."""
    import shutil

    from vitp.utils import shard_groups
    from vitp.utils import save_safetensors
    from .wan_keys import INDEX, key_map, read_config, read_tensors, to_diffusers_state, transformer_folder, \
        weight_locations

    src, out = transformer_folder(base_folder, "transformer"), Path(out)
    wan = read_config(src)
    kmap, where = key_map(wan), weight_locations(src)
    pairs = _module_pairs(adapters)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src / "config.json", out / "config.json")
    with torch.device("meta"):
        from .wan import WanModel

        sizes = {k: v.numel() * 4 for k, v in WanModel(wan).state_dict().items()}
    groups = shard_groups(sizes, max_shard_bytes)
    index: Dict[str, str] = {}
    for i, keys in enumerate(groups):
        raw = read_tensors(where, [d for k in keys for d in kmap[k]])
        state = {k: torch.cat([raw[d] for d in kmap[k]]) for k in keys}
        mods = {f"{m}.lora_{x}": t for m, ab in pairs.items() if f"{m}.weight" in state for x, t in zip("AB", ab)}
        part = to_diffusers_state(merge_lora(state, mods, config), wan, partial=True)
        name = f"diffusion_pytorch_model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_safetensors(part, str(out / name), metadata={"format": "pt"})
        index.update({k: name for k in part})
    (out / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": dict(sorted(index.items()))}, indent=2) + "\n")
    return out
