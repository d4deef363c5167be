"""One override syntax for every vitp command: Hydra's ``key=value`` grammar, checked against the
closed schema of :mod:`vitp.config`.

``vitp-train`` and ``vitp-plan`` compose a new run config from ``conf/`` with the overrides
(:func:`compose_checked`); ``vitp-eval``, ``vitp-sample`` and ``vitp-sweep eval`` apply them to a
finished run's config (:func:`apply_overrides`). Both parse with Hydra's own parser
(``OverridesParser``) and set values as Hydra does (``OmegaConf.update(..., merge=True)`` on the
typed schema), so a value means the same on every command, and bad input is one line:

- an unknown key: ``unknown config key trainer.max_step (did you mean trainer.max_steps?); ...``
- a bad value: ``Error merging override sampler.method=foo; Invalid value 'foo', expected one of [heun, euler]``
- a malformed override: ``cannot parse 'sampler.steps=[1,': ...``

Values written for Hydra from Python (:func:`hydra_value`, :func:`hydra_override`) follow its
quoting rules ("Quoted values" in https://hydra.cc/docs/advanced/override_grammar/basic/), and are
checked to read back as the value they came from.

Nothing here imports torch: a bad command line fails fast.
"""
from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple

if TYPE_CHECKING:
    from hydra.core.override_parser.types import Override
    from omegaconf import DictConfig


# ------------------------------------------------------------------------------- parsing
def is_override(arg: str) -> bool:
    """Whether a command-line word is written as an override (``key=value``, ``+key=value``,
    ``~key``), not a flag or a path: a dotted name before the first ``=``."""
    return bool(re.match(r"^(\+\+|\+|~)?[A-Za-z_][\w.@/\-]*(=|$)", arg)) and ("=" in arg or arg.startswith("~"))


def parse_overrides(args: Sequence[str], config_loader: Any = None) -> List["Override"]:
    """Hydra's parse of ``args`` (``OverridesParser.create().parse_overrides``), one at a time so
    an error names its override. ``config_loader`` lets ``glob(...)`` sweeps list group options.

    Raises ``ValueError`` (one line) for a word that is not an override or one Hydra cannot parse.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create(config_loader=config_loader)
    out = []
    for arg in args:
        if not is_override(arg):
            raise ValueError(f"{arg!r} is not an override; write key=value (e.g. sampler.steps=50)")
        try:
            out += parser.parse_overrides([arg])
        except HydraException as e:
            raise ValueError(f"cannot parse {arg!r}: {str(e).splitlines()[0].split(' See https://')[0]}; quote a value "
                             f"holding = [ ] {{ }} ( ) , or spaces: key='...' (Hydra's override grammar)") from None
    return out


def override_key(override: str) -> str:
    """The config key of an override string, without its ``+``/``++``/``~`` prefix."""
    return override.split("=", 1)[0].lstrip("+~")


def error_chain(error: BaseException) -> str:
    """An error and its causes (Hydra wraps the informative OmegaConf error), in one line."""
    parts: List[str] = []
    while error is not None and len(parts) < 4:
        # Hydra's config search path and OmegaConf's node details repeat what the message says
        text = re.split(r" (?:Config search path|full_key:)", " ".join(str(error).split()))[0]
        if text and text not in parts:
            parts.append(text)
        error = error.__cause__
    return "; ".join(parts)


# ------------------------------------------------------------------------------- a new run config
def with_fix(message: str) -> str:
    """An override's composition error with its fix where OmegaConf gives none: a boolean key given
    another word (``Value 'maybe' is not a valid bool``) gets ``; use KEY=true or KEY=false``, a
    ``data.buckets`` entry that is not a mapping (``[[8,8]]``) the form a bucket is written in, an
    unknown group option (``experiment=smok``) the nearest one (``did you mean experiment=smoke?``)."""
    missing = re.search(r"Could not find '([\w/]+)/([^'/]+)' Available options in '[\w/]+': ([^;]*)", message)
    if missing:  # a misspelt group option gets what a misspelt key gets (vitp.config.unknown_key_message)
        from vitp.config import nearest_name

        near = nearest_name(missing.group(2), missing.group(3).split())
        if near:
            return f"{message} (did you mean {missing.group(1)}={near}?)"
    bad_bool = re.search(r"override ([\w.]+)=.*is not a valid bool", message)
    if bad_bool:
        key = bad_bool.group(1)
        return f"{message}; use {key}=true or {key}=false"
    bucket = re.search(r"^(Error merging override \S+); Invalid type assigned: \w+ is not a subclass of "
                       r"BucketConfig\. value: (.*)$", message)
    if bucket:  # OmegaConf names the dataclass, not how a bucket is written
        from vitp.config import BucketConfig

        return (f"{bucket.group(1)}: a bucket is a mapping with resolution and batch_size (frames, weight "
                f"optional), not {bucket.group(2)}; e.g. {BucketConfig.EXAMPLE}")
    return message


def compose_checked(overrides: Sequence[str]) -> "DictConfig":
    """The run config ``vitp-train <overrides>`` would compose (:func:`vitp.config.compose`; ``hydra.*``
    overrides are skipped, they set Hydra, not the run), checked by :func:`vitp.config.validate_config`
    (each field's range and the cross-field rules; the layout needs the world size, checked later).

    Raises ``ValueError`` in one line for an unknown key (with the nearest key), a value the schema
    refuses (a wrong type, a value out of its field's range: ``trainer.micro_batch_size=0: must be an
    integer >= 1; ...``), a cross-field rule broken, or an unknown group choice (with the available ones)."""
    from vitp.config import check_override_keys, compose, validate_config

    check_override_keys(list(overrides))
    try:
        cfg = compose([o for o in overrides if override_key(o).split(".")[0].split("/")[0] != "hydra"])
    except Exception as e:  # noqa: BLE001 - Hydra / OmegaConf composition errors of many types
        raise ValueError(with_fix(error_chain(e))) from None
    validate_config(cfg)
    from vitp.models.lora import adopt_lora_file

    adopt_lora_file(cfg)  # trainer.lora's nulls: the defaults, or trainer.lora.init_from's (vitp-plan sizes it)
    return cfg


def check_run_dir(overrides: Sequence[str], resume: bool = False) -> str:
    """The run directory ``vitp-train <overrides>`` will write (``hydra.run.dir`` resolved as Hydra
    resolves it; ``${now:...}`` at this second), after checking that it can be made: its nearest
    existing folder must be a folder this process may write (not a file, not on a read-only file
    system). Checked before Hydra creates the folder and its log file.

    Raises ``ValueError`` in one line naming the folder and the keys that move the run (``resume``:
    ``vitp-train --resume``, whose folder exists: the copy to continue instead)."""
    from pathlib import Path

    from vitp.config import compose

    try:
        run_dir = Path(compose(list(overrides), with_hydra=True).hydra.run.dir)
    except Exception as e:  # noqa: BLE001 - Hydra / OmegaConf errors of many types
        raise ValueError(error_chain(e)) from None
    fix = "choose another with hydra.run.dir=DIR, or paths.output_root=DIR for the default <date>/<time> folders"
    existing = next(p for p in (run_dir.absolute(), *run_dir.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"run directory {run_dir} cannot be made: {existing} is a file, not a folder; {fix}")
    from vitp.utils import unwritable

    why = unwritable(existing)
    if why:
        if existing == run_dir.absolute():  # it exists (a resumed run): it is there, only not writable
            fix = ("copy the run to a writable place and continue the copy with vitp-train --resume COPY" if resume
                   else fix)
            reason = "on a read-only file system" if "read-only" in why else "this user may not write it"
            raise ValueError(f"run directory {run_dir} is not writable ({reason}); {fix}")
        raise ValueError(f"run directory {run_dir} cannot be made: {existing} is {why}; {fix}")
    return str(run_dir)


# ------------------------------------------------------------------------------- a finished run's config
def typed_config(saved: Any, source: Any = None) -> "DictConfig":
    """``saved`` (a run's ``.hydra/config.yaml`` or a weights file's ``vitp_config``) on the typed
    schema, so values set later are checked as ``vitp-train`` checks them.

    Raises ``ValueError`` naming a key the schema lacks (:func:`vitp.config.check_keys`) or a value
    of the wrong type; with ``source`` (the file ``saved`` was read from) the message names that
    file, which the user never typed."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from vitp.config import Config, check_keys

    try:
        check_keys(saved)
        return OmegaConf.merge(OmegaConf.structured(Config), saved)
    except (ValueError, OmegaConfBaseException) as e:
        if source is None:
            raise
        key = getattr(e, "full_key", None)
        msg = str(e).strip().splitlines()[0]
        raise ValueError(f"{source}: {f'{key}: ' if key else ''}{msg}: the run's recorded config was damaged, edited "
                         "or written by another vitp version; restore that key in the file (as the run was launched)") \
            from None


# group choices that set keys a resumed run can set itself: conf/<group>/<option>.yaml holds only these
GROUP_CHOICE_KEYS = {("parallel", "auto"): "parallel.auto=true"}


def refusal(o: "Override", prog: str, allowed: Optional[Tuple[str, ...]] = None, hint: str = "") -> Optional[str]:
    """Why ``prog`` cannot set the parsed override ``o`` on a finished run's config, or ``None``:
    a sweep, an add or delete, a group choice or ``hydra.*`` key (for ``vitp-train --resume``, a
    choice in :data:`GROUP_CHOICE_KEYS` names its key, e.g. ``parallel=auto`` ->
    ``parallel.auto=true``), an unknown key (the schema's message with the nearest key), or a key
    outside the prefixes ``allowed`` (``hint`` appended)."""
    from vitp.config import CONFIG_GROUPS, unknown_key_message

    key, line = o.key_or_group, o.input_line
    if o.is_sweep_override():
        return f"{line}: {prog} takes one value per key; compare several with vitp-sweep"
    if o.is_add() or o.is_force_add() or o.is_delete():
        return f"{line}: {prog} sets keys of the run's config; it does not add or delete them (drop the prefix)"
    if key in CONFIG_GROUPS or "@" in key or key.split(".")[0] == "hydra":
        same = GROUP_CHOICE_KEYS.get((key, str(o.value())))
        if same and prog.startswith("vitp-train"):
            return (f"{line}: {prog} sets keys of the run's config, not config files; write {same} instead (what "
                    f"{line} sets when vitp-train composes a run)")
        example = "trainer.max_steps=2000" if prog.startswith("vitp-train") else "sampler.steps=50"
        return (f"{key}= picks a config file when vitp-train composes a run; {prog} sets keys of the run's "
                f"config, e.g. {example}")
    msg = unknown_key_message(key)
    if msg:
        return msg
    if allowed is not None and not key.startswith(allowed):
        keys = ", ".join(k + ("*" if k.endswith(".") else "") for k in allowed)
        return f"{key}: {prog} can change {keys}; the other keys are fixed by the trained weights{hint}"
    return None


def apply_overrides(cfg: "DictConfig", args: Sequence[str], prog: str,
                    allowed: Optional[Tuple[str, ...]] = None) -> "DictConfig":
    """A copy of the typed run config ``cfg`` (:func:`typed_config`) with the ``key=value``
    overrides ``args`` set as Hydra sets them. ``allowed``: key prefixes ``prog`` may change
    (``None``: every schema key).

    Raises ``ValueError`` (one line, naming ``prog``) for a malformed override, a sweep, an
    add/delete, a group choice, an unknown key, a key outside ``allowed``, or a bad value."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    cfg = cfg.copy()
    for o in parse_overrides(args):
        msg = refusal(o, prog, allowed)
        if msg:
            raise ValueError(msg)
        try:
            OmegaConf.update(cfg, o.key_or_group, o.value(), merge=True)
        except OmegaConfBaseException as e:
            raise ValueError(with_fix(f"Error merging override {o.input_line}; {error_chain(e)}")) from None
    return cfg


# ------------------------------------------------------------------------------- writing values for Hydra
def same_value(a: Any, b: Any) -> bool:
    """Deep equality that tells ``True`` from ``1`` and takes NaN as equal to NaN."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return a == b


def quote(text: str) -> str:
    """Hydra's single-quoted string: ``'`` is escaped as ``\\'`` and so is a run of backslashes
    before a quote or the end (doubled); other backslashes stay literal (Hydra 1.3, "Quoted
    values" in https://hydra.cc/docs/advanced/override_grammar/basic/)."""
    return "'" + re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), text) + "'"


def _hydra_string(text: str) -> str:
    """``text`` bare when Hydra's parser reads it back as exactly that string (so group choices
    like ``experiment=smoke`` stay as they are), else quoted (commas, which would make a sweep,
    ``=`` and other grammar characters, ``true``/``1e3``/``null`` that would change type, outer
    spaces, non-ASCII, ...)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        override = OverridesParser.create().parse_overrides([f"k={text}"])[0]
        if not override.is_sweep_override() and same_value(override.value(), text):
            return text
    except Exception:  # noqa: BLE001 - any parse error means: quote it
        pass
    return quote(text)


def hydra_value(value: Any) -> str:
    """A JSON value (``json.loads`` output) written in Hydra's override grammar.

    Raises ``ValueError`` for other types, or an object key inside a list that is not a plain name."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # Hydra reads Python's repr back exactly, also inf, -inf and nan
    if isinstance(value, str):
        return _hydra_string(value)
    if isinstance(value, list):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):  # inside a list (top-level objects are flattened)
        return "{" + ",".join(f"{_hydra_key(str(k))}:{hydra_value(v)}" for k, v in value.items()) + "}"
    raise ValueError(f"unsupported value {value!r} of type {type(value).__name__}")


def _hydra_key(key: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][\w\-]*", key):
        raise ValueError(f"object key {key!r} inside a list is not a plain name; use letters, digits, _ and -")
    return key


def hydra_override(key: str, value: Any, what: str = "value") -> str:
    """``key=<value>`` checked with Hydra's own parser to read back as ``value``; ``what`` names
    the value in errors (``"hyperparameter"``).

    Raises ``ValueError`` naming ``key`` when it is not a key Hydra can parse, or the value cannot
    be written so that it arrives intact."""
    text = f"{key}={hydra_value(value)}"
    try:
        (override,) = parse_overrides([text])
    except ValueError as e:
        raise ValueError(f"{what} {key!r} is not a config key Hydra can parse ({e}); "
                         f"use dotted names like trainer.max_steps") from None
    if override.is_sweep_override() or not same_value(override.value(), value):
        raise ValueError(f"{what} {key}={value!r} cannot be passed to Hydra intact (read back as "
                         f"{override.value()!r})")
    return text


# ------------------------------------------------------------------------------- flags written as overrides
FLAG_PREFIX = "cli."  # cli.num=8 is --num 8: no config section is named cli, so it never clashes


def is_flag_override(arg: str) -> bool:
    """Whether a command-line word is a flag written as an override, ``cli.<flag>=value``."""
    return arg.startswith(FLAG_PREFIX) and "=" in arg


def _flag_value(kind: Any, value: Any) -> Any:
    """``value`` as a flag of ``kind`` (``int``, ``bool``, ``str``, ``[int]``, ``[str]`` or a tuple
    of choices), or raise ``TypeError``."""
    if isinstance(kind, list):  # one value or a list of them
        items = value if isinstance(value, list) else [value]
        return [_flag_value(kind[0], v) for v in items]
    if isinstance(kind, tuple):
        if value not in kind:
            raise TypeError(f"one of {', '.join(kind)}")
        return value
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise TypeError("an integer")
    if kind is bool and not isinstance(value, bool):
        raise TypeError("true or false")
    if kind is str:
        if isinstance(value, (list, dict)) or value is None:
            raise TypeError("a string (quote it if it holds , = or spaces)")
        return str(value)
    return value


def flag_overrides(args: Sequence[str], prog: str, flags: dict) -> Tuple[dict, List[str]]:
    """``({flag: value}, other words)``: the words of ``args`` that write a flag of ``prog`` as an
    override, ``cli.<flag>=<value>`` (``cli.num=8`` for ``--num 8``, ``cli.classes=[3,7]``,
    ``cli.force=true``, ``cli.prompt_file=p.txt``; dashes or underscores), read with Hydra's grammar,
    taken out. Launchers parse their own flags by prefix (torchrun refuses ``--num``: "ambiguous
    option ... --numa-binding"), but pass a ``key=value`` word on untouched.

    ``flags``: ``{name: kind}`` (kinds as :func:`_flag_value`). Raises ``ValueError`` (one line)
    for an unknown flag, a value of the wrong kind or a flag given twice."""
    values: dict = {}
    rest: List[str] = []
    for arg in args:
        if not is_flag_override(arg):
            rest.append(arg)
            continue
        (o,) = parse_overrides([arg])
        name = o.key_or_group[len(FLAG_PREFIX):].replace("-", "_")
        if name not in flags:
            known = ", ".join(f"{FLAG_PREFIX}{f}" for f in flags)
            raise ValueError(f"{arg}: {prog} has no flag --{name.replace('_', '-')}; flags as overrides: {known}")
        if name in values or o.is_sweep_override():
            raise ValueError(f"{arg}: {prog} takes one value per flag")
        try:
            values[name] = _flag_value(flags[name], o.value())
        except TypeError as e:
            raise ValueError(f"{arg}: {FLAG_PREFIX}{name} takes {e}") from None
    return values, rest
