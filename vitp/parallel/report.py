"""What a parallel plan does to a model or a pipeline stage (:class:`PlanReport`), readable without
torch: :func:`vitp.parallel.plan.apply_plan` and :func:`~vitp.parallel.plan.describe_plan` build it,
the planner (:mod:`vitp.plan`) reads its collectives, also from its cache of them
(:mod:`vitp.plan.facts`)."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .styles import Collective, ParallelStyle, StepShape


@dataclass
class PlanReport:
    """What a plan did (or, from :func:`vitp.parallel.plan.describe_plan`, would do) to one model or stage.

    ``rows``: ``(pattern, style, modes, applied, matched canonical names)``; ``params``:
    canonical parameter name -> role (``sharded(dim=.., stride=..)`` or
    ``partial_grad(<attribute>)``); ``partial_grad_elements``: elements of the latter.
    """

    plan: str
    mode: str
    rows: List[Tuple[str, str, Tuple[str, ...], bool, List[str]]] = field(default_factory=list)
    params: Dict[str, str] = field(default_factory=dict)
    partial_grad_elements: int = 0
    axes: Tuple[str, ...] = ("tp",)  # the active parallel axes ("tp", "cp"): the table's heading names them
    _sizes: List[Tuple[ParallelStyle, Dict[str, int]]] = field(default_factory=list, repr=False)
    _grouped: Optional[tuple] = field(default=None, repr=False, compare=False)

    def sharded(self) -> List[str]:
        """Canonical names of the parameters each TP rank holds a slice of."""
        return sorted(n for n, r in self.params.items() if r.startswith("sharded"))

    def partial_grad(self) -> List[str]:
        """Canonical names of the replicated parameters whose gradient is summed over the TP group."""
        return sorted(n for n, r in self.params.items() if r.startswith("partial_grad"))

    def collectives(self, shape: StepShape) -> List[Collective]:
        """TP collectives of one micro-batch (forward ones ``shape.redo`` times), plus one
        ``per_step`` all-reduce of the partial gradients (tag ``param_grad``), merged by kind,
        direction, tag and size; the context-parallel ones (tags ``cp``, ``cp_boundary``) run over
        the cp group, the others over the TP group. Empty at tp = cp = 1."""
        if shape.tp == 1 and shape.cp == 1:
            return []
        counts: Dict[tuple, int] = defaultdict(int)
        for style, sizes, n in self._groups():  # equal entries at once: the same keys, in the same order
            for c in style.collectives(sizes, shape):
                counts[(c.kind, c.direction, c.tag, c.nbytes)] += n * c.count * (shape.redo if c.direction == "fwd"
                                                                                 and c.redo else 1)
        out = [Collective(k, d, t, nb, n) for (k, d, t, nb), n in counts.items()]
        if self.partial_grad_elements:
            out.append(Collective("all_reduce", "bwd", "param_grad", self.partial_grad_elements * shape.act_bytes,
                                  per_step=True))
        return out

    def _groups(self) -> List[Tuple[ParallelStyle, Dict[str, int], int]]:
        """``[(style, sizes, n)]``: the ``n`` equal ``(style, sizes)`` entries of the matched modules
        (e.g. the same row on every block of a stage) once each, in order of first occurrence."""
        if self._grouped is None or self._grouped[0] != len(self._sizes):
            groups: Dict[tuple, list] = {}
            for style, sizes in self._sizes:
                key = (id(style), tuple(sizes.items()))
                if key in groups:
                    groups[key][2] += 1
                else:
                    groups[key] = [style, sizes, 1]
            self._grouped = (len(self._sizes), [tuple(g) for g in groups.values()])
        return self._grouped[1]

    def table(self, where: str = "") -> str:
        """The plan as applied, one line per applied row (logged by :func:`vitp.parallel.plan.apply_plan`);
        ``where`` (e.g. ``"stage 1"``) goes into the heading."""
        skipped = sum(not r[3] for r in self.rows)
        if "tp" in self.axes:
            what = (f"(mode {self.mode}{', with cp' if 'cp' in self.axes else ''}): {len(self.sharded())} sharded, "
                    f"{len(self.partial_grad())} partial-gradient parameters")
        else:  # a context-parallel run at tp = 1: no tensor-parallel mode, nothing sharded
            what = "(context parallelism at tp=1: no parameter sharded)"
        lines = [f"parallel plan {self.plan!r}{' on ' + where if where else ''} {what}; "
                 f"{skipped} row(s) of other modes or degrees not applied"]
        for pattern, style, _modes, applied, matched in self.rows:
            if applied:
                lines.append(f"  {pattern:28} -> {style}: {len(matched)} module(s)")
        return "\n".join(lines)
