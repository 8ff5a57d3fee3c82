"""``rolloutlog bench fleet``: routing overhead and scaling of the engine fleet.

Registered into the ``bench`` group by :mod:`rolloutlog.cli.bench`; the benchmark module
is imported when the command runs.
"""

from __future__ import annotations

import json
import sys

import click

from ._options import json_option, picked, shown


@click.command("fleet")
@shown("--max-engines", default=8, type=click.IntRange(min=2))
@shown("--latency", default=0.2, help="Seconds per request on a fake engine.")
@shown("--capacity", default=4, help="Requests one fake engine serves at once.")
@shown("--rounds", default=10, help="Offered load: rounds of requests.")
@shown("--overhead-requests", default=400)
@json_option()
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
    result = main(**picked("max_engines", "latency", "capacity", "rounds", "overhead_requests"))
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
