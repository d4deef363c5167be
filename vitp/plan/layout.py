"""A candidate layout as the planner sees it, and the valid ones for a config and world size.

Validity is decided by :func:`vitp.config.validate_layout` itself (the rules a run is checked
with), applied to a copy of the config with the candidate's ``parallel.*`` and
``trainer.micro_batch_size`` set, so the planner never offers a layout ``vitp-train`` refuses.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable, List, Optional, Sequence

from vitp.utils import divisors


@dataclass(frozen=True)
class LayoutSpec:
    """One ``(tp, cp, pp, dp, sp, AC)`` layout with its batch split and numerics.

    ``micro`` samples per micro-batch per dp rank, ``accum`` micro-batches per optimizer step
    (DeepSpeed's gradient accumulation steps, the 1F1B pipeline's micro-batch count);
    ``ac`` layers per activation checkpoint (0 = off); ``precision`` fp32 | bf16; ``device`` the
    device type (cpu | cuda) the kernels run on. ``partial_sync`` (``p < 1``,
    :mod:`vitp.parallel.partial_sync`): every TP rank keeps its own residual stream, so no token is
    sharded (``sp`` is False) and ``partial_sp`` says the synchronized slice moves as
    reduce-scatter + all-gather. ``cp`` context-parallel ranks hold ``N / cp`` tokens of every
    sample (:mod:`vitp.parallel.context`; ``cp_mode`` ``ulysses`` or ``ring`` for full
    attention); they see the same samples, so ``global_batch`` counts ``dp`` only, while the
    gradient reduction and ZeRO-1's partitions span :attr:`engine_dp` = ``dp * cp`` ranks.
    """

    tp: int
    pp: int
    dp: int
    sp: bool
    ac: int
    micro: int
    accum: int
    precision: str = "fp32"
    zero_stage: int = 1
    device: str = "cpu"
    partial_sync: float = 1.0
    partial_sp: bool = False
    cp: int = 1
    cp_mode: str = "ulysses"

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def engine_dp(self) -> int:
        """Ranks of the gradient reduction and of ZeRO's partitions: ``dp * cp``."""
        return self.dp * self.cp

    @property
    def global_batch(self) -> int:
        return self.micro * self.accum * self.dp

    def as_dict(self) -> dict:
        return asdict(self)

    def overrides(self) -> List[str]:
        """The ``vitp-train`` overrides that select this layout."""
        out = [f"parallel.tp={self.tp}", f"parallel.cp={self.cp}", f"parallel.pp={self.pp}",
               f"parallel.sequence_parallel={str(self.sp or self.partial_sp).lower()}",
               f"parallel.activation_checkpoint_interval={self.ac}", f"trainer.micro_batch_size={self.micro}"]
        out += [f"parallel.cp_mode={self.cp_mode}"] if self.cp > 1 and self.cp_mode != "ulysses" else []
        return out + ([f"parallel.partial_sync={self.partial_sync}"] if self.partial_sync < 1 else [])


def layout_of(cfg: Any, world_size: int, device_type: str = "cpu") -> LayoutSpec:
    """The :class:`LayoutSpec` of a composed run config on ``world_size`` processes.

    Raises ``ValueError`` as :func:`vitp.config.validate_layout` does.
    """
    from vitp.config import validate_layout

    lay = validate_layout(cfg, world_size, device_type)
    tr, par = cfg.trainer, cfg.parallel
    sp = bool(par.sequence_parallel) and lay.tp > 1
    p = float(par.get("partial_sync", 1.0)) if lay.tp > 1 else 1.0
    return LayoutSpec(tp=lay.tp, pp=lay.pp, dp=lay.dp, sp=sp and p >= 1, ac=int(par.activation_checkpoint_interval),
                      micro=int(tr.micro_batch_size), accum=tr.global_batch_size // (tr.micro_batch_size * lay.dp),
                      precision=lay.precision, zero_stage=lay.engine_zero_stage(par.zero_stage), device=device_type,
                      partial_sync=p, partial_sp=sp and p < 1, cp=lay.cp, cp_mode=str(par.cp_mode))


def _cp_modes(cfg: Any, cp: int, cp_modes: Optional[Sequence[str]]) -> Sequence[str]:
    """The ``parallel.cp_mode`` values to try at ``cp``: ``cp_modes`` if given, else ``ulysses``
    and, only where Ulysses cannot split the heads (full attention), ``ring``; one value at cp = 1
    or with factorized attention (whose blocks never use the ring)."""
    if cp == 1:
        return [str(cfg.parallel.cp_mode)]
    if cp_modes:
        return list(cp_modes)
    return ["ulysses", "ring"] if str(cfg.model.attention) == "full" else ["ulysses"]


class PlainConfig(dict):
    """A resolved config as nested dicts read like a ``DictConfig`` (``cfg.parallel.tp``,
    ``cfg.model.get("preset")``, ``getattr(m, "family", "vit")``): :func:`vitp.config.validate_layout`
    reads it in microseconds where a ``DictConfig`` takes milliseconds (issue 54 item 2).
    Values are what the ``DictConfig`` returns (enum choices included); missing keys raise
    ``AttributeError`` on attribute access, ``KeyError`` on indexing."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    @classmethod
    def of(cls, value: Any) -> Any:
        """``value`` (plain containers) with every dict a :class:`PlainConfig`, lists kept lists."""
        if isinstance(value, dict):
            return cls({k: cls.of(v) for k, v in value.items()})
        if isinstance(value, (list, tuple)):
            return [cls.of(v) for v in value]
        return value


LAYOUT_KEYS = ("parallel.", "trainer.micro_batch_size")  # what candidate_layouts sets per candidate


def _interpolations(value: Any) -> List[str]:
    """Every string of the unresolved containers ``value`` that holds an interpolation (``${...}``)."""
    if isinstance(value, dict):
        return [s for v in value.values() for s in _interpolations(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _interpolations(v)]
    return [value] if isinstance(value, str) and "${" in value else []


def _plain_base(cfg: Any) -> Optional[PlainConfig]:
    """``cfg`` resolved once as a :class:`PlainConfig`, or ``None`` (read ``cfg`` itself) when a
    value interpolates a key the candidates change (it would have to be resolved per candidate)
    or does not resolve."""
    from omegaconf import DictConfig, OmegaConf

    if not isinstance(cfg, DictConfig):
        return None
    if any(k in s for s in _interpolations(OmegaConf.to_container(cfg, resolve=False)) for k in LAYOUT_KEYS):
        return None
    try:
        return PlainConfig.of(OmegaConf.to_container(cfg, resolve=True))
    except Exception:  # noqa: BLE001 - an interpolation that does not resolve: validate on cfg as before
        return None


def _with_layout(cfg: Any, base: Optional[PlainConfig], parallel: dict, micro: int) -> Any:
    """``cfg`` with ``parallel`` keys and ``trainer.micro_batch_size`` set (a copy: cheap on ``base``)."""
    if base is None:
        from omegaconf import OmegaConf

        return OmegaConf.merge(cfg, {"parallel": parallel, "trainer": {"micro_batch_size": micro}})
    return PlainConfig({**base, "parallel": PlainConfig({**base["parallel"], **parallel}),
                        "trainer": PlainConfig({**base["trainer"], "micro_batch_size": micro})})


def candidate_layouts(cfg: Any, world_size: int, device_type: str = "cpu", ac_options: Sequence[int] = (0, 1),
                      micro_options: Optional[Iterable[int]] = None, cp_modes: Optional[Sequence[str]] = None
                      ) -> List[LayoutSpec]:
    """Every layout of ``world_size`` processes that :func:`vitp.config.validate_layout` accepts:
    all ``(cp, tp, pp)`` dividing the world (cp = 1 first), sequence parallelism on and off
    (tp > 1), each ``ac_options`` interval, and each micro-batch size in ``micro_options``
    (default: every divisor of ``global_batch / dp``), keeping ``trainer.global_batch_size``. At
    cp > 1 with full attention ``cp_mode=ring`` is offered only where ``ulysses`` is invalid
    (heads not divisible by ``tp * cp``), unless ``cp_modes`` names the modes to try. Each
    candidate is checked on a plain copy of the resolved config (:class:`PlainConfig`)."""
    out = []
    base = _plain_base(cfg)
    glob = cfg.trainer.global_batch_size
    for cp in divisors(world_size):
        for tp in divisors(world_size // cp):
            for pp in divisors(world_size // (cp * tp)):
                dp = world_size // (cp * tp * pp)
                micros = sorted(set(micro_options or divisors(max(1, glob // dp))))
                for sp in ([False, True] if tp > 1 else [False]):
                    for ac in ac_options:
                        for micro in micros:
                            out += _first_valid(cfg, world_size, device_type, [
                                _with_layout(cfg, base, {"tp": tp, "pp": pp, "cp": cp, "cp_mode": mode,
                                                         "sequence_parallel": sp,
                                                         "activation_checkpoint_interval": ac}, micro)
                                for mode in _cp_modes(base or cfg, cp, cp_modes)], cp_modes is None)
    return out


def _first_valid(cfg: Any, world_size: int, device_type: str, configs: List[Any], first_only: bool
                 ) -> List[LayoutSpec]:
    """The layouts of ``configs`` that validate (only the first that does when ``first_only``)."""
    out = []
    for c in configs:
        try:
            out.append(layout_of(c, world_size, device_type))
        except ValueError:
            continue
        if first_only:
            break
    return out


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive integers."""
    return -(-a // b)


def local_tokens(tokens: int, tp: int, sp: bool, cp: int = 1) -> int:
    """Tokens a rank holds outside attention/MLP: ``N / cp`` of a context-parallel shard, and of
    those ``ceil(N / cp / tp)`` under sequence parallelism (padded to a multiple of tp,
    :func:`vitp.parallel.sequence_parallel_enter`)."""
    n = tokens // cp
    return ceil_div(n, tp) if sp and tp > 1 else n


def gathered_tokens(tokens: int, tp: int, sp: bool, cp: int = 1) -> int:
    """Tokens of a gathered sequence-parallel tensor: ``N / cp`` padded to a multiple of tp (SP), else ``N / cp``."""
    n = tokens // cp
    return ceil_div(n, tp) * tp if sp and tp > 1 else n


__all__ = ["LayoutSpec", "candidate_layouts", "ceil_div", "gathered_tokens", "layout_of", "local_tokens"]
