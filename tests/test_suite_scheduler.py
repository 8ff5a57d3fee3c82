"""The test suite's own scheduler (tests/conftest.py): units of work, longest first by
the estimates table, and the table it writes."""

from __future__ import annotations

from pathlib import Path

from suite_scheduling import (
    NEW_TEST_S,
    estimate,
    load_estimates,
    longest_first,
    work_unit,
    write_estimates,
)


def test_units_engines_module_fixtures_and_single_tests() -> None:
    assert work_unit("tests/backends/test_contract.py::T::test_x[vllm]") == "@vllm_engine"
    assert work_unit("tests/backends/test_contract.py::T::test_x[vllm_fleet]") == "@vllm_servers"
    # A module-scoped fixture (a Ray head) keeps its file on one worker.
    assert work_unit("tests/engines/test_ray_launcher.py::test_x") == (
        "tests/engines/test_ray_launcher.py"
    )
    assert work_unit("tests/test_errors.py::test_x") is None
    assert work_unit("tests/no_such_file.py::test_x") is None


def test_longest_unit_first_and_ties_keep_the_collection_order() -> None:
    units = {
        "a.py::t1": {"a.py::t1": False},
        "@group": {"g.py::t1": False, "g.py::t2": False},
        "b.py::t1": {"b.py::t1": False},
        "c.py::t1": {"c.py::t1": False},
        "new.py::t": {"new.py::t": False},
    }
    tests = {"g.py::t1": 30.0, "g.py::t2": 30.0, "b.py::t1": 100.0}
    files = {"a.py": 0.5, "c.py": 0.5, "g.py": 30.0, "b.py": 100.0}
    order = [name for name, _ in longest_first(units, tests, files)]
    assert order == ["b.py::t1", "@group", "new.py::t", "a.py::t1", "c.py::t1"]
    assert estimate("new.py::t", tests, files) == NEW_TEST_S


def test_the_table_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "durations.json"
    write_estimates(path, {"a.py::slow": 12.34, "a.py::fast": 0.1, "b.py::t": 0.3})
    tests, files = load_estimates(path)
    assert tests == {"a.py::slow": 12.3}
    assert files == {"a.py": 6.22, "b.py": 0.3}
    assert load_estimates(tmp_path / "missing.json") == ({}, {})
