"""``rolloutlog bench``: benchmarks that print ratios against baselines measured in the same run."""

from __future__ import annotations

import click


@click.group()
def bench() -> None:
    """Benchmarks (each prints ratios against a baseline measured in the same run)."""


from .bench_durability import durability  # noqa: E402

bench.add_command(durability)
