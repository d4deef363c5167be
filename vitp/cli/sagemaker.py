"""SageMaker training-job entry: the job's environment -> ``vitp-train`` with Hydra overrides.

SageMaker's training toolkit (PyPI ``sagemaker-training``; in the PyTorch containers through
``sagemaker-pytorch-training``) runs the entry script ``scripts/sagemaker_entry.py``, which calls
:func:`main`: once (``python sagemaker_entry.py --key value ...``) or, for
``distribution={"torch_distributed": {"enabled": True}}``, under ``torchrun --nnodes H
--nproc_per_node P [--master_addr algo-1 --master_port 7777 --node_rank i] sagemaker_entry.py
--key value ...`` on every host. Everything comes from the toolkit's environment, nothing from
literal paths:

========================  ==========================================================================
what                      where from (default under the base dir ``$SAGEMAKER_BASE_DIR``, else /opt/ml)
========================  ==========================================================================
hyperparameters           ``SM_HPS`` (JSON of all of them), else the ``--key value`` argv pairs
run directory             ``<checkpoint LocalPath>/run``: ``input/config/checkpointconfig.json``
                          ``LocalPath`` (default ``<base>/checkpoints``), synced to
                          ``checkpoint_s3_uri`` and restored on restart, so every job on that URI
                          resumes the same run (``trainer.resume=auto``), whatever its job name
TensorBoard events        ``input/config/tensorboardoutputconfig.json`` ``LocalPath`` (default
                          ``<base>/output/tensorboard``)
final weights, eval.json  ``SM_MODEL_DIR`` (default ``<base>/model``)
samples, eval, metrics    ``SM_OUTPUT_DATA_DIR`` (default ``<base>/output/data``)
data                      ``SM_CHANNEL_TRAIN`` -> ``data.root``; ``SM_CHANNEL_VALIDATION`` ->
                          ``data.heldout_root`` (the held-out set instead of a split of train)
failure reason            ``SM_OUTPUT_DIR/failure`` (default ``<base>/output/failure``)
========================  ==========================================================================

A hyperparameter the user sets (``hydra.run.dir``, ``data.root``, ...) wins over these defaults.

Sources (sagemaker-training 5.1.4, sagemaker-pytorch-training 3.0.0):

- ``SM_*`` variables: ``sagemaker_training/environment.py`` (``Environment.to_env_vars``; the
  toolkit puts them in the environment of the entry script and of torchrun's workers),
  https://github.com/aws/sagemaker-training-toolkit/blob/master/ENVIRONMENT_VARIABLES.md
- hyperparameter values: ``hyperparameters.json`` holds strings, each decoded with
  ``json.loads`` (kept as the string when that fails) by ``environment.read_hyperparameters``;
  ``SM_HPS`` is ``json.dumps`` of the decoded dict (lossless); the argv pairs are
  ``mapping.to_cmd_args`` (``str()`` of each value: lists as Python reprs, booleans as
  ``True``/``False``, objects as ``k=v,k2=v2``); ``sagemaker_*`` keys are the toolkit's own and
  are removed from both (``mapping.split_by_criteria``).
- ``SAGEMAKER_BASE_DIR``, default ``/opt/ml``: ``environment.py`` (``BASE_PATH_ENV``).
- failure file: ``files.write_failure_file`` writes it only if it does not exist yet, and
  SageMaker shows its first 1024 characters as the job's FailureReason
  (https://docs.aws.amazon.com/sagemaker/latest/dg/your-algorithms-training-algo-output.html).
- ``checkpointconfig.json`` / ``tensorboardoutputconfig.json`` and their ``LocalPath`` key, as
  SageMaker Debugger reads them (``smdebug/core/config_constants.py`` in
  awslabs/sagemaker-debugger); their defaults: ``CheckpointConfig.LocalPath`` and
  ``TensorBoardOutputConfig.LocalPath`` in the SageMaker API reference
  (https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_CheckpointConfig.html,
  .../API_TensorBoardOutputConfig.html).
"""
from __future__ import annotations

import ast
import json
import os
import re
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from vitp.cli.overrides import compose_checked, error_chain, override_key
from vitp.cli.overrides import hydra_override as _hydra_override

DEFAULT_BASE_DIR = "/opt/ml"  # the toolkit's default when SAGEMAKER_BASE_DIR is unset (environment.py)
RUN_DIR_NAME = "run"  # the run directory inside the checkpoint path: the same for every job on that path


@dataclass(frozen=True)
class JobPaths:
    """Where a SageMaker job keeps things (see the module docstring for the sources)."""

    checkpoints: str  # checkpoint local path (synced to checkpoint_s3_uri)
    tensorboard: str  # TensorBoard local path (synced to the TensorBoard S3 output)
    model: str  # SM_MODEL_DIR: uploaded as model.tar.gz
    output: str  # SM_OUTPUT_DIR: holds the failure file
    output_data: str  # SM_OUTPUT_DATA_DIR: uploaded as output.tar.gz
    train: Optional[str]  # SM_CHANNEL_TRAIN
    validation: Optional[str]  # SM_CHANNEL_VALIDATION


def _local_path(config_file: Path, default: str) -> str:
    """``LocalPath`` of one of SageMaker's ``input/config/*config.json`` files, else ``default``.

    Raises ``ValueError`` when the file exists but is not a JSON object."""
    if not config_file.is_file():
        return default
    try:
        value = json.loads(config_file.read_text()).get("LocalPath")
    except (ValueError, AttributeError) as e:
        raise ValueError(f"{config_file} is not a JSON object ({e})") from None
    return str(value) if value else default


def _base_dir(env: Mapping[str, str]) -> Path:
    return Path(env.get("SAGEMAKER_BASE_DIR") or DEFAULT_BASE_DIR)


def _output_dir(env: Mapping[str, str]) -> str:
    return env.get("SM_OUTPUT_DIR") or str(_base_dir(env) / "output")


def job_paths(env: Mapping[str, str]) -> JobPaths:
    """The job's folders, from the toolkit's environment ``env`` (``os.environ``).

    Raises ``ValueError`` when a SageMaker config file it reads is not a JSON object."""
    base = _base_dir(env)
    config = base / "input" / "config"
    output = _output_dir(env)
    return JobPaths(
        checkpoints=_local_path(config / "checkpointconfig.json", str(base / "checkpoints")),
        tensorboard=_local_path(config / "tensorboardoutputconfig.json", str(base / "output" / "tensorboard")),
        model=env.get("SM_MODEL_DIR") or str(base / "model"),
        output=output,
        output_data=env.get("SM_OUTPUT_DATA_DIR") or str(Path(output) / "data"),
        train=env.get("SM_CHANNEL_TRAIN") or None,
        validation=env.get("SM_CHANNEL_VALIDATION") or None,
    )


# ------------------------------------------------------------------------------- hyperparameters
_ARGV_OBJECT = re.compile(r"[A-Za-z_][\w.\-]*=[^,]*(,[A-Za-z_][\w.\-]*=[^,]*)*")


def _leaf_type(key: str) -> Tuple[bool, Any]:
    """``(True, type hint)`` when the dotted ``key`` names a leaf of vitp's schema
    (:class:`vitp.config.Config`; ``hydra.*``: Hydra's own ``hydra.conf.HydraConf``), else
    ``(False, None)``: a section, a group choice or an unknown key."""
    import typing
    from dataclasses import is_dataclass

    from hydra.conf import HydraConf

    from vitp.config import Config

    parts = key.split(".")
    node, parts = (HydraConf, parts[1:]) if parts[0] == "hydra" else (Config, parts)
    for i, part in enumerate(parts):
        hint = typing.get_type_hints(node).get(part)
        if hint is None:
            return False, None
        if not is_dataclass(hint):
            return i == len(parts) - 1, hint
        node = hint
    return False, None


def _decode_argv_value(text: str, key: str) -> Any:
    """The value of hyperparameter ``key`` as the toolkit's argv carries it (``mapping.to_cmd_args``,
    ``str()`` of each value). A string key of the schema (``paths.output_root``,
    ``hydra.run.dir``) takes the text as it is, also with ``=``, commas or spaces; other keys
    read JSON (numbers, ``true``, lists, objects), else a Python literal (``str()`` of a list or
    bool: ``['a', 'b']``, ``True``), else the text; a key that is no leaf of the schema (a section
    such as ``trainer``) also reads ``k=v,k2=v2`` as an object (how the toolkit writes one). The
    empty text is ``null`` (how it writes ``None``) unless the key is a plain ``str``."""
    leaf, hint = _leaf_type(key)
    if leaf and hint in (str, Optional[str]):
        return None if text == "" and hint is not str else text
    if text == "":
        return None
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        value = ast.literal_eval(text)
        if isinstance(value, (list, dict, bool, int, float)):
            return value
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        pass
    if not leaf and _ARGV_OBJECT.fullmatch(text):
        return {k: _decode_argv_value(v, f"{key}.{k}") for k, v in (item.split("=", 1) for item in text.split(","))}
    return text


def _argv_hyperparameters(argv: Sequence[str]) -> Dict[str, Any]:
    """``--key value`` pairs (also ``--key=value``; ``-k`` for one-letter keys, as the toolkit writes them)."""
    out: Dict[str, Any] = {}
    items = list(argv)
    while items:
        flag = items.pop(0)
        if not flag.startswith("-") or flag in ("-", "--"):
            raise ValueError(f"argument {flag!r} is not a --key: hyperparameters arrive as --key value pairs")
        key, eq, value = flag.lstrip("-").partition("=")
        if not eq:
            if not items:
                raise ValueError(f"hyperparameter --{key} has no value")
            value = items.pop(0)
        out[key] = _decode_argv_value(value, key)
    return out


def job_hyperparameters(env: Mapping[str, str], argv: Sequence[str] = ()) -> Dict[str, Any]:
    """The job's hyperparameters: ``SM_HPS`` when the toolkit set it (lossless JSON; the argv
    duplicates it as text), else the ``--key value`` argv (:func:`_decode_argv_value`).
    Keys starting with ``sagemaker_`` (the toolkit's own) are dropped.

    Raises ``ValueError`` on malformed ``SM_HPS`` or argv."""
    if "SM_HPS" in env:
        try:
            hps = json.loads(env["SM_HPS"] or "{}")
        except ValueError as e:
            raise ValueError(f"SM_HPS is not valid JSON ({e}); hyperparameters must be a JSON object") from None
        if not isinstance(hps, dict):
            raise ValueError(f"SM_HPS is a JSON {type(hps).__name__}, not an object of hyperparameters")
    else:
        hps = _argv_hyperparameters(argv)
    return {k: v for k, v in hps.items() if not str(k).startswith("sagemaker_")}


def flatten(hps: Mapping[str, Any], prefix: str = "") -> List[Tuple[str, Any]]:
    """``{"trainer": {"max_steps": 1}}`` -> ``[("trainer.max_steps", 1)]``: objects become dotted
    keys (Hydra overrides set leaves). Raises ``ValueError`` on an empty object (it sets nothing)."""
    out: List[Tuple[str, Any]] = []
    for key, value in hps.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            if not value:
                raise ValueError(f"hyperparameter {path} is an empty object; give its keys, e.g. {path}.<key>")
            out += flatten(value, path + ".")
        else:
            out.append((path, value))
    return out


# ------------------------------------------------------------------------------- Hydra grammar
def hydra_override(key: str, value: Any) -> str:
    """``key=<value>`` for a hyperparameter, quoted by Hydra's rules and checked with Hydra's own
    parser to read back as ``value`` (:func:`vitp.cli.overrides.hydra_override`).

    Raises ``ValueError`` naming the hyperparameter when the key is not a config key Hydra can
    parse, or the value cannot be written so that it arrives intact."""
    return _hydra_override(key, value, "hyperparameter")


# ------------------------------------------------------------------------------- overrides
def sagemaker_overrides(env: Mapping[str, str], argv: Sequence[str] = ()) -> List[str]:
    """Hydra overrides for the job described by ``env`` (``os.environ``) and ``argv`` (the
    entry's arguments): the hyperparameters (:func:`job_hyperparameters`, :func:`flatten`,
    :func:`hydra_override`), then the job's paths and data channels for keys they left unset.

    ``SM_HPS='{"experiment": "smoke", "trainer": {"max_steps": 4}, "hydra.run.dir": "out,dir"}'``
    -> ``["experiment=smoke", "trainer.max_steps=4", "hydra.run.dir='out,dir'", ...]``.
    Raises ``ValueError`` on a malformed hyperparameter.
    """
    out = [hydra_override(k, v) for k, v in flatten(job_hyperparameters(env, argv))]
    paths = job_paths(env)
    defaults = {
        "hydra.run.dir": str(Path(paths.checkpoints) / RUN_DIR_NAME),
        "trainer.tensorboard_dir": paths.tensorboard,
        "trainer.export_dir": paths.model,
        "trainer.output_data_dir": paths.output_data,
        "trainer.progress": False,  # a job's log (CloudWatch); true gives a progress line every 30 s there
        "data.root": paths.train,
        "data.heldout_root": paths.validation,
    }
    if not _reads_folders(out):  # digits, synthetic, shards: the channels are the user's to place
        defaults.pop("data.root")
        defaults.pop("data.heldout_root")
    given = {override_key(o) for o in out}
    out += [hydra_override(k, v) for k, v in defaults.items() if v is not None and k not in given]
    return out


def channel_keys(overrides: Sequence[str], env: Mapping[str, str], argv: Sequence[str] = ()) -> List[str]:
    """The keys of ``overrides`` (:func:`sagemaker_overrides`) filled from the data channels
    (``data.root``, ``data.heldout_root``), not from a hyperparameter."""
    given = {k for k, _ in flatten(job_hyperparameters(env, argv))}
    return [k for k in ("data.root", "data.heldout_root")
            if k not in given and any(override_key(o) == k for o in overrides)]


def _reads_folders(overrides: Sequence[str]) -> bool:
    """Whether the job's data (composed from its hyperparameters) is an image or video folder, the
    data the ``train`` / ``validation`` channels fill ``data.root`` / ``data.heldout_root`` of.
    True when the hyperparameters do not compose: :func:`check_overrides` then names the problem."""
    from vitp.config import compose

    try:
        return str(compose([o for o in overrides if not override_key(o).startswith("hydra")]).data.name) in (
            "image_folder", "video_folder")
    except Exception:  # a bad hyperparameter, reported by check_overrides with its fix
        return True


def check_overrides(overrides: Sequence[str]) -> None:
    """Refuse what Hydra would refuse, with one readable line: an unknown key (with the nearest
    key, :func:`vitp.config.check_override_keys`), a wrong type, an unknown group choice.

    Raises ``ValueError``."""
    compose_checked(overrides)  # not vitp.cli.train: a bad job fails before torch loads


# ------------------------------------------------------------------------------- failure reason
def failure_reason(error: BaseException) -> str:
    """The text for SageMaker's failure file: first line the problem and its fix, then where it
    happened, then (for errors that are not bad input) the traceback.

    A :class:`SystemExit` from ``vitp-train`` (bad input: ``run_cli`` exits 2; a non-finite loss:
    3) or from Hydra (``sys.exit(1)``) is raised while handling the real error, which is its
    ``__context__``."""
    from vitp.cli import reported_errors

    if isinstance(error, SystemExit) and error.__context__ is not None:
        error = error.__context__
    where = (f"(rank {os.environ.get('RANK', '0')} of {os.environ.get('WORLD_SIZE', '1')} on "
             f"{os.environ.get('SM_CURRENT_HOST', 'this host')}; the job's log has the details)")
    if isinstance(error, SystemExit):
        return f"vitp-train exited with status {error.code}\n{where}\n"
    if isinstance(error, reported_errors()):
        return f"vitp-train: error: {error_chain(error)}\n{where}\n"
    trace = "".join(traceback.format_exception(type(error), error, error.__traceback__)[-12:])
    return f"{type(error).__name__}: {error_chain(error)}\n{where}\n{trace}"


def write_failure(output_dir: str, text: str) -> bool:
    """Create ``<output_dir>/failure`` holding ``text``, unless it exists: the first rank to fail
    has the reason (later ones mostly see the broken process group), and the toolkit, which
    writes its own summary only when the file is absent, keeps ours. Returns whether it wrote."""
    path = Path(output_dir) / "failure"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)  # atomic: one writer wins
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return True


def main() -> None:
    """Entry point ``vitp-sagemaker`` (what ``scripts/sagemaker_entry.py`` calls): train with the
    job's overrides; on any failure write the reason to the failure file and exit non-zero."""
    output = _output_dir(os.environ)
    try:
        overrides = sagemaker_overrides(os.environ, sys.argv[1:])
        check_overrides(overrides)
    except ValueError as e:
        print(f"vitp-sagemaker: error: {e}", file=sys.stderr)
        write_failure(output, f"vitp-sagemaker: error: {e}\n(fix the job's hyperparameters)\n")
        raise SystemExit(2) from None
    from vitp.cli.train import main as train_main
    from vitp.train.rundir import LAUNCHER_KEYS_ENV

    # the channels' mount points are the job's, not the run's: a restarted job may get others
    os.environ[LAUNCHER_KEYS_ENV] = ",".join(channel_keys(overrides, os.environ, sys.argv[1:]))
    sys.argv = sys.argv[:1] + overrides
    try:
        train_main(signal_exit=False)  # a SIGTERM stop (job stop, spot interruption) saved: exit 0
    except SystemExit as e:
        if e.code not in (0, None):
            write_failure(output, failure_reason(e))
        raise
    except BaseException as e:
        write_failure(output, failure_reason(e))
        raise


if __name__ == "__main__":
    main()
