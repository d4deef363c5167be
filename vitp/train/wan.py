"""``vitp-train`` on a Wan transformer (``model.family=wan``): the stages, their weights from the
diffusers folder, and the diffusers folder a run writes at its end or ``vitp-export --format
diffusers`` writes from a checkpoint.

The model is :func:`vitp.pipeline.wan_stages.build_parallel_wan_pipeline` in the run's layout,
each rank filled with only its slices of the folder's tensors
(:func:`vitp.models.wan_keys.load_shard`); the loss is
:class:`vitp.objectives.wan_flow.WanFlowLoss` (:func:`vitp.models.wan_run.wan_loss`). Checkpoints,
the EMA and resuming are the generator's own (every piece is keyed by the pipeline's parameter
names, :func:`vitp.models.generator_key`, which are Wan's vitp keys).

The diffusers folder (:func:`write_diffusers`): the trained transformer under its own name
(``transformer``, or ``transformer_2`` for Wan 2.2 A14B's low-noise expert) in diffusers' key
names and ``config.json``, loaded by ``WanTransformer3DModel.from_pretrained``; started from a
pipeline folder, the folder is a whole pipeline: its ``model_index.json`` copied and every other
component (scheduler, VAE, text encoder, tokenizer, the other expert) linked to the source's, so
``WanPipeline.from_pretrained`` loads it.
"""
from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

log = logging.getLogger("vitp")
DIFFUSERS_DIR = "diffusers"  # <run dir>/diffusers: the run's final EMA weights as a diffusers folder


def build_wan_model(cfg: Any, layout: Any, load: bool) -> Tuple[Any, Any, Any, Dict[str, Any]]:
    """``(module, state, loss_fn, read)``: this rank's Wan stage in ``layout`` (tp, SP, cp, pp,
    dp of the run config ``cfg``), filled from ``trainer.init_from`` when ``load`` (a run that
    does not resume a checkpoint), ``read`` the bytes it read (:func:`vitp.models.wan_keys.load_shard`;
    empty when not loading). With ``trainer.lora.enabled`` the stage gets its adapters
    (:func:`vitp.models.lora.apply_lora`, base frozen; drawn, or from ``trainer.lora.init_from``:
    :func:`vitp.models.lora.initial_factors`) and the base is read even when resuming. Collective. Raises as :func:`vitp.models.wan_run.wan_source` and
    :func:`vitp.models.wan_keys.load_shard`."""
    from vitp.models import generator_key, token_grid
    from vitp.models.lora import apply_lora, initial_factors, spec_of
    from vitp.models.wan_keys import load_shard
    from vitp.parallel.lora import is_lora_key
    from vitp.models.wan_run import wan_loss, wan_source
    from vitp.pipeline.wan_stages import build_parallel_wan_pipeline

    path, config = wan_source(cfg)
    m, par = cfg.model, cfg.parallel
    loss_fn = wan_loss(cfg, path)
    grid = token_grid(m.image_size, m.num_frames, m.patch_size, m.tubelet_size)
    module, state = build_parallel_wan_pipeline(
        config, grid, loss_fn, tp=layout.tp, cp=layout.cp, pp=layout.pp, dp=layout.dp,
        sequence_parallel=par.sequence_parallel, cp_mode=str(par.cp_mode), seed=cfg.seed, defer_grad_sync=True,
        activation_checkpoint_interval=par.activation_checkpoint_interval)
    read: Dict[str, Any] = {}
    spec = spec_of(cfg)
    if spec is not None:  # after the plan: each rank keeps its share of every adapter's full factors
        init = initial_factors(cfg) if load and cfg.trainer.lora.init_from else None  # resuming: the checkpoint's
        apply_lora(module, spec, state, key_of=lambda n: module_key(n, config.num_layers), seed=cfg.seed, init=init)
    if load or spec is not None:  # a LoRA checkpoint holds no base weight: the base is always read
        params = {generator_key(n, config.num_layers): p for n, p in module.named_parameters() if not is_lora_key(n)}
        read = load_shard(path, params, config, state.tp_rank, state.tp_size, subfolder=None)
    return module, state, loss_fn, read


def module_key(name: str, depth: int) -> str:
    """The canonical name (``blocks.<i>.attn.qkv``) of a pipeline module name (``1.attn.qkv``)."""
    from vitp.models import generator_key

    head = name.split(".", 1)[0]
    return generator_key(name, depth) if head.isdigit() and "." in name else name


def trained_name(transformer: Path) -> str:
    """The subfolder the trained weights take in a pipeline: the source's own name inside a
    pipeline folder (``transformer`` / ``transformer_2``), else ``transformer``."""
    from vitp.models.wan_run import pipeline_folder

    return transformer.name if pipeline_folder(transformer) is not None else "transformer"


def diffusers_weights(out: Path, transformer: Path) -> Path:
    """The transformer folder inside a diffusers export ``out`` of a run from ``transformer``."""
    from vitp.models.wan_run import pipeline_folder

    return out / trained_name(transformer) if pipeline_folder(transformer) is not None else out


def link_pipeline(out: Path, transformer: Path) -> None:
    """Make ``out`` a whole pipeline around its trained transformer: the source pipeline's
    ``model_index.json`` copied, every other component it names linked (absolute symlinks; copied
    where links are refused). Other folders of the source (a ``samples/`` folder, a user's notes)
    are not linked: writing into them through the link would write into the source model. Nothing
    for a transformer folder without a pipeline."""
    from vitp.models.wan_config import read_json_object
    from vitp.models.wan_run import pipeline_folder

    pipe = pipeline_folder(transformer)
    if pipe is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy2(pipe / "model_index.json", out / "model_index.json")
    components = {k for k, v in read_json_object(pipe / "model_index.json").items()
                  if not k.startswith("_") and isinstance(v, list)}  # {"vae": ["diffusers", "AutoencoderKLWan"]}
    for part in sorted(p for p in pipe.iterdir() if p.is_dir() and p.name != transformer.name
                       and p.name in components):
        dest = out / part.name
        if dest.is_symlink() or dest.exists():
            continue
        try:
            dest.symlink_to(part.resolve(), target_is_directory=True)
        except OSError:
            shutil.copytree(part, dest)


def write_diffusers(run_dir: Path, cfg: Any, module: Any, ema: Any, state: Any) -> Path:
    """``<run dir>/diffusers``: the EMA weights of every stage as a diffusers folder
    (:func:`vitp.pipeline.wan_stages.save_wan_stages`: each stage's file written by its first rank),
    plus the pipeline around it (:func:`link_pipeline`). Collective. Returns the folder."""
    from vitp.eval.inference import ema_weights
    from vitp.models.wan_run import wan_source
    from vitp.pipeline.wan_stages import save_wan_stages

    path, config = wan_source(cfg)
    out = Path(run_dir) / DIFFUSERS_DIR
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        remove_weights(diffusers_weights(out, path))  # an earlier finish's files (another pp: other shard names)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    with ema_weights(module, ema):
        save_wan_stages(diffusers_weights(out, path), module, config, state)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        link_pipeline(out, path)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return out


def remove_weights(folder: Path) -> None:
    """Delete a diffusers transformer folder's weight files and index (before it is written again)."""
    for f in Path(folder).glob("diffusion_pytorch_model*.safetensors*"):
        f.unlink()


def final_weights_written(run_dir: Path, cfg: Any) -> bool:
    """Whether a Wan run's final diffusers folder is there (its ``config.json``)."""
    from vitp.models.wan_run import wan_source

    try:
        path, _ = wan_source(cfg)
    except (FileNotFoundError, ValueError):
        return (Path(run_dir) / DIFFUSERS_DIR).is_dir()
    return (diffusers_weights(Path(run_dir) / DIFFUSERS_DIR, path) / "config.json").is_file()


def export_checkpoint_diffusers(tag_dir: Path, out: Path, cfg: Any, kind: str = "ema",
                                max_shard_bytes: int = 5 * 10**9) -> Path:
    """Write a training checkpoint's ``kind`` weights (``ema`` / ``model``) of a Wan run as a
    diffusers folder at ``out`` in one process, reading one shard's tensors at a time
    (:func:`vitp.checkpoint.sharded.read_full`): ``config.json`` (the source folder's options),
    ``diffusion_pytorch_model.safetensors`` or shards of at most ``max_shard_bytes`` plus
    ``diffusion_pytorch_model.safetensors.index.json``; around it the pipeline of a pipeline
    source (:func:`link_pipeline`). Returns the transformer folder.

    Raises ``FileNotFoundError`` / ``ValueError`` when the source folder ``trainer.init_from`` of
    the run is gone (its options make ``config.json``) or the checkpoint is not a Wan model's.
    """
    from importlib.metadata import version

    from vitp.utils import shard_groups
    from vitp.checkpoint.sharded import read_full, tensor_shapes
    from vitp.models.wan_keys import CLASS_NAME, INDEX, WEIGHTS, key_map, to_diffusers_state
    from vitp.models.wan_run import wan_source
    from vitp.utils import save_safetensors

    path, config = wan_source(cfg)
    shapes = tensor_shapes(tag_dir, kind)
    kmap = key_map(config)
    if set(shapes) != set(kmap):
        raise ValueError(f"checkpoint {tag_dir} does not hold the Wan model of trainer.init_from={path}: "
                         f"{len(set(kmap) - set(shapes))} keys missing, {len(set(shapes) - set(kmap))} unexpected")
    target = diffusers_weights(out, path)
    target.mkdir(parents=True, exist_ok=True)
    remove_weights(target)  # --force over an earlier export: no stale shard stays next to the new files
    groups = shard_groups({k: math.prod(shapes[k][0]) * torch.empty((), dtype=shapes[k][1]).element_size()
                           for k in kmap}, max_shard_bytes)
    names = [WEIGHTS] if len(groups) == 1 else [
        f"diffusion_pytorch_model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map, total = {}, 0
    for keys, name in zip(groups, names):
        tensors = to_diffusers_state(read_full(tag_dir, kind, keys), config, partial=True)
        save_safetensors(tensors, str(target / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (target / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    conf = {"_class_name": CLASS_NAME, "_diffusers_version": version("diffusers"), **config.to_dict()}
    (target / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    link_pipeline(out, path)
    return target


def copy_diffusers(run_dir: Path, export: Path) -> Optional[Path]:
    """Copy ``<run dir>/diffusers`` into ``export`` (``trainer.export_dir``), links kept as links."""
    src = Path(run_dir) / DIFFUSERS_DIR
    if not src.is_dir():
        return None
    dest = Path(export) / DIFFUSERS_DIR
    shutil.copytree(src, dest, symlinks=True, dirs_exist_ok=True)
    return dest


__all__ = ["DIFFUSERS_DIR", "build_wan_model", "copy_diffusers", "diffusers_weights", "export_checkpoint_diffusers",
           "final_weights_written", "link_pipeline", "remove_weights", "trained_name", "write_diffusers"]
