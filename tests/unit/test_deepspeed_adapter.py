"""The DeepSpeed internals vitp relies on exist in the installed DeepSpeed, and a missing one fails
with a message naming it (so an upgrade fails here, not silently in a run)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import vitp.deepspeed_adapter as ds


def test_every_internal_the_adapter_relies_on_exists_in_the_installed_deepspeed():
    ds.check()  # raises RuntimeError naming each missing symbol
    assert ds.missing() == []
    targets = {i.target for i in ds.REQUIRED}
    for name in ("PipelineEngine._INSTRUCTION_MAP", "PipelineModule.mpu", "PipelineModule.forward",
                 "get_hp_fragment_mapping", "partition_balanced", "build_shm_op", "_take_model_step"):
        assert any(t.endswith(name) for t in targets), name
    # every adapter function that touches an internal is covered by an entry of the registry
    assert {i.needed_by for i in ds.REQUIRED} == {
        "patch_instruction", "pipeline_grid", "seed_layers_for_init_only", "partition_balanced",
        "param_fragment", "hp_fragment", "partition_group", "report_grad_norm", "disable_shm_comm_op", "pipeline_instructions",
        "link_optimizer_state"}
    assert all(callable(getattr(ds, i.needed_by)) for i in ds.REQUIRED)


def test_a_missing_symbol_is_named_with_the_function_that_needs_it(monkeypatch):
    from deepspeed.runtime.pipe.engine import PipelineEngine

    monkeypatch.delattr(PipelineEngine, "_INSTRUCTION_MAP")
    with pytest.raises(RuntimeError, match=r"DeepSpeed [\d.]+ lacks internals vitp relies on .*"
                                           r"deepspeed.runtime.pipe.engine:PipelineEngine._INSTRUCTION_MAP is missing "
                                           r".*needed by vitp.deepspeed_adapter.patch_instruction"):
        ds.check()
    assert len(ds.missing()) == 1


def test_a_changed_function_body_is_named(monkeypatch):
    from deepspeed.runtime.pipe.module import PipelineModule

    def forward(self, forward_input):  # a DeepSpeed that no longer reseeds (or renamed the flag)
        return forward_input

    monkeypatch.setattr(PipelineModule, "forward", forward)
    with pytest.raises(RuntimeError, match=r"PipelineModule.forward no longer contains 'if self.seed_layers:', "
                                           r"needed by vitp.deepspeed_adapter.seed_layers_for_init_only"):
        ds.check()


def test_a_missing_module_is_named():
    fake = [ds.Internal("deepspeed.runtime.no_such_module:Thing", "pipeline_grid")]
    assert ds.missing(fake) == [
        "deepspeed.runtime.no_such_module:Thing is missing (ModuleNotFoundError: No module named "
        "'deepspeed.runtime.no_such_module'), needed by vitp.deepspeed_adapter.pipeline_grid"]


def test_patch_instruction_changes_one_engine_only():
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    class Engine(PipelineEngine):  # no constructor call: only the table matters here
        def __init__(self):
            pass

    calls = []

    def wrap(original):
        def reduce_grads(self):
            calls.append("before")
            return original
        return reduce_grads

    patched, other = Engine(), Engine()
    ds.patch_instruction(patched, "ReduceGrads", wrap)
    assert patched._INSTRUCTION_MAP[schedule.ReduceGrads](patched) is PipelineEngine._INSTRUCTION_MAP[
        schedule.ReduceGrads]
    assert calls == ["before"]
    assert other._INSTRUCTION_MAP is PipelineEngine._INSTRUCTION_MAP
    assert patched._INSTRUCTION_MAP[schedule.ForwardPass] is PipelineEngine._INSTRUCTION_MAP[schedule.ForwardPass]
    with pytest.raises(AttributeError):
        ds.patch_instruction(patched, "NoSuchInstruction", wrap)


def test_partition_balanced_cuts_blocks_as_deepspeed():
    # Embed, 5 blocks, Final on 2 stages: [Embed + 3 blocks | 2 blocks + Final]
    assert ds.partition_balanced([0, 1, 1, 1, 1, 1, 0], 2) == [0, 4, 7]


def test_patches_compose_and_every_training_instruction_is_in_the_table():
    """A second patch of the same instruction wraps the first (the step hook and the timeline both
    wrap ReduceGrads), and a patch of another instruction keeps earlier ones."""
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    class Engine(PipelineEngine):
        def __init__(self):
            pass

    calls = []

    def tag(name):
        def wrap(original):
            def fn(self, **kw):
                calls.append(name)
                return original
            return fn
        return wrap

    engine = Engine()
    ds.patch_instruction(engine, "ReduceGrads", tag("hook"))
    ds.patch_instruction(engine, "ForwardPass", tag("forward"))
    ds.patch_instruction(engine, "ReduceGrads", tag("timer"))
    inner = engine._INSTRUCTION_MAP[schedule.ReduceGrads](engine)  # the timer's original: the hook
    assert inner(engine) is PipelineEngine._INSTRUCTION_MAP[schedule.ReduceGrads]
    assert engine._INSTRUCTION_MAP[schedule.ForwardPass](engine) is PipelineEngine._INSTRUCTION_MAP[schedule.ForwardPass]
    assert calls == ["timer", "hook", "forward"]
    names = ds.pipeline_instructions()
    assert {getattr(schedule, n) for n in names} == set(PipelineEngine._INSTRUCTION_MAP)


def test_disable_shm_comm_op_sets_the_table_without_probing_every_op(monkeypatch):
    """Reading ``deepspeed.ops.__compatible_ops__`` first runs DeepSpeed's probe of every op
    builder (compiler and linker subprocesses); vitp only writes the one entry it needs, and
    ``build_shm_op`` then builds nothing."""
    import deepspeed.ops
    from deepspeed.comm.torch import build_shm_op

    def probe():
        raise AssertionError("DeepSpeed's op probe ran")

    monkeypatch.delitem(vars(deepspeed.ops), "__compatible_ops__", raising=False)
    monkeypatch.setattr(deepspeed.ops, "_probe_compatible_ops", probe)
    ds.disable_shm_comm_op()
    assert vars(deepspeed.ops)["__compatible_ops__"] == {"deepspeed_shm_comm": False}
    assert build_shm_op() is None


def test_deepspeed_imports_without_mlflow_and_mlflow_still_imports_after():
    """A rank's DeepSpeed import (through vitp's pipeline module) leaves out the autotuner's
    ``mlflow`` import (about 1 s of start-up); ``import mlflow`` afterwards still works."""
    pytest.importorskip("mlflow")  # installed with the sagemaker extra
    code = ("import sys, vitp.pipeline.stages, deepspeed.autotuning.autotuner as a; "
            "print('mlflow' in sys.modules, a.has_mlflow); import mlflow; print(mlflow.__name__)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["False", "False", "mlflow"]
