"""Where ``vitp-export`` and the end of ``vitp-train`` may not write: onto the weights a run starts
from, or over a run's own files.

A run's inputs (:func:`run_inputs`) are ``trainer.init_from`` (a Wan run's: also its transformer
folder and the pipeline folder around it, whose other components an export links),
``trainer.init_from_timm`` and ``trainer.lora.init_from``. An output that is one of them, lies
inside one or holds one would overwrite the model the run started from, which its checkpoints and
adapters need: ``vitp-export RUN --format diffusers -o BASE --force`` deleted ``BASE/transformer``'s
shards before it failed. An output that is the run folder, or lies inside one of its existing
entries other than ``export/`` (``checkpoints/``, ``diffusers/``, ``lora/``, the final weights),
would overwrite the run's files. Both are refused (``ValueError``, one line naming the fix) before
anything is written: :func:`check_export_out` for ``vitp-export -o``, :func:`check_final_writes`
for ``vitp-train``'s ``RUN/diffusers``, ``RUN/lora``, final weights and ``trainer.export_dir``.
``vitp-sample --out`` may not write into a run's files or a model's folder either
(:func:`check_sample_out`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

EXPORT_DIR = "export"  # <run dir>/export: vitp-export's default outputs, the one run entry -o may go into
INDEX = ".index.json"  # a sharded export X.safetensors's index, X.safetensors.index.json
RELATION = {"is": "is", "inside": "lies inside", "holds": "holds"}


def _real(path: Any) -> Path:
    """``path`` absolute, links followed, a sharded export's index as the file it stands for."""
    p = Path(os.path.realpath(Path(str(path)).expanduser()))
    return p.with_name(p.name[:-len(INDEX)]) if p.name.endswith(".safetensors" + INDEX) else p


def relation(path: Any, other: Any) -> Optional[str]:
    """How ``path`` meets ``other`` (both resolved: :func:`_real`): ``"is"``, ``"inside"`` (``path``
    lies inside the folder ``other``), ``"holds"`` (``other`` lies inside ``path``), else ``None``."""
    a, b = _real(path), _real(other)
    return "is" if a == b else "inside" if b in a.parents else "holds" if a in b.parents else None


def _named(key: str, path: Path) -> str:
    """``key=value``, and the resolved ``path`` after it where the value does not show it."""
    return key if key.endswith(f"={path}") else f"{key} ({path})"


def run_inputs(cfg: Any) -> List[Tuple[str, Path]]:
    """``[(key=value, resolved path)]`` of the weights the run config ``cfg`` reads (module doc);
    a Wan folder that cannot be read adds only the given path."""
    tr = cfg.trainer
    given = [("trainer.init_from", tr.get("init_from")), ("trainer.init_from_timm", tr.get("init_from_timm")),
             ("trainer.lora.init_from", (tr.get("lora") or {}).get("init_from"))]
    out = [(f"{k}={v}", _real(v)) for k, v in given if v]
    if tr.get("init_from") and str(cfg.model.get("family", "vit")) == "wan":
        from vitp.models.wan_run import pipeline_folder, wan_source

        try:
            transformer, _ = wan_source(cfg)
        except (FileNotFoundError, ValueError):  # refused elsewhere, naming the folder
            return out
        pipe = pipeline_folder(transformer)
        out += [(f"trainer.init_from={tr.init_from}", _real(p)) for p in (transformer, pipe) if p is not None]
    return out


def wan_targets(out: Path, cfg: Any) -> List[Path]:
    """What a Wan diffusers folder ``out`` of the run ``cfg`` writes through: ``out``, the trained
    transformer's folder in it (``transformer``, ``transformer_2``: a link there from an earlier
    export of the other expert would lead into the source) and ``model_index.json``."""
    from vitp.models.wan_run import pipeline_folder, wan_source

    try:
        transformer, _ = wan_source(cfg)
    except (FileNotFoundError, ValueError):  # refused when the export reads the source
        return [Path(out)]
    if pipeline_folder(transformer) is None:  # a lone transformer: written as out itself
        return [Path(out)]
    return [Path(out), Path(out) / transformer.name, Path(out) / "model_index.json"]


def is_run_dir(folder: Path) -> bool:
    """Whether ``folder`` is a vitp run folder (its recorded config, checkpoints or metrics)."""
    folder = Path(folder)
    return ((folder / ".hydra" / "config.yaml").is_file() or (folder / "checkpoints").is_dir()
            or (folder / "metrics.jsonl").is_file())


def _run_entry(out: Path, run_dir: Path, free: Sequence[str] = (EXPORT_DIR,)) -> Optional[Path]:
    """The run's own file or folder that ``out`` is or lies inside (``run_dir`` itself for the run
    folder), or ``None``: outside the run, under one of its ``free`` entries, or at a new name in it."""
    a, run = _real(out), _real(run_dir)
    if a == run:
        return run
    if run not in a.parents:
        return None
    top = run / a.relative_to(run).parts[0]
    return top if top.name not in free and (top.exists() or top.is_symlink()) else None


def holds_weights(folder: Path) -> bool:
    """Whether ``folder`` holds a model: a diffusers pipeline (``model_index.json``) or a model
    folder (``config.json`` with ``*.safetensors`` weights or their index)."""
    f = Path(folder)
    return f.is_dir() and ((f / "model_index.json").is_file()
                           or (f / "config.json").is_file() and any(f.glob("*.safetensors*")))


def check_sample_out(out: Path, default: Path, prog: str = "vitp-sample") -> None:
    """Refuse (``ValueError``, ``--force`` or not) a sampling ``--out`` that is or lies inside a
    recorded run's own files other than ``samples/`` and ``export/`` (the run folder itself, its
    ``diffusers/``, ``lora/``, ``checkpoints/``) or a folder holding a model (:func:`holds_weights`):
    grids and latents would land among the weights, as ``vitp-export`` refuses there too. The
    message names ``default``, the output it would write without ``--out``."""
    real = _real(out)
    fix = "{what}, --force or not; give --out a new name, e.g. " + f"{default} (the default)"
    run = next((p for p in (real, *real.parents) if (p / ".hydra" / "config.yaml").is_file()), None)
    hit = _run_entry(out, run, (EXPORT_DIR, "samples")) if run is not None else None
    if hit is not None:
        where = ("is the run folder" if hit == run else f"is the run's {hit}" if hit == real else
                 f"lies inside the run's {hit}")
        raise ValueError(f"--out {out} {where}: " + fix.format(what=f"{prog} would write among the run's files"))
    model = next((p for p in (real, *real.parents) if holds_weights(p)), None)
    if model is not None:
        where = "is" if model == real else "lies inside"
        raise ValueError(f"--out {out} {where} the model folder {model}: "
                         + fix.format(what=f"{prog} would write among its weights"))


def check_export_out(out: Path, targets: Sequence[Path], cfg: Any, run_dir: Optional[Path]) -> None:
    """Refuse (``ValueError``) a ``vitp-export -o out`` whose ``targets`` (what it writes: ``out``,
    and for a folder the paths :func:`wan_targets` names) meet an input of the run ``cfg``
    (:func:`run_inputs`) or the files of the run folder ``run_dir`` (module doc)."""
    for key, base in run_inputs(cfg):
        for t in targets:
            how = relation(t, base)
            if how is not None:
                shown = t if t == out else f"{out} (through {t})"
                raise ValueError(f"-o {shown} {RELATION[how]} the run's base {_named(key, base)}: the export would "
                                 "overwrite the weights the run started from; give -o another folder or file")
    if run_dir is not None and is_run_dir(run_dir):
        hit = _run_entry(out, run_dir)
        if hit is not None:
            where = ("is the run folder" if hit == _real(run_dir) else
                     f"is the run's {hit}" if hit == _real(out) else f"lies inside the run's {hit}")
            raise ValueError(f"-o {out} {where}: the export would overwrite the run's files; give -o a new name, "
                             f"e.g. under {Path(run_dir) / EXPORT_DIR} (the default), or a folder outside the run")


def final_targets(cfg: Any, folder: Path) -> List[Path]:
    """What the end of ``vitp-train`` writes into ``folder`` (the run dir or ``trainer.export_dir``):
    a LoRA run's ``lora/``, a Wan run's ``diffusers/`` (and its trained transformer folder), else
    the final weights ``model_ema.safetensors`` and ``model.safetensors``."""
    folder = Path(folder)
    if cfg.trainer.lora.enabled:
        return [folder / "lora"]
    if str(cfg.model.get("family", "vit")) == "wan":
        return wan_targets(folder / "diffusers", cfg)
    return [folder / "model_ema.safetensors", folder / "model.safetensors"]


def check_final_writes(cfg: Any, run_dir: Optional[Path]) -> None:
    """Refuse (``ValueError``) a run whose final weights (:func:`final_targets`, in ``run_dir`` and
    ``trainer.export_dir``; ``run_dir`` ``None``: a new folder, not checked) would land on one of
    its inputs (:func:`run_inputs`)."""
    inputs = run_inputs(cfg)
    export = cfg.trainer.get("export_dir")
    for where, folder in (("hydra.run.dir", run_dir), ("trainer.export_dir", export)):
        for t in final_targets(cfg, folder) if folder else []:
            for key, base in inputs:
                how = relation(t, base)
                if how is not None:
                    meet = "the same path" if how == "is" else f"which {RELATION[how]} it"
                    raise ValueError(f"{_named(key, base)}: the run writes its final weights to {t} ({where}={folder}), "
                                     f"{meet}, and would overwrite the model it starts from; start from a copy of "
                                     f"it, or choose another {where}")


__all__ = ["EXPORT_DIR", "check_export_out", "check_final_writes", "check_sample_out", "final_targets", "holds_weights",
           "is_run_dir", "relation", "run_inputs", "wan_targets"]
