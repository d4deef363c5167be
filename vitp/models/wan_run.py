"""A run config of ``model.family=wan``: the Wan transformer of ``trainer.init_from`` as the model
of ``vitp-train``, checked and sized before any process group exists.

:func:`adopt_wan_model` reads the folder's ``config.json`` (diffusers' ``WanTransformer3DModel``,
:func:`vitp.models.wan_keys.read_config`) when the config is checked
(:func:`vitp.config.validate_config`) and writes the sizes into ``cfg.model`` under the
generator's names, so the layout checks, the planner's start-up check and the telemetry count
the real model: ``width = num_attention_heads x attention_head_dim``, ``depth = num_layers``,
``num_heads``, ``mlp_ratio = ffn_dim / width``, ``patch_size``/``tubelet_size`` from
``patch_size = (pt, p, p)``, ``text_dim``, and ``text_len = 512``, the caption tokens
``WanPipeline`` gives the transformer (umT5 embeddings zero-padded to 512). On synthetic data the
latent channels follow the folder's ``in_channels``. Without a folder, ``model.preset`` names a
published config (:data:`vitp.plan.wan.WAN_PRESETS`) that sizes the model the same way, so
``vitp-plan`` plans a real Wan with no weights on disk; ``vitp-train`` still needs the folder.

Sample grids and the held-out evaluation of a Wan run are :mod:`vitp.eval.wan_eval`'s (they sample
with the pipeline's ``scheduler/``: a transformer folder without its pipeline trains without grids,
with a warning). What vitp's Wan run does not do is refused here, naming the key and what to set:
``trainer.compile=blocks``, shape buckets, partial synchronisation, the
generator-only options (dropout, layer scale, factorized attention) and the options
:class:`vitp.models.wan.WanConfig` refuses (image-to-video ``image_dim`` / ``added_kv_proj_dim``;
an image-conditioned pipeline, :func:`vitp.models.wan_config.read_pipeline`). The objective's flow
shift defaults to the pipeline's ``scheduler/scheduler_config.json``
(:func:`vitp.objectives.wan_flow.config_shift`).

Wan 2.2 A14B's two experts (the Wan-AI/Wan2.2 repository; diffusers' ``WanPipeline``
``boundary_ratio`` in ``pipelines/wan/pipeline_wan.py`` as the reference): a run fine-tunes one
expert, ``model.expert=high`` (``transformer/``, used by the pipeline for timesteps ``t >=
boundary_ratio * 1000``) or ``low`` (``transformer_2/``, below), or the one ``trainer.init_from``
names; its noise levels are drawn only in that expert's range (:func:`expert_sigma_range`,
``objective.sigma_range``).
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any, Optional, Tuple

from .wan_config import WanConfig

log = logging.getLogger("vitp")

TEXT_TOKENS = 512  # WanPipeline's max_sequence_length: the caption tokens the transformer is given
NEEDS_FOLDER = ("model.family=wan needs trainer.init_from=FOLDER: a local diffusers Wan transformer folder "
                "(config.json + diffusion_pytorch_model*.safetensors) or a whole pipeline folder (model_index.json, "
                "transformer/), e.g. hf download Wan-AI/Wan2.1-T2V-1.3B-Diffusers --local-dir /models/wan2.1 then "
                "trainer.init_from=/models/wan2.1; or scripts/make_tiny_wan.py OUT for a tiny random one")


def is_wan(cfg: Any) -> bool:
    """Whether the run config (or its ``model`` section) trains a Wan transformer."""
    m = getattr(cfg, "model", cfg)
    return str(getattr(m, "family", "vit")) == "wan"


EXPERTS = {"high": "transformer", "low": "transformer_2"}  # model.expert -> its subfolder of a Wan 2.2 A14B pipeline


@functools.lru_cache(maxsize=16)
def _read(folder: str, subfolder: str, stamp: float) -> Tuple[Path, WanConfig]:
    from .wan_config import read_config, transformer_folder

    path = transformer_folder(folder, subfolder)
    return path, read_config(path)


def wan_source(cfg: Any) -> Tuple[Path, WanConfig]:
    """``(transformer folder, its checked WanConfig)`` of the run's ``trainer.init_from`` (read once
    per folder and ``config.json`` change): for a pipeline folder its ``transformer/``, or
    ``transformer_2/`` with ``model.expert=low``. Raises ``ValueError`` without ``trainer.init_from``;
    ``FileNotFoundError`` / ``ValueError`` prefixed with ``trainer.init_from=...`` for a missing
    folder, a damaged ``config.json`` or an option vitp's Wan lacks
    (:func:`vitp.models.wan_config.transformer_folder`, :func:`vitp.models.wan_config.read_config`)."""
    folder = cfg.trainer.init_from
    if not folder:
        preset = cfg.model.get("preset")
        raise ValueError(f"model.preset={preset} sizes a Wan model for vitp-plan, but training reads its weights: "
                         + NEEDS_FOLDER.split(": ", 1)[1] if preset else NEEDS_FOLDER)
    path = Path(str(folder)).expanduser()
    alone = (path / "config.json").is_file()  # a transformer folder names its expert (wan_expert checks the key)
    try:
        sub = "transformer" if alone else _expert_subfolder(cfg, path)
        conf = path / "config.json" if alone else path / sub / "config.json"
        return _read(str(path.resolve()), sub, conf.stat().st_mtime if conf.is_file() else 0.0)
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"trainer.init_from={folder}: {e}") from None


def _expert_subfolder(cfg: Any, pipe: Path) -> str:
    """The transformer subfolder of the pipeline folder ``pipe`` a run trains: ``transformer``, or
    ``transformer_2`` for ``model.expert=low`` (refused, naming the key, on a pipeline without it)."""
    from .wan_config import read_pipeline

    expert = cfg.model.get("expert")
    if expert is None or not (pipe / "model_index.json").is_file():
        return "transformer"
    if not read_pipeline(pipe).two_experts:
        raise ValueError(_NOT_TWO.format(expert=expert))
    return EXPERTS[str(expert)]


_NOT_TWO = ("model.expert={expert}: the folder is not one of Wan 2.2 A14B's two experts (a pipeline whose "
            "model_index.json lists transformer and transformer_2 with a boundary_ratio); drop model.expert, or give "
            "the two-expert pipeline folder")


def wan_expert(cfg: Any, transformer: Path) -> Optional[Tuple[str, float]]:
    """``(expert, boundary_ratio)`` of a run that fine-tunes one of Wan 2.2 A14B's experts
    (``"high"``: ``transformer/``, ``"low"``: ``transformer_2/`` of a pipeline whose
    ``model_index.json`` has both and ``boundary_ratio``), else ``None``. ``transformer``: the run's
    transformer folder (:func:`wan_source`). Raises ``ValueError`` naming the keys for
    ``model.expert`` on a folder without two experts, or naming another expert than the folder
    given (``trainer.init_from=PIPE/transformer`` with ``model.expert=low``)."""
    from .wan_config import read_pipeline

    expert, pipe = cfg.model.get("expert"), pipeline_folder(transformer)
    info = read_pipeline(pipe) if pipe is not None else None
    if info is None or not info.two_experts or transformer.name not in EXPERTS.values():
        if expert:
            raise ValueError(f"trainer.init_from={cfg.trainer.init_from}: " + _NOT_TWO.format(expert=expert))
        return None
    own = "low" if transformer.name == "transformer_2" else "high"
    if expert and expert != own:
        raise ValueError(f"model.expert={expert} ({EXPERTS[expert]}/) but trainer.init_from={cfg.trainer.init_from} is "
                         f"the {own}-noise expert {transformer.name}/: give trainer.init_from={pipe} (the pipeline "
                         f"folder) with model.expert={expert}, or drop model.expert to train {transformer.name}/")
    return own, float(info.boundary_ratio)


def expert_note(cfg: Any) -> Optional[str]:
    """The start-up line of a run on a Wan 2.2 A14B pipeline folder that did not choose its expert
    (no ``model.expert``; ``trainer.init_from`` the pipeline, not one of its expert folders): which
    expert trains, on which noise levels, and the key that picks the other; None otherwise."""
    init = cfg.trainer.get("init_from")
    if not is_wan(cfg) or cfg.model.get("expert") or not init or not (Path(str(init)) / "model_index.json").is_file():
        return None
    path, _ = wan_source(cfg)
    expert = wan_expert(cfg, path)
    if expert is None:
        return None
    other = "low" if expert[0] == "high" else "high"
    lo, hi = cfg.objective.sigma_range
    return (f"trainer.init_from={init} is Wan 2.2 A14B's two-expert pipeline: training its {expert[0]}-noise expert "
            f"{path.name}/ (noise levels [{lo}, {hi}]), the default; set model.expert={other} to train "
            f"{EXPERTS[other]}/ instead")


def expert_sigma_range(given: Any, expert: str, ratio: float) -> list:
    """The noise levels ``[lo, hi]`` an A14B expert trains on: ``[ratio, 1]`` (high: timesteps ``t >=
    boundary_ratio * 1000``, where ``WanPipeline`` uses ``transformer``) or ``[0, ratio]`` (low),
    for ``given`` the default ``[0, 1]``; ``given`` itself when it lies inside. Raises
    ``ValueError`` naming ``objective.sigma_range`` for a range reaching past the boundary."""
    lo, hi = (ratio, 1.0) if expert == "high" else (0.0, ratio)
    g = [float(v) for v in given]
    if g == [0.0, 1.0]:
        return [lo, hi]
    if not lo <= g[0] < g[1] <= hi:
        raise ValueError(f"objective.sigma_range={g} reaches outside the {expert}-noise expert's noise levels [{lo}, "
                         f"{hi}] (boundary_ratio {ratio}: WanPipeline runs {EXPERTS[expert]}/ only there); leave "
                         "objective.sigma_range at [0, 1] (the expert's range) or give a range inside it")
    return g


def preset_config(name: str) -> WanConfig:
    """The checked :class:`WanConfig` of a published Wan config named in
    :data:`vitp.models.wan_config.WAN_PRESETS` (re-exported by :mod:`vitp.plan.wan`). Raises ``ValueError`` naming ``model.preset`` and the known
    names for an unknown one."""
    from .wan_config import WAN_PRESETS

    if name not in WAN_PRESETS:
        raise ValueError(f"model.preset={name}: unknown Wan preset; known: {', '.join(sorted(WAN_PRESETS))} "
                         "(or give trainer.init_from=FOLDER, a diffusers Wan folder or one with its config.json alone)")
    return WanConfig.from_dict(WAN_PRESETS[name], f"model.preset={name}")


def wan_config_of(cfg: Any) -> Tuple[Optional[Path], WanConfig]:
    """``(transformer folder or None, WanConfig)`` of a Wan run: ``trainer.init_from``'s
    ``config.json`` (:func:`wan_source`), else ``model.preset``'s published config (no folder: a
    plan without the weights). Both given: the folder's sizes must be the preset's. Raises
    ``ValueError`` with neither (:data:`NEEDS_FOLDER`), an unknown preset, or a folder of other
    sizes than its preset (naming both)."""
    preset = cfg.model.get("preset")
    if not cfg.trainer.init_from and preset:
        return None, preset_config(str(preset))
    path, c = wan_source(cfg)
    if preset:
        want = preset_config(str(preset))
        diff = [k for k in SIZE_KEYS if getattr(c, k) != getattr(want, k)]
        if diff:
            raise ValueError(f"trainer.init_from={cfg.trainer.init_from} is not model.preset={preset}: "
                             + ", ".join(f"{k} {getattr(c, k)} vs {getattr(want, k)}" for k in diff)
                             + "; drop model.preset (the folder sizes the model) or give the preset's folder")
    return path, c


SIZE_KEYS = ("patch_size", "num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "text_dim",
             "ffn_dim", "num_layers", "cross_attn_norm")


def pipeline_folder(transformer: Path) -> Optional[Path]:
    """The pipeline folder (``model_index.json``) holding the transformer folder, else ``None``."""
    parent = transformer.parent
    return parent if (parent / "model_index.json").is_file() else None


def wan_shift(cfg: Any, transformer: Path) -> float:
    """The objective's flow shift: ``objective.shift``, else the ``flow_shift`` (Euler: ``shift``)
    of the pipeline's ``scheduler/scheduler_config.json`` (:func:`vitp.objectives.wan_flow.config_shift`).
    Raises ``ValueError`` when neither is there (a transformer folder alone), naming both keys."""
    from vitp.objectives.wan_flow import config_shift, scheduler_config

    if cfg.objective.shift is not None:
        return float(cfg.objective.shift)
    pipe = pipeline_folder(transformer)
    if pipe is None or not (pipe / "scheduler" / "scheduler_config.json").is_file():
        raise ValueError(f"trainer.init_from={cfg.trainer.init_from} has no pipeline scheduler/scheduler_config.json "
                         f"to take the flow shift from; set objective.shift (Wan's folders use 3.0 at 480p, 5.0 at "
                         f"720p, 12.0 for Wan 2.2 A14B), or give the whole pipeline folder")
    return config_shift(scheduler_config(pipe))


def wan_loss(cfg: Any, transformer: Path) -> Any:
    """The run's :class:`vitp.objectives.wan_flow.WanFlowLoss` from ``cfg.objective`` (shift:
    :func:`wan_shift`)."""
    from vitp.objectives.wan_flow import WanFlowLoss

    o = cfg.objective
    return WanFlowLoss(wan_shift(cfg, transformer), sampling=o.sampling, weighting=o.weighting,
                       logit_mean=o.logit_mean, logit_std=o.logit_std, sigma_range=list(o.sigma_range))


def _refuse_unsupported(cfg: Any) -> None:
    """Raises ``ValueError`` naming the first option a Wan run does not support and what to set."""
    tr, m, par = cfg.trainer, cfg.model, cfg.parallel
    rules = [
        (not tr.init_from_timm, "trainer.init_from_timm is for vitp's generator; a Wan run starts from "
                                "trainer.init_from=FOLDER alone"),
        (str(tr.compile) == "off", f"trainer.compile={tr.compile} compiles vitp's generator blocks only; set "
                                   "trainer.compile=off for model.family=wan"),
        (not cfg.data.buckets, "data.buckets with model.family=wan: Wan trains one latent shape per run here; "
                               "leave data.buckets empty"),
        (par.partial_sync == 1, f"parallel.partial_sync={par.partial_sync}: Wan trains with exact tensor "
                                "parallelism; set parallel.partial_sync=1"),
        (str(m.attention) == "full", "model.attention=factorized: Wan attends over all tokens; set "
                                     "model.attention=full"),
    ]
    for name in ("attn_drop", "proj_drop", "drop_path"):
        rules.append((m[name] == 0, f"model.{name}={m[name]}: Wan has no dropout; set model.{name}=0"))
    rules.append((m.layer_scale_init is None, "model.layer_scale_init is a generator option; set it to null"))
    for ok, msg in rules:
        if not ok:
            raise ValueError(msg)


NO_VAE = ("{key}={num} on a Wan run scores decoded pixels, but {where}; give a pipeline folder with its vae/ (as "
          "diffusers' Wan2.1-T2V-1.3B-Diffusers ships: vitp-train trainer.init_from=PIPELINE, vitp-eval RUN "
          "--weights PIPELINE), or set {key}=0")


def quality_pipeline(cfg: Any, transformer: Path) -> Optional[Path]:
    """``None`` when neither ``eval.fid.num`` nor ``eval.fvd.num`` is set, else the pipeline folder
    around ``transformer`` whose ``scheduler/`` samples and whose ``vae/`` decodes the samples FID,
    FVD and CLIP score read (:func:`vitp.eval.wan_eval.wan_quality_metrics`). Raises ``ValueError``
    naming the key and the fix for a transformer folder without its pipeline or a pipeline without
    ``scheduler/`` or ``vae/`` (the field's numbers compare pixels)."""
    f, v = cfg.eval.fid.num, cfg.eval.fvd.num
    if not (f or v):
        return None
    key, num = ("eval.fid.num", f) if f else ("eval.fvd.num", v)
    pipe = pipeline_folder(transformer)
    if pipe is None or not (pipe / "scheduler").is_dir():
        raise ValueError(NO_VAE.format(key=key, num=num, where=f"trainer.init_from={cfg.trainer.init_from} is a "
                                       "transformer folder without its pipeline (scheduler/, vae/)"))
    if not (pipe / "vae" / "config.json").is_file():
        raise ValueError(NO_VAE.format(key=key, num=num, where=f"the pipeline {pipe} has no vae/"))
    return pipe


def _refuse_set_sizes(cfg: Any, sizes: dict) -> None:
    """Raises ``ValueError`` for a ``model.<key>`` that differs from both its schema default and the
    folder's value (``sizes``: key -> (value, what the folder calls it)): set by hand, it would be
    overwritten silently (a Wan model's sizes are its folder's)."""
    from dataclasses import fields, is_dataclass
    from enum import Enum

    from omegaconf import OmegaConf

    schema = OmegaConf.get_type(cfg.model)  # vitp.config.ModelConfig for a checked config
    if not is_dataclass(schema):
        return
    defaults = {f.name: f.default for f in fields(schema)}
    plain = lambda v: v.name if isinstance(v, Enum) else v  # noqa: E731
    for key, (value, name) in sizes.items():
        given = plain(cfg.model[key])
        if given != plain(defaults[key]) and given != value:
            shown = f"{value:g}" if isinstance(value, float) else value
            raise ValueError(f"model.{key}={given}: a Wan model's sizes come from its folder's config.json ({name}: "
                             f"model.{key}={shown} for trainer.init_from={cfg.trainer.init_from}); drop model.{key}, "
                             "or give a folder of that size")


def check_links(pipe: Path) -> None:
    """Raises ``FileNotFoundError`` for a component of the pipeline folder ``pipe`` that is a link to
    nothing (a run's ``RUN/diffusers`` links the base's scheduler, VAE, text encoder: the base
    moved or was deleted), naming the link, its target and the fix."""
    import os

    for child in sorted(pipe.iterdir()):
        if child.is_symlink() and not child.exists():
            raise FileNotFoundError(f"{child} links to {os.readlink(child)}, which does not exist (the base pipeline "
                                    f"folder moved or was deleted); put it back, or link the new place: ln -sfn "
                                    f"NEW_BASE/{child.name} {child}")


def check_vae_files(pipe: Path) -> None:
    """The pipeline's ``vae/`` as its first sample grid will read it: ``config.json`` a JSON object
    and every weight file (``diffusion_pytorch_model.safetensors``, or the shards its index lists)
    present with a readable safetensors header (safetensors' ``safe_open``, numpy: no torch here).
    Nothing when there is no ``vae/config.json``. Raises ``FileNotFoundError`` / ``ValueError``
    naming the file and the fix (copy it again), at the config check rather than after the steps
    before the first grid."""
    from safetensors import SafetensorError, safe_open

    from .wan_config import read_json_object

    vae = pipe / "vae"
    if not (vae / "config.json").is_file():
        return
    read_json_object(vae / "config.json", "VAE options", "copy the pipeline's vae/ again")
    weights = vae / "diffusion_pytorch_model.safetensors"
    index = weights.with_name(weights.name + ".index.json")
    files = ([vae / f for f in sorted(set(read_json_object(index).get("weight_map", {}).values()))]
             if index.is_file() else [weights])
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f} does not exist: the pipeline's vae/ decodes sample grids and evaluations; "
                                    "copy the pipeline's vae/ again")
        try:
            with safe_open(str(f), framework="numpy"):
                pass
        except SafetensorError as e:
            raise ValueError(f"{f} is not a readable safetensors file ({e}): it is empty, truncated or damaged (an "
                             "interrupted download or copy); copy the pipeline's vae/ again") from None


def adopt_wan_model(cfg: Any) -> Optional[WanConfig]:
    """For ``model.family=wan``: refuse what a Wan run does not support (module doc), read the
    folder's config (or ``model.preset``'s, :func:`wan_config_of`) and write its sizes into
    ``cfg.model`` (and the latent channels of synthetic data into ``data.latent_channels``); check
    the flow shift can be found (with a folder). Returns the :class:`WanConfig` (``None`` for
    another family). Raises ``ValueError`` / ``FileNotFoundError`` naming the key, the folder and
    the fix; ``ValueError`` for ``model.preset`` with another family."""
    if not is_wan(cfg):
        for key in ("preset", "expert"):
            if cfg.model.get(key):
                raise ValueError(f"model.{key}={cfg.model[key]} names a Wan config: set model=wan (model.family=wan) "
                                 f"or drop model.{key}")
        return None
    _refuse_unsupported(cfg)
    path, c = wan_config_of(cfg)
    pt, p, _ = c.patch_size
    if cfg.data.name == "synthetic":
        cfg.data.latent_channels = c.in_channels
    if c.out_channels != c.in_channels:
        raise ValueError(f"trainer.init_from={cfg.trainer.init_from}: out_channels={c.out_channels} differs from "
                         f"in_channels={c.in_channels}; vitp trains Wan on velocity targets of the input's shape")
    sizes = {"width": (c.width, "num_attention_heads x attention_head_dim"), "depth": (c.num_layers, "num_layers"),
             "num_heads": (c.num_attention_heads, "num_attention_heads"), "mlp_ratio": (c.ffn_dim / c.width, "ffn_dim"),
             "mlp": ("gelu", "a GELU FFN"), "qkv_bias": (True, "biased q/k/v"), "qk_norm": (True, "q/k RMSNorm"),
             "patch_size": (p, "patch_size[1:]"), "tubelet_size": (pt, "patch_size[0]"), "text_dim": (c.text_dim, "text_dim"),
             "text_len": (TEXT_TOKENS, "its 512 caption tokens")}
    _refuse_set_sizes(cfg, sizes)
    for key, (value, _) in sizes.items():
        cfg.model[key] = value
    if path is not None:  # a folder without a scheduler needs objective.shift: said now, not at the first step
        pipe = pipeline_folder(path)
        if pipe is not None:
            check_links(pipe)
        wan_shift(cfg, path)
        if pipe is None or not (pipe / "scheduler").is_dir():
            log.warning("trainer.init_from=%s has no pipeline scheduler/: no sample grids and no sampled video "
                        "statistics (the held-out loss is computed); give the whole pipeline folder for them",
                        cfg.trainer.init_from)
        quality_pipeline(cfg, path)  # FID / FVD / CLIP score decode through the pipeline's vae/
        if pipe is not None:
            check_vae_files(pipe)  # read at the first grid: damaged, it would fail after the steps before it
        expert = wan_expert(cfg, path)
        if expert is not None:  # written into the config: the run's .hydra/config.yaml says what was drawn
            cfg.objective.sigma_range = expert_sigma_range(cfg.objective.sigma_range, *expert)
    elif cfg.model.get("expert"):
        raise ValueError(f"model.expert={cfg.model.expert} needs trainer.init_from=<a Wan 2.2 A14B pipeline folder>")
    return c


def check_wan_input(cfg: Any) -> None:
    """After the input shape is resolved: the model's input channels are the folder's
    ``in_channels``. Raises ``ValueError`` naming both and the data keys."""
    if not is_wan(cfg):
        return
    _, c = wan_config_of(cfg)
    if int(cfg.model.in_channels) != c.in_channels:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg.model, DictConfig) and not OmegaConf.is_interpolation(cfg.model, "in_channels"):
            raise ValueError(f"model.in_channels={cfg.model.in_channels}: a Wan model takes its folder's in_channels="
                             f"{c.in_channels} (trainer.init_from={cfg.trainer.init_from}), and the input channels "
                             "follow the data (data.latent_channels / the latent pack); drop model.in_channels")
        raise ValueError(f"the data give {cfg.model.in_channels} input channels (data.latent_channels / the latent "
                         f"pack) but the Wan folder trainer.init_from={cfg.trainer.init_from} takes in_channels="
                         f"{c.in_channels}; encode the data with this model's VAE (vitp-pack data.vae=FOLDER/vae)")


def wan_mlp_units(cfg: Any) -> int:
    """The Wan folder's ``ffn_dim`` (the MLP hidden units tensor parallelism splits)."""
    return wan_config_of(cfg)[1].ffn_dim


WAN_OBJECTIVE = {"shift": None, "sampling": "uniform", "logit_mean": 0.0, "logit_std": 1.0, "weighting": "none",
                 "sigma_range": [0.0, 1.0]}  # objective keys read by Wan runs alone, at their defaults


def unused_wan_keys(cfg: Any) -> list:
    """The ``objective.*`` keys of :data:`WAN_OBJECTIVE` set away from their defaults in a run that
    is not Wan's (they have no effect there)."""
    if is_wan(cfg):
        return []
    o = cfg.objective
    return [f"objective.{k}" for k, v in WAN_OBJECTIVE.items()
            if (list(o[k]) if k == "sigma_range" else o[k]) != v]
