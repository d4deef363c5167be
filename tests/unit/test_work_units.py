"""The suite's own scheduling (tests/conftest.py): xdist sends each work unit to one worker."""
from types import SimpleNamespace

from xdist.remote import Producer

from tests.conftest import pytest_xdist_make_scheduler, unit_of


class _Controller:
    """What xdist's scheduler reads of the controller's config: two workers."""

    option = SimpleNamespace(loadscopereorder=False)

    def getvalue(self, name):
        return {"tx": ["2*popen"]}[name]


def test_the_scheduler_groups_tests_by_work_unit(pytestconfig):
    """The scheduler the controller gets from ``pytest_xdist_make_scheduler`` splits nodeids into
    work units: a file's tests are one scope (whatever their parameters), files sharing session
    fixtures are one, so a module or session fixture is built on one worker only. (With ``--dist
    loadgroup`` on pytest 9.2 every test was its own scope: the context-parallel file built its
    8-layout fixture on both workers, 90 CPU-s each.)"""
    impls = pytestconfig.pluginmanager.hook.pytest_xdist_make_scheduler.get_hookimpls()
    assert any(i.function is pytest_xdist_make_scheduler and i.tryfirst for i in impls)  # before xdist's own
    sched = pytest_xdist_make_scheduler(_Controller(), Producer("test", enabled=False))
    scope = sched._split_scope
    assert scope("tests/distributed/test_context_parallel.py::test_context_parallel_matches_single_process[cp2-img-"
                 "ulysses]") == scope("tests/distributed/test_context_parallel.py::test_video_long_recipe_runs_at_cpu_"
                                      "size") == "tests/distributed/test_context_parallel.py"
    assert {scope(f"tests/distributed/{f}::test_x") for f in ("test_pipeline.py", "test_checkpoint.py",
                                                              "test_reference.py")} == {"reference_runs"}
    assert scope("tests/distributed/parallel/test_tp_modules.py::test_y[a-b]") == "parallel_groups"
    assert scope("tests/unit/test_config.py::test_z") == unit_of("tests/unit/test_config.py") == "tests/unit/test_config.py"
