"""``vitp-sample`` for Wan: a Wan run directory (``model.family=wan``) or a diffusers Wan pipeline
folder sampled as diffusers' ``WanPipeline`` samples it, in one process or split over ranks.

What goes in is what ``WanPipeline.__call__`` (diffusers 0.42, ``pipelines/wan/pipeline_wan.py``;
Wan Team 2025, arXiv 2503.20314) gives its transformer: the prompts' caption embeddings (the
run's caption store where it holds them, else encoded with the run's local text encoder, as
``vitp-sample --prompt`` finds them for every text run: :class:`vitp.data.text.PromptConditioning`),
each prompt's tokens then zeros up to 512 (:func:`vitp.objectives.wan_sampling.pad_prompt_embeds`),
the encoded empty prompt as the negative prompt (the pipeline's default), classifier-free guidance
with ``sampler.cfg_scale`` (the pipeline's ``guidance_scale``) over ``sampler.steps`` steps of
diffusers' own scheduler from the folder's ``scheduler/`` (:func:`vitp.objectives.wan_sampling.load_scheduler`:
UniPC or flow-match Euler, its ``flow_shift``). Sample ``i`` starts from
:func:`vitp.eval.sampling.sample_noise` of ``(sampler.seed, i)``, so the set is the same in every layout.

Wan 2.2 as the pipeline's ``model_index.json`` says (:func:`vitp.models.wan_config.read_pipeline`):
A14B's two experts, ``transformer`` for timesteps ``t >= boundary_ratio * num_train_timesteps``
with ``sampler.cfg_scale`` and ``transformer_2`` below with ``sampler.cfg_scale_2`` (the pipeline's
``guidance_scale_2``; default ``sampler.cfg_scale``); a run that fine-tuned one expert samples its
``RUN/diffusers`` pipeline, where the trained expert replaced its source and the other is linked
to the source folder's (:func:`vitp.train.wan.link_pipeline`). TI2V-5B's ``expand_timesteps``:
per-token timesteps, text-to-video (an image-conditioned pipeline is refused).

Under a launcher each rank builds its stage of the transformer in the layout ``parallel.*`` says
(tp, sequence parallel, cp Ulysses or ring, pp; ``dp = world / (tp x cp x pp)``), reading only its
slices of the folder (:func:`vitp.train.wan.build_wan_model`); the replicas split the samples
(:class:`vitp.eval.inference.Share`) and rank 0 gathers the latents, decodes them through the
pipeline's VAE (:func:`vitp.objectives.wan_sampling.decode_latents`) and writes the output folder:
``latents.safetensors`` (``latents`` (B, C, T, H, W) fp32, ``noise`` of the same shape,
``frames`` (B, F, H', W', 3) uint8 when decoded; the prompts and settings in its metadata), a
``grid.gif`` (``grid.png`` for one frame) with a row per prompt, and ``prompts.txt``.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import logging
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

import torch
from omegaconf import OmegaConf

from vitp.utils import check_output_in_run, load_run_yaml

SMOKE = "experiment=wan_smoke"  # the config a plain pipeline folder is sampled with (its sizes, the demo encoder)


def is_wan_source(source: Path) -> bool:
    """Whether ``source`` is a Wan run directory (``.hydra/config.yaml`` with ``model.family=wan``),
    its ``checkpoints/`` folder or one of its checkpoints (:func:`checkpoint_run`: refused by
    :func:`wan_sample_config`, naming ``vitp-export``), or a diffusers Wan folder
    (``model_index.json`` of a ``WanPipeline``, or a transformer ``config.json`` of
    ``WanTransformer3DModel``)."""
    source = Path(source)
    run = source / ".hydra" / "config.yaml"
    if run.is_file():
        return str(load_run_yaml(run).get("model", {}).get("family", "vit")) == "wan"
    if checkpoint_run(source) is not None:
        return True
    from vitp.models.wan_config import I2V_PIPELINES

    for name, cls in (("model_index.json", ("WanPipeline", *I2V_PIPELINES)),
                      ("config.json", ("WanTransformer3DModel",))):
        if (source / name).is_file():  # an image-conditioned Wan pipeline is Wan's, to be refused by name
            try:
                return json.loads((source / name).read_text()).get("_class_name") in cls
            except (ValueError, AttributeError):
                return False
    return False


def checkpoint_run(source: Path) -> Optional[Path]:
    """The Wan run directory whose ``checkpoints/`` folder or checkpoint (``step_N``) ``source``
    is (:func:`vitp.checkpoint.run_of_checkpoint`), else None."""
    from vitp.checkpoint.training import run_of_checkpoint

    run = run_of_checkpoint(source)
    if run is None:
        return None
    return run if str(load_run_yaml(run / ".hydra" / "config.yaml").get("model", {}).get("family", "vit")) == "wan" \
        else None


def wan_sample_config(source: Path, overrides: List[str], num: Optional[int],
                      allowed: Tuple[str, ...], prog: str = "vitp-sample") -> Tuple[Any, Path, Path]:
    """``(config, weights folder, output base)`` to sample ``source`` with: a run's
    ``.hydra/config.yaml`` and its final ``RUN/diffusers`` folder, or for a LoRA run its base
    ``trainer.init_from`` with the run's final adapters ``RUN/lora`` (``trainer.lora.init_from``:
    :func:`wan_denoisers` adds them), or for a diffusers folder the ``experiment=wan_smoke`` config
    of that folder; with ``num`` samples per prompt and the ``overrides`` (keys starting with one
    of ``allowed``: :data:`vitp.cli.sample.SAMPLE_KEYS`, and for a LoRA run ``trainer.init_from``,
    its base pipeline moved elsewhere), checked as ``vitp-train`` checks a Wan run (sizes from the
    folder's ``config.json``; a LoRA's base by its hash).

    Raises ``FileNotFoundError`` for a run without its diffusers folder or final adapters and for
    a checkpoint of a run (both naming ``vitp-export``), ``ValueError`` for a bad override, a LoRA
    of another base, or a folder whose pipeline has no ``scheduler/``."""
    from vitp.cli.overrides import apply_overrides, typed_config
    from vitp.config import compose
    from vitp.train.wan import DIFFUSERS_DIR

    source = Path(source)
    run = source / ".hydra" / "config.yaml"
    owner = checkpoint_run(source)
    if owner is not None:
        saved = load_run_yaml(owner / ".hydra" / "config.yaml")
        lora = bool(OmegaConf.select(saved, "trainer.lora.enabled"))
        raise FileNotFoundError(
            f"{source} is a checkpoint of the Wan run {owner}: {prog} reads diffusers folders; write one with "
            f"vitp-export {source} --format diffusers{' --merge' if lora else ''} -o OUT, then {prog} OUT "
            f"(the run's final {'adapters' if lora else 'weights'}: {prog} {owner})")
    lora_dir = None
    if run.is_file():
        weights, saved = source / DIFFUSERS_DIR, load_run_yaml(run)
        if OmegaConf.select(saved, "trainer.lora.enabled"):
            lora_dir = source / "lora"
            if not lora_file_of(lora_dir):
                raise FileNotFoundError(f"{source} is a LoRA run without its final adapters {lora_dir} (the run has "
                                        "not finished): " + export_advice(source, saved, f"{prog} OUT", merge=True))
        elif not any((weights / p / "config.json").is_file() for p in ("", "transformer", "transformer_2")):
            raise FileNotFoundError(f"{source} has no final diffusers folder {weights} (the run has not finished): "
                                    + export_advice(source, saved, f"{prog} OUT --prompt ..."))
        cfg, base = typed_config(saved, run), source
        if run_expert(cfg) == "transformer_2" and not cfg.model.get("expert"):  # named by its folder, not the key
            cfg.model.expert = "low"
        if lora_dir is not None:  # its base, moved elsewhere (a full fine-tuning samples RUN/diffusers)
            allowed = (*allowed, "trainer.init_from")
    else:  # a model folder: samples go to ./outputs/<model_name>/samples, never into the model's folder
        weights, base = source, Path("outputs") / model_name(source)
        cfg = typed_config(compose([SMOKE, f"trainer.init_from={source}"]))
    cfg.trainer.device = "auto"  # sampled where it is started, whatever the run trained on
    if num is not None:
        cfg.sampler.samples_per_class = num
    cfg = apply_overrides(cfg, overrides, prog, allowed=allowed)
    if lora_dir is not None:  # the base the run adapted (wherever it is now) and the run's final adapters
        weights = Path(str(cfg.trainer.init_from))
        cfg.trainer.lora.init_from = str(lora_dir)
    cfg.trainer.init_from = str(weights)
    validate_run_lora(cfg, lora_dir)
    return cfg, weights, base


def validate_run_lora(cfg: Any, adapters: Optional[Path]) -> None:
    """:func:`vitp.config.validate_config` of a config whose ``trainer.lora.init_from`` is a LoRA
    run's ``adapters`` (set here, not by the user; None: no adapters), which are read now, before
    any model: adapters that do not fit the base ``trainer.init_from`` are refused naming that key,
    the one the user sets, not ``trainer.lora.init_from``."""
    from vitp.config import validate_config
    from vitp.models.lora import OtherBaseError, read_init_lora

    validate_config(cfg)
    if adapters is None:
        return
    try:
        read_init_lora(cfg)
    except OtherBaseError as e:
        raise ValueError(f"{e.base}: the run's adapters {e.reason}") from None


def lora_file_of(folder: Path) -> Optional[Path]:
    """The adapters file of a LoRA run's ``RUN/lora`` folder (:func:`vitp.models.lora.lora_file`),
    None when it has none."""
    from vitp.models.lora import lora_file

    try:
        return lora_file(folder)
    except FileNotFoundError:
        return None


def lora_target(cfg: Any) -> Optional[Path]:
    """The transformer folder a config's ``trainer.lora.init_from`` adapters apply to (the base the
    LoRA run adapted: one expert of a Wan 2.2 A14B pipeline), resolved; None without adapters."""
    if not (cfg.trainer.lora.enabled and cfg.trainer.lora.init_from):
        return None
    from vitp.models.lora import base_path

    return base_path(cfg).resolve()


def wan_denoisers(cfg: Any, folders: Tuple[Path, ...], device: Any) -> List[Any]:
    """The :class:`vitp.models.wan.WanModel` of each transformer folder (vitp's reader: local
    safetensors only), on ``device``, in eval mode; the one :func:`lora_target` names with the
    config's adapters merged into its weights (:func:`vitp.models.lora_files.merge_lora`: ``W +
    scaling B A`` in fp32, as ``vitp-export --merge`` writes them)."""
    from vitp.models import from_pretrained as read_wan_folder
    from vitp.models.lora import read_init_lora
    from vitp.models.lora_files import merge_lora

    target, out = lora_target(cfg), []
    for folder in folders:
        model = read_wan_folder(str(folder))
        if target is not None and Path(folder).resolve() == target:
            model.load_state_dict(merge_lora(model.state_dict(), *read_init_lora(cfg)))
        out.append(model.to(device).eval())
    return out


def export_advice(run_dir: Path, saved: Any, then: str, merge: bool = False) -> str:
    """How to get a diffusers folder of the Wan run ``run_dir`` (its recorded config ``saved``) that
    has none: ``vitp-export`` of its latest checkpoint (``merge``: the base with a LoRA run's
    adapters merged), then the command ``then``; a run without a checkpoint yet has nothing to
    export, so it is told how to get one (training on, or resuming it)."""
    from vitp.checkpoint import LATEST

    run = Path(run_dir)
    export = f"vitp-export {run} --format diffusers{' --merge' if merge else ''} -o OUT"
    what = "the base with its adapters merged" if merge else "one"
    if (run / "checkpoints" / LATEST).is_file():
        return f"write {what} from its latest checkpoint with {export}, then {then}"
    every = OmegaConf.select(saved, "trainer.checkpoint_every")
    when = (f"its first checkpoint (trainer.checkpoint_every={every})" if every else
            "its end (trainer.checkpoint_every=0: its one checkpoint is the final one)")
    return (f"it has no checkpoint yet ({run / 'checkpoints' / LATEST} is missing), so vitp-export has nothing to "
            f"write: let it train to {when}, or resume it with vitp-train --resume {run}; then {export}, and {then}")


def model_name(folder: Path) -> str:
    """The name of ``./outputs/<name>/samples``, where the samples of the model ``folder`` go, with
    ``<hash>`` 8 hex of a hash of its resolved path, so two folders never share one: a pipeline
    folder's ``<folder name>-<hash>``; a bare weights folder's (``transformer/``, a name every
    pipeline repeats) ``<parent name>-<folder name>-<hash>``; for a folder inside a vitp run
    (``RUN/diffusers``, ``RUN/export/step_0000004_ema_diffusers``) ``<run name>-<its path in the
    run, '-' joined>-<hash>`` (``run1-diffusers-1a2b3c4d``)."""
    real = Path(folder).resolve()
    digest = hashlib.sha1(str(real).encode()).hexdigest()[:8]
    run = next((p for p in real.parents if (p / ".hydra" / "config.yaml").is_file()), None)
    if run is not None:
        return "-".join([run.name, *real.relative_to(run).parts, digest])
    bare = not (real / "model_index.json").is_file()  # a transformer folder: named with its pipeline's
    return "-".join([p for p in ([real.parent.name] if bare else []) + [real.name] if p] + [digest])


def pipeline_of(cfg: Any) -> Path:
    """The pipeline folder of the run's weights (its ``scheduler/``, ``vae/``). Raises
    ``ValueError`` for a transformer folder alone, naming the fix."""
    from vitp.models.wan_run import pipeline_folder, wan_source

    transformer, _ = wan_source(cfg)
    pipe = pipeline_folder(transformer)
    if pipe is None or not (pipe / "scheduler").is_dir():
        raise ValueError(f"{cfg.trainer.init_from} is a Wan transformer without its pipeline (no model_index.json "
                         "and scheduler/ around it): vitp-sample takes its scheduler and VAE from the pipeline; "
                         "give a whole pipeline folder (Wan-AI/Wan2.1-T2V-1.3B-Diffusers's layout)")
    return pipe


def run_expert(cfg: Any) -> Optional[str]:
    """The transformer subfolder a Wan run fine-tuned when its source was one of a pipeline's experts
    (``model.expert``, or a ``trainer.init_from`` naming ``transformer_2``), from the run's config
    alone (the source may be gone); None for a run that names no expert."""
    from vitp.models.wan_run import EXPERTS

    if cfg.model.get("expert"):
        return EXPERTS[str(cfg.model.expert)]
    name = Path(str(cfg.trainer.init_from or "")).name
    return name if name == "transformer_2" else None


def sampling_pipeline(cfg: Any, pipe: Path, trained: Optional[str] = None) -> Any:
    """The :class:`vitp.models.wan_config.PipelineInfo` of the pipeline ``pipe`` to sample, checked
    against the sampler keys and the run: ``trained`` the expert subfolder the run fine-tuned
    (:func:`run_expert`), which must be one of the pipeline's transformers and hold the run's own
    weights (not a link to the source). Raises ``ValueError`` naming the key or the folder and the
    fix (``sampler.cfg_scale_2`` on one transformer; a run's expert the pipeline lacks or links),
    and as :func:`vitp.models.wan_config.read_pipeline`."""
    from vitp.models.wan_config import read_pipeline

    info = read_pipeline(pipe)
    if cfg.sampler.get("cfg_scale_2") is not None and not info.two_experts:
        raise ValueError(f"sampler.cfg_scale_2={cfg.sampler.cfg_scale_2} is the guidance of Wan 2.2 A14B's low-noise "
                         f"expert, but {pipe} has one transformer (no transformer_2 and boundary_ratio in its "
                         "model_index.json); drop sampler.cfg_scale_2")
    if trained is not None and trained not in info.experts:
        raise ValueError(f"the run fine-tuned {trained}/ (a Wan 2.2 A14B expert) but its pipeline {pipe} lists "
                         f"{list(info.experts)} in model_index.json; write the run's folder again with vitp-export RUN "
                         "--format diffusers -o OUT from a run whose trainer.init_from is the two-expert pipeline")
    if trained is not None and (pipe / trained).is_symlink():
        raise ValueError(f"{pipe / trained} is a link to the source's {trained}/, not the run's fine-tuned expert; "
                         f"write the run's folder again with vitp-export RUN --format diffusers -o OUT")
    return info


def prompt_embeds(cond: Any, text_dim: int) -> torch.Tensor:
    """``(n + 1, 512, text_dim)`` fp32: the empty prompt (row 0, the negative prompt) and the
    ``n`` prompts of :class:`vitp.data.text.PromptConditioning` ``cond``, each prompt's tokens
    (its mask) then zeros up to 512 as ``WanPipeline`` gives them. Raises ``ValueError`` when the
    encoder's channels are not the model's ``text_dim``, naming ``data.text_encoder``."""
    from vitp.objectives.wan_sampling import pad_prompt_embeds

    emb, mask = cond.emb, cond.mask
    if emb.shape[-1] != text_dim:
        raise ValueError(f"the caption embeddings have {emb.shape[-1]} channels but the Wan transformer takes "
                         f"text_dim={text_dim}: set data.text_encoder=<the local umT5 encoder of this model> "
                         "(and data.text_embeddings to a store of its embeddings)")
    return pad_prompt_embeds(emb.float(), mask)


def wan_generate(denoisers: Any, scheduler: Any, cfg: Any, ids: torch.Tensor, embeds: torch.Tensor,
                 share: Any = None, info: Any = None) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """``(latents, noise)``, each ``(B, C, T, H, W)`` fp32 at the run's latent size
    (``model.in_channels``, ``model.num_frames``, ``model.image_size``): sample ``i`` (prompt row
    ``ids[i]`` of ``embeds``, :func:`prompt_embeds`) denoised from :func:`vitp.eval.sampling.sample_noise`
    of ``(sampler.seed, i)`` by :func:`vitp.objectives.wan_sampling.sample_wan` (``sampler.steps``,
    ``guidance_scale = sampler.cfg_scale`` against row 0), in batches of ``sampler.batch_size``.
    ``denoisers``: one denoiser, or a list of the pipeline's experts in the order of ``info`` (a
    :class:`vitp.models.wan_config.PipelineInfo`: the second expert below its ``boundary_ratio``
    with ``sampler.cfg_scale_2``; ``expand_timesteps``). With ``share`` each replica samples its
    range and rank 0 gets them all (``None`` elsewhere; collective)."""
    from vitp.config import parse_resolution
    from vitp.eval.inference import Share
    from vitp.eval.sampling import sample_noise
    from vitp.objectives.wan_sampling import sample_wan

    s, m, share = cfg.sampler, cfg.model, share or Share()
    denoisers = list(denoisers) if isinstance(denoisers, (list, tuple)) else [denoisers]
    experts = {} if info is None else dict(expand_timesteps=info.expand_timesteps)
    if len(denoisers) == 2:
        g2 = s.get("cfg_scale_2")
        experts.update(denoiser_2=denoisers[1], boundary_ratio=info.boundary_ratio,
                       guidance_scale_2=None if g2 is None else float(g2))
    shape = (int(m.in_channels), int(m.num_frames), *parse_resolution(m.image_size, "model.image_size"))
    mine = share.indices(len(ids))
    lat, noise = [torch.empty((0, *shape))], [torch.empty((0, *shape))]
    for i in range(mine.start, mine.stop, s.batch_size):
        idx = range(i, min(mine.stop, i + s.batch_size))
        z = sample_noise(s.seed, idx, shape)
        cond = embeds[ids[idx.start:idx.stop]]
        neg = embeds[:1].expand_as(cond)
        lat.append(sample_wan(denoisers[0], scheduler, z, cond, neg, num_inference_steps=int(s.steps),
                              guidance_scale=float(s.cfg_scale), **experts).float().cpu())
        noise.append(z)
    both = torch.stack([torch.cat(lat), torch.cat(noise)], dim=1)  # one gather for both
    both = share.gather(both, len(ids))
    return None if both is None else (both[:, 0], both[:, 1])


def build_wan_sharded(cfg: Any, prog: str = "vitp-sample", experts: Tuple[Path, ...] = ()) -> Tuple[Any, Any]:
    """``(denoiser, share)`` of this rank: its stage of the Wan transformer of ``trainer.init_from``
    in the layout of ``cfg`` (:func:`vitp.eval.launch.inference_layout`), its slices read from the
    folder, fp32, as a :class:`vitp.eval.inference.StageDenoiser` with its
    :class:`vitp.eval.inference.Share`. ``experts``: transformer folders (Wan 2.2 A14B's two), each
    built in the same layout instead: the denoiser is then a list of theirs. Collective. Raises
    ``ValueError`` for a layout the world cannot run (before any process group)."""
    from vitp.eval.inference import Share, StageDenoiser
    from vitp.eval.launch import _log_level, inference_layout
    from vitp.parallel import distributed as dist
    from vitp.train.wan import build_wan_model

    device = dist.resolve_device(cfg.trainer.device)
    lay = inference_layout(cfg, dist.world_size(), device.type, prog)
    if lay.tp * lay.cp * lay.pp == 1:  # whole-model replicas: the model one process runs, no DeepSpeed
        return wan_replica(cfg, device, experts)
    dist.init_distributed(device, dist.timeout_of(cfg))
    m, out = cfg.model, []
    for name in experts or (None,):
        one = cfg if name is None else _expert_config(cfg, name)
        with contextlib.redirect_stdout(io.StringIO()), _log_level(("DeepSpeed", "vitp"), logging.WARNING):
            module, state, _, _ = build_wan_model(one, lay, load=True)
        module.to(device).eval()
        out.append(StageDenoiser(module, cfg.trainer.micro_batch_size, m.patch_size, m.tubelet_size))
    return (out if experts else out[0]), Share.of(module, state)


def wan_replica(cfg: Any, device: Any, experts: Tuple[Path, ...] = ()) -> Tuple[Any, Any]:
    """``(model, share)`` of this rank as one of ``world`` data-parallel replicas of the whole Wan
    transformer (``tp = cp = pp = 1``): the :class:`vitp.models.wan.WanModel` of ``trainer.init_from``
    read as one process reads it (each of ``experts`` instead: a list), on ``device``, fp32, with the
    :class:`vitp.eval.inference.Share` of its rank over a plain ``torch.distributed`` group (no
    DeepSpeed, no collective per forward: a replica's samples are one process's, byte for byte).
    Collective."""
    from vitp.eval.inference import Share
    from vitp.models.wan_run import wan_source
    from vitp.parallel import distributed as dist

    dist.init_process_group(device, dist.timeout_of(cfg))
    models = wan_denoisers(cfg, experts or (wan_source(cfg)[0],), device)
    return (models if experts else models[0]), Share.replicas()


def _expert_config(cfg: Any, folder: Path) -> Any:
    """A copy of ``cfg`` whose ``trainer.init_from`` is the transformer ``folder`` (no
    ``model.expert``: the folder names it; a LoRA run's adapters only where :func:`lora_target`
    is that folder)."""
    from vitp.config import LoraConfig

    one = copy.deepcopy(cfg)
    target = lora_target(cfg)
    one.trainer.init_from = str(folder)
    one.model.expert = None
    if target is not None and Path(folder).resolve() != target:  # a LoRA run's adapters: its own expert's alone
        one.trainer.lora = OmegaConf.structured(LoraConfig())
    return one


def decode_frames(pipe: Path, latents: torch.Tensor) -> Optional[torch.Tensor]:
    """``(B, F, H', W', 3)`` uint8 frames of ``latents`` through the pipeline's ``vae/``
    (:func:`vitp.objectives.wan_sampling.decode_latents`, rounded as ``numpy_to_pil``), or ``None``
    when the pipeline has no VAE."""
    if not (pipe / "vae" / "config.json").is_file():
        return None
    from diffusers import AutoencoderKLWan

    from vitp.objectives.wan_sampling import decode_latents

    vae = AutoencoderKLWan.from_pretrained(str(pipe / "vae"), local_files_only=True).float().eval()
    frames = torch.as_tensor(decode_latents(vae, latents, output_type="np"))
    return (frames * 255).round().clamp(0, 255).to(torch.uint8)


def output_name(cfg: Any, prompts: List[str], scheduler: Any, two_experts: bool = False) -> str:
    """``sample_wan_p2-<hash>_n3_unipc4_shift3_cfg5_seed0``: everything that decides the samples
    (two experts: ``cfg5-2``, the low-noise expert's guidance after the dash)."""
    s, sc = cfg.sampler, scheduler.config
    kind = "unipc" if type(scheduler).__name__.startswith("UniPC") else "euler"
    shift = sc.get("flow_shift", sc.get("shift", 1.0))
    rows = f"p{len(prompts)}-{hashlib.sha1(chr(10).join(prompts).encode()).hexdigest()[:8]}"
    g2 = s.get("cfg_scale_2")
    cfg2 = f"-{s.cfg_scale if g2 is None else g2:g}" if two_experts else ""
    return (f"sample_wan_{rows}_n{s.samples_per_class}_{kind}{s.steps}_shift{shift:g}_cfg{s.cfg_scale:g}{cfg2}"
            f"_seed{s.seed}")


def write_outputs(out: Path, latents: torch.Tensor, noise: torch.Tensor, frames: Optional[torch.Tensor],
                  prompts: List[str], cfg: Any, settings: dict) -> List[Path]:
    """Write the output folder of the module doc into ``out``; returns the files written."""
    from vitp.media import to_grid, video_grid, write_gif
    from vitp.utils import atomic_write, atomic_write_text, save_safetensors

    out.mkdir(parents=True, exist_ok=True)
    tensors = {"latents": latents.contiguous(), "noise": noise.contiguous()}
    if frames is not None:
        tensors["frames"] = frames.contiguous()
    meta = {"prompts": json.dumps(prompts), "settings": json.dumps(settings)}
    with atomic_write(out / "latents.safetensors") as tmp:
        save_safetensors(tensors, str(tmp), metadata=meta)
    files = [out / "latents.safetensors"]
    if frames is not None:
        per = cfg.sampler.samples_per_class
        x = frames.permute(0, 4, 1, 2, 3).float() / 127.5 - 1  # (B, 3, F, H, W) in [-1, 1]
        if x.shape[2] == 1:
            from torchvision.utils import save_image

            with atomic_write(out / "grid.png") as tmp:
                save_image(to_grid(x, nrow=per), str(tmp))
            files.append(out / "grid.png")
        else:
            grid = (video_grid(x, nrow=per) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
            files.append(write_gif(out / "grid.gif", grid, fps=cfg.sampler.fps))
    atomic_write_text(out / "prompts.txt", "".join(f"{i} {p}\n" for i, p in enumerate(prompts, 1)))
    return files + [out / "prompts.txt"]


def run_wan(a: Any, overrides: List[str], conditioning: Callable, allowed: Tuple[str, ...]) -> None:
    """``vitp-sample`` of the Wan run or folder ``a.source`` (the parsed flags ``a`` of
    :func:`vitp.cli.sample.parse_args`: prompts, ``--num``, ``--out`` (a folder), ``--force``,
    ``--scheduler``, ``--flow-shift``): samples as the module doc says, in one process or split over
    the launched ranks; rank 0 writes the output folder (default ``RUN/samples/<output_name>``, for a
    model folder ``./outputs/<model_name>/samples/<output_name>``, :func:`model_name`) and
    prints one line. ``conditioning``: ``(a, cfg, meta) -> (PromptConditioning, row ids, prompts)``
    (:func:`vitp.cli.sample._conditioning`), ``allowed``: the override keys. Raises ``ValueError``
    before sampling for class labels, no prompt, ``--format mp4``, an ``--out`` :func:`check_wan_out`
    refuses; ``PermissionError`` for an output into the run
    folder where this process may not write; as :func:`wan_sample_config` and :func:`pipeline_of`."""
    from vitp.eval.launch import choose_layout, finish, launched
    from vitp.eval.sampling import class_grid_labels
    from vitp.objectives.wan_sampling import load_scheduler
    from vitp.parallel.distributed import is_main, resolve_device, world_size

    if a.format == "mp4":
        raise ValueError("--format mp4: a Wan sample folder holds a GIF grid (and the frames in latents.safetensors); "
                         "leave --format out")
    from vitp.models.wan_run import wan_source

    cfg, weights, base = wan_sample_config(a.source, overrides, a.num, allowed)
    check_output_in_run(a.out, base / "samples", a.source, "vitp-sample")  # a read-only run: before any work
    pipe = pipeline_of(cfg)
    lora = lora_target(cfg)  # a LoRA run samples its base pipeline, the adapters on the expert it adapted
    info = sampling_pipeline(cfg, pipe, run_expert(cfg) if (Path(a.source) / ".hydra").is_dir() and lora is None
                             else None)
    scheduler = load_scheduler(pipe, a.scheduler, a.flow_shift)
    cond, rows, prompts = conditioning(a, cfg, {})
    embeds = prompt_embeds(cond, int(cfg.model.text_dim))
    out = check_wan_out(a.out, base / "samples" / output_name(cfg, prompts, scheduler, info.two_experts), a.force)
    ids = torch.tensor(rows)[class_grid_labels(len(rows), cfg.sampler.samples_per_class)]
    experts = tuple(pipe / name for name in info.experts) if info.two_experts else ()
    if launched():  # replicas of the whole model where one fits a device, unless a layout key is given
        cfg = choose_layout(cfg, overrides, world_size(), resolve_device(cfg.trainer.device), "vitp-sample")
        denoiser, share = build_wan_sharded(cfg, experts=experts)
    else:
        denoiser = wan_denoisers(cfg, experts or (wan_source(cfg)[0],), resolve_device(cfg.trainer.device))
        share = None
    got = wan_generate(denoiser, scheduler, cfg, ids, embeds, share, info)
    finish()
    if got is None or not is_main():
        return
    adapters = lora_file_of(Path(a.source) / "lora") if lora else None
    _write(out, got, pipe, prompts, cfg, scheduler, info, weights, adapters)


MEDIA_SUFFIXES = (".gif", ".mp4", ".png", ".jpg", ".jpeg", ".webp")  # a file name, not a Wan sample folder


def check_wan_out(out: Optional[Path], default: Path, force: bool) -> Path:
    """The output folder of a Wan sample: ``out`` (``--out``), else ``default`` (``base``:
    :func:`wan_sample_config`). Raises ``ValueError`` (one line, before sampling) for an ``--out``
    among a run's or a model's files (:func:`vitp.checkpoint.outputs.check_sample_out`, ``force``
    or not), one named as a media file or that is a file, and without ``force`` a folder holding an
    earlier sample or other files."""
    from vitp.checkpoint.outputs import check_sample_out

    if out is not None:
        check_sample_out(out, default)
        if out.suffix.lower() in MEDIA_SUFFIXES:  # it made a folder of that name
            raise ValueError(f"--out {out}: a Wan sample is a folder (latents.safetensors, grid.gif, prompts.txt), "
                             f"not a {out.suffix} file; give --out a folder name, e.g. {out.with_suffix('')}")
    out = out or default
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; a Wan sample is a folder (latents.safetensors, grid.gif)")
    if (out / "latents.safetensors").exists() and not force:
        raise ValueError(f"{out} holds an earlier sample; choose another --out, or pass --force to replace it")
    if out.is_dir() and any(out.iterdir()) and not force:  # as vitp-export refuses a non-empty -o
        raise ValueError(f"{out} exists and holds other files than a vitp-sample output; choose another --out, or "
                         "pass --force to write into it")
    return out


def _write(out: Path, got: Tuple[torch.Tensor, torch.Tensor], pipe: Path, prompts: List[str], cfg: Any,
           scheduler: Any, info: Any, weights: Path, lora: Optional[Path] = None) -> None:
    """Rank 0's end of :func:`run_wan`: decode, write the output folder, print its line (``lora``:
    the adapters file merged into ``weights``)."""
    latents, noise = got
    frames = decode_frames(pipe, latents)
    s = cfg.sampler
    settings = {"scheduler": type(scheduler).__name__, "flow_shift": dict(scheduler.config).get(
        "flow_shift", dict(scheduler.config).get("shift")), "steps": s.steps, "guidance_scale": s.cfg_scale,
        "seed": s.seed, "samples_per_prompt": s.samples_per_class, "weights": str(weights),
        "expand_timesteps": info.expand_timesteps, **({"lora": str(lora)} if lora else {})}
    g2 = s.cfg_scale if s.get("cfg_scale_2") is None else s.cfg_scale_2
    if info.two_experts:
        settings.update(experts=list(info.experts), boundary_ratio=info.boundary_ratio, guidance_scale_2=g2)
    files = write_outputs(out, latents, noise, frames, prompts, cfg, settings)
    what = f"{len(prompts)} prompt{'s' if len(prompts) != 1 else ''} x {s.samples_per_class} sample" \
           f"{'s' if s.samples_per_class != 1 else ''}"
    how = f"{settings['scheduler']} {s.steps} steps, shift {settings['flow_shift']:g}, CFG {s.cfg_scale:g}"
    if info.two_experts:
        how += f" (two experts, boundary {info.boundary_ratio:g}, low-noise CFG {g2:g})"
    if lora:
        how += f", the base {weights} with the LoRA {lora}"
    decoded = f"{frames.shape[1]} frames" if frames is not None else "no vae/ in the pipeline: latents only"
    print(f"wrote {out} ({what}, {decoded}, {how}: {', '.join(f.name for f in files)})")
