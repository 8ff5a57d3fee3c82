"""``rolloutlog report`` (issue 15.3): one self-contained HTML file, opened in headless
Chromium (Debian's ``chromium``), every chart drawn, the screenshot not blank."""

from __future__ import annotations

import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from click.testing import CliRunner
from prom_server import kill_group, require_binary

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "metrics"))

from metrics_helpers import RUN_ID, run_scenario

from rolloutlog.cli import main as cli_main

CHARTS = ("reward", "staleness", "throughput", "outcomes", "timeline", "restores")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A report of the scripted run (failures, drops, evictions, a crash, a restore)."""
    tmp = tmp_path_factory.mktemp("report")
    url = f"sqlite:///{tmp / 'log.db'}"
    run_scenario(url)
    out = tmp / "report.html"
    result = CliRunner().invoke(cli_main, ["report", url, "--run", RUN_ID, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"wrote {out} (6 charts, run {RUN_ID})" in result.output
    return out


def _chromium(args: list[str], tmp: Path, timeout: float = 120.0) -> bytes:
    """Run headless Chromium (own process group, fresh profile, no network services)."""
    binary = require_binary("chromium")
    proc = subprocess.Popen(
        [
            binary,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp}",
            "--virtual-time-budget=15000",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, proc.returncode
    return out


def _png_pixels(path: Path) -> tuple[int, int, bytes]:
    """Width, height and the decompressed (filtered) scanlines of a PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height = 8, b"", 0, 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    return width, height, zlib.decompress(idat)


def test_the_report_is_self_contained(report: Path) -> None:
    page = report.read_text()
    # No external resource: no script, stylesheet or image fetched from anywhere.
    assert not re.search(r"<script[^>]+src=", page)
    assert not re.search(r"<link[^>]+href=", page)
    assert "cdn.plot.ly" not in page.split("</head>")[1]
    assert page.count('class="plotly-graph-div"') == len(CHARTS)
    for chart in CHARTS:
        assert f'id="chart-{chart}"' in page


def test_every_chart_renders_in_headless_chromium(report: Path, tmp_path: Path) -> None:
    dom = _chromium(["--dump-dom", report.as_uri()], tmp_path / "dom-profile").decode()
    marker = re.search(r'<p id="render-status" data-plots="(\d+)" data-drawn="(\d+)"', dom)
    assert marker is not None, dom[:2000]
    assert marker.groups() == (str(len(CHARTS)), str(len(CHARTS)))
    # Each chart's div holds a drawn svg with its traces (or the table).
    for chart in CHARTS:
        start = dom.index(f'id="chart-{chart}"')
        end = dom.find('class="plotly-graph-div"', start + 1)
        chunk = dom[start : end if end > 0 else len(dom)]
        assert "main-svg" in chunk, chart
        assert 'class="trace' in chunk or 'class="table' in chunk, chart

    shot = tmp_path / "report.png"
    _chromium(
        ["--window-size=1200,3200", f"--screenshot={shot}", report.as_uri()],
        tmp_path / "shot-profile",
    )
    width, height, pixels = _png_pixels(shot)
    assert (width, height) == (1200, 3200)
    # A blank page compresses to a handful of byte values; charts have many colours.
    assert len(set(pixels)) > 50, len(set(pixels))


def test_a_missing_plotly_names_the_extra(
    report: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "plotly.graph_objects", None)
    url = "sqlite:///" + str(report.parent / "log.db")
    out = tmp_path / "r.html"
    result = CliRunner().invoke(cli_main, ["report", url, "--out", str(out)])
    assert result.exit_code == 1
    assert "pip install 'rolloutlog[report]'" in result.output
    assert not out.exists()
    unknown = CliRunner().invoke(cli_main, ["report", url, "--run", "nope", "--out", str(out)])
    assert unknown.exit_code == 1 and "no run 'nope'" in unknown.output
