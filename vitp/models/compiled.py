"""Regional compilation of the generator (``trainer.compile=blocks``): ``torch.compile`` on each
:class:`~vitp.models.Block`, not on the whole model.

Every block of a stack is an instance of one class with the same forward, and dynamo inlines
``nn.Module`` calls with the parameters as graph inputs (``torch._dynamo.config.
inline_inbuilt_nn_modules``, on by default in torch 2.14), so one compiled graph serves every
block of the same kind: compile time does not grow with depth (PyTorch's "regional compilation"
recipe, pytorch/tutorials ``recipes_source/regional_compilation.py``). Distinct graphs come from
distinct shapes (buckets, the micro-batch of sampling), from grad mode (training against
sampling), from the block kind (factorized attention: spatial and temporal) and from constants
held by a block (a drop-path rate per block). Shapes are static (``dynamic=False``): one compile
per distinct shape, each served from the run's inductor cache on a restart.

The tensor / sequence / context-parallel collectives run inside the compiled region where dynamo
traces them; ``docs/performance.md`` lists what it does not trace (graph breaks) as measured.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.nn as nn

log = logging.getLogger("vitp")

MODES = ("off", "blocks")
CACHE_ENV = "VITP_COMPILE_CACHE"  # overrides the cache folder (tests share one across runs)
# graphs a block may hold: shapes x grad modes x block kinds x per-block constants
RECOMPILE_LIMIT = 64


def compile_cache_dir(run_dir: Optional[os.PathLike]) -> Optional[Path]:
    """Inductor's cache folder of a run: ``$VITP_COMPILE_CACHE`` when set, else
    ``<run_dir>/compile_cache`` (a restart of the run reuses the compiled kernels), else ``None``
    (inductor's default, ``/tmp/torchinductor_<user>``)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(run_dir) / "compile_cache" if run_dir is not None else None


def use_cache_dir(folder: Optional[os.PathLike]) -> None:
    """Point inductor's (and Triton's) on-disk caches at ``folder`` for the rest of the process
    (``TORCHINDUCTOR_CACHE_DIR``, read by ``torch._inductor.runtime.cache_dir_utils.cache_dir``;
    in-memory caches keyed by the old folder are cleared as its ``temporary_cache_dir`` does)."""
    if folder is None:
        return
    folder = str(Path(folder).absolute())
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") == folder:
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    os.environ.pop("TRITON_CACHE_DIR", None)  # then under the inductor folder (cache_dir_utils.triton_cache_dir)
    from torch._inductor.utils import clear_caches

    clear_caches()


def compile_blocks(model: nn.Module, mode: str = "blocks", cache_dir: Optional[os.PathLike] = None) -> int:
    """Compile every :class:`~vitp.models.Block` of ``model`` (a :class:`~vitp.models.Generator`,
    a pipeline module or a stage, after :func:`~vitp.models.parallelize_generator`) in place with
    ``Block.compile(dynamic=False)``: parameters, state-dict keys and hooks stay as they were, the
    call (hooks included) runs compiled. ``mode="off"`` does nothing. Returns the number of blocks.

    Raises ``ValueError`` for an unknown ``mode``.
    """
    from .generator import Block

    if mode not in MODES:
        raise ValueError(f"trainer.compile={mode!r}; use one of {MODES}")
    if mode == "off":
        return 0
    use_cache_dir(cache_dir)
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 16 * RECOMPILE_LIMIT)
    # DeepSpeed's pipeline runs backward with retain_graph=True over a stage's outputs (tokens, c),
    # which AOTAutograd's donated buffers refuse (measured at tp2 x pp2)
    torch._functorch.config.donated_buffer = False
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for b in blocks:
        b.compile(dynamic=False)
    return len(blocks)


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far: dynamo's traces with inductor's forward
    compiles (``_compile.compile_inner``) plus the backward compiles (``bw_compiler``), from
    ``torch._dynamo.utils.compilation_time_metrics``."""
    from torch._dynamo.utils import compilation_time_metrics as m

    return float(sum(sum(v) for k, v in m.items() if k in ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")))


def compile_stats() -> Dict[str, float]:
    """``{"compile_s": seconds so far, "graphs": distinct graphs compiled, "graph_breaks": count}``
    of this process (dynamo's counters)."""
    from torch._dynamo.utils import counters

    return {"compile_s": compile_seconds(), "graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


class CompileLog:
    """Logs the compile time of each new shape: :meth:`after` a step compares
    :func:`compile_stats` with the last step's and reports what the step compiled."""

    def __init__(self, enabled: bool):
        self.enabled, self.last = enabled, compile_stats() if enabled else {}
        self.total = 0.0

    def after(self, what: str) -> Optional[float]:
        """Log and return the compile seconds spent since the last call (``None`` if none)."""
        if not self.enabled:
            return None
        now = compile_stats()
        spent = now["compile_s"] - self.last["compile_s"]
        new = now["graphs"] - self.last["graphs"]
        self.last = now
        if new <= 0 and spent < 1e-3:
            return None
        self.total += spent
        log.info("compiled blocks for %s: %d new graph(s) in %.1f s (%.1f s in all, %d graph break(s))", what, new,
                 spent, self.total, now["graph_breaks"])
        return spent
