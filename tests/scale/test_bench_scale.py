"""``rolloutlog bench scale`` at toy sizes: the result's shape and its sanity checks."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from rolloutlog.cli import main as cli_main

LOOKUPS = (
    "read_where_prompt_ms",
    "sql_prompt_history_ms",
    "read_where_step_ms",
    "sql_step_batch_ms",
    "view_prompt_history_ms",
    "view_step_batch_ms",
)


def test_bench_scale_json(tmp_path: Path) -> None:
    args = [
        "bench", "scale", "--events", "60000", "--baseline-events", "30000", "--window",
        "3000", "--batch", "500", "--lookups", "5", "--view-repeats", "1",
        "--restore-repeats", "1", "--db-dir", str(tmp_path), "--json",
    ]  # fmt: skip
    out = CliRunner().invoke(cli_main, args)
    assert out.exit_code == 0, out.output
    result = json.loads(out.output)
    assert set(result["ratios"]) == {"append_10m_vs_100k", "restore_10m_vs_100k"}
    assert all(v is not None and v > 0 for v in result["ratios"].values())
    for label in ("small", "large"):
        lat = result["lookup_latency_ms"][label]
        for key in LOOKUPS:
            assert lat[key] is not None and lat[key] >= 0
        # The lookups found rows: the generated log has its rollout index.
        rows = result["lookups"][label]["mean_rows"]
        assert all(rows[k] > 0 for k in ("read_where_prompt", "read_where_step")), rows
        assert result["append"][label]["appended"] == 3000
        assert result["restore"][label]["invariants"] == "pass"
    assert result["logs"]["large"]["events"] >= 60000
    # The logs are kept and reused by the next run.
    assert (tmp_path / "scale-60000.db").exists() and (tmp_path / "scale-60000.json").exists()
    again = CliRunner().invoke(cli_main, [*args[:-1]])
    assert again.exit_code == 0, again.output
    assert "append_10m_vs_100k" in again.output


def test_bench_scale_refuses_bad_sizes(tmp_path: Path) -> None:
    out = CliRunner().invoke(
        cli_main,
        ["bench", "scale", "--events", "1000", "--baseline-events", "2000",
         "--db-dir", str(tmp_path)],
    )  # fmt: skip
    assert out.exit_code == 2 and "must exceed the baseline" in out.output
