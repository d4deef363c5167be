"""The documentation against the code: the generated config reference, README's length, every
relative link, and every command shown in a fenced ``bash``/``sh``/``console`` block of README.md
and docs/*.md.

A ``vitp-*`` command line (also behind torchrun, the deepspeed launcher or mpirun) is parsed by
that CLI's own argument parser and its ``key=value`` overrides are composed with the real config
(sweep axes expanded) and validated, with the launcher's process count as the world size. Other
commands are either checked cheaply here (pip extras, pytest markers) or listed in ``RUN_BY``
with the test that runs them (asserted to exist). A command that is neither fails the test:
add it to ``RUN_BY`` with the test that runs it, or drop it from the docs.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import io
import re
import shlex
import tomllib
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(bash|sh|console)\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")

# commands that are not vitp CLIs: (program, first arguments) -> the test that runs them
RUN_BY: Dict[Tuple[str, ...], str] = {
    ("torchrun", "scripts/benchmark_tp_comm.py"): "tests/unit/test_scripts.py::test_benchmark_tp_comm",
    ("python", "scripts/bench.py"): "tests/unit/test_scripts.py::test_bench_quick",
    ("python", "scripts/bench_data.py"): "tests/unit/test_scripts.py::test_bench_data_small",
    ("python", "scripts/make_photo_folder.py"): "tests/distributed/test_own_data.py::test_the_documented_cpu_command_trains",
    ("bash", "scripts/gpu_check.sh"): "tests/unit/test_scripts.py::test_gpu_check_cpu_smoke",
    ("python", "scripts/make_random_eval_weights.py"):
        "tests/unit/test_fid.py::test_split_sums_equal_one_process_and_torchmetrics",
    ("python", "scripts/make_tiny_wan.py"): "tests/unit/test_wan_objective.py::test_finetuning_doc_example_runs",
    ("torchrun", "vitp.train"): "tests/distributed/test_train.py::test_torchrun_with_tensor_and_sequence_parallelism",
    ("deepspeed", "vitp.train"): "tests/distributed/test_checkpoint.py::test_kill_during_save_resumes_from_the_previous_checkpoint",
    ("mpirun", "vitp.train"): "tests/distributed/test_launchers.py::test_openmpi_launch_trains_as_data_parallel",
    ("vitp-sagemaker-job", "--dry-run"): "tests/unit/test_sagemaker_job.py::test_dry_run_prints_the_request_the_sdk_sends",
    ("torchrun", "vitp.cli.sample"):
        "tests/distributed/test_sample_cli.py::test_sample_under_torchrun_writes_the_one_process_grid",
    ("torchrun", "vitp.cli.eval"):
        "tests/distributed/test_sample_cli.py::test_eval_under_torchrun_gives_the_one_process_heldout_loss",
}
VITP_CLIS = {"vitp-train": "train", "vitp-sample": "sample", "vitp-eval": "eval", "vitp-export": "export",
             "vitp-plan": "plan", "vitp-sweep": "sweep", "vitp-sagemaker-job": "sagemaker_job",
             "vitp-encode-captions": "encode_captions", "vitp-pack": "pack"}


def _blocks() -> List[Tuple[Path, str]]:
    return [(doc, m.group(2)) for doc in DOCS for m in FENCE.finditer(doc.read_text())]


def commands() -> List[Tuple[str, List[str]]]:
    """``(where, argv)`` of every command in the fenced shell blocks: continuation lines joined,
    comments dropped, ``&&`` chains split, leading ``VAR=value`` assignments and ``.venv/bin/`` removed."""
    out = []
    for doc, body in _blocks():
        for line in body.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                argv, words = words[:cut], words[cut + 1:]
                while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", argv[0]):
                    argv = argv[1:]
                if argv:
                    argv[0] = argv[0].removeprefix(".venv/bin/")
                    out.append((f"{doc.relative_to(REPO)}: {line.strip()}", argv))
    return out


class _Parsed(BaseException):
    """Raised by the patched argparse once a CLI's command line parsed (stops before any work)."""

    def __init__(self, ns):
        self.ns = ns


@contextlib.contextmanager
def _stop_after_parsing():
    originals = {n: getattr(argparse.ArgumentParser, n) for n in ("parse_args", "parse_intermixed_args")}

    def patched(name):
        def parse(self, *args, **kwargs):
            raise _Parsed(originals[name](self, *args, **kwargs))
        return parse

    try:
        for n in originals:
            setattr(argparse.ArgumentParser, n, patched(n))
        yield
    finally:
        for n, f in originals.items():
            setattr(argparse.ArgumentParser, n, f)


def parse_cli(prog: str, args: List[str]) -> argparse.Namespace:
    """The namespace ``prog``'s own parser makes of ``args`` (nothing else of the CLI runs); an
    argparse error fails the test with the CLI's message."""
    module = importlib.import_module(f"vitp.cli.{VITP_CLIS[prog]}")
    err = io.StringIO()
    try:
        with _stop_after_parsing(), contextlib.redirect_stderr(err):
            module.main(args)
    except _Parsed as p:
        return p.ns
    except SystemExit as e:
        pytest.fail(f"{prog} {shlex.join(args)}: exit {e.code}: {err.getvalue().strip()}")
    pytest.fail(f"{prog} returned without parsing its command line with argparse")


def sweep_combos(overrides: List[str]) -> List[List[str]]:
    """Every combination of Hydra sweep overrides (``key=a,b``: an axis), parsed by Hydra's own
    override grammar; other overrides are kept verbatim in each combination."""
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser

    axes = []
    for arg in overrides:
        (o,) = OverridesParser.create().parse_overrides([arg])
        key = arg[: len(arg) - len(arg.lstrip("+~"))] + o.key_or_group
        axes.append([f"{key}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override() else [arg])
    return [list(c) for c in itertools.product(*axes)]


def check_overrides(overrides: List[str], world: Optional[int] = None, sweep: bool = False) -> None:
    """Compose and validate ``overrides`` (with ``sweep``: every combination of its axes) as
    ``vitp-train`` would; with ``world`` also the layout (skipped under ``parallel=auto``).
    ``vitp-train``'s ``--resume RUN_DIR`` is taken out (the documented folder does not exist here;
    its overrides are checked against the default config)."""
    from vitp.cli.train import split_resume
    from vitp.config import check_override_keys, compose, validate_config

    _, overrides = split_resume(list(overrides))
    overrides = [_tiny_wan_folder(o) for o in overrides]
    for combo in sweep_combos(overrides) if sweep else [overrides]:
        check_override_keys(combo)
        cfg = compose(combo)
        validate_config(cfg, None if cfg.parallel.auto else world)


TINY_WAN = "/tmp/wan_tiny"  # docs/finetuning.md: the folder `python scripts/make_tiny_wan.py /tmp/wan_tiny` writes
TINY_WANS = {TINY_WAN: {}, "/tmp/wan_a14b": {"two_experts": True, "vae": False}}  # and --two-experts
_TINY_WAN: Dict[str, str] = {}


def _tiny_wan_folder(override: str) -> str:
    """``trainer.init_from=/tmp/wan_tiny[/...]`` (``/tmp/wan_a14b``) pointed at a tiny Wan pipeline
    folder written once here as the documented ``scripts/make_tiny_wan.py /tmp/wan_tiny --sharded``
    (``--two-experts``) writes it (a Wan run's config check
    reads the folder's config.json); other overrides unchanged."""
    import atexit
    import shutil
    import tempfile

    key, _, value = override.partition("=")
    doc = next((d for d in TINY_WANS if value == d or value.startswith(d + "/")), None)
    if key != "trainer.init_from" or doc is None:
        return override
    if doc not in _TINY_WAN:
        from tests.helpers import make_tiny_wan

        parent = tempfile.mkdtemp(prefix="docs_wan_")
        atexit.register(shutil.rmtree, parent, ignore_errors=True)  # a folder per pytest worker, not left in /tmp
        folder = Path(parent) / Path(doc).name
        _TINY_WAN[doc] = str(make_tiny_wan().write_pipeline(folder, sharded=True, **TINY_WANS[doc]))
    return f"{key}={_TINY_WAN[doc]}{value[len(doc):]}"


def _launched(argv: List[str]) -> Tuple[Optional[int], List[str], str]:
    """``(world size or None, argv after the module/script, module or script)`` of a launcher line."""
    prog, rest = argv[0], argv[1:]
    if prog == "torchrun":
        from torch.distributed.run import get_args_parser

        a = get_args_parser().parse_args(rest)
        return int(a.nproc_per_node) * int(str(a.nnodes).split(":")[-1]), a.training_script_args, a.training_script
    if prog == "deepspeed":
        from deepspeed.launcher.runner import parse_args

        a = parse_args(rest)
        return (a.num_gpus if a.num_gpus > 0 else None), a.user_args, a.user_script
    i = rest.index("-m")  # mpirun / srun ... python -m vitp.train
    world = int(rest[rest.index("-np") + 1]) if "-np" in rest else None
    return world, rest[i + 2:], rest[i + 1]


def _covered(key: Tuple[str, ...]) -> None:
    test = RUN_BY.get(key)
    assert test, f"no test runs {' '.join(key)}: add it to RUN_BY in {Path(__file__).name} or drop it from the docs"
    path, _, func = test.partition("::")
    tree = ast.parse((REPO / path).read_text())
    assert not func or func in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, \
        f"RUN_BY names {test}, which does not exist"


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def check_command(argv: List[str]) -> None:
    """One documented command, checked as the module docstring says."""
    prog = argv[0]
    if prog in ("torchrun", "deepspeed", "mpirun", "srun"):
        world, args, target = _launched(argv)
        if target in ("vitp.train",):
            check_overrides(args, world)
        elif target.startswith("vitp.cli."):  # vitp-sample / vitp-eval under a launcher (the run's layout)
            cli = {v: k for k, v in VITP_CLIS.items()}[target.removeprefix("vitp.cli.")]
            _check_vitp_cli(cli, args)
        else:
            assert (REPO / target).is_file(), f"{target} does not exist"
        _covered((prog, target))
    elif prog in ("python", "python3") and argv[1:3] == ["-m", "vitp.train"]:
        check_overrides(argv[3:], 1)
    elif prog in ("python", "python3", "bash") and argv[1:2] == ["-m"] and argv[2] == "venv":
        pass  # the standard library's venv
    elif prog in ("python", "python3", "bash"):
        script = argv[1]
        text = (REPO / script).read_text()
        for flag in (a.split("=")[0] for a in argv[2:] if a.startswith("--")):
            assert flag in text, f"{script} has no option {flag}"
        _covered(("python" if prog != "bash" else "bash", script))
    elif prog == "pip":
        extras = _pyproject()["project"]["optional-dependencies"]
        for spec in (a for a in argv[2:] if a != "-e"):
            for extra in re.findall(r"\[([^\]]+)\]", spec):
                assert all(e in extras for e in extra.split(",")), f"pip {spec}: no such extra in pyproject.toml"
    elif prog == "pytest":
        markers = " ".join(_pyproject()["tool"]["pytest"]["ini_options"].get("markers", []))
        for expr in (argv[i + 1] for i, a in enumerate(argv) if a == "-m"):
            assert all(m in markers for m in re.findall(r"\w+", expr.replace("not ", ""))), f"unknown marker in {expr}"
    elif prog == "tensorboard":
        assert any(d.startswith("tensorboard") for d in _pyproject()["project"]["dependencies"])
    elif prog == "hf":  # Hugging Face's CLI, run once outside vitp on a machine with network access
        assert argv[1] == "download" and "--local-dir" in argv, "hf: document 'hf download REPO --local-dir DIR'"
    elif prog == "source":
        assert argv[1] == ".venv/bin/activate"
    elif prog == "vitp-train":
        check_overrides(argv[1:], 1)
    elif prog in VITP_CLIS:
        _check_vitp_cli(prog, argv[1:])
    else:
        pytest.fail(f"no check for {shlex.join(argv)}: add one to check_command or RUN_BY")


def _check_vitp_cli(prog: str, args: List[str]) -> None:
    from vitp.cli.overrides import flag_overrides

    ns = parse_cli(prog, args)
    overrides = list(getattr(ns, "overrides", None) or [])
    flags = getattr(importlib.import_module(f"vitp.cli.{VITP_CLIS[prog]}"), "FLAGS", {})
    _, overrides = flag_overrides(overrides, prog, flags)  # cli.num=8: a flag, checked by the CLI's rules
    if prog == "vitp-sagemaker-job":
        from vitp.cli.sagemaker_job import spec_from_args

        spec_from_args(ns)
        if ns.dry_run:
            _covered((prog, "--dry-run"))
    if overrides:
        check_overrides(overrides, sweep=prog == "vitp-sweep")


def test_config_reference_is_generated_from_the_schema():
    spec = importlib.util.spec_from_file_location("config_reference", REPO / "scripts" / "config_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert (REPO / "docs" / "config.md").read_text() == mod.render(), \
        "docs/config.md is stale: run python scripts/config_reference.py"
    rows = mod.schema_fields((REPO / "vitp" / "config.py").read_text())
    obj = {r["name"]: r for r in rows["ObjectiveConfig"]}
    assert obj["t_uniform"]["default"] == "0.0" and mod.set_by()["objective.t_uniform"][0] == \
        "experiment=video_demo: 0.2"
    assert {r["name"]: r for r in rows["DataConfig"]}["buckets"]["default"] == "[]"
    with pytest.raises(ValueError, match="field ObjectiveConfig.P_mean has no one-line # comment"):
        mod.schema_fields((REPO / "vitp" / "config.py").read_text().replace(
            "P_mean: float = -0.8  # mean of the logit-normal t distribution", "P_mean: float = -0.8"))


def test_readme_is_the_front_door():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    status = text.index("## Status")
    assert status < text.index("## Quick start") and "Not run on a GPU yet" in text[status:text.index("## Quick start")]


def _anchors(doc: Path) -> set:
    """GitHub's heading anchors of a Markdown file."""
    heads = re.findall(r"^#+ (.+)$", FENCE.sub("", doc.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(REPO)))
def test_relative_links_point_to_existing_files(doc):
    for target in LINK.findall(FENCE.sub("", doc.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        assert dest.exists(), f"{doc.relative_to(REPO)}: link {target} names no file"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{doc.relative_to(REPO)}: link {target}: no such heading"


def test_every_documented_command_is_checked():
    cmds = commands()
    assert len(cmds) >= 20 and any(a[0] == "vitp-train" for _, a in cmds)
    assert len({shlex.join(a) for _, a in cmds}) <= 100, "keep the number of distinct commands in the docs modest"
    for where, argv in cmds:
        try:
            check_command(argv)
        except Exception as e:  # pytest.fail's own exception passes through with its message
            raise AssertionError(f"{where}\n  {type(e).__name__}: {e}") from None


@pytest.mark.parametrize("argv,message", [
    (["vitp-train", "trainer.max_step=10"], "did you mean trainer.max_steps"),
    (["vitp-train", "model.mlp=relu"], "relu"),
    (["torchrun", "--nproc_per_node", "4", "-m", "vitp.train", "parallel.tp=3"], "does not divide world_size=4"),
    (["vitp-sample", "RUN", "--nmu", "8"], "unrecognized arguments"),
    (["vitp-sweep", "train", "model.depth=2,x"], "depth"),
    (["pip", "install", "-e", ".[tset]"], "no such extra"),
    (["cp", "a", "b"], "no check for"),
])
def test_the_check_catches_a_wrong_command(argv, message):
    with pytest.raises((Exception, pytest.fail.Exception)) as e:
        check_command(argv)
    assert message in str(e.value) + str(getattr(e.value, "__cause__", "")), str(e.value)


def test_readme_sections_named_in_code_and_packaging_exist():
    """``README "Quick start"``-style pointers (pyproject.toml, vitp/, scripts/) name README headings
    that exist (pyproject.toml once pointed at an "Install" section the README does not have)."""
    headings = {m.group(1).strip() for m in re.finditer(r"^#+\s+(.*)$", (REPO / "README.md").read_text(), re.M)}
    files = [REPO / "pyproject.toml", *sorted((REPO / "vitp").rglob("*.py")), *sorted((REPO / "scripts").rglob("*.py"))]
    pointers = [(f.name, m.group(1)) for f in files for m in re.finditer(r'README\s+"([^"]+)"', f.read_text())]
    assert pointers, "no README pointer found: the pattern no longer matches how code cites the README"
    missing = [(name, section) for name, section in pointers
               if not any(h == section or h.startswith(section + " ") for h in headings)]
    assert not missing, f"README has no such heading: {missing}; headings: {sorted(headings)}"
