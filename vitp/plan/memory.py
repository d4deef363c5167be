"""Per-rank memory of a layout: model state, saved activations, pipeline buffers and workspace.

Model state (Rajbhandari et al. 2020, "ZeRO", §3 and §5.1: mixed-precision Adam keeps ``2 + 2``
bytes of half-precision weights and gradients plus ``4 + 4 + 4`` bytes of fp32 master weights and
the two Adam moments per parameter; stage 1 partitions the last ``12`` over the engine's
data-parallel ranks, ``dp * cp`` with context parallelism). What DeepSpeed
0.19 keeps here is the table :data:`STATE_BYTES` (read from ``runtime/zero/stage_1_and_2.py`` and
``runtime/bf16_optimizer.py``, measured in ``tests/distributed/test_plan_validation.py``): ZeRO-1
keeps an fp32 master copy of its partition even in fp32 training, and accumulates gradients in
the model dtype in ``param.grad``. Change the table (or pass another) when the ZeRO setup changes.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", §4: count the tensors autograd saves per block, per micro-batch; tensor parallelism
divides those inside attention/MLP by t, sequence parallelism also the rest, full recomputation
keeps only each checkpoint's input). Their GPT block stores ``sbh (34 + 5 a s / h)`` bytes in
fp16; this generator's block is listed tensor by tensor in :func:`block_saved` (adaLN-Zero, no
dropout masks, and fused SDPA kernels that keep the logsumexp instead of the ``a s^2`` score
matrix). Context parallelism divides every token-proportional tensor by cp; the embedding's
input, the pixel tensors of the loss and the gathered prediction stay whole on every cp rank. Pipeline (Narayanan et al. 2021, §2.2.1; DeepSpeed ``TrainSchedule``): with 1F1B, stage
``s`` of ``p`` holds the activations of ``min(p - s, m)`` micro-batches at once.

A Wan block (:func:`wan_block_saved`: fp32 LayerNorms, q/k RMSNorm across heads in self- and
cross-attention, rotary positions, cross-attention over ``L = 512`` caption tokens, FFN of
``ffn_dim``, adaLN-single modulation in fp32) is listed the same way; its stage-level tensors are
``temb``, ``mod (6D)``, ``ctx (L D)`` per sample and the rotary tables (:func:`stage_tensor_bytes`).
Its block was measured at tp = 1 on CPU in fp32 and bf16 (``tests/unit/test_plan_wan.py``); its
tp / sp / cp divisions follow the generator's rules, not measured.

Measured on CPU (gloo, fp32 and bf16; ``tests/distributed/test_plan_validation.py``); on CUDA the
same tensors are assumed, with fp32 norm statistics (:data:`NORM_STATS_BYTES`). Not modelled:
dropout and drop-path masks (the recipes use none) and SDPA's math fallback, which stores the
``B H N S`` attention probabilities when no fused kernel applies.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .layout import LayoutSpec, gathered_tokens, local_tokens
from .lora import LoraPlan, lora_layer_costs
from .shapes import ModelShape, layer_params_per_rank, stage_layer_ranges

ACT_BYTES = {"fp32": 4, "bf16": 2}
FREQ_DIM = 256  # timestep sinusoid size


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of model state: ``whole`` on every dp rank, ``split`` over the dp ranks
    (ZeRO partitions), ``step_split`` allocated only during the optimizer step (split over dp)."""

    whole: Dict[str, float]
    split: Dict[str, float]
    step_split: Dict[str, float] = field(default_factory=dict)


# (ZeRO stage, precision) -> bytes per parameter, as DeepSpeed 0.19 lays them out for this engine
# (torch AdamW as the client optimizer, pipeline engine, default grad_accum_dtype = model dtype).
STATE_BYTES: Dict[Tuple[int, str], StateBytes] = {
    # DeepSpeedZeroOptimizer: model-dtype params (flat buffer) and grads (param.grad, full size);
    # fp32 master partition + AdamW exp_avg / exp_avg_sq of the partition; fp32 grad partition at the step
    (1, "fp32"): StateBytes({"weights": 4, "grads": 4}, {"master": 4, "adam": 8}, {"grad_partition": 4}),
    (1, "bf16"): StateBytes({"weights": 2, "grads": 2}, {"master": 4, "adam": 8}, {"grad_partition": 4}),
    # BF16_Optimizer (bf16 + ZeRO 0 under a pipeline): also a full fp32 gradient accumulation buffer
    (0, "bf16"): StateBytes({"weights": 2, "grads": 2 + 4}, {"master": 4, "adam": 8}),
    # plain torch AdamW (refused by validate_layout in pipelines, kept for completeness)
    (0, "fp32"): StateBytes({"weights": 4, "grads": 4, "adam": 8}, {}),
}

# DeepSpeed's default zero_optimization.reduce_bucket_size (elements). ZeRO-1 allocates one such
# contiguous gradient bucket (model dtype) when a backward starts (setup_buckets) and, under a
# pipeline, reduce_gradients(pipeline_parallel=True) appends a second one: both are alive while the
# gradients are reduced (measured: 2 x 5e8 x 4 bytes in fp32, 2 x 5e8 x 2 in bf16)
ZERO_BUCKET_ELEMENTS = 500_000_000
ZERO_BUCKET_BUFFERS = 2
# DeepSpeed's PipelineEngine keeps max(2, in-flight) output buffers per stage; its last stage runs
# backward on the loss and returns without clearing them, so the outputs (x_pred) of the last 2
# micro-batches stay allocated there
LAST_OUTPUT_BUFFERS = 2


STATS = "stats"  # Saved.nbytes of LayerNorm mean/rstd: see NORM_STATS_BYTES
# LayerNorm's saved mean and rstd: the input dtype on CPU (measured with bf16 here); fp32 on CUDA
# (ATen's accumulate type for bf16; read from the kernels, not measured here); None = activation dtype
NORM_STATS_BYTES = {"cuda": 4, "cpu": None}


@dataclass(frozen=True)
class Saved:
    """One tensor kept from forward to backward, per sample on one rank: ``elements`` values of
    ``nbytes`` bytes each (``None`` = the activation dtype, :data:`STATS` = norm statistics)."""

    name: str
    elements: float
    nbytes: Optional[object] = None

    def bytes(self, precision: str, device: str = "cpu") -> float:
        size = NORM_STATS_BYTES.get(device, 4) if self.nbytes == STATS else self.nbytes
        return self.elements * (size or ACT_BYTES[precision])


def _proj_input_copy(shape: ModelShape, kind: str, tp: int, sp: bool, cp: int = 1,
                     cp_mode: str = "ulysses") -> bool:
    """Whether ``proj`` saves its own copy of the attention output (else a view of SDPA's output):
    with qk-norm q is contiguous and SDPA's CPU output follows its (B, H, N, hd) layout, so the
    transpose copies; a temporal block under TP or CP ungroups it (copy); SP padding re-pads it
    (copy); under context parallelism Ulysses' second all-to-all returns a new tensor (copy), while
    the ring's fused block kernels (:mod:`vitp.parallel.ring`) give an output in q's layout, as
    SDPA does at cp=1, which the log-sum-exp merge keeps (a view; both measured)."""
    regrouped = (tp > 1 or cp > 1) and kind == "temporal"
    context = cp > 1 and kind == "full" and cp_mode != "ring"
    return shape.qk_norm or regrouped or context or (sp and (shape.tokens // cp) % tp != 0)


def block_saved(shape: ModelShape, kind: str, tp: int, sp: bool, cp: int = 1, cp_mode: str = "ulysses"
                ) -> List[Saved]:
    """Tensors one block saves for backward, per sample on one TP rank (parameters excluded;
    the conditioning ``c`` is counted once per stage, see :func:`stage_memory`).

    Region sizes: ``n`` tokens of the sequence region (N / cp, or ceil(N / cp / tp) under SP), ``g``
    tokens of a gathered input (N / cp, padded to a multiple of tp under SP; the column-parallel
    ``qkv`` and ``fc1`` save their local input and re-gather it in backward, as Megatron does),
    and attention / MLP internals over ``1/tp`` of the heads / hidden units. Context parallelism
    (``cp`` ranks, :mod:`vitp.parallel.context`) divides every token count by cp: Ulysses'
    full-sequence q, k, v, output and logsumexp ``(B, N, 3 h / cp hd)`` hold as many elements as
    the local ``(B, N / cp, 3 h hd)`` (its all-to-alls save nothing), the temporal exchange
    regroups ``N / cp`` tokens, and the ring keeps the local q, k, v, output and logsumexp.
    """
    N, D, H, h = shape.tokens, shape.width, shape.heads, shape.hidden
    n, g, local = local_tokens(N, tp, sp, cp), gathered_tokens(N, tp, sp, cp), N // cp
    # SP pad rows are cut before attention: regrouping (factorized) or Ulysses' all-to-all copies the N / cp rows
    qkv_rows = g if kind == "full" and (cp == 1 or cp_mode == "ring") else local
    rows = [Saved("norm1 input (residual)", n * D), Saved("norm1 output", n * D),
            Saved("qkv input (modulated; local, re-gathered in backward)", n * D),
            Saved("qkv output (q, k, v)", qkv_rows * 3 * D / tp),
            Saved("SDPA output", local * D / tp), Saved("SDPA logsumexp", local * H / tp, 4),
            Saved("proj output (gate1 input)", n * D), Saved("norm2 input (residual)", n * D),
            Saved("norm2 output", n * D), Saved("fc1 input (modulated; local, re-gathered in backward)", n * D),
            Saved("MLP hidden (fc1 out, act out)" if shape.mlp == "gelu"
                  else "MLP hidden (fc1_g, silu, fc1_x, product)", g * (2 if shape.mlp == "gelu" else 4) * h / tp),
            Saved("fc2 output (gate2 input)", n * D), Saved("norm1/norm2 mean and rstd", 4 * n, STATS),
            Saved("adaLN: silu(c), 1+scale1, 1+scale2, modulation output (6D)", 9 * D)]
    if _proj_input_copy(shape, kind, tp, sp, cp, cp_mode):
        rows.append(Saved("proj input (own copy)", g * D / tp))
    if shape.qk_norm:
        rows += [Saved("q, k after qk-norm", 2 * local * D / tp),
                 Saved("qk-norm mean and rstd", 4 * local * H / tp, STATS)]
    if shape.layer_scale:
        rows.append(Saved("LayerScale outputs (estimate)", 2 * n * D))
    if shape.text_tokens:
        L = shape.text_tokens
        rows += [Saved("cross-attn: norm_cross output, q input (estimate)", 2 * n * D),
                 Saved("cross-attn: q, k, v, output (estimate)", (2 * g + 2 * L) * D / tp),
                 Saved("cross-attn: logsumexp, proj output (estimate)", local * H / tp + n * D)]
    return rows


def wan_block_saved(shape: ModelShape, tp: int, sp: bool, cp: int = 1, cp_mode: str = "ulysses") -> List[Saved]:
    """Tensors one Wan block (:class:`vitp.models.wan.WanBlock`, diffusers' ``WanTransformerBlock``)
    saves for backward, per sample on one rank; ``mod``, ``ctx`` and the rotary tables are stage
    tensors (:func:`stage_tensor_bytes`). Sizes as :func:`block_saved` (``n`` sequence-region
    tokens, ``g`` gathered, attention / FFN internals over ``1/tp``); ``L`` caption tokens,
    ``F = ffn_dim``. fp32 rows are the norms' fp32 copies and statistics (diffusers'
    ``FP32LayerNorm``, RMSNorm's upcast) and the fp32 modulation; in fp32 training the upcasts of q
    and k are views of their linear outputs (rows dropped). Measured at tp = 1 on CPU (both
    precisions): ``tests/unit/test_plan_wan.py``."""
    N, D, H, F, L = shape.tokens, shape.width, shape.heads, shape.hidden, shape.text_tokens
    n, g, local = local_tokens(N, tp, sp, cp), gathered_tokens(N, tp, sp, cp), N // cp
    qkv_rows = g if cp == 1 or cp_mode == "ring" else local
    rows = [Saved("norm1/norm2/norm3 fp32 inputs", 3 * n * D, 4), Saved("norm1/norm2/norm3 mean and rstd", 6 * n, 4),
            Saved("norm1/norm3 fp32 outputs (times 1 + scale)", 2 * n * D, 4),
            Saved("modulation: scale_shift_table + mod (fp32, 6D), 1 + scale, 1 + c_scale", 8 * D, 4),
            Saved("qkv input (modulated; local, re-gathered in backward)", n * D),
            Saved("qkv output (q, k, v)", qkv_rows * 3 * D / tp),
            Saved("q, k RMSNorm: normalised (fp32) and rstd", 2 * local * D / tp + 2 * local, 4),
            Saved("q, k after rotary (SDPA inputs)", 2 * local * D / tp),
            Saved("SDPA output, proj input copy", 2 * local * D / tp), Saved("SDPA logsumexp (self, cross)", 2 * local * H / tp, 4),
            Saved("attn output (gate input)", n * D), Saved("cross q input (norm2 output)", n * D),
            Saved("cross q RMSNorm: fp32 input, normalised, rstd", 2 * g * D / tp + g, 4),
            Saved("cross q normed, SDPA output (= proj input)", 2 * g * D / tp),
            Saved("cross k RMSNorm: normalised (fp32), rstd", L * D / tp + L, 4),
            Saved("cross k normed, kv output", 3 * L * D / tp), Saved("fc1 input (modulated)", n * D),
            Saved("FFN hidden (fc1 out, GELU-tanh out)", 2 * g * F / tp), Saved("fc2 output in fp32 (c_gate input)", n * D, 4)]
    return rows


def wan_upcast_saved(shape: ModelShape, tp: int, sp: bool, cp: int = 1) -> List[Saved]:
    """The fp32 copies of q, k (self-attention) and k (cross-attention) that RMSNorm makes of
    16-bit activations (in fp32 training they are views of the linear outputs: not new)."""
    local = shape.tokens // cp
    return [Saved("q, k RMSNorm fp32 inputs", 2 * local * shape.width / tp, 4),
            Saved("cross k RMSNorm fp32 input", shape.text_tokens * shape.width / tp, 4)]


def stage_tensor_bytes(shape: ModelShape, lay: LayoutSpec) -> float:
    """Bytes per micro-batch of the tensors a stage's layers share (counted once per stage): the
    generator's conditioning ``c (B, D)``; Wan's ``temb (B, D)``, ``mod (B, 6, D)``, ``ctx (B, L, D)``
    and the fp32 rotary tables ``cos, sin (N / cp, hd / 2)`` of this rank's tokens."""
    a = ACT_BYTES[lay.precision]
    if not shape.is_wan:
        return lay.micro * shape.width * a
    rope = 2 * (shape.tokens // lay.cp) * (shape.width // shape.heads // 2) * 4
    return lay.micro * (7 + shape.text_tokens) * shape.width * a + rope


def stage_output_bytes(shape: ModelShape, lay: LayoutSpec) -> float:
    """Bytes per micro-batch a non-last pipeline stage sends forward (and receives as gradients):
    the generator's ``(tokens, c)``; Wan's ``(tokens, temb, mod, ctx, cos, sin)``
    (:mod:`vitp.pipeline.wan_stages`); tokens of this rank (``N / cp``, ``ceil(N / cp / tp)`` under SP)."""
    n = local_tokens(shape.tokens, lay.tp, lay.sp, lay.cp)
    return lay.micro * n * shape.width * ACT_BYTES[lay.precision] + stage_tensor_bytes(shape, lay)


def wan_embed_saved(shape: ModelShape) -> List[Saved]:
    """Tensors Wan's input layer saves per sample (an estimate from :class:`vitp.models.wan.WanEmbed`,
    not measured): the latents for the Conv3d, the fp32 timestep embedder, ``time_proj``'s SiLU,
    the caption projection (Linear, GELU-tanh, Linear) over ``L`` tokens of ``Dc`` channels."""
    D, L = shape.width, shape.text_tokens
    return [Saved("z_t (conv input)", shape.pixels), Saved("timestep sinusoid, embedder hidden (fp32)", FREQ_DIM + 2 * D, 4),
            Saved("time_proj: SiLU input and output (estimate)", 2 * D),
            Saved("caption projection: input, fc1 out, GELU out (estimate)", L * (shape.text_dim + 2 * D))]


def wan_final_saved(shape: ModelShape, tp: int, sp: bool, cp: int = 1) -> List[Saved]:
    """Tensors Wan's output head saves per sample (an estimate from :class:`vitp.models.wan.WanFinal`):
    the fp32 norm's input (gathered under SP), statistics and output, ``1 + scale``, the linear's input."""
    N, D = shape.tokens // cp, shape.width
    g = gathered_tokens(shape.tokens, tp, sp, cp)
    return [Saved("final norm fp32 input (estimate)", g * D, 4), Saved("final norm mean, rstd, fp32 output", 2 * N + N * D, 4),
            Saved("final 1 + scale (fp32)", D, 4), Saved("final linear input (modulated)", N * D)]


def embed_saved(shape: ModelShape) -> List[Saved]:
    """Tensors the input layer saves per sample (stage 0): the noisy input for the tubelet conv
    (in the model dtype), the timestep MLP's inputs, the class indices (Wan: :func:`wan_embed_saved`)."""
    if shape.is_wan:
        return wan_embed_saved(shape)
    D, L = shape.width, shape.text_tokens
    text = [Saved("caption embeddings, projection hidden, ctx (estimate)", L * (shape.text_dim + 3 * D))] if L else []
    return [Saved("z_t (conv input)", shape.pixels), Saved("timestep sinusoid", FREQ_DIM),
            Saved("timestep MLP hidden (pre/post SiLU)", 2 * D), Saved("class index (int64)", 1, 8), *text]


def final_saved(shape: ModelShape, tp: int, sp: bool, cp: int = 1) -> List[Saved]:
    """Tensors the output layer saves per sample (last stage): over this rank's ``N / cp`` tokens
    (its output is all-gathered over cp afterwards, saving nothing); under SP the final norm
    saves the gathered (padded) tokens (Wan: :func:`wan_final_saved`)."""
    if shape.is_wan:
        return wan_final_saved(shape, tp, sp, cp)
    N, D = shape.tokens // cp, shape.width
    g = gathered_tokens(shape.tokens, tp, sp, cp)
    return [Saved("final norm input (gathered under SP)", g * D), Saved("final norm output", N * D),
            Saved("final linear input (modulated)", N * D), Saved("final norm mean and rstd", 2 * N, STATS),
            Saved("final adaLN: silu(c), 1+scale", 2 * D)]


def loss_saved(shape: ModelShape) -> List[Saved]:
    """Tensors the v-loss saves per sample (last stage, outside any activation checkpoint): it
    works in fp32."""
    return [Saved("v-loss residual (fp32)", shape.pixels, 4), Saved("v-loss denominator", 1, 4)]


def _sum(rows: List[Saved], lay: LayoutSpec) -> float:
    return sum(r.bytes(lay.precision, lay.device) for r in rows)


def chunks(first: int, end: int, interval: int) -> List[Tuple[int, int]]:
    """Activation-checkpoint chunks of a stage's layers ``[first, end)``: DeepSpeed's
    ``PipelineModule`` cuts the stage's local layer list every ``interval`` layers."""
    return [(i, min(i + interval, end)) for i in range(first, end, interval)]


def layer_saved_bytes(shape: ModelShape, layer: int, lay: LayoutSpec, extra: Optional[List[float]] = None) -> float:
    """Saved bytes per sample of layer ``layer`` (0 = Embed, 1..depth = blocks, depth+1 = Final),
    plus ``extra[layer]`` (LoRA's, :func:`vitp.plan.lora.lora_layer_costs`)."""
    if extra is not None:
        return layer_saved_bytes(shape, layer, lay) + extra[layer]
    return _layer_saved(shape, layer, lay.tp, lay.sp, lay.cp, lay.cp_mode, lay.precision, lay.device)


def layers_saved_bytes(shape: ModelShape, first: int, end: int, lay: LayoutSpec,
                       extra: Optional[List[float]] = None) -> List[float]:
    """:func:`layer_saved_bytes` of the layers ``[first, end)``, in order (without ``extra`` a slice
    of one list remembered per shape and the layout fields it reads)."""
    if extra is not None:
        return [layer_saved_bytes(shape, i, lay, extra) for i in range(first, end)]
    return list(_all_layers_saved(shape, lay.tp, lay.sp, lay.cp, lay.cp_mode, lay.precision, lay.device)[first:end])


@functools.lru_cache(maxsize=4096)
def _all_layers_saved(shape: ModelShape, *key: Any) -> Tuple[float, ...]:
    return tuple(_layer_saved(shape, i, *key) for i in range(shape.depth + 2))


@functools.lru_cache(maxsize=65536)
def _layer_saved(shape: ModelShape, layer: int, tp: int, sp: bool, cp: int, cp_mode: str, precision: str,
                 device: str) -> float:
    """:func:`layer_saved_bytes` without ``extra``, remembered: it reads only these fields of the layout."""
    lay = LayoutSpec(tp=tp, pp=1, dp=1, sp=sp, ac=0, micro=1, accum=1, precision=precision, device=device, cp=cp,
                     cp_mode=cp_mode)
    if layer == 0:
        return _sum(embed_saved(shape), lay)
    if layer == shape.depth + 1:
        return _sum(final_saved(shape, lay.tp, lay.sp, lay.cp), lay)
    if shape.is_wan:
        up = _sum(wan_upcast_saved(shape, lay.tp, lay.sp, lay.cp), lay) if lay.precision != "fp32" else 0.0
        return _sum(wan_block_saved(shape, lay.tp, lay.sp, lay.cp, lay.cp_mode), lay) + up
    return _sum(block_saved(shape, shape.block_kind(layer - 1), lay.tp, lay.sp, lay.cp, lay.cp_mode), lay)


def chunk_input_bytes(shape: ModelShape, first_layer: int, lay: LayoutSpec) -> float:
    """Bytes per sample a checkpoint keeps of its chunk's input (besides ``c``): the data batch
    (fp32 pixels, t, int64 y; whole on every cp rank) for the input layer, else the tokens of this rank."""
    if first_layer == 0:
        return shape.pixels * 4 + 4 + (shape.text_tokens * shape.text_dim * 4 if shape.is_wan else 8)
    return local_tokens(shape.tokens, lay.tp, lay.sp, lay.cp) * shape.width * ACT_BYTES[lay.precision]


def _resaved_input_bytes(shape: ModelShape, first_layer: int, lay: LayoutSpec) -> float:
    """Bytes per sample of a chunk's stored input that its recomputation saves again (the same
    storage, so not new memory): the tokens the first block's norm1 (or the final norm, without
    SP) reads; for the input layer the class indices, and in fp32 also z_t (bf16 makes a copy)."""
    if first_layer == 0:
        return 8 + (shape.pixels * 4 if lay.precision == "fp32" else 0)
    if first_layer == shape.depth + 1 and lay.sp and lay.tp > 1:
        return 0.0  # the final layer saves the gathered tokens, a new tensor
    return chunk_input_bytes(shape, first_layer, lay)


def _rebuilt_only_bytes(shape: ModelShape, first: int, end: int, lay: LayoutSpec) -> float:
    """Bytes per micro-batch that only a recomputation of the chunk ``[first, end)`` saves.

    With the input layer in the chunk: ``c`` is rebuilt as a new tensor when a block of the chunk
    reads it; and DeepSpeed makes the first stage's float inputs require grad whenever
    checkpointing is on (it assumes reentrant checkpointing, ``_exec_load_micro_batch``), so the
    timestep sinusoid saves its float64 frequencies (per micro-batch) and arguments (per sample).
    """
    if first != 0:
        return 0.0
    c = shape.width * ACT_BYTES[lay.precision] if end > 1 else 0.0
    return lay.micro * (c + FREQ_DIM // 2 * 8) + FREQ_DIM // 2 * 8


def recompute_peak(shape: ModelShape, lay: LayoutSpec, first: int, end: int,
                   extra: Optional[List[float]] = None) -> float:
    """Peak bytes of one micro-batch during its backward with activation checkpointing:
    chunks are rebuilt last to first; while chunk ``j`` is rebuilt the inputs of chunks ``<= j``
    are still stored (later ones were freed with their chunk's backward, the loss's saved tensors
    before any), and its rebuilt tensors are alive at once (``c`` excluded: counted per stage)."""
    peak, prefix = 0.0, 0.0
    saved = (None if extra is not None else  # one remembered list: the same sums as per layer, in order
             _all_layers_saved(shape, lay.tp, lay.sp, lay.cp, lay.cp_mode, lay.precision, lay.device))
    for a, e in chunks(first, end, lay.ac):
        prefix += chunk_input_bytes(shape, a, lay)
        rebuilt = (sum(saved[a:e]) if saved is not None else
                   sum(layer_saved_bytes(shape, i, lay, extra) for i in range(a, e))) - _resaved_input_bytes(shape, a, lay)
        peak = max(peak, lay.micro * (prefix + rebuilt) + _rebuilt_only_bytes(shape, a, e, lay))
    return peak


@dataclass(frozen=True)
class MemoryOptions:
    """Knobs of the memory model that follow the code it models.

    ``state_bytes``: :data:`STATE_BYTES`-like table; ``zero_bucket_elements``: ZeRO-1's gradient
    bucket (0 = none); ``adaln_sharded``: the blocks' adaLN modulation is split over TP;
    ``ema_bytes``: bytes per parameter of the trainer's EMA copy (fp32, on the training device,
    split over the ``dp * cp`` ranks as ZeRO-1 splits the optimizer: :class:`vitp.train.ema.EMA`;
    0 = none). ``lora``: a LoRA run (:mod:`vitp.plan.lora`): the state above is the adapters',
    the frozen base only its weights.
    """

    state_bytes: Dict[Tuple[int, str], StateBytes] = field(default_factory=lambda: dict(STATE_BYTES))
    zero_bucket_elements: int = ZERO_BUCKET_ELEMENTS
    adaln_sharded: bool = True
    ema_bytes: float = 4.0
    lora: Optional[LoraPlan] = None


@dataclass(frozen=True)
class StageMemory:
    """Predicted peak bytes of one rank of pipeline stage ``stage``.

    ``ema``: the trainer's fp32 EMA of the rank's parameters; ``activations``: saved tensors of the
    ``in_flight`` micro-batches (with activation
    checkpointing: the checkpoints' inputs); ``recompute``: with checkpointing, the extra bytes at
    the recomputation peak of one micro-batch's backward; ``pipe_buffers``: stage outputs held until their backward;
    ``zero_buckets``: ZeRO-1's two contiguous gradient buckets (:func:`zero_bucket_bytes`, 3.73 GiB in
    fp32 whatever the model) on a GPU; on CPU (``lay.device == "cpu"``) only the pages gradients
    fill, at most ``grads`` (Linux commits memory on first touch; the start-up check,
    ``vitp/train/preflight.py``, sizes CPU runs by this ``total`` too); ``workspace``: the fp32 gradient
    partition at the step plus one layer's activation gradients (an estimate, not validated).
    ``ckpt_host``: host memory a checkpoint stages on one rank (its share: weights shard, and its
    fragments of EMA, moments and master weights; not in ``total``, which counts device memory);
    ``ckpt_write``: bytes one rank writes per checkpoint (:func:`checkpoint_bytes`).
    """

    stage: int
    params: int
    weights: float
    grads: float
    optimizer: float
    ema: float
    activations: float
    recompute: float
    pipe_buffers: float
    zero_buckets: float
    workspace: float
    in_flight: int
    ckpt_host: float = 0.0
    ckpt_write: float = 0.0
    adapter_params: int = 0

    @property
    def total(self) -> float:
        return (self.weights + self.grads + self.optimizer + self.ema + self.activations + self.recompute
                + self.pipe_buffers + self.zero_buckets + self.workspace)


def checkpoint_bytes(P: int, lay: LayoutSpec) -> Tuple[float, float]:
    """``(host, write)`` bytes of one rank holding ``P`` parameters per checkpoint
    (:mod:`vitp.checkpoint.train_state`): it stages its weights shard (training dtype) and its
    ZeRO fragments of the fp32 EMA, AdamW moments and (bf16) master weights; it writes its
    fragments and ``1 / (dp cp)`` of the weights (the replicas split them: DCP's de-duplication).
    Piece headers (~1 KiB per piece) are not counted."""
    weights = P * (2 if lay.precision == "bf16" else 4)
    frag = P * (4 + 8 + (4 if lay.precision == "bf16" else 0)) / (lay.engine_dp if lay.zero_stage >= 1 else 1)
    return weights + frag, weights / lay.engine_dp + frag


def zero_bucket_bytes(lay: LayoutSpec, opts: Optional[MemoryOptions] = None) -> float:
    """Bytes ZeRO-1 allocates for its gradient buckets on one rank (:data:`ZERO_BUCKET_BUFFERS` of
    ``opts.zero_bucket_elements`` in the model dtype; 0 without ZeRO-1), whatever the model: what
    ``tests/distributed/plan_measure.py`` measures. :func:`stage_memory` counts all of it on a GPU,
    at most the rank's gradient bytes on CPU (``StageMemory.zero_buckets``)."""
    opts = opts or MemoryOptions()
    return ZERO_BUCKET_BUFFERS * opts.zero_bucket_elements * ACT_BYTES[lay.precision] if lay.zero_stage == 1 else 0


def _state(P: int, lay: LayoutSpec, opts: MemoryOptions) -> Tuple[float, float, float, float]:
    """``(weights, grads, optimizer, step transient)`` bytes of ``P`` parameters on one rank."""
    key = (lay.zero_stage, lay.precision)
    if key not in opts.state_bytes:
        raise ValueError(f"no memory model for ZeRO stage {lay.zero_stage} with {lay.precision}; "
                         f"known: {sorted(opts.state_bytes)}")
    sb = opts.state_bytes[key]
    other = sum(v for k, v in sb.whole.items() if k not in ("weights", "grads"))
    return (P * sb.whole.get("weights", 0), P * sb.whole.get("grads", 0),
            P * other + P * sum(sb.split.values()) / lay.engine_dp, P * sum(sb.step_split.values()) / lay.engine_dp)


def _activations(shape: ModelShape, lay: LayoutSpec, first: int, end: int, last: bool,
                 extra: Optional[List[float]] = None) -> Tuple[float, float]:
    """``(stored, recompute)`` bytes per micro-batch of the stage's layers ``[first, end)``: what
    one micro-batch holds between its forward and backward, and (activation checkpointing) how
    much more its backward needs at the recomputation peak (:func:`recompute_peak`)."""
    c = stage_tensor_bytes(shape, lay)  # the conditioning (Wan: mod, ctx, rotary), shared by the stage's layers
    loss = _sum(loss_saved(shape), lay) if last else 0.0
    if not lay.ac:
        return lay.micro * (sum(layers_saved_bytes(shape, first, end, lay, extra)) + loss) + c, 0.0
    stored = lay.micro * (_chunk_inputs(shape, first, end, lay.ac, lay.tp, lay.sp, lay.cp, lay.precision) + loss) + c
    return stored, max(0.0, recompute_peak(shape, lay, first, end, extra) + c - stored)


@functools.lru_cache(maxsize=65536)
def _chunk_inputs(shape: ModelShape, first: int, end: int, ac: int, tp: int, sp: bool, cp: int, precision: str
                  ) -> float:
    """Bytes per sample of the stored inputs of the checkpoint chunks of ``[first, end)``
    (:func:`chunk_input_bytes` summed in chunk order), remembered: it reads only these fields."""
    lay = LayoutSpec(tp=tp, pp=1, dp=1, sp=sp, ac=ac, micro=1, accum=1, precision=precision, cp=cp)
    return sum(chunk_input_bytes(shape, a, lay) for a, _ in chunks(first, end, ac))


def _stage_state(P: int, Pa: int, lay: LayoutSpec, opts: MemoryOptions) -> Dict[str, float]:
    """Model state bytes of one rank holding ``P`` base parameters (and ``Pa`` LoRA adapter
    parameters with ``opts.lora``: the state is theirs, the frozen base only weights in its dtype)."""
    trained = Pa if opts.lora else P
    weights, grads, optimizer, step = _state(trained, lay, opts)
    if opts.lora:
        weights += P * opts.lora.base_bytes(lay.precision)
    host, write = checkpoint_bytes(trained, lay)
    ema_split = lay.engine_dp if lay.zero_stage >= 1 else 1  # sharded like ZeRO's partitions
    return dict(weights=weights, grads=grads, optimizer=optimizer, step=step, ckpt_host=host, ckpt_write=write,
                ema=trained * opts.ema_bytes / ema_split)


def stage_memory(model: Any, lay: LayoutSpec, opts: Optional[MemoryOptions] = None) -> List[StageMemory]:
    """Predicted per-rank memory of every pipeline stage of ``model`` (a config section) in ``lay``
    (with ``opts.lora``, of a LoRA run: :mod:`vitp.plan.lora`).

    Raises ``ValueError`` for a (ZeRO stage, precision) pair the table lacks, or ``depth < pp``.
    """
    opts = opts or MemoryOptions()
    shape = ModelShape.from_config(model)
    per_layer = layer_params_per_rank(model, lay.tp, opts.adaln_sharded)
    adapters, extra = lora_layer_costs(model, opts.lora, lay) if opts.lora else ([0] * len(per_layer), None)
    act_b = ACT_BYTES[lay.precision]
    out = []
    for s, (first, end) in enumerate(stage_layer_ranges(shape.depth, lay.pp)):
        last = s == lay.pp - 1
        P, Pa = sum(per_layer[first:end]), sum(adapters[first:end])
        state = _stage_state(P, Pa, lay, opts)
        in_flight = min(lay.pp - s, lay.accum)
        stored, rebuilt = _activations(shape, lay, first, end, last, extra)
        # stage outputs: tokens until their backward; the last stage's predictions stay in its
        # output buffers (DeepSpeed returns before clearing them there), the newest LAST_OUTPUT_BUFFERS
        # (the prediction gathered over cp, every cp rank holds it whole)
        tokens_bytes = lay.micro * local_tokens(shape.tokens, lay.tp, lay.sp, lay.cp) * shape.width * act_b
        out_bytes = (lay.micro * shape.pixels * act_b if last else  # the generator's buffers measured without c
                     stage_output_bytes(shape, lay) if shape.is_wan else tokens_bytes)
        held = min(LAST_OUTPUT_BUFFERS, lay.accum) if last else in_flight
        layer_max = max(layers_saved_bytes(shape, first, end, lay, extra))
        bucket = zero_bucket_bytes(lay, opts)
        if lay.device == "cpu":  # Linux commits pages on first touch: only what the gradients fill is resident
            bucket = min(bucket, state["grads"])
        out.append(StageMemory(
            stage=s, params=P, weights=state["weights"], grads=state["grads"], optimizer=state["optimizer"],
            ema=state["ema"], ckpt_host=state["ckpt_host"], ckpt_write=state["ckpt_write"],
            activations=in_flight * stored, recompute=rebuilt,
            pipe_buffers=held * out_bytes, zero_buckets=bucket, workspace=state["step"] + lay.micro * layer_max,
            in_flight=in_flight, adapter_params=Pa))
    return out
