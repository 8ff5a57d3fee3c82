"""``scripts/gpu/trl_nccl_check.py`` on a machine without GPUs: its argument parsing and
its one-line refusal (the check itself needs two CUDA GPUs and vLLM)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "trl_nccl_check.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("trl_nccl_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_arguments() -> None:
    script = _script()
    args = script.parse_args([])
    assert (args.trainer_gpu, args.engine_gpu, args.port, args.model) == (0, 1, 0, None)
    args = script.parse_args(["--engine-gpu", "3", "--port", "8123", "--timeout-s", "60"])
    assert (args.engine_gpu, args.port, args.timeout_s) == (3, 8123, 60.0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--engine-gpu", "0"], "--trainer-gpu and --engine-gpu must differ"),
        (["--port", "70000"], "--port in 0..65535"),
        (["--timeout-s", "0"], "--timeout-s and --tolerance must be > 0"),
        (["--trainer-gpu", "x"], "invalid int value: 'x'"),
    ],
)
def test_bad_arguments_are_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        _script().parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]


def test_refuses_without_cuda_in_one_line() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has two CUDA GPUs: the script would run the check")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("trl_nccl_check: needs ")
    if not torch.cuda.is_available():
        assert "torch.cuda.is_available() is False" in lines[0]
    assert proc.stdout == ""
