"""Every use vitp makes of DeepSpeed internals, in one place.

vitp runs on DeepSpeed's public API (``deepspeed.initialize``, ``PipelineModule``,
``PipelineEngine.train_batch``, ``save_checkpoint`` / ``load_checkpoint``) except for the few
things below, which reach into private attributes, patch a class table, swap a class, flip a flag
after construction, or rely on an undocumented helper. Each function says why. They hold at the
pinned DeepSpeed (``pyproject.toml``); an upgrade can break any of them without an error of its
own, so :data:`REQUIRED` lists every internal symbol they rely on (and, where the reliance is on
what a DeepSpeed function does, a text its source must contain), and :func:`check` verifies them
in the installed DeepSpeed (``tests/unit/test_deepspeed_adapter.py``), raising ``RuntimeError``
that names the missing symbol and the adapter function that needs it.

Nothing here imports another vitp module (``vitp.parallel`` may import this one).
"""
from __future__ import annotations

import importlib
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

if not torch.cuda.is_available():
    # DeepSpeed's accelerator probe otherwise prints a warning to stdout at import (it would spoil
    # `vitp-plan --json`) and probes for accelerators; a user's own setting wins
    os.environ.setdefault("DS_ACCELERATOR", "cpu")



def import_deepspeed() -> Any:
    """Import DeepSpeed, once per process, without the optional ``mlflow`` import of its autotuner.

    Why: ``import deepspeed`` imports ``deepspeed.autotuning.autotuner``, which imports ``mlflow``
    when it is installed (SageMaker's SDK installs it): about 1 s of every rank's start-up, for
    DeepSpeed's autotuner, which vitp never runs. ``mlflow`` is hidden during that import only, so
    DeepSpeed records it as absent and a later ``import mlflow`` of the user's still works. A
    process that imported ``mlflow`` already keeps it. Every vitp module calls this before its
    first DeepSpeed import. Returns the ``deepspeed`` module.
    """
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    hide = "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # an import of it raises ImportError, which DeepSpeed expects
    try:
        import deepspeed
    finally:
        if hide and sys.modules.get("mlflow", 0) is None:
            del sys.modules["mlflow"]
    return deepspeed

@dataclass(frozen=True)
class Internal:
    """One DeepSpeed internal vitp relies on: ``target`` is ``"module:Qual.name"``; ``uses`` (if set)
    must occur in the source of that function (what we rely on it doing); ``needed_by`` names the
    adapter function."""

    target: str
    needed_by: str
    uses: Optional[str] = None


# the instructions of DeepSpeed's training schedule (pipeline_instructions)
_TRAIN_INSTRUCTIONS = ("LoadMicroBatch", "ForwardPass", "BackwardPass", "SendActivation", "RecvActivation", "SendGrad",
                       "RecvGrad", "ReduceTiedGrads", "ReduceGrads", "OptimizerStep")

REQUIRED: List[Internal] = [
    # patch_instruction: the pipeline engine looks instructions up through self._INSTRUCTION_MAP
    Internal("deepspeed.runtime.pipe.engine:PipelineEngine._INSTRUCTION_MAP", "patch_instruction"),
    Internal("deepspeed.runtime.pipe.engine:PipelineEngine._exec_schedule", "patch_instruction",
             uses="self._INSTRUCTION_MAP[type(cmd)]"),
    Internal("deepspeed.runtime.pipe.schedule:ReduceGrads", "patch_instruction"),
    # pipeline_instructions: the instructions of DeepSpeed's 1F1B training schedule, each executed
    # with its kwargs (buffer_id), each kind in micro-batch order on a stage
    *[Internal(f"deepspeed.runtime.pipe.schedule:{name}", "pipeline_instructions") for name in _TRAIN_INSTRUCTIONS],
    Internal("deepspeed.runtime.pipe.engine:PipelineEngine._exec_schedule", "pipeline_instructions",
             uses="self._exec_instr(**cmd.kwargs)"),
    Internal("deepspeed.runtime.pipe.engine:PipelineEngine._train_schedule", "pipeline_instructions",
             uses="schedule.TrainSchedule("),
    Internal("deepspeed.runtime.pipe.schedule:TrainSchedule.steps", "pipeline_instructions",
             uses="micro_batch_id, is_forward = self._step_to_micro_batch(step_id)"),
    # pipeline_grid: the module's PipelineParallelGrid
    Internal("deepspeed.runtime.pipe.module:PipelineModule.mpu", "pipeline_grid", uses="return self._grid"),
    # seed_layers_for_init_only: forward reseeds while the flag is set
    Internal("deepspeed.runtime.pipe.module:PipelineModule.forward", "seed_layers_for_init_only",
             uses="if self.seed_layers:"),
    Internal("deepspeed.runtime.pipe.module:PipelineModule._build", "seed_layers_for_init_only",
             uses="if self.seed_layers:"),
    # partition_balanced: how partition_method="type:..." cuts the layers into stages
    Internal("deepspeed.runtime.utils:partition_balanced", "partition_balanced"),
    Internal("deepspeed.runtime.pipe.module:PipelineModule._partition_layers", "partition_balanced",
             uses="partition_balanced("),
    # link_optimizer_state: ZeRO / bf16 optimizers link AdamW's state to each parameter lazily
    Internal("deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state",
             "link_optimizer_state", uses="if not self._hp_optimizer_states_linked:"),
    Internal("deepspeed.runtime.bf16_optimizer:BF16_Optimizer._lazy_init_hp_params_optimizer_state",
             "link_optimizer_state", uses="if not self._hp_optimizer_states_linked:"),
    # param_fragment / hp_fragment: the flat range of a parameter a rank's partition holds, and its fp32 state
    Internal("deepspeed.utils.tensor_fragment:get_hp_fragment_mapping", "param_fragment",
             uses="lp_frag_address = fragment_address(start=fragment_start - lp_start"),
    Internal("deepspeed.utils.tensor_fragment:tensor_fragment.get_hp_fragment", "hp_fragment",
             uses="return self.get_optim_state_fragment(optim_state_key)"),
    Internal("deepspeed.utils.mixed_precision_linkage:_init_lp_to_hp_mapping", "partition_group",
             uses="lp_param._dp_group = dp_group"),
    # report_grad_norm: the engine copies optimizer._global_grad_norm after each step
    Internal("deepspeed.runtime.engine:DeepSpeedEngine._take_model_step", "report_grad_norm",
             uses="self.optimizer._global_grad_norm"),
    # disable_shm_comm_op: init_distributed builds the op only if this table says it is compatible
    Internal("deepspeed.ops:__getattr__", "disable_shm_comm_op", uses='"__compatible_ops__"'),
    Internal("deepspeed.comm.torch:build_shm_op", "disable_shm_comm_op",
             uses="deepspeed.ops.__compatible_ops__.get(builder.NAME"),
]


def _resolve(target: str) -> Any:
    module, _, qual = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qual.split("."):
        obj = inspect.getattr_static(obj, part)  # no descriptor or lazy module attribute runs
    return obj


def _problem(item: Internal) -> Optional[str]:
    try:
        obj = _resolve(item.target)
    except (ImportError, AttributeError) as e:
        return f"{item.target} is missing ({type(e).__name__}: {e})"
    if item.uses is None:
        return None
    try:
        source = inspect.getsource(getattr(obj, "__func__", obj))
    except (OSError, TypeError) as e:
        return f"{item.target}: source unreadable ({e})"
    return None if item.uses in source else f"{item.target} no longer contains {item.uses!r}"


def missing(required: Optional[List[Internal]] = None) -> List[str]:
    """One line per entry of ``required`` (default :data:`REQUIRED`) that the installed DeepSpeed
    lacks (symbol absent, or its source without the ``uses`` text), naming the adapter function
    that needs it; ``[]`` when all hold."""
    out = []
    for item in REQUIRED if required is None else required:
        problem = _problem(item)
        if problem:
            out.append(f"{problem}, needed by vitp.deepspeed_adapter.{item.needed_by}")
    return out


def check(required: Optional[List[Internal]] = None) -> None:
    """Raise ``RuntimeError`` naming every DeepSpeed internal of ``required`` (default
    :data:`REQUIRED`) that the installed DeepSpeed lacks, and the adapter function that needs it."""
    deepspeed = import_deepspeed()

    problems = missing(required)
    if problems:
        raise RuntimeError(f"DeepSpeed {deepspeed.__version__} lacks internals vitp relies on "
                           f"(vitp/deepspeed_adapter.py): " + "; ".join(problems))


# ------------------------------------------------------------------------- pipeline engine
def patch_instruction(engine: Any, instruction: str, wrap: Callable[[Callable], Callable]) -> None:
    """Replace how this pipeline ``engine`` executes the schedule instruction ``instruction``
    (a class name of ``deepspeed.runtime.pipe.schedule``, e.g. ``"ReduceGrads"``) by
    ``wrap(original)``, a function of the engine (``fn(engine, **instruction_kwargs)``).

    Why: DeepSpeed has no hook between the last micro-batch's backward and its gradient reduction;
    its engine dispatches instructions through the class table ``_INSTRUCTION_MAP``, looked up on
    ``self``, so an instance attribute overrides it for this engine only. Patches compose: a second
    patch of the same instruction wraps the first (``wrap`` gets the already patched function).
    Raises ``AttributeError`` for a name ``deepspeed.runtime.pipe.schedule`` lacks, ``KeyError``
    for an instruction the table lacks.
    """
    from deepspeed.runtime.pipe import schedule

    table: Dict[Any, Callable] = engine._INSTRUCTION_MAP  # this engine's own table once patched, else the class's
    kind = getattr(schedule, instruction)
    engine._INSTRUCTION_MAP = {**table, kind: wrap(table[kind])}


def pipeline_instructions() -> List[str]:
    """The class names (of ``deepspeed.runtime.pipe.schedule``) of every instruction DeepSpeed's
    training schedule (``TrainSchedule``, 1F1B; also at ``pp = 1``) issues: load, forward, backward,
    the four point-to-point transfers, the two gradient reductions and the optimizer step.

    Why it is internal: the schedule and its instruction classes are DeepSpeed's engine internals.
    What :mod:`vitp.train.timeline` relies on: ``_exec_schedule`` calls the function of each
    instruction with the instruction's kwargs (``buffer_id`` for buffer ops), and in
    ``TrainSchedule`` each kind of buffer op runs on a stage in micro-batch order (so the k-th
    ``ForwardPass`` of a step is micro-batch k; buffers are reused, ``buffer_id`` is not the
    micro-batch).
    """
    return list(_TRAIN_INSTRUCTIONS)


def pipeline_grid(module: Any) -> Any:
    """The ``PipelineParallelGrid`` (process groups and ranks) of a ``PipelineModule``.

    Why: DeepSpeed builds the grid inside ``PipelineModule`` and keeps it private (``_grid``);
    ``mpu()`` returns it (it is what DeepSpeed passes as the model-parallel unit).
    """
    return module.mpu()


def seed_layers_for_init_only(module: Any) -> None:
    """Stop ``module`` (built with ``seed_layers=True``) reseeding the RNG in every forward.

    Why: ``seed_layers`` seeds layer ``i`` with ``base_seed + i`` while building (what makes
    initialisation layout independent), but DeepSpeed also reseeds in every forward with a
    rank-independent seed, which would give every data-parallel rank the same dropout masks;
    DeepSpeed has no option for the first without the second, so the flag is cleared after
    construction.
    """
    module.seed_layers = False


def partition_balanced(weights: List[int], num_parts: int) -> List[int]:
    """Part boundaries (``num_parts + 1`` indices) DeepSpeed's ``partition_method="type:..."``
    uses for per-layer ``weights``.

    Why: the planner and the weight gatherer must know which stage owns which block before (or
    without) building a ``PipelineModule``; this undocumented helper is what DeepSpeed cuts with.
    """
    from deepspeed.runtime.utils import partition_balanced as _partition

    return _partition(weights=weights, num_parts=num_parts)


# ------------------------------------------------------------------------- optimizer state
def is_partitioned(optimizer: Any) -> bool:
    """Whether ``optimizer`` is DeepSpeed's ZeRO / bf16 wrapper, whose fp32 state lives in flat
    partitions reached through each parameter's ``_hp_mapping`` (else a plain torch optimizer)."""
    return hasattr(optimizer, "_lazy_init_hp_params_optimizer_state")


def param_fragment(param: Any) -> Optional[Tuple[int, int]]:
    """``(start, numel)``: the flat range of ``param`` whose fp32 state this rank's partition
    holds, or ``None`` when it holds none. Why: DeepSpeed exposes it only as the internal
    ``_hp_mapping.lp_fragment_address`` (``deepspeed/utils/tensor_fragment.py``)."""
    m = getattr(param, "_hp_mapping", None)
    if m is None:
        return None
    return int(m.lp_fragment_address.start), int(m.lp_fragment_address.numel)


def partition_group(param: Any) -> Any:
    """The process group over which ``param``'s fp32 state is partitioned (ZeRO's data-parallel
    group). Why: set only as the internal ``param._dp_group`` (``_init_lp_to_hp_mapping``)."""
    return param._dp_group


def hp_fragment(param: Any, key: Optional[str] = None) -> Any:
    """The live 1-D fp32 tensor of this rank's fragment of ``param``: the master weights
    (``key=None``) or an optimizer state (``exp_avg``, ...; linked by :func:`link_optimizer_state`).
    Why: the public ``safe_get_local_*`` functions serve ZeRO-3 only."""
    return param._hp_mapping.get_hp_fragment(key)


# ------------------------------------------------------------------------- optimizer, comm
def link_optimizer_state(optimizer: Any) -> bool:
    """Link the AdamW state of a ZeRO / bf16 ``optimizer`` wrapper to each parameter's
    ``_hp_mapping`` as the state is now (creating torch AdamW's zero state first where no step has
    run), so that DeepSpeed's ``safe_get/set_full_optimizer_state`` reach it. Returns ``False``
    (doing nothing) for a plain torch optimizer.

    Why: DeepSpeed links the moments only after its first ``step()`` and once per optimizer (a
    flag); a freshly built engine has no state to link, and a state replaced since is not relinked.
    """
    if not hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):
        return False
    base = optimizer.optimizer
    for group in base.param_groups:  # torch creates AdamW's state at the first step: before it, as torch would
        for flat in group["params"]:
            if not base.state.get(flat):
                base.state[flat] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(flat),
                                    "exp_avg_sq": torch.zeros_like(flat)}
    optimizer._hp_optimizer_states_linked = False
    optimizer._lazy_init_hp_params_optimizer_state()
    return True


def report_grad_norm(optimizer: Any, norm: Any) -> None:
    """Hand ``norm`` to the DeepSpeed engine as this step's global grad norm
    (``engine.get_global_grad_norm()``). Why: the engine copies a client optimizer's private
    ``_global_grad_norm`` after each step; there is no public setter."""
    optimizer._global_grad_norm = norm


def disable_shm_comm_op() -> None:
    """Keep ``deepspeed.init_distributed`` from JIT-compiling its shared-memory comm op on CPU.

    Why: the first build takes about 50 s with g++ and training does not use it; DeepSpeed builds
    it only if ``deepspeed.ops.__compatible_ops__`` (a module-level table it fills on first
    access) marks it compatible, and has no switch for it. The table is set in the module's
    namespace, not read: reading it first runs DeepSpeed's probe of every op builder (compiler
    and linker subprocesses on each start, ``cannot find -laio``) for a table only this op reads.
    """
    import_deepspeed()
    import deepspeed.ops

    table = vars(deepspeed.ops).setdefault("__compatible_ops__", {})
    table["deepspeed_shm_comm"] = False
