"""The suite's pytest-xdist scheduling (`make test`: -n N --dist loadgroup), used by
tests/conftest.py: which tests must share a worker, and the longest work first.

A module of its own (not conftest.py) so that its test can import it: pytest imports
every conftest.py of the tree under the one name ``conftest``.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

# pytest-xdist (`make test`: -n N --dist loadgroup) runs the tests of one session vLLM
# engine of tests/backends on one worker, so each engine (1.5-4.5 GB) starts once per run,
# not once per worker. Those tests are known by their node id: the controller schedules
# before any worker has collected (and xdist 3.8's own xdist_group marks do not reach the
# node ids under pytest 9). tests/conftest.py checks at collection that every
# test using an engine fixture is covered here.
ENGINE_TESTS = {
    "tests/backends/test_contract.py::test_vllm_engine_failure_names_the_cause": "vllm_engine",
    "tests/backends/test_fleet.py::test_sigkill_one_vllm_engine_then_restart_and_refit": (
        "vllm_servers"
    ),
    "tests/backends/test_fleet_weights.py::"
    "test_vllm_engines_reused_from_an_earlier_run_are_refit_and_probed": "vllm_servers",
    "tests/backends/test_fleet_multiturn.py::"
    "test_an_engine_killed_mid_turn_resends_only_that_turn_on_the_other_engine": "vllm_servers",
}


def engine_group(nodeid: str) -> str | None:
    """The session engine a test of tests/backends uses (by its parameters), or None."""
    if not nodeid.startswith("tests/backends/"):
        return None
    base, _, params = nodeid.partition("[")
    parts = params.rstrip("]").split("-")
    if "vllm_server" in parts or "vllm_fleet" in parts:
        return "vllm_servers"
    if "vllm" in parts:
        return "vllm_engine"
    return ENGINE_TESTS.get(base)


ENGINE_PARAMS = {
    "vllm": "vllm_engine",
    "vllm_server": "vllm_servers",
    "vllm_fleet": "vllm_servers",
}
ENGINE_FIXTURES = {
    "vllm_session_backend": "vllm_engine",
    "vllm_server_engines": "vllm_servers",
    "vllm_server_session_backend": "vllm_servers",
    "vllm_fleet_session_backend": "vllm_servers",
}


# Longest first (`make test`): each worker takes the longest unit of work left, so the run
# does not end on one worker still in a long test while the others are idle. The
# estimates (seconds; setup + call + teardown) are a measured run's, kept in
# tests/durations.json: per test where it took a second or more, else the per-test mean of
# its file. A test of a file not in the table counts NEW_TEST_S (new tests are often the
# slow ones); the order is the only thing the table changes, never which tests run.
# Regenerate after adding slow tests: `make test-durations` (the suite, writing the table).
DURATIONS_TABLE = Path(__file__).with_name("durations.json")
NEW_TEST_S = 5.0


def load_estimates(path: Path = DURATIONS_TABLE) -> tuple[dict[str, float], dict[str, float]]:
    """(per-test seconds, per-file mean seconds) from the table; empty if it is missing."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return {}, {}
    return dict(raw["tests"]), dict(raw["files"])


def estimate(nodeid: str, tests: dict[str, float], files: dict[str, float]) -> float:
    """Seconds a test is expected to take (see DURATIONS_TABLE)."""
    if nodeid in tests:
        return tests[nodeid]
    return files.get(nodeid.split("::", 1)[0], NEW_TEST_S)


ROOT = Path(__file__).resolve().parents[1]  # pytest's rootdir: node ids are relative to it
_MODULE_FIXTURE = re.compile(r"""scope=["'](module|class|package)["']""")


@functools.cache
def has_module_fixture(path: str) -> bool:
    """Whether the test file defines a module-, class- or package-scoped fixture."""
    try:
        return _MODULE_FIXTURE.search((ROOT / path).read_text()) is not None
    except OSError:
        return False


def work_unit(nodeid: str) -> str | None:
    """The unit of work a test belongs to (one worker runs a unit), or None: on its own.

    A session engine's tests are one unit (engine_group). So are the tests of a file that
    defines a module-scoped fixture (a fresh venv with the core install, a Ray head, a
    killed run's TensorBoard files, a tiny benchmark): on several workers, each would
    build it again, once per worker (and again after an interruption by another file)."""
    group = engine_group(nodeid)
    if group is not None:
        return f"@{group}"
    path = nodeid.split("::", 1)[0]
    return path if has_module_fixture(path) else None


def longest_first(
    units: dict[str, dict[str, bool]], tests: dict[str, float], files: dict[str, float]
) -> list[tuple[str, dict[str, bool]]]:
    """The units of work (name: its node ids) longest first by their tests' estimates; a
    stable sort, so units of equal estimates keep the collection order."""
    return sorted(units.items(), key=lambda unit: -sum(estimate(n, tests, files) for n in unit[1]))


def make_scheduler(config: Any, log: Any) -> Any:
    """xdist's group scheduling, the groups being the work units, longest first."""
    from xdist.scheduler import LoadGroupScheduling

    tests, files = load_estimates()

    class WorkUnitScheduling(LoadGroupScheduling):  # type: ignore[misc]
        _longest_first = False

        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid) or str(super()._split_scope(nodeid))

        def _assign_work_unit(self, node: Any) -> None:
            # The work queue is complete before the first unit is assigned: order it once.
            if not self._longest_first:
                units = longest_first(self.workqueue, tests, files)
                self.workqueue.clear()
                self.workqueue.update(units)
                self._longest_first = True
            super()._assign_work_unit(node)

    return WorkUnitScheduling(config, log)


def write_estimates(path: Path, durations: dict[str, float]) -> None:
    """The table: tests of a second or more by name, the others by their file's mean."""
    per_file: dict[str, list[float]] = {}
    for nodeid, seconds in durations.items():
        per_file.setdefault(nodeid.split("::", 1)[0], []).append(seconds)
    table = {
        "tests": {n: round(s, 1) for n, s in sorted(durations.items()) if s >= 1.0},
        "files": {f: round(sum(v) / len(v), 2) for f, v in sorted(per_file.items())},
    }
    path.write_text(json.dumps(table, indent=0, sort_keys=True) + "\n")
