"""Everything installed lives under ``rolloutlog`` (docs/architecture.md).

A user project with its own ``migrations``, ``controller`` and ``eventstore`` packages
(Django, alembic) on the path must neither shadow ours nor be imported by us; the
public API is importable from ``rolloutlog`` itself, and the core never imports torch.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The top-level folders and the package each one is installed as (pyproject package-dir).
FOLDERS = {
    "rolloutlog": "rolloutlog",
    "eventstore": "rolloutlog.eventstore",
    "controller": "rolloutlog.controller",
    "migrations": "rolloutlog.migrations",
}
HEAVY = ("torch", "transformers", "tokenizers", "safetensors", "vllm")


def _run(
    args: list[str], *, cwd: Path, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run a child in its own process group; kill the whole group if it overruns."""
    proc = subprocess.Popen(
        args,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"{args} ran past {timeout}s:\n{out}\n{err[-3000:]}")
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def _cli() -> list[str]:
    script = Path(sys.executable).parent / "rolloutlog"
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "from rolloutlog.cli import main; main()"]


def test_every_package_folder_is_listed_in_pyproject() -> None:
    """The explicit package list ships every folder that has an ``__init__.py``."""
    listed = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = set()
    for folder, package in FOLDERS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            found.add(".".join([package, *rel.parts]))
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert listed - found == set()


def test_no_generic_top_level_imports() -> None:
    """No ``import controller`` / ``from migrations import ...`` anywhere in the repository."""
    bad = re.compile(r"^\s*(from|import)\s+(controller|eventstore|migrations)\b", re.M)
    offenders = [
        str(p.relative_to(REPO))
        for top in ("rolloutlog", "eventstore", "controller", "migrations", "tests", "examples")
        for p in (REPO / top).rglob("*.py")
        if bad.search(p.read_text())
    ]
    assert offenders == []


def test_public_api_is_light() -> None:
    """``from rolloutlog import ...`` works, and the core imports no torch/transformers/vllm."""
    code = (
        "import sys, json\n"
        "from rolloutlog import EventStore, RolloutController, RolloutRuntime, RolloutConfig\n"
        "import rolloutlog.controller.metrics, rolloutlog.controller.replay_tool\n"
        "import rolloutlog.controller.sql_audit, rolloutlog.controller.prompt_ledger\n"
        "import rolloutlog.controller.backends\n"
        "import rolloutlog.cli.db, rolloutlog.cli.audit, rolloutlog.cli.replay\n"
        "import rolloutlog.cli.metrics, rolloutlog.cli.compact, rolloutlog.cli.demo\n"
        "print(json.dumps([EventStore.__module__, RolloutController.__name__,\n"
        "    RolloutRuntime.__name__, RolloutConfig.__name__,\n"
        f"    sorted(m for m in {HEAVY!r} if m in sys.modules)]))\n"
    )
    proc = _run([sys.executable, "-c", code], cwd=REPO, env=dict(os.environ), timeout=120)
    assert proc.returncode == 0, proc.stderr
    module, ctl, rt, cfg, heavy = json.loads(proc.stdout)
    assert module.startswith("rolloutlog.eventstore")
    assert (ctl, rt, cfg) == ("RolloutController", "RolloutRuntime", "RolloutConfig")
    assert heavy == []


# A module of each mapped folder, imported under the folder's bare name.
BARE = {
    "controller": "controller.rollout_controller",
    "eventstore": "eventstore.store",
    "migrations": "migrations",
}


@pytest.mark.parametrize("folder", sorted(BARE))
def test_a_bare_import_of_a_mapped_folder_fails_naming_the_package(folder: str) -> None:
    """From the repository root (first on sys.path), ``import controller...`` would load a
    second copy of the package, whose errors an ``except`` of rolloutlog's never matches:
    it fails instead, naming the ``rolloutlog.`` path."""
    proc = _run(
        [sys.executable, "-c", f"import {BARE[folder]}"],
        cwd=REPO,
        env=dict(os.environ),
        timeout=120,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"ImportError: import rolloutlog.{folder}, not {folder}: this folder is installed as "
        f"the package rolloutlog.{folder}, and a bare `{folder}` import would load a second "
        "copy of it"
    )


def test_the_mapped_packages_import_once_from_the_repository_root() -> None:
    """The same modules as ``rolloutlog.*`` work there, and no bare copy is loaded."""
    code = (
        "import sys, json\n"
        "import rolloutlog.controller.rollout_controller as rc\n"
        "import rolloutlog.eventstore.store, rolloutlog.migrations\n"
        "from rolloutlog.controller.domain.errors import RestoreError\n"
        "print(json.dumps([rc.__name__, RestoreError.__module__,\n"
        f"    sorted(m for m in sys.modules if m.split('.')[0] in {sorted(BARE)!r})]))\n"
    )
    proc = _run([sys.executable, "-c", code], cwd=REPO, env=dict(os.environ), timeout=120)
    assert proc.returncode == 0, proc.stderr
    name, error_module, bare = json.loads(proc.stdout)
    assert name == "rolloutlog.controller.rollout_controller"
    assert error_module.startswith("rolloutlog.controller.domain.")
    assert bare == []


@pytest.mark.parametrize("where", ["tests/probe.py", "rolloutlog/probe.py", "examples/probe.py"])
def test_ruff_bans_bare_imports_of_the_mapped_folders(where: str) -> None:
    """Ruff's TID251 (banned-api in pyproject.toml) flags each bare import in our code."""
    ruff = Path(sys.executable).parent / "ruff"
    if not ruff.is_file():
        pytest.skip("ruff is not installed beside this interpreter (the dev extra)")
    source = "".join(f"import {module}\n" for module in BARE.values())
    proc = subprocess.run(
        [str(ruff), "check", "--no-cache", "--select", "TID251", "--output-format", "json",
         "--stdin-filename", where, "-"],
        input=source, cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    found = json.loads(proc.stdout)
    assert sorted(f["message"].split("`")[1] for f in found) == sorted(BARE), proc.stderr
    assert {f["code"] for f in found} == {"TID251"}


def _user_project(root: Path) -> dict[str, str]:
    """A project with its own migrations/, controller/, eventstore/ that must not be touched."""
    for name in ("migrations", "controller", "eventstore"):
        pkg = root / name
        pkg.mkdir()
        (pkg / "__init__.py").write_text(
            f"raise ImportError('the user project\\'s {name} package was imported')\n"
        )
        (pkg / "env.py").write_text("raise ImportError('user env.py')\n")
    return dict(os.environ, PYTHONPATH=str(root), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def test_user_packages_named_like_ours_do_not_interfere(tmp_path: Path) -> None:
    """EventStore.open and ``rolloutlog db upgrade`` from a project with look-alike packages."""
    env = _user_project(tmp_path)
    code = (
        "from rolloutlog import EventStore\n"
        "store = EventStore.open('sqlite:///api.db')\n"
        "store.close()\n"
        "print('opened')\n"
    )
    proc = _run([sys.executable, "-c", code], cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "opened"
    assert (tmp_path / "api.db").is_file()

    proc = _run([*_cli(), "db", "upgrade", "sqlite:///cli.db"], cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    proc = _run([*_cli(), "db", "check", "sqlite:///cli.db"], cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_demo_from_a_user_project_with_look_alike_packages(tmp_path: Path) -> None:
    """The demo (worker subprocesses included) runs from such a project too."""
    pytest.importorskip("torch")
    env = _user_project(tmp_path)
    args = [*_cli(), "demo", "--json", "--steps", "8", "--checkpoint-every", "3"]
    proc = _run([*args, "--db", "sqlite:///runs/demo.db"], cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["ok"] is True
    assert summary["steps_trained"] == 8
