"""``rolloutlog demo --task multi-turn`` end to end, as a real subprocess: the worker is
SIGKILLed mid-conversation (a trajectory with durable turns and no end), a second one
resumes each trajectory after its last durable turn, and the summary (from the SQL log
and the calculator's own execution ledger) shows the zeros; the summary's counting is
also checked against a ledger with a duplicated execution."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from rolloutlog.eventstore import EventStore
from rolloutlog.grpo.demo import multi_turn_summary
from rolloutlog.grpo.multiturn_task import CalculatorLedger

from .conftest import rolloutlog

STEPS = 12
ZEROS = (
    "trajectories_lost",
    "model_calls_regenerated_after_restore",
    "tool_calls_executed_twice",
    "prompts_trained_twice",
)


@pytest.mark.slow
def test_multi_turn_demo_kills_mid_conversation_and_resumes(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'log.db'}"
    proc = rolloutlog(
        "demo",
        "--task",
        "multi-turn",
        "--json",
        "--steps",
        str(STEPS),
        "--checkpoint-every",
        "4",
        "--workdir",
        str(tmp_path),
        "--db",
        db,
        timeout=300,
    )
    assert proc.returncode == 0, f"demo failed:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ZEROS:
        assert s[key] == 0, (key, s)
    assert s["turns_salvaged"] > 0
    assert s["reward_first"] < s["reward_last"], s["rewards"]
    assert s["ok"] is True and s["task"] == "multi-turn"
    assert s["steps_trained"] == STEPS and s["invariant_violations"] == []
    assert s["killed_after_step"] >= 4 and isinstance(s["restored_from_offset"], int)
    assert s["model_calls"] > 0 and s["trajectories"] > 0
    # The calculator ran, each key once (its own ledger, read here independently).
    ledger = CalculatorLedger(tmp_path / "checkpoints" / s["run_id"] / "calculator-ledger.tsv")
    entries = ledger.entries()
    assert entries and len(entries) == s["tool_calls_executed"]
    assert max(Counter(k for k, _ in entries).values()) == 1
    # The summary counts a duplicated execution (a tool run twice) when there is one.
    with EventStore.open(db) as store:
        again = multi_turn_summary(store, s["run_id"], [*entries, entries[0]])
    assert again["tool_calls_executed_twice"] == 1
    assert again["turns_salvaged"] == s["turns_salvaged"]


def test_multi_turn_demo_refuses_other_backends() -> None:
    proc = rolloutlog("demo", "--task", "multi-turn", "--backend", "vllm", timeout=60)
    assert proc.returncode == 2
    assert "--task multi-turn runs on --backend torch or deterministic" in proc.stderr
