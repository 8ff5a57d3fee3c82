"""``scripts/apt-get-wait`` (used by ``scripts/setup.sh``): an apt-get that another apt's
lock refuses is retried until the lock is free or the wait is over; other errors fail at
once. apt-get itself is a stand-in on PATH (no root, no network)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LOCKED = "E: Could not get lock /var/lib/apt/lists/lock. It is held by process 7 (apt-get)"


def _fake_apt(tmp_path: Path, failures: int, message: str = LOCKED) -> Path:
    """An apt-get that fails ``failures`` times with ``message``, then succeeds; it logs
    its arguments, one call per line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "apt-get"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$*" >> {tmp_path / "calls"}\n'
        f"n=$(wc -l < {tmp_path / 'calls'})\n"
        f'if [ "$n" -le {failures} ]; then echo "{message}" >&2; exit 100; fi\n'
        "echo done\n"
    )
    fake.chmod(0o755)
    return bin_dir


def _run(tmp_path: Path, bin_dir: Path, wait_s: int) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "APT_LOCK_WAIT_S": str(wait_s)}
    return subprocess.run(
        [str(REPO / "scripts" / "apt-get-wait"), "update", "-qq"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,
    )


def _calls(tmp_path: Path) -> list[str]:
    return (tmp_path / "calls").read_text().splitlines()


def test_a_held_lists_lock_is_waited_for(tmp_path: Path) -> None:
    done = _run(tmp_path, _fake_apt(tmp_path, failures=2), wait_s=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "done"
    assert "another apt holds a lock; waiting" in done.stderr
    assert _calls(tmp_path) == ["-o DPkg::Lock::Timeout=60 update -qq"] * 3


def test_other_errors_and_a_lock_past_the_wait_fail(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    other = _run(one, _fake_apt(one, failures=5, message="E: no space"), wait_s=60)
    assert other.returncode == 100 and "E: no space" in other.stderr
    assert len(_calls(one)) == 1
    late = _run(two, _fake_apt(two, failures=5), wait_s=0)
    assert late.returncode == 100 and "Could not get lock" in late.stderr
    assert len(_calls(two)) == 1


def test_setup_uses_it_for_apt() -> None:
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert "scripts/apt-get-wait update" in setup
    assert "scripts/apt-get-wait install" in setup
