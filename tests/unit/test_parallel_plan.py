"""The generator's declarative parallel plan (vitp.models.GENERATOR_PLAN) on one process.

A ``ParallelState`` with ``tp_size=2`` and no process group is enough to apply a plan (sharding
slices full weights; collectives run only in forward/backward), so the plan's bookkeeping is
checked here: what it applies equals what it declares, the planner reads the same report, and a
wrong row fails loudly. Numerical parity of the applied plan is tests/distributed/parallel.
"""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch.nn as nn

from tests.helpers import compose_cfg
from vitp.models import GENERATOR_PLAN, Generator, parallelize_generator
from vitp.parallel import ParallelState, PlanRow, describe_plan
from vitp.parallel.styles import HeadParallelAttention, ParallelStyle, PartialGradient
from vitp.plan import layout_of, tp_collectives
from vitp.plan.comm import step_shape
from vitp.pipeline import stage_blocks

MODES = {"tp": {}, "sp": {"sequence_parallel": True}, "partial": {"partial_sync": 0.5, "sequence_parallel": True}}
RICH = ["experiment=smoke", "model.qk_norm=true", "model.layer_scale_init=0.1", "model.depth=4"]


def _state(mode: str) -> ParallelState:
    return ParallelState(tp_size=2, tp_rank=1, **MODES[mode])


def _model(cfg):
    return Generator.from_config(cfg.model, seed=0)


def _pp_stage(cfg, first: int, end: int) -> nn.Module:
    """Layers ``first..end`` of the generator in a container named like a DeepSpeed stage."""
    gen, stage = _model(cfg), nn.Module()
    layers = [gen.embed, *gen.blocks, gen.final]
    for i in range(first, end):
        stage.add_module(str(i), layers[i])
    return stage


@pytest.mark.parametrize("mode", list(MODES))
def test_applied_plan_equals_declared_and_planner(mode, caplog):
    """apply == describe (parameters and collectives), the model's parameter attributes are those
    the report names, and the planner's collective list of every pipeline stage is the plan's."""
    over = RICH + ["parallel.tp=2", "parallel.pp=2", f"parallel.sequence_parallel={mode != 'tp'}"]
    if mode == "partial":
        over.append("parallel.partial_sync=0.5")
    cfg = compose_cfg(over)
    lay = layout_of(cfg, 4)
    depth, first = cfg.model.depth, 0
    for s, blocks in enumerate(stage_blocks(depth, 2)):
        end = first + blocks + (s == 0) + (s == 1)
        stage = _pp_stage(cfg, first, end)
        declared = describe_plan(stage, GENERATOR_PLAN, mode)
        with caplog.at_level(logging.DEBUG, logger="vitp"):
            applied = parallelize_generator(stage, _state(mode), seq_len=16)
        assert "parallel plan 'generator'" in caplog.text
        assert applied.params == declared.params and applied.partial_grad_elements == declared.partial_grad_elements
        shape = step_shape(cfg.model, lay)
        assert applied.collectives(shape) == declared.collectives(shape) == tp_collectives(cfg.model, lay, s)
        sharded = sorted(n for n, p in _named(stage) if getattr(p, "tensor_model_parallel", False))
        assert sharded == applied.sharded() and len(sharded) >= 6 * blocks
        partial = sorted(n for n, p in _named(stage) if getattr(p, "sequence_parallel", False)
                         or getattr(p, "tp_partial_grad", False))
        assert partial == applied.partial_grad()
        first = end


def _named(stage):
    from vitp.models import generator_layers

    return [(f"{ln}.{n}", p) for ln, layer in generator_layers(stage) for n, p in layer.named_parameters()]


def test_plan_modes_differ_as_documented():
    """What each mode adds: SP row biases and LayerScale gammas; partial sync also the patch
    embedding and the head; q/k norms always."""
    cfg = compose_cfg(RICH)
    rep = {m: parallelize_generator(_model(cfg), _state(m)) for m in MODES}
    assert set(rep["tp"].partial_grad()) == {f"blocks.{i}.attn.{n}_norm.{w}" for i in range(4) for n in "qk"
                                             for w in ("weight", "bias")}
    sp_extra = set(rep["sp"].partial_grad()) - set(rep["tp"].partial_grad())
    assert sp_extra == {f"blocks.{i}.{n}" for i in range(4) for n in ("attn.proj.bias", "mlp.fc2.bias", "ls1.gamma",
                                                                      "ls2.gamma")}
    part_extra = set(rep["partial"].partial_grad()) - set(rep["sp"].partial_grad())
    assert part_extra == {"embed.x_embedder.proj.weight", "embed.x_embedder.proj.bias", "final.linear.weight",
                          "final.linear.bias"}
    assert rep["tp"].sharded() == rep["sp"].sharded() == rep["partial"].sharded()
    assert "final.adaLN_modulation.1.weight" in rep["tp"].sharded()
    skipped = [r for r in rep["tp"].rows if not r[3]]
    assert {r[0] for r in skipped} >= {"embed.x_embedder", "final.linear"}  # partial-only rows, checked not applied


@pytest.mark.parametrize("pattern, msg", [
    ("blocks.*.atn", "row 'blocks.*.atn' .* matches no module of the model"),
    ("decoder.*.attn", "row 'decoder.*.attn' .* names no layer of the model; its layers are embed, blocks, final"),
])
def test_a_row_naming_no_module_is_refused(pattern, msg):
    cfg = compose_cfg(RICH)
    plan = GENERATOR_PLAN.with_rows(PlanRow(pattern, HeadParallelAttention(), ("partial",)))
    with pytest.raises(ValueError, match=msg):  # refused in every mode, not only where the row applies
        parallelize_generator(_model(cfg), _state("tp"), plan=plan)
    with pytest.raises(ValueError, match=msg):
        describe_plan(_model(cfg), plan, "sp")


def test_a_row_only_on_absent_layers_is_fine_for_a_middle_stage():
    cfg = compose_cfg(RICH)
    stage = _pp_stage(cfg, 2, 4)  # blocks 1 and 2: no embed, no final
    rep = parallelize_generator(stage, _state("sp"), seq_len=16)
    assert {r[0]: r[4] for r in rep.rows}["embed"] == [] and "blocks.1.attn.qkv.weight" in rep.sharded()


@dataclasses.dataclass(frozen=True)
class _Lying(ParallelStyle):
    """Declares a partial gradient it never installs (the fault the self-check guards against)."""

    def apply(self, module, ctx):
        return None

    def roles(self, module, mode):
        return {n: "partial_grad(sequence_parallel)" for n, _ in module.named_parameters()}


def test_declared_roles_must_match_what_was_applied():
    cfg = compose_cfg(RICH)
    plan = GENERATOR_PLAN.with_rows(PlanRow("embed.y_embedder", _Lying()))
    with pytest.raises(RuntimeError, match="applied parameter roles differ .*embed.y_embedder.weight"):
        parallelize_generator(_model(cfg), _state("tp"), plan=plan)
    ok = GENERATOR_PLAN.with_rows(PlanRow("embed.y_embedder", PartialGradient("sequence_parallel")))
    assert "embed.y_embedder.weight" in parallelize_generator(_model(cfg), _state("tp"), plan=ok).partial_grad()


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match=r"unknown mode\(s\) \['cp'\]"):
        PlanRow("blocks.*.attn", HeadParallelAttention(), ("cp",))
