"""``rolloutlog bench fleet``: routing overhead and scaling of the engine fleet.

Registered into the ``bench`` group by :mod:`rolloutlog.cli.bench`; the benchmark module
is imported when the command runs.
"""

from __future__ import annotations

import json
import sys

import click


@click.command("fleet")
@click.option("--max-engines", default=8, show_default=True, type=click.IntRange(min=2))
@click.option(
    "--latency", default=0.2, show_default=True, help="Seconds per request on a fake engine."
)
@click.option(
    "--capacity", default=4, show_default=True, help="Requests one fake engine serves at once."
)
@click.option("--rounds", default=10, show_default=True, help="Offered load: rounds of requests.")
@click.option("--overhead-requests", default=400, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def fleet(
    max_engines: int,
    latency: float,
    capacity: int,
    rounds: int,
    overhead_requests: int,
    as_json: bool,
) -> None:
    """Fleet scaling (1 vs N fake engines) and per-request routing overhead."""
    from rolloutlog.bench.fleet_bench import main

    if latency <= 0 or capacity < 1 or rounds < 1 or overhead_requests < 8:
        raise click.BadParameter(
            "need --latency > 0, --capacity >= 1, --rounds >= 1, --overhead-requests >= 8"
        )
    result = main(
        max_engines=max_engines,
        latency=latency,
        capacity=capacity,
        rounds=rounds,
        overhead_requests=overhead_requests,
    )
    if as_json:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
        return
    for row in result["scaling"]:
        click.echo(
            f"{row['engines']} engine(s): {row['requests_per_s']:.0f} req/s "
            f"(ideal {row['ideal_requests_per_s']:.0f}), served {row['served_per_engine']}"
        )
    key = f"throughput_{max_engines}_vs_1"
    click.echo(f"{key}: {result[key]:.2f} (goal {result['goals'][key]})")
    o = result["overhead"]
    click.echo(
        f"per request: direct {o['direct_ms_median']:.3f} ms, fleet {o['fleet_ms_median']:.3f} ms, "
        f"overhead {o['overhead_ms_per_request']:.3f} ms (goal <= 1), pick {o['pick_us']:.1f} µs"
    )
