"""Bad input at the controller level, on a real run log: each is a clear error that names
the problem, and nothing is lost (the log is unchanged and readable afterwards).

Covers rows corrupted in place (bad JSON, unknown type, newer schema version) seen by
replay / restore / open / ``rolloutlog replay --check`` / ``rolloutlog audit``; a
truncated SQLite file; a database at another alembic head; every field of
:class:`RunConfig` given an invalid value (generated from the pydantic models), unknown
fields, a restore without an offset, a config fingerprint mismatch and
``rolloutlog run`` with a bad config.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml
from click.testing import CliRunner
from pydantic import BaseModel
from reliability_harness import FINGERPRINT, drive, exactly_once, rollout_config, run

from rolloutlog.cli import main
from rolloutlog.controller.config import ConfigError, RolloutConfig, StoreConfig
from rolloutlog.controller.domain.errors import RestoreError
from rolloutlog.controller.replay_tool import check_history
from rolloutlog.controller.rollout_controller import RolloutController, replay
from rolloutlog.eventstore import (
    CorruptEventError,
    EventStore,
    NewerSchemaVersionError,
    SchemaMismatchError,
    StoreError,
    StoreUnavailableError,
    UnknownEventTypeError,
)
from rolloutlog.grpo.run_config import RunConfig, load_run_config

STEPS = 4


def _build_log(url: str) -> None:
    """A run of STEPS steps with a checkpoint after each, and no snapshots (so every
    replay decodes every row)."""
    store = EventStore.open(url)
    try:
        ctl = RolloutController.start(
            store,
            "r",
            rollout_config(),
            dataset_fingerprint=FINGERPRINT,
            dataset_size=120,
            store_config=StoreConfig(snapshot_interval=0, group_commit_window_ms=1),
        )
        ctl.checkpoint(0)
        run(drive(ctl, STEPS))
        ctl.close()
    finally:
        store.close()


@pytest.fixture
def logged(db_url: str) -> Iterator[str]:
    """``db_url`` holding run ``r``."""
    _build_log(db_url)
    yield db_url


def _rows(url: str) -> list[tuple[Any, ...]]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return [
                tuple(r)
                for r in conn.exec_driver_sql(
                    "SELECT seq, epoch, type, schema_version, payload FROM events "
                    "WHERE run_id = 'r' ORDER BY seq"
                )
            ]
    finally:
        engine.dispose()


def _sql(url: str, statement: str, params: dict[str, Any] | None = None) -> None:
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(statement), params or {})
    finally:
        engine.dispose()


def _cli(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=True)


def _checkpoints(store: EventStore) -> list[int]:
    return [r.seq for r in store.read("r") if r.type == "CheckpointMarked"]


# ---------------------------------------------------------------- corrupt rows

CORRUPTIONS = [
    pytest.param("payload", '{"group_id": 1, "sibl', CorruptEventError, "invalid JSON", id="json"),
    pytest.param("payload", '{"group_id": "x"}', CorruptEventError, "corrupt event", id="fields"),
    pytest.param("type", "FromTheFuture", UnknownEventTypeError, "unknown event type", id="type"),
    pytest.param("schema_version", 99, NewerSchemaVersionError, "schema version 99", id="version"),
]


@pytest.mark.parametrize(("column", "value", "error", "words"), CORRUPTIONS)
def test_corrupt_row_is_named_by_offset_everywhere_and_nothing_is_lost(
    logged: str, column: str, value: Any, error: type[StoreError], words: str
) -> None:
    url = logged
    store = EventStore.open(url)
    try:
        checkpoints = _checkpoints(store)
        # A completion before the newest checkpoint: every restore path must read it.
        bad = next(
            r.seq
            for r in store.read("r", checkpoints[1], checkpoints[-1])
            if r.type == "SiblingCompleted"
        )
        before = _rows(url)
        info = store.get_run("r")
        index = ("type", "schema_version", "payload").index(column) + 2
        original = next(r for r in before if r[0] == bad)[index]
        update = f"UPDATE events SET {column} = :v WHERE run_id = 'r' AND seq = :s"
        _sql(url, update, {"v": value, "s": bad})

        def expect(fn: Any) -> str:
            with pytest.raises(error) as caught:
                fn()
            msg = str(caught.value)
            assert f"offset {bad}" in msg and words.lower() in msg.lower(), msg
            return msg

        expect(lambda: replay(store, "r"))
        expect(lambda: replay(store, "r", use_snapshots=False))
        expect(lambda: RolloutController.restore(store, "r", checkpoints[-1]))
        expect(lambda: RolloutController.open(store, "r"))
        expect(lambda: check_history(store, "r"))
        # Nothing was written by the refused opens: same epoch, same rows.
        after = store.get_run("r")
        assert (after.current_epoch, after.last_seq) == (info.current_epoch, info.last_seq)

        res = _cli("replay", url, "--run", "r", "--check")
        assert res.exit_code != 0 and f"offset {bad}" in res.output, res.output
        res = _cli("replay", url, "--run", "r")
        assert res.exit_code != 0 and f"offset {bad}" in res.output, res.output
        res = _cli("audit", url, "--run", "r", "--json")
        # The SQL views read the audit columns; if a view has to parse the bad row the
        # error must still be a clean CLI error, never a traceback.
        assert res.exception is None or isinstance(res.exception, SystemExit), res.output
        if res.exit_code != 0:
            assert "Error" in res.output, res.output

        # Every other row is intact and readable; the corrupt one is readable raw.
        assert [r for r in _rows(url) if r[0] != bad] == [r for r in before if r[0] != bad]
        assert len(list(store.read("r"))) == info.last_seq
        replay(store, "r", to_seq=bad - 1)
        # Repairing the row gives back the whole run.
        _sql(url, update, {"v": original, "s": bad})
        assert _rows(url) == before
        assert check_history(store, "r").violation is None
        result = exactly_once(store, "r")
        assert result["lost"] == () and result["trained_twice"] == ()
    finally:
        store.close()


# ---------------------------------------------------------------- damaged databases


def test_truncated_sqlite_log(sqlite_url: str, tmp_path: Path) -> None:
    _build_log(sqlite_url)
    path = Path(sqlite_url.removeprefix("sqlite:///"))
    assert not Path(f"{path}-wal").exists() or Path(f"{path}-wal").stat().st_size == 0
    size = path.stat().st_size
    page = 4096
    assert size > 4 * page
    for cut in (size // 2 + page // 3, 3 * page + 100, 50):
        damaged = tmp_path / f"cut{cut}.db"
        damaged.write_bytes(path.read_bytes()[:cut])
        url = f"sqlite:///{damaged}"
        with pytest.raises(StoreUnavailableError) as caught:
            store = EventStore.open(url)
            try:
                list(store.read("r"))
                replay(store, "r")
            finally:
                store.close()
        msg = str(caught.value)
        assert str(damaged) in msg and "not a valid SQLite database" in msg, msg
        res = _cli("replay", url, "--check")
        assert res.exit_code != 0 and "not a valid SQLite database" in res.output, res.output
    # The original file is untouched and whole.
    with EventStore.open(sqlite_url) as store:
        assert check_history(store, "r").violation is None


@pytest.mark.parametrize("revision", ["ffffffffffff", "0001"])
def test_database_at_another_alembic_head(logged: str, revision: str) -> None:
    url = logged
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        head = conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar_one()
        known = revision if revision != "0001" else _revision_named("0001")
    engine.dispose()
    _sql(url, "UPDATE alembic_version SET version_num = :v", {"v": known})
    with pytest.raises(SchemaMismatchError) as caught:
        EventStore.open(url)
    assert repr(known) in str(caught.value), caught.value
    for args in (("replay", url, "--check"), ("audit", url)):
        res = _cli(*args)
        assert res.exit_code != 0 and known in res.output, (args, res.output)
    _sql(url, "UPDATE alembic_version SET version_num = :v", {"v": head})
    with EventStore.open(url) as store:
        assert check_history(store, "r").violation is None


def _revision_named(prefix: str) -> str:
    from alembic.script import ScriptDirectory

    from rolloutlog.eventstore.migrate import alembic_config

    revs = [s.revision for s in ScriptDirectory.from_config(alembic_config()).walk_revisions()]
    return next(r for r in revs if r.startswith(prefix))


# ---------------------------------------------------------------- restore refusals


def test_restore_without_an_offset_and_with_another_config(logged: str) -> None:
    with EventStore.open(logged) as store:
        epoch = store.get_run("r").current_epoch
        with pytest.raises(RestoreError, match="needs the checkpoint offset"):
            RolloutController.restore(store, "r", None)
        offset = _checkpoints(store)[-1]
        other = rollout_config().model_copy(update={"group_size": 3, "lookahead": 1})
        with pytest.raises(RestoreError) as caught:
            RolloutController.restore(store, "r", offset, rollout=other)
        msg = str(caught.value)
        assert "fingerprint mismatch" in msg and "group_size" in msg and "lookahead" in msg
        with pytest.raises(RestoreError, match="dataset differs"):
            RolloutController.restore(
                store, "r", offset, rollout=rollout_config(), dataset_fingerprint="other"
            )
        with pytest.raises(RestoreError, match="not a CheckpointMarked"):
            RolloutController.restore(store, "r", offset - 1)
        assert store.get_run("r").current_epoch == epoch  # nothing opened
        ctl, report = RolloutController.restore(
            store, "r", offset, rollout=rollout_config(), dataset_fingerprint=FINGERPRINT
        )
        ctl.close()
        assert report.epoch == epoch + 1


# ---------------------------------------------------------------- configs


def _invalid_values(ann: Any, info: Any) -> list[Any]:
    """Values the field must refuse: a mapping for a scalar, and each bound crossed."""
    values: list[Any] = [{"not": "valid"}]
    for meta in info.metadata:
        for attr, delta in (("ge", -1), ("gt", 0), ("le", 1), ("lt", 0)):
            bound = getattr(meta, attr, None)
            if bound is not None:
                values.append(
                    bound + delta if not isinstance(bound, float) else bound + delta * 0.5
                )
        if getattr(meta, "min_length", None):
            values.append("")
        if getattr(meta, "max_length", None) is not None:
            values.append("x" * (meta.max_length + 1))
    return values


def _leaf_cases(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for name, info in model.model_fields.items():
        dotted = f"{prefix}{name}"
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield dotted, "not a section"
            yield from _leaf_cases(ann, dotted + ".")
        else:
            for value in _invalid_values(ann, info):
                yield dotted, value


def _sections(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    yield prefix
    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _sections(ann, f"{prefix}{name}.")


def _nest(dotted: str, value: Any) -> dict[str, Any]:
    out: Any = value
    for part in reversed(dotted.split(".")):
        out = {part: out}
    return out


FIELD_CASES = list(_leaf_cases(RunConfig))


def test_every_config_field_is_covered() -> None:
    """The cases come from the models, nested sections included."""
    dotted = {d for d, _ in FIELD_CASES}
    assert {"steps", "rollout.group_size", "store.url", "trainer.betas", "task.alphabet"} <= dotted
    assert len(dotted) >= 40
    for section in ("rollout", "store", "generation", "telemetry", "task", "trainer", "model"):
        assert section in dotted


@pytest.mark.parametrize(
    ("dotted", "value"), FIELD_CASES, ids=[f"{d}={v!r}"[:60] for d, v in FIELD_CASES]
)
def test_invalid_value_names_the_dotted_field(tmp_path: Path, dotted: str, value: Any) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(_nest(dotted, value)))
    with pytest.raises(ConfigError) as caught:
        load_run_config(path)
    msg = str(caught.value)
    assert f"  {dotted}:" in msg or f"  {dotted}." in msg, msg
    assert str(path) in msg


@pytest.mark.parametrize("section", list(_sections(RunConfig)))
def test_unknown_field_is_rejected_by_name(tmp_path: Path, section: str) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(_nest(f"{section}no_such_knob", 1)))
    with pytest.raises(ConfigError) as caught:
        load_run_config(path)
    assert f"  {section}no_such_knob: Extra inputs are not permitted" in str(caught.value)


def test_defaults_and_a_valid_file_load(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("steps: 2\nrollout: {group_size: 2}\n")
    cfg = load_run_config(path)
    assert cfg.steps == 2 and cfg.rollout.group_size == 2
    assert isinstance(cfg.rollout, RolloutConfig)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("- a\n- b\n", "must be a mapping"),
        ("steps: [1\n", "not valid YAML"),
        ("rollout:\n  sampler: newest\n", "rollout.sampler"),
    ],
)
def test_rolloutlog_run_with_a_bad_config_exits_nonzero(
    tmp_path: Path, text: str, words: str
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    res = _cli("run", str(path))
    assert res.exit_code != 0 and words in res.output, res.output
    assert "Traceback" not in res.output
    assert not any(p.suffix == ".db" for p in tmp_path.iterdir()), os.listdir(tmp_path)
