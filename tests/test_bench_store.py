"""``rolloutlog bench store`` at a tiny size: the shape of its results, not its speed.

Speed targets are measured by the benchmark itself (docs/benchmarks.md), never asserted
in tests.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from rolloutlog.bench import store_bench
from rolloutlog.cli import main
from rolloutlog.controller.rollout_index import TABLES as INDEX_TABLES
from rolloutlog.eventstore import EventStore

EVENTS = 2000
SYSTEMS = {
    "raw_sqlite3",
    "eventsourcing_aggregate_recorder",
    "eventsourcing_application_recorder",
    "rolloutlog",
    "rolloutlog_generic",
    "rolloutlog_pydantic_json",
    "rolloutlog_group_commit",
    "rolloutlog_process_commit",
}
#: Systems that only write (the SQL-layer comparison: rows already built).
SQL_SYSTEMS = {"sql_today", "sql_now", "sql_fat_index", "sql_now_generic", "sql_deferred_index"}
REQUIRED_RATIOS = {
    "append_vs_raw",
    "append_vs_eventsourcing",
    "read_vs_eventsourcing",
    "append_sql_vs_today",
}


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One tiny run, shared by the shape tests (pages of 300 rows: several per read)."""
    db_dir = tmp_path_factory.mktemp("bench")
    out = store_bench.run_store_benchmark(
        events=EVENTS, batch=250, page_size=300, repeat=2, db_dir=db_dir
    )
    out["_db_dir"] = str(db_dir)
    return out


def test_result_is_json_with_the_required_ratios(result: dict[str, Any]) -> None:
    clean = {k: v for k, v in result.items() if not k.startswith("_")}
    assert json.loads(json.dumps(clean)) == clean
    assert result["benchmark"] == "store"
    assert (result["events"], result["batch"], result["repeat"]) == (EVENTS, 250, 2)
    assert result["synchronous"] == "FULL" and result["journal_mode"] == "wal"
    assert set(result["ratios"]) >= REQUIRED_RATIOS
    for name, value in result["ratios"].items():
        assert isinstance(value, float) and value > 0, name
    assert set(result["targets"]) == REQUIRED_RATIOS
    assert set(result["met"]) == REQUIRED_RATIOS
    assert set(result["met_on_cpu_time"]) == REQUIRED_RATIOS
    assert set(result["cpu_ratios"]) == set(result["ratios"])
    for name, value in result["cpu_ratios"].items():
        assert isinstance(value, float) and value > 0, name
    assert all(isinstance(v, bool) for v in result["met"].values())
    assert result["machine"]["cpus"] >= 1


def test_every_system_wrote_and_read_back_every_event(result: dict[str, Any]) -> None:
    systems = result["systems"]
    assert set(systems) == SYSTEMS | SQL_SYSTEMS
    for name, m in systems.items():
        assert m["append_events"] == EVENTS, name
        assert m["read_events"] == (0 if name in SQL_SYSTEMS else EVENTS), name
        assert m["append_eps"] > 0, name
        assert m["append_cpu_eps"] > 0, name
        assert len(m["append_eps_samples"]) == 2, name
    assert {systems[name]["layout"] for name in SQL_SYSTEMS} == {
        "today",
        "now",
        "fat_index",
        "generic",
        "deferred",
    }
    assert systems["rolloutlog_process_commit"]["writer"] == "process"
    assert systems["rolloutlog_group_commit"]["writer"] == "thread"
    for name in SYSTEMS - {"rolloutlog_group_commit", "rolloutlog_process_commit"}:
        assert systems[name]["read_eps"] > 0, name
        assert len(systems[name]["read_eps_samples"]) == 2, name
        assert systems[name]["synchronous"] == "FULL", name
        assert systems[name]["journal_mode"] == "wal", name


def test_same_rows_and_realistic_payloads(result: dict[str, Any]) -> None:
    systems = result["systems"]
    raw = systems["raw_sqlite3"]["payload_bytes_avg"]
    # rolloutlog's pydantic JSON and the raw baseline's json text are the same bytes.
    assert systems["rolloutlog"]["payload_bytes_avg"] == raw
    assert systems["rolloutlog_pydantic_json"]["payload_bytes_avg"] == raw  # same document
    assert 120 <= raw <= 200
    # eventsourcing stores the same fields plus its own framing (timestamp transcoding).
    assert systems["eventsourcing_aggregate_recorder"]["payload_bytes_avg"] > raw


def test_ratios_are_computed_from_the_reported_numbers(result: dict[str, Any]) -> None:
    s, r = result["systems"], result["ratios"]
    rl = s["rolloutlog"]
    best_es_append = max(
        s["eventsourcing_aggregate_recorder"]["append_eps"],
        s["eventsourcing_application_recorder"]["append_eps"],
    )
    assert r["append_vs_raw"] == pytest.approx(
        rl["append_eps"] / s["raw_sqlite3"]["append_eps"], rel=1e-2
    )
    assert r["append_vs_eventsourcing"] == pytest.approx(
        rl["append_eps"] / best_es_append, rel=1e-2
    )
    best_es_read = max(
        s["eventsourcing_aggregate_recorder"]["read_eps"],
        s["eventsourcing_application_recorder"]["read_eps"],
    )
    assert r["read_vs_eventsourcing"] == pytest.approx(rl["read_eps"] / best_es_read, rel=1e-2)


def test_paired_medians_come_from_the_samples_of_each_round(result: dict[str, Any]) -> None:
    s, r = result["systems"], result["ratios"]
    for what in ("append", "read"):
        ours = s["rolloutlog"][f"{what}_eps_samples"]
        aggregate = s["eventsourcing_aggregate_recorder"][f"{what}_eps_samples"]
        application = s["eventsourcing_application_recorder"][f"{what}_eps_samples"]
        per_round = [a / max(b, c) for a, b, c in zip(ours, aggregate, application, strict=True)]
        assert r[f"{what}_vs_eventsourcing_paired_median"] == pytest.approx(
            statistics.median(per_round), rel=1e-2
        )
        assert result["cpu_ratios"][f"{what}_vs_eventsourcing_paired_median"] > 0
    ours = s["rolloutlog"]["append_eps_samples"]
    pydantic_json = s["rolloutlog_pydantic_json"]["append_eps_samples"]
    assert r["append_vs_pydantic_json_paired_median"] == pytest.approx(
        statistics.median(a / b for a, b in zip(ours, pydantic_json, strict=True)), rel=1e-2
    )


def test_database_files_are_removed(result: dict[str, Any]) -> None:
    assert list(Path(result["_db_dir"]).rglob("*.db*")) == []


def test_a_short_read_back_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The read-back check is real: a store that loses the last event fails the run."""
    real_read = EventStore.read

    def lossy(self: EventStore, *args: Any, **kwargs: Any) -> Iterator[Any]:
        rows = list(real_read(self, *args, **kwargs))
        return iter(rows[:-1])

    monkeypatch.setattr(EventStore, "read", lossy)
    specs = [store_bench.spec(i) for i in range(100)]
    with pytest.raises(store_bench.BenchmarkError, match="read 99 events, wrote 100"):
        store_bench.bench_rolloutlog(tmp_path / "x.db", specs, batch=10, page_size=30)


def test_scale_mode(tmp_path: Path) -> None:
    out = store_bench.run_scale_benchmark(
        sizes=(600, 200), window=150, batch=50, repeat=2, db_dir=tmp_path
    )
    assert json.loads(json.dumps(out)) == out
    assert list(out["sizes"]) == ["200", "600"]
    for label, n in (("200", 200), ("600", 600)):
        entry = out["sizes"][label]
        assert entry["prefilled_events"] == n
        assert entry["measured_events"] == 150
        assert entry["append_eps"] > 0
        assert entry["append_eps"] == max(entry["append_eps_samples"])
        assert len(entry["append_eps_samples"]) == 2
        assert len(entry["fill_eps_by_chunk"]) == 1
        assert entry["file_bytes"] > 0
    assert set(out["ratios"]) == {"append_600_vs_200"}
    assert out["ratios"]["append_600_vs_200"] > 0
    assert out["cpu_ratios"]["append_600_vs_200"] > 0
    assert len(out["paired_ratios"]["append_600_vs_200"]) == 2
    assert isinstance(out["met"]["append_600_vs_200"], bool)
    assert list(tmp_path.rglob("*.db*")) == []


@pytest.mark.parametrize(
    ("n", "label"), [(100_000, "100k"), (10_000_000, "10m"), (2_500, "2500"), (0, "0")]
)
def test_size_label(n: int, label: str) -> None:
    assert store_bench.size_label(n) == label


def test_cli_json_and_table(tmp_path: Path) -> None:
    runner = CliRunner()
    args = ["bench", "store", "--events", "600", "--batch", "100", "--repeat", "1"]
    res = runner.invoke(main, [*args, "--json", "--db-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert set(out["ratios"]) >= REQUIRED_RATIOS
    assert {m["read_events"] for name, m in out["systems"].items() if name not in SQL_SYSTEMS} == {
        600
    }

    res = runner.invoke(main, [*args, "--db-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    for needle in ("append_vs_raw", "append_vs_eventsourcing", "read_vs_eventsourcing"):
        assert needle in res.stdout


def test_cli_scale_json(tmp_path: Path) -> None:
    res = CliRunner().invoke(
        main,
        ["bench", "store", "--scale", "--scale-sizes", "100,300", "--scale-window", "100",
         "--batch", "50", "--json", "--db-dir", str(tmp_path)],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "append_300_vs_100" in json.loads(res.stdout)["ratios"]


@pytest.mark.parametrize(
    "args",
    [["--events", "0"], ["--scale", "--scale-sizes", "100"], ["--scale", "--scale-sizes", "x,y"]],
)
def test_cli_rejects_bad_sizes(args: list[str]) -> None:
    res = CliRunner().invoke(main, ["bench", "store", *args])
    assert res.exit_code == 2
    assert "error" in res.output.lower()


def test_help() -> None:
    res = CliRunner().invoke(main, ["bench", "--help"])
    assert res.exit_code == 0 and "store" in res.stdout
    res = CliRunner().invoke(main, ["bench", "store", "--help"])
    assert res.exit_code == 0
    for option in ("--events", "--batch", "--json", "--db-dir", "--scale"):
        assert option in res.stdout


@pytest.mark.postgres
def test_postgresql_mode_compares_with_raw_copy_and_measures_tail_latency(pg_url: str) -> None:
    from rolloutlog.bench.store_bench import run_pg_store_benchmark
    from rolloutlog.eventstore import EventStore

    EventStore.open(pg_url).close()  # the schema
    result = run_pg_store_benchmark(pg_url, events=2_000, batch=500, repeat=2)
    systems = result["systems"]
    assert set(systems) == {
        "raw_copy", "rolloutlog", "rolloutlog_indexed", "rolloutlog_one_statement",
        "rows_built", "group_commit", "process_commit",
    }  # fmt: skip
    assert all(m["append_events"] == 2_000 for m in systems.values())
    ratios = result["ratios"]
    raw = systems["raw_copy"]["append_eps"]
    for ratio, system in (
        ("append_vs_raw_copy", "rolloutlog"),
        ("append_rows_built_vs_raw_copy", "rows_built"),
        ("group_commit_vs_raw_copy", "group_commit"),
        ("process_commit_vs_raw_copy", "process_commit"),
    ):  # rounded to 3 places
        assert ratios[ratio] == pytest.approx(systems[system]["append_eps"] / raw, abs=1e-3)
        # The paired median lies within the per-round ratios of the samples.
        paired = [
            a / b
            for a, b in zip(
                systems[system]["append_eps_samples"],
                systems["raw_copy"]["append_eps_samples"],
                strict=True,
            )
        ]
        assert min(paired) - 2e-3 <= ratios[f"{ratio}_paired_median"] <= max(paired) + 2e-3
    # Batches of 500: pipelined (250 per statement) against one statement each.
    pipelined = [
        a / b
        for a, b in zip(
            systems["rolloutlog"]["append_eps_samples"],
            systems["rolloutlog_one_statement"]["append_eps_samples"],
            strict=True,
        )
    ]
    gain = ratios["append_pipelined_vs_one_statement_paired_median"]
    assert min(pipelined) - 2e-3 <= gain <= max(pipelined) + 2e-3
    for system in ("group_commit", "process_commit"):
        assert systems[system]["transactions"] >= 4  # at most 500 per transaction
    # Every append woke the listener (4 appends per rolloutlog system run, 2 runs).
    assert result["tail_latency_ms"]["samples"] == 8
    lat = result["tail_latency_ms"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["max"]  # from the call: never negative
    # From the return: a lower bound, below the upper one (and often negative).
    assert lat["from_return_p50"] < lat["p50"] and lat["from_return_p90"] < lat["p90"]
    with EventStore.open(pg_url) as store:  # the benchmark's runs were removed
        assert store.list_runs() == []
        with store.engine.connect() as conn:  # and every row they wrote, index rows too
            for table in (*INDEX_TABLES, "events", "epochs", "runs"):
                left = conn.exec_driver_sql(
                    f"SELECT count(*) FROM {table} WHERE run_id LIKE 'bench-%%'"
                ).scalar()
                assert left == 0, table


def test_the_workload_indexes_the_keys_the_domain_events_have() -> None:
    """Every system indexes what the controller would: the real events' audit keys (a
    sibling event names its group, no prompt and no target step)."""
    for i in (0, 1, 2, 31, 32, 2047, 2048, 99_999):
        s = store_bench.spec(i)
        keys = store_bench.rolloutlog_event(s).audit_keys()
        index = store_bench._index_keys(s)
        assert index[:3] == (keys.group_id, keys.prompt_index, keys.target_step), i
        assert keys.group_id is not None and keys.prompt_index is None, i


def test_deferred_layout_reports_the_append_path_and_the_sustained_rate(
    result: dict[str, Any],
) -> None:
    deferred = result["systems"]["sql_deferred_index"]
    # Its catch-ups are part of the sustained rate, not of the append path's.
    assert deferred["catch_up_seconds"] > 0
    assert deferred["with_catch_up_eps"] < deferred["append_eps"]
    ratios = result["ratios"]
    assert (
        ratios["append_sql_deferred_index_with_catch_up_vs_today"]
        < ratios["append_sql_deferred_index_vs_today"]
    )
