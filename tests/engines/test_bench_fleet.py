"""``rolloutlog bench fleet`` runs end to end on a small configuration."""

from __future__ import annotations

import json

from click.testing import CliRunner

from rolloutlog.cli import main


def test_bench_fleet_json_reports_scaling_and_overhead() -> None:
    # Each run lasts rounds x latency = 0.5 s whatever the engine count; at 0.05 s latency
    # a 0.1 s stall of the loaded CI machine could make two engines look no faster.
    args = ["bench", "fleet", "--max-engines", "2", "--latency", "0.25", "--rounds", "2"]
    result = CliRunner().invoke(main, [*args, "--overhead-requests", "16", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["throughput_2_vs_1"] > 1.0  # two engines serve more than one
    one, two = report["scaling"]
    assert (one["engines"], two["engines"]) == (1, 2)
    assert two["served_per_engine"][0] > 0 and two["served_per_engine"][1] > 0
    assert report["overhead"]["requests"] == 16
    assert report["overhead"]["pick_us"] > 0
    assert "overhead_ms_per_request" in report and "goals_met" in report
