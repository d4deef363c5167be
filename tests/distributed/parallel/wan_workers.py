"""Rank-side checks of Wan under tensor, sequence and context parallelism
(:mod:`vitp.models.parallelize_wan`), float64 on CPU gloo.

:func:`worker` runs every layout of one world size in one spawned group: a tiny perturbed
:class:`~vitp.models.WanModel` (same seed on every rank), the unsharded model as reference on the
same inputs, and per layout the sharded copy's output, MSE loss, every gradient (sharded ones
gathered back to full shape; under context parallelism summed over cp and divided by cp, the
``dp x cp`` reduction at dp = 1) and the grad norm, as relative errors. A fault case normalises
q and k per rank (over the local heads' channels only) to show the comparison catches it.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

# 4 heads x 12 channels (rotary parts t, h, w = 4, 4, 4), ffn 32, text 16, patches (1, 2, 2)
CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=12, in_channels=4, out_channels=4,
              text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2)
# latents (B, C, T, H, W) fed in turn through one sharded model: grid (3, 2, 4), N = 24; then grid
# (1, 2, 3), N = 6 (3 tokens per cp rank, padded to 4 under SP at tp = 2, 6 -> 8 at tp = 4)
SHAPES = {"3x4x8": (2, 4, 3, 4, 8), "1x4x6": (2, 4, 1, 4, 6)}
TEXT_LEN = 5

# name -> (tp, cp, sequence_parallel, cp_mode)
LAYOUTS = {
    2: {"tp2": (2, 1, False, "ulysses"), "tp2_sp": (2, 1, True, "ulysses"),
        "cp2_ulysses": (1, 2, False, "ulysses"), "cp2_ring": (1, 2, False, "ring")},
    4: {"tp2_cp2_ulysses": (2, 2, False, "ulysses"), "tp2_cp2_ring": (2, 2, False, "ring"),
        "tp2_sp_cp2_ulysses": (2, 2, True, "ulysses"), "tp2_sp_cp2_ring": (2, 2, True, "ring"),
        "tp4": (4, 1, False, "ulysses"), "tp4_sp": (4, 1, True, "ulysses")},
    8: {},  # the 8-rank group runs pipeline layouts only (PIPE_LAYOUTS)
}
# injected faults (each must fail the comparison): "local" normalises q and k over each rank's
# heads alone (TPRMSNorm._local); "sum_backward" sums the squares with Megatron's g
# (reduce_from_tp_region: all-reduce forward, identity backward), so the statistic's gradient
# misses the other ranks' parts
FAULTS = {2: {"tp2_local_qk_norm": ((2, 1, False, "ulysses"), "local"),
              "tp2_norm_sum_identity_backward": ((2, 1, False, "ulysses"), "sum_backward")}, 4: {}, 8: {}}
# LoRA on the frozen perturbed base, B drawn non-zero (vitp.models.lora): self-attention's q and v
# pieces of the fused qkv (not k), cross-attention's q and both pieces of its fused kv ("to_v"
# names both attentions' v), both output projections and the MLP; rank 2, alpha 3 (scaling 1.5)
LORA_TARGETS = ("attn1.to_q", "to_v", "to_out.0", "attn2.to_q", "attn2.to_k", "ffn.net.0.proj", "ffn.net.2")
LORA_LAYOUTS = {2: {"tp2_lora": (2, 1, False, "ulysses"), "tp2_sp_lora": (2, 1, True, "ulysses"),
                    "cp2_ring_lora": (1, 2, False, "ring")}, 4: {}, 8: {}}
# LoRA dropout on every adapter's input (lora_dropout_parity), latents of shape 3x4x8 (no SP padding)
LORA_DROPOUT = 0.3
LORA_DROPOUT_LAYOUTS = {2: {"tp2_lora_dropout": (2, 1, False, "ulysses"),
                            "tp2_sp_lora_dropout": (2, 1, True, "ulysses")}, 4: {}, 8: {}}
# the fault: a column-parallel adapter's B split contiguously like an unfused linear's rows (not per
# piece, as the fused qkv / kv weight is), so updates land on the wrong pieces' rows
LORA_FAULTS = {2: {"tp2_lora_b_contiguous": (2, 1, False, "ulysses")}, 4: {}, 8: {}}


def lora_spec(b_std: float = 0.0):
    from vitp.models.lora import LoraSpec

    return LoraSpec(rank=2, alpha=3.0, targets=LORA_TARGETS, b_std=b_std)


def build():
    """(perturbed float64 reference model, ``{shape: (inputs, MSE target)}``), identical on every rank."""
    from vitp.models import WanModel

    torch.manual_seed(0)
    model = WanModel(CONFIG).double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():  # norms start at one, biases near zero: noise makes all matter
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    assert all(bool((p != 0).all()) for p in model.parameters())
    data = {}
    for name, (B, C, *thw) in SHAPES.items():
        x = torch.randn(B, C, *thw, generator=g, dtype=torch.float64)
        t = torch.rand(B, generator=g, dtype=torch.float64) * 1000
        text = torch.randn(B, TEXT_LEN, CONFIG["text_dim"], generator=g, dtype=torch.float64)
        target = torch.randn(B, CONFIG["out_channels"], *thw, generator=g, dtype=torch.float64)
        data[name] = ((x, t, text), target)
    return model, data


def fwd_bwd(model, inputs, target):
    model.zero_grad(set_to_none=True)
    out = model(*inputs)
    loss = F.mse_loss(out, target)
    loss.backward()
    return out.detach(), loss.detach()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def full_grads(model, state) -> dict:
    """``{name: full gradient}``: summed over cp (divided by cp), sharded ones gathered over TP."""
    from vitp.parallel import full_weight

    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None and state.cp_size > 1:
            g = g.clone()
            torch.distributed.all_reduce(g, group=state.cp_group)
            g /= state.cp_size
        out[name] = None if g is None else full_weight(p, state, g)  # collective: every rank, same order
    return out


def compare(ref_run, model, state, inputs, target) -> dict:
    """Relative errors of ``model`` against the reference run ``(out, loss, {name: grad})``."""
    out_r, loss_r, grads_r = ref_run
    out, loss = fwd_bwd(model, inputs, target)
    grads = full_grads(model, state)
    scale = max(float(g.abs().max()) for g in grads_r.values())
    errs = {n: float((grads[n] - r).abs().max()) / max(float(r.abs().max()), 1e-3 * scale)
            for n, r in grads_r.items() if grads.get(n) is not None}
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values() if g is not None))
    norm_r = torch.sqrt(sum((g ** 2).sum() for g in grads_r.values()))
    worst = max(errs, key=errs.get)
    return {"out": rel(out, out_r), "loss": rel(loss, loss_r), "grad": errs[worst], "worst": worst,
            "all_keys": sorted(grads_r),
            "grad_norm": rel(norm, norm_r), "missing": sorted(set(grads_r) - set(errs)),
            "extra": sorted(n for n, g in grads.items() if g is not None and n not in grads_r)}


def _lora_fault(model, factors, state) -> None:
    """Re-slice every column-parallel adapter's B contiguously (:data:`LORA_FAULTS`)."""
    from vitp.parallel import ColumnParallelLinear, shard_tensor

    for name, m in model.named_modules():
        if isinstance(m, ColumnParallelLinear) and getattr(m, "lora_A", None) is not None:
            with torch.no_grad():
                m.lora_B.copy_(shard_tensor(factors[name][1], 0, 1, state.tp_size, state.tp_rank))


def layout_parity(layout, ref, runs, fault=None, lora=None) -> dict:
    """Shard a copy of ``ref`` in ``layout`` and compare it on every shape of ``runs``
    (``{shape: (inputs, target, reference run)}``, in turn), with ``fault`` (:data:`FAULTS`,
    ``"lora_contiguous"``) injected; ``lora``: the reference's adapters ``{module: (A, B)}``, given
    to the sharded copy after its plan (base frozen): ``{shape: compare(...)}``."""
    from vitp.models.lora import apply_lora
    from vitp.models.parallelize_wan import parallelize_wan
    from vitp.parallel import TPRMSNorm, make_state, norms, reduce_from_tp_region

    tp, cp, sp, mode = layout
    world = torch.distributed.get_world_size()
    state = make_state(tp=tp, cp=cp, dp=world // (tp * cp), sequence_parallel=sp, cp_mode=mode)
    model = copy.deepcopy(ref)
    report = parallelize_wan(model, state)
    if lora is not None:
        apply_lora(model, lora_spec(), state, init=lora)
        if fault == "lora_contiguous":
            _lora_fault(model, lora, state)
    tp_norms = [m for m in model.modules() if isinstance(m, TPRMSNorm)]
    for m in tp_norms:
        m._local = fault == "local"
    summed = norms.sum_over_tp_region
    if fault == "sum_backward":
        norms.sum_over_tp_region = reduce_from_tp_region
    try:
        res = {shape: compare(run, model, state, inputs, target) for shape, (inputs, target, run) in runs.items()}
    finally:
        norms.sum_over_tp_region = summed
    for r in res.values():
        r.update(sharded=len(report.sharded()), partial=len(report.partial_grad()), tp_norms=len(tp_norms))
    return res


def worker(rank: int, world: int, train: dict = None) -> dict:
    """Every layout (and fault) of ``world`` ranks: ``{name: compare(...)}``; with ``train``
    (:func:`train_setup`'s paths) also ``"train"``: the runs of :data:`TRAIN_LAYOUTS`."""
    from .tp_workers import init

    init(rank)
    ref, data = build()
    runs = {}
    for shape, (inputs, target) in data.items():
        out_r, loss_r = fwd_bwd(ref, inputs, target)
        runs[shape] = (inputs, target, (out_r, loss_r, {n: p.grad.detach().clone() for n, p in ref.named_parameters()}))
    res = {name: layout_parity(lay, ref, runs) for name, lay in LAYOUTS[world].items()}
    res.update({name: layout_parity(lay, ref, runs, fault) for name, (lay, fault) in FAULTS[world].items()})
    if LORA_LAYOUTS[world] or LORA_FAULTS[world]:
        res.update(lora_parity(ref, data, world))
    res.update({name: pipeline_parity(lay, ref, runs) for name, lay in PIPE_LAYOUTS[world].items()})
    if train:  # after the checks above: the trainer's process groups and seeds come last
        res["train"] = train_cases(rank, world, train)
        if world == 8:
            res["plan"] = plan_measure_wan(rank, train)
        res["vitp_eval"] = eval_in_group(train, world)  # last: vitp-eval closes the process group
    return res


def lora_parity(ref, data, world: int) -> dict:
    """:data:`LORA_LAYOUTS` and :data:`LORA_FAULTS` of ``world``: a copy of ``ref`` with adapters
    (B non-zero, base frozen) is the reference; every layout shards ``ref`` and gets the same
    adapters. Each result also says how many base parameters got a gradient (none must)."""
    from vitp.models.lora import apply_lora, lora_factors

    model = copy.deepcopy(ref)
    apply_lora(model, lora_spec(b_std=0.3))
    factors = lora_factors(model)
    runs = {}
    for shape, (inputs, target) in data.items():
        out_r, loss_r = fwd_bwd(model, inputs, target)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        runs[shape] = (inputs, target, (out_r, loss_r, grads))
    res = {name: layout_parity(lay, ref, runs, lora=factors) for name, lay in LORA_LAYOUTS[world].items()}
    res.update({name: layout_parity(lay, ref, runs, "lora_contiguous", factors)
                for name, lay in LORA_FAULTS[world].items()})
    for r in res.values():
        for shape_res in r.values():
            shape_res["lora_keys"] = len(shape_res["all_keys"])
    res.update({name: lora_dropout_parity(ref, data, lay) for name, lay in LORA_DROPOUT_LAYOUTS[world].items()})
    return res


class _FixedMask(torch.nn.Module):
    """Dropout with the TP ranks' recorded masks ``masks`` (one per rank, bool): ``x * mask / (1 - p)``
    with the rank masks joined along the one dimension where a rank's piece is smaller than ``x``
    (tokens under SP, a row-parallel linear's input columns), or, where every rank saw all of
    ``x``, rank 0's. ``kind`` says which it was and whether the ranks' masks were equal:
    ``"replicated"`` (equal), ``"replicated_differ"``, ``"sharded"`` (differ), ``"sharded_same"``."""

    def __init__(self, p: float, masks: list):
        super().__init__()
        self.p, self.masks, self.kind = p, masks, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        same = all(torch.equal(m, self.masks[0]) for m in self.masks)
        if self.masks[0].shape == x.shape:
            self.kind, mask = ("replicated" if same else "replicated_differ"), self.masks[0]
        else:
            d = next(i for i, (a, b) in enumerate(zip(self.masks[0].shape, x.shape)) if a != b)
            self.kind, mask = ("sharded_same" if same else "sharded"), torch.cat(self.masks, d)
        return x * mask / (1 - self.p)


def lora_dropout_parity(ref, data, layout) -> dict:
    """LoRA with dropout :data:`LORA_DROPOUT` on every adapter's input (B non-zero, base frozen) in
    ``layout`` (tp > 1, one forward and backward of shape ``3x4x8`` in training mode, the TP
    streams seeded by :func:`vitp.parallel.model_parallel_seed`): every adapter's dropout mask is
    recorded on each rank, gathered over tp and given to the one-process model with the same
    adapters (:class:`_FixedMask`). Returns relative errors of the sharded output, loss and every
    adapter gradient against that reference (``"out"``, ``"loss"``, ``"grad"``, ``"keys"``: adapter
    gradients compared, ``"extra"``: other parameters with a gradient), ``"eval_out"``: the sharded
    model in eval mode against the one-process model (dropout off), ``"vs_no_dropout"``: the
    training-mode output against that same dropout-free output, ``"kept"``: the fraction of inputs
    kept, ``"masks"``: ``{linear: _FixedMask.kind}``. Restores the default RNG state."""
    import dataclasses

    from vitp.models.lora import apply_lora, lora_factors
    from vitp.models.parallelize_wan import parallelize_wan
    from vitp.parallel import make_state, model_parallel_seed
    from vitp.parallel.lora import lora_linears

    rng = torch.get_rng_state()
    spec = dataclasses.replace(lora_spec(b_std=0.3), dropout=LORA_DROPOUT)
    one = copy.deepcopy(ref)
    apply_lora(one, spec)
    factors = lora_factors(one)
    inputs, target = data["3x4x8"]
    out_plain, _ = fwd_bwd(one.eval(), inputs, target)  # no dropout
    tp, cp, sp, mode = layout
    state = make_state(tp=tp, cp=cp, dp=torch.distributed.get_world_size() // (tp * cp), sequence_parallel=sp,
                       cp_mode=mode)
    model = copy.deepcopy(ref)
    parallelize_wan(model, state)
    apply_lora(model, spec, state, init=factors)
    model_parallel_seed(0, state)
    masks = {}
    hooks = [m.lora_dropout.register_forward_hook(lambda _m, _i, out, n=n: masks.setdefault(n, []).append(out != 0))
             for n, m in lora_linears(model)]
    out, loss = fwd_bwd(model.train(), inputs, target)
    for h in hooks:
        h.remove()
    grads = full_grads(model, state)
    out_eval, _ = fwd_bwd(model.eval(), inputs, target)
    fixed, kept = {}, []
    for n, m in lora_linears(one):
        (local,) = masks[n]  # one call per forward
        parts = [torch.empty(local.shape, dtype=torch.float64) for _ in range(state.tp_size)]
        torch.distributed.all_gather(parts, local.double(), group=state.tp_group)
        m.lora_dropout = fixed[n] = _FixedMask(LORA_DROPOUT, [t.bool() for t in parts])
        kept.append(local.double().mean())
    out_r, loss_r = fwd_bwd(one.train(), inputs, target)
    grads_r = {n: p.grad.detach().clone() for n, p in one.named_parameters() if p.grad is not None}
    torch.set_rng_state(rng)
    return {"out": rel(out, out_r), "loss": rel(loss, loss_r),
            "grad": max(rel(grads[n], g) for n, g in grads_r.items()),
            "keys": len(grads_r), "extra": sorted(n for n, g in grads.items() if g is not None and n not in grads_r),
            "eval_out": rel(out_eval, out_plain), "vs_no_dropout": rel(out, out_plain),
            "kept": float(sum(kept) / len(kept)), "masks": {n: f.kind for n, f in fixed.items()}}


# ----------------------------------------------------------------------------- vitp-train on Wan
# 4 steps of experiment=wan_smoke from the tiny perturbed pipeline folder (scripts/make_tiny_wan.py:
# 2 heads, 2 layers, text_dim 32), per world size: name -> layout overrides. tp2 x cp2 needs
# ring attention: Ulysses splits the 2 heads over tp x cp = 4 ranks.
# LoRA runs (base frozen, B drawn non-zero so every path matters from step 1): fused qkv's q and v
# pieces, both kv pieces, both output projections, the MLP's fc2
LORA_TRAIN = ["trainer.lora.enabled=true", "trainer.lora.rank=4", "trainer.lora.alpha=6",
              "trainer.lora.targets=[attn1.to_q,to_v,attn2.to_k,to_out.0,ffn.net.2]", "trainer.lora.b_init_std=0.05"]
_TP_SP, _RING8 = ["parallel.tp=2", "parallel.sequence_parallel=true"], ["parallel.cp=2", "parallel.cp_mode=ring",
                                                                         "parallel.pp=2"]
TRAIN_LAYOUTS = {
    2: {"tp2_sp": _TP_SP, "cp2_ulysses": ["parallel.cp=2"],
        "cp2_ring": ["parallel.cp=2", "parallel.cp_mode=ring"], "pp2": ["parallel.pp=2"],
        "lora_tp2_sp": [*_TP_SP, *LORA_TRAIN], "lora_cp2": ["parallel.cp=2", *LORA_TRAIN],
        "lora_pp2": ["parallel.pp=2", *LORA_TRAIN]},
    4: {},
    8: {"tp2_sp_cp2_pp2_ring": [*_TP_SP, *_RING8], "lora_tp2_sp_cp2_pp2_ring": [*_TP_SP, *_RING8, *LORA_TRAIN]},
}


# the training runs (and the one-process reference) also draw sample grids and evaluate the held-out
# loss at steps 0, 2 and 4 (vitp.eval.wan_eval), with guidance, and the video statistics at the end
EVAL = ["trainer.eval_every=2", "trainer.sample_every=2", "sampler.cfg_scale=5"]
# vitp-eval of a run inside the spawned group (world: run name, layout overrides): the 2-rank group
# evaluates the tp2 + SP run at dp2 (the held-out items and samples split over two replicas), the
# 8-rank group its run in its training layout, given (tp2 + SP x cp2 ring x pp2; without layout keys
# vitp-eval takes 8 replicas of the whole model, which fits a rank)
EVAL_IN_GROUP = {2: ("tp2_sp", ["parallel.tp=1", "parallel.sequence_parallel=false"]),
                 8: ("tp2_sp_cp2_pp2_ring", [*_TP_SP, *_RING8])}


def wan_smoke(train: dict, *extra: str) -> list:
    """The overrides of a ``wan_smoke`` run from :func:`train_setup`'s folder and caption store."""
    return ["experiment=wan_smoke", f"trainer.init_from={train['folder']}",
            f"data.text_embeddings={train['store']}", *extra]


def train_setup(base) -> dict:
    """The tiny perturbed Wan pipeline folder (transformer in shards) and the wan_smoke captions
    encoded once by the demo encoder, under ``base`` (in the calling process, no process group):
    ``{"folder", "store", "runs", "other", "with_vae", "inception", "i3d", "clip"}`` paths as strings
    (``other``: a second tiny folder of another seed, a base LoRA adapters do not fit; ``with_vae``:
    the pipeline of the same transformer with a tiny VAE; the last three: random-weight feature
    networks of scripts/make_random_eval_weights.py)."""
    from pathlib import Path

    from tests.helpers import make_tiny_wan
    from vitp.config import compose, validate_config
    from vitp.data.build import ensure_text_embeddings

    from tests.helpers import eval_weights_script

    base = Path(base)
    folder = make_tiny_wan().write_pipeline(base / "tiny", sharded=True, vae=False)
    other = make_tiny_wan().write_pipeline(base / "other", sharded=True, vae=False, seed=1)  # another base
    with_vae = make_tiny_wan().write_pipeline(base / "tiny_vae", sharded=True)  # the same transformer and a VAE
    nets = eval_weights_script()
    train = {"folder": str(folder), "store": str(base / "captions"), "runs": str(base / "runs"), "other": str(other),
             "with_vae": str(with_vae), "inception": str(nets.random_inception(base / "inception.pth")),
             "i3d": str(nets.random_i3d(base / "i3d.pt")), "clip": str(nets.random_clip(base / "clip"))}
    cfg = compose(wan_smoke(train))
    validate_config(cfg)
    ensure_text_embeddings(cfg)
    return train


def _status_bytes(key: str) -> int:
    """A ``/proc/self/status`` entry (``VmHWM``, ``VmRSS``) of this process, bytes."""
    line = next(x for x in open("/proc/self/status") if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024


def train_measured(rank: int, overrides: list, run_dir: str) -> dict:
    """``vitp.train.train`` of ``overrides`` on this rank, its peak resident memory counted from its
    start (VmHWM reset to the current RSS through ``/proc/self/clear_refs``, as
    tests/distributed/test_reshard.py measures): ``{"losses", "grad_norms", "stopped_at", "peak" (VmHWM
    bytes), "start" (RSS at the start), "folder_read" ({"bytes", "share"} of the Wan folder),
    "optimizer"}`` (:func:`optimizer_state`)."""
    from vitp.config import compose
    from vitp.train import Trainer

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = _status_bytes("VmRSS")
    tr = Trainer(compose(overrides), run_dir)
    res = tr.fit()
    return {**{k: res[k] for k in ("losses", "grad_norms", "stopped_at", "folder_read")},
            "peak": _status_bytes("VmHWM"), "start": start, "optimizer": optimizer_state(tr)}


def optimizer_state(tr) -> dict:
    """The optimizer state of a finished :class:`vitp.train.Trainer` on this rank, read from the
    DeepSpeed optimizer: ``{"bytes"`` (ZeRO-1's fp32 master partitions and the AdamW state they
    carry: ``exp_avg``, ``exp_avg_sq``, step; under ZeRO stage 0 AdamW's state alone), ``"adapters"``
    (LoRA parameters this rank holds), ``"partitions"`` (ranks the optimizer state is split over: the
    engine's ``dp x cp`` under ZeRO, else 1)``}``."""
    from vitp.parallel.lora import is_lora_key

    opt = tr.engine.optimizer
    masters = list(getattr(opt, "single_partition_of_fp32_groups", []))
    inner = getattr(opt, "optimizer", opt)
    state = [t for st in inner.state.values() for t in st.values() if torch.is_tensor(t)]
    return {"bytes": sum(t.numel() * t.element_size() for t in masters + state),
            "adapters": sum(p.numel() for n, p in tr.engine.module.named_parameters() if is_lora_key(n)),
            "partitions": tr.layout.engine_dp if masters else 1}


def train_cases(rank: int, world: int, train: dict) -> dict:
    """:data:`TRAIN_LAYOUTS` of ``world`` trained in turn, the full fine-tunings with :data:`EVAL` (run dirs
    ``<runs>/<name>``): ``{name: train_measured(...)}``; at 2 ranks also :func:`lora_relaunches`."""
    out = {name: train_measured(rank, wan_smoke(train, *over, *(() if name.startswith("lora_") else EVAL)),
                                f"{train['runs']}/{name}")
           for name, over in TRAIN_LAYOUTS[world].items()}
    return {**out, **(lora_relaunches(train) if world == 2 else {})}


def lora_relaunches(train: dict) -> dict:
    """A LoRA run relaunched at another layout, in the 2-rank group: ``lora_stop_tp2_sp`` stops after
    step 2 at tp2 + SP, ``lora_resumed_cp2`` resumes its checkpoint (zstd pieces) at cp2 in a new run
    dir; ``lora_cont_cp2`` continues ``lora_tp2_sp``'s diffusers file for one step at lr 0 at cp2
    (rank, alpha and targets from the file). ``{name: {"losses", "grad_norms", "stopped_at"}}``."""
    from vitp.config import compose
    from vitp.train import train as fit

    runs, keys = train["runs"], ("losses", "grad_norms", "stopped_at")
    cases = {"lora_stop_tp2_sp": [*_TP_SP, *LORA_TRAIN, "trainer.exit_at_step=2"],
             "lora_resumed_cp2": ["parallel.cp=2", *LORA_TRAIN,
                                  f"trainer.resume={runs}/lora_stop_tp2_sp/checkpoints/step_0000002"],
             "lora_cont_cp2": ["parallel.cp=2", "trainer.lora.enabled=true", "optim.lr=0", "trainer.max_steps=1",
                               f"trainer.lora.init_from={runs}/lora_tp2_sp/lora/pytorch_lora_weights.safetensors"]}
    out = {}
    for name, over in cases.items():
        res = fit(compose(wan_smoke(train, *over)), f"{runs}/{name}")
        out[name] = {k: res[k] for k in keys}
    return out


def plan_measure_wan(rank: int, train: dict) -> dict:
    """One training step of the 8-rank layout measured as tests/distributed/test_plan_validation.py
    measures the generator's (:func:`tests.distributed.plan_measure.measure_rank`): weights, gradients,
    optimizer, EMA and activation bytes of this rank, its stage and the step's TP / cp collectives."""
    from tests.distributed.plan_measure import measure_rank

    (name, over), = [(n, o) for n, o in TRAIN_LAYOUTS[8].items() if not n.startswith("lora_")]
    return measure_rank(rank, {name: wan_smoke(train, *over)}, f"{train['runs']}/plan")[name]


def quality_args(train: dict, tag: str) -> list:
    """``vitp-eval`` arguments of FID (6 samples in blocks of 4, 4 real items), CLIP score and FVD
    (3 clips, 3 real) of :data:`EVAL_IN_GROUP`'s 2-rank run with the weights of :func:`train_setup`'s
    pipeline with a VAE (the base's transformer), real statistics cached under ``tag``. One sample
    per forward (``sampler.batch_size=1``): with batches of 4 against 2, float32 rounding moved 1 in
    74,000 8-bit values by one level."""
    name, over = EVAL_IN_GROUP[2]
    runs = train["runs"]
    return [f"{runs}/{name}", "--weights", train["with_vae"], f"eval.fid.real_stats={runs}/fid_real_{tag}.safetensors",
            f"eval.fvd.real_stats={runs}/fvd_real_{tag}.safetensors", *over, "eval.fid.num=6", "eval.fid.block=4",
            "eval.fid.real_num=4", f"eval.fid.weights={train['inception']}", f"eval.clip.model={train['clip']}",
            "eval.fvd.num=3", "eval.fvd.real_num=3", f"eval.fvd.weights={train['i3d']}", "sampler.batch_size=1"]


def quality_pp2_args(train: dict) -> list:
    """:func:`quality_args` of FID alone at pp2 (the samples drawn by two pipeline stages, decoded
    and gathered by stage 0 alone), reading the real statistics the dp2 evaluation cached."""
    name, _ = EVAL_IN_GROUP[2]
    runs = train["runs"]
    return [f"{runs}/{name}", "--weights", train["with_vae"], "parallel.pp=2", "parallel.tp=1",
            "parallel.sequence_parallel=false", f"eval.fid.real_stats={runs}/fid_real_group.safetensors",
            "eval.fid.num=6", "eval.fid.block=4", "eval.fid.real_num=4", f"eval.fid.weights={train['inception']}",
            "sampler.batch_size=1"]


def eval_in_group(train: dict, world: int) -> dict:
    """``vitp-eval RUN`` of :data:`EVAL_IN_GROUP` in this group (``vitp.cli.eval.run`` under the
    group's launcher environment: each rank reads its slices of ``RUN/diffusers``); rank 0's results.
    At 2 ranks also ``"quality"``: FID, CLIP score and FVD (:func:`quality_args`) over the two
    replicas, ``"quality_pp2"``: FID at pp2 (:func:`quality_pp2_args`), and ``"lora_dp2"`` /
    ``"lora_tp2"``: the LoRA run ``lora_pp2`` over two replicas and at tp2; the group closes once,
    after them."""
    import vitp.eval.launch as launch
    from vitp.cli.eval import run

    name, over = EVAL_IN_GROUP[world]
    finish, launch.finish = launch.finish, lambda: None
    try:
        res = run([f"{train['runs']}/{name}", *over])
        if world == 2:
            res["quality"] = run(quality_args(train, "group"))
            res["quality_pp2"] = run(quality_pp2_args(train))
            lora = f"{train['runs']}/lora_pp2"  # its base with RUN/lora: replicas (merged), tp2 (on the TP linears)
            res["lora_dp2"] = run([lora, "sampler.fps=2"])
            res["lora_tp2"] = run([lora, "parallel.tp=2", "parallel.pp=1"])
    finally:
        launch.finish = finish
        finish()
    return res


# pipeline layouts, DeepSpeed's 1F1B engine: name -> (tp, cp, pp, sequence_parallel, cp_mode)
PIPE_LAYOUTS = {
    2: {"pp2": (1, 1, 2, False, "ulysses")},
    4: {"tp2_pp2": (2, 1, 2, False, "ulysses"), "tp2_sp_pp2": (2, 1, 2, True, "ulysses"),
        "cp2_pp2_ring": (1, 2, 2, False, "ring"), "pp2_dp2": (1, 1, 2, False, "ulysses")},
    8: {"tp2_sp_cp2_pp2_ulysses": (2, 2, 2, True, "ulysses"), "tp2_cp2_pp2_ring": (2, 2, 2, False, "ring")},
}


class _CaptureGrads(torch.optim.Optimizer):
    """Keeps the gradients DeepSpeed hands its optimizer (after its data-parallel reduction) and
    changes nothing."""

    def __init__(self, params):
        super().__init__(params, {})
        self.grads = {}

    def step(self, closure=None):
        self.grads = {id(p): p.grad.detach().clone() for g in self.param_groups for p in g["params"]
                      if p.grad is not None}


def _mse(out, target):
    return F.mse_loss(out, target)


def _load_from_folder(module, state, ref, config) -> dict:
    """Write ``ref`` (float32) as a diffusers folder in a temporary directory of this rank, fill the
    stage from it with :func:`vitp.models.wan_keys.load_shard` (this rank's slices only) and check
    every tensor against :func:`vitp.pipeline.load_full_state` of the full state: ``{"bytes",
    "share", "same", "folder_bytes"}``."""
    import tempfile
    from pathlib import Path

    from vitp.models import generator_key
    from vitp.models.wan import WanModel
    from vitp.models.wan_keys import load_shard, save_pretrained
    from vitp.pipeline import load_full_state

    full = {k: v.detach().float() for k, v in ref.state_dict().items()}
    with tempfile.TemporaryDirectory() as tmp:
        one = WanModel(config)
        one.load_state_dict(full)
        folder = save_pretrained(one, Path(tmp) / "transformer")
        folder_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        params = {generator_key(n, config.num_layers): p for n, p in module.named_parameters()}
        read = load_shard(folder, params, config, state.tp_rank, state.tp_size)
        exported = _export_round_trip(module, config, state, folder)
    from_folder = {n: p.detach().clone() for n, p in module.named_parameters()}
    load_full_state(module, full, state, config.num_layers, source="reference")
    same = all(torch.equal(from_folder[n], p) for n, p in module.named_parameters())
    return {"bytes": read["bytes"], "share": read["share"], "same": same, "folder_bytes": folder_bytes, **exported}


def _export_round_trip(module, config, state, source) -> dict:
    """The stages written back as one diffusers folder (:func:`vitp.pipeline.wan_stages.save_wan_stages`,
    a folder rank 0 picks) and, on rank 0, loaded by diffusers' ``WanTransformer3DModel``:
    ``{"export_warnings": missing + unexpected + mismatched keys, "export_identical": every tensor
    bit-identical to the source folder's, "export_files": shard count}`` (rank 0's; empty elsewhere)."""
    import shutil
    import tempfile
    from pathlib import Path

    from safetensors.torch import load_file

    from vitp.models.wan_keys import WEIGHTS
    from vitp.pipeline.wan_stages import save_wan_stages

    where = [tempfile.mkdtemp() if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(where, src=0)
    out = Path(where[0]) / "export"
    try:
        save_wan_stages(out, module, config, state)
        if torch.distributed.get_rank() != 0:
            return {}
        from diffusers import WanTransformer3DModel

        model, info = WanTransformer3DModel.from_pretrained(str(out), output_loading_info=True)
        src = load_file(str(source / WEIGHTS))
        got = model.state_dict()
        return {"export_warnings": sum(len(v) for v in info.values()),
                "export_identical": got.keys() == src.keys() and all(torch.equal(got[k], src[k]) for k in src),
                "export_files": len(list(out.glob("*.safetensors")))}
    finally:
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            shutil.rmtree(where[0], ignore_errors=True)


def pipeline_parity(layout, ref, runs) -> dict:
    """Wan as DeepSpeed pipeline stages (:func:`vitp.pipeline.wan_stages.build_parallel_wan_pipeline`)
    loaded with ``ref``'s weights, one ``train_batch`` per shape of ``runs`` (the token grid set on
    every stage and the engine's activation shapes reset between them): ``{shape: {"loss", "grad",
    "worst", "keys"}}`` relative errors of this rank's stage (float32) against the one-process
    float64 reference."""
    import deepspeed

    from vitp.models import generator_key, set_grid, token_grid
    from vitp.models.wan import WanConfig
    from vitp.parallel import full_weight
    from vitp.pipeline import load_full_state
    from vitp.pipeline.wan_stages import build_parallel_wan_pipeline

    tp, cp, pp, sp, mode = layout
    world = torch.distributed.get_world_size()
    dp = world // (tp * cp * pp)
    config = WanConfig.from_dict(CONFIG)
    grid0 = token_grid(list(SHAPES["3x4x8"][3:]), SHAPES["3x4x8"][2], 2, 1)
    module, state = build_parallel_wan_pipeline(config, grid0, _mse, tp=tp, cp=cp, pp=pp, dp=dp,
                                                sequence_parallel=sp, cp_mode=mode)
    # float32: DeepSpeed's gradient reduction refuses float64 (the reference stays float64). The
    # stage reads its slices of the reference written as a diffusers folder, equal to slicing the
    # full state in memory
    loaded = _load_from_folder(module, state, ref, config)
    opt = _CaptureGrads(module.parameters())
    B = SHAPES["3x4x8"][0]
    engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config={
        "train_batch_size": B * dp * cp, "train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 0}, "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
        "pipeline": {"pipe_partitioned": False, "grad_partitioned": False}, "steps_per_print": 10**9})
    res = {}
    for shape, (inputs, target, (_, loss_r, grads_r)) in runs.items():
        set_grid(engine.module, token_grid(list(inputs[0].shape[-2:]), inputs[0].shape[2], 2, 1))
        engine.reset_activation_shape()
        batch = (tuple(t.float() for t in inputs), target.float())
        loss = engine.train_batch(data_iter=iter([batch]))
        errs = {}
        for name, p in engine.module.named_parameters():
            key = generator_key(name, config.num_layers)
            g = full_weight(p, state, opt.grads[id(p)]).double()  # collective over tp, same order on every rank
            errs[key] = float((g - grads_r[key]).abs().max()) / max(float(grads_r[key].abs().max()), 1e-12)
        worst = max(errs, key=errs.get)
        res[shape] = {"loss": rel(loss.double(), loss_r), "grad": errs[worst], "worst": worst, "keys": sorted(errs),
                      "all_keys": sorted(grads_r), **loaded}
    return res


def one_process_runs(rank: int, train: dict) -> dict:
    """One-process ``wan_smoke`` runs of :func:`train_setup`'s folder (a forked 1-rank group, so no
    process group is left in pytest's process): ``{"one", "stopped" (``exit_at_step=2``), "resume"
    (the same folder resumed), "lr0" (``optim.lr=0``), the LoRA runs ``lora_*`` and ``lora_cont`` (one step
    at lr 0 continuing ``lora_one``'s diffusers file)}``, each ``{"losses", "grad_norms", "stopped_at"}``."""
    from pathlib import Path

    from vitp.config import compose
    from vitp.train import train as fit

    runs, keys = Path(train["runs"]), ("losses", "grad_norms", "stopped_at")
    cases = [("one", "one", tuple(EVAL)), ("stopped", "resume", ("trainer.exit_at_step=2",)), ("resume", "resume", ()),
             ("lr0", "lr0", ("optim.lr=0",)), ("lora_one", "lora_one", LORA_TRAIN),
             ("lora_stopped", "lora_resume", (*LORA_TRAIN, "trainer.exit_at_step=2")),
             ("lora_resume", "lora_resume", LORA_TRAIN),
             # continues lora_one's diffusers file (rank, alpha, targets from it) at lr 0: its adapters stay the file's
             ("lora_cont", "lora_cont", ("trainer.lora.enabled=true", "optim.lr=0", "trainer.max_steps=1",
                                         f"trainer.lora.init_from={runs}/lora_one/lora/pytorch_lora_weights.safetensors"))]
    out = {}
    for name, folder, extra in cases:
        res = fit(compose(wan_smoke(train, *extra)), runs / folder)
        out[name] = {k: res[k] for k in keys}
        if name == "lora_stopped":  # the same run dir against another base is refused before any step
            out["lora_other_base"] = _refused(compose(wan_smoke({**train, "folder": train["other"]}, *LORA_TRAIN)),
                                                runs / folder)
    return out


def _refused(cfg, run_dir) -> str:
    """The message of the ``ValueError`` that training ``cfg`` in ``run_dir`` raises ("" if none)."""
    from vitp.train import train as fit

    try:
        fit(cfg, run_dir)
    except ValueError as e:
        return str(e)
    return ""
