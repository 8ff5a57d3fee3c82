"""One base under every error the library raises: ``RolloutlogError``.

Every public exception class that a rolloutlog module defines derives from it (the
builtin base a caller catches it by, ``ValueError``, ``KeyError``, ``RuntimeError``,
stays as a second base), and pickles whole: type, message and attributes.
"""

from __future__ import annotations

import importlib
import pickle
import pkgutil
from types import ModuleType

import pytest

import rolloutlog
from rolloutlog import RolloutlogError
from rolloutlog.controller.backends.base import BackendUnavailableError
from rolloutlog.controller.config import ConfigError
from rolloutlog.controller.domain.errors import InvariantViolation, StaleAttemptError
from rolloutlog.controller.rollout_runtime import RunStoppedError
from rolloutlog.eventstore.errors import AppendConflictError, RunNotFoundError

LAYERS = ("eventstore", "controller", "migrations")
#: Modules whose import needs a dependency this machine may lack (an optional extra).
_OPTIONAL = ("vllm", "ray", "httpx", "torch", "transformers", "plotly", "datasets")


def _library_modules() -> list[ModuleType]:
    modules: list[ModuleType] = []
    # The layers are installed under rolloutlog from folders of their own (package-dir),
    # so each is walked from its own path.
    roots = [importlib.import_module(f"rolloutlog.{n}") for n in LAYERS]
    infos = [
        info
        for root in [rolloutlog, *roots]
        for info in pkgutil.walk_packages(root.__path__, f"{root.__name__}.")
    ]
    for info in infos:
        if ".migrations.versions." in info.name or "index_migrations." in info.name:
            continue  # alembic revision scripts: loaded by alembic, not importable alone
        if info.name == "rolloutlog.migrations.env":
            continue  # runs alembic's context at import
        try:
            modules.append(importlib.import_module(info.name))
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.split(".")[0] not in _OPTIONAL:
                raise
    return modules


def _exception_classes() -> list[type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for module in _library_modules():
        for name, value in vars(module).items():
            if (
                isinstance(value, type)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
                and not name.startswith("_")
            ):
                found[f"{module.__name__}.{name}"] = value
    return [found[k] for k in sorted(found)]


def test_every_library_error_derives_from_rolloutlog_error() -> None:
    classes = _exception_classes()
    # Not vacuous: the store's, the domain's, the backends' and the runtime's are there.
    names = {cls.__name__ for cls in classes}
    assert {"StoreError", "DomainError", "BackendError", "RunStoppedError"} <= names
    assert len(classes) > 40
    outside = [
        f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, RolloutlogError)
    ]
    assert outside == [], f"errors not deriving from RolloutlogError: {outside}"


def test_builtin_bases_are_kept() -> None:
    assert issubclass(ConfigError, ValueError)
    assert issubclass(RunNotFoundError, KeyError)
    assert issubclass(RunStoppedError, RuntimeError)


@pytest.mark.parametrize(
    "error",
    [
        AppendConflictError("r", 3, 5),
        StaleAttemptError("attempt 1 of group 2 is stale"),
        InvariantViolation("broken", groups=(1, 2), offset=7),
        BackendUnavailableError("no engine"),
        ConfigError("steps: must be > 0"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_pickle_whole(error: RolloutlogError) -> None:
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error)
    assert str(back) == str(error)
    assert vars(back) == vars(error)
