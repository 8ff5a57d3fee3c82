"""``rolloutlog replay --explain trajectory:G[/S]``: a multi-turn trajectory turn by turn,
on a real multi-turn run with a restore (abandoned turns reused by the resume)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

_AUDIT = str(Path(__file__).resolve().parents[1] / "audit")
if _AUDIT not in sys.path:
    sys.path.insert(0, _AUDIT)

from mt_audit_helpers import BuiltMtRun, build_mt_run  # noqa: E402

from rolloutlog.cli import main  # noqa: E402
from rolloutlog.controller import replay_tool as rt  # noqa: E402
from rolloutlog.controller.domain.trajectory import fold_trajectories  # noqa: E402
from rolloutlog.eventstore import EventStore  # noqa: E402


@pytest.fixture(scope="module")
def mt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BuiltMtRun]:
    root = tmp_path_factory.mktemp("mt-replay")
    url = f"sqlite:///{root / 'log.db'}"
    with EventStore.open(url) as store:
        built = build_mt_run(store, url, root / "ledger.tsv")
    yield built
    built.audit.close()


def test_every_trajectory_turn_by_turn(mt: BuiltMtRun) -> None:
    book = fold_trajectories((epoch, e) for _, epoch, e in mt.turn_events)
    epoch_of = {seq: epoch for seq, epoch, _ in mt.turn_events}
    resumed_seen = 0
    with EventStore.open(mt.url) as store:
        for (group, sibling), traj in book.items():
            found = rt.explain_trajectory(store, mt.run_id, group, sibling)
            t = found[-1]  # the sibling's newest trajectory: the book's
            assert (t["group_id"], t["sibling"]) == (group, sibling)
            assert (t["data_pass"], t["prompt_index"]) == traj.prompt
            assert t["model_calls"] == traj.turns and t["resumes"] == traj.resumes
            assert t["completed"] == traj.completed
            assert t["model_tokens"] == sum(traj.loss_mask())
            steps = [s for turn in t["turns"] for s in turn["steps"]]
            offsets = [s["offset"] for s in steps]
            assert offsets == sorted(offsets) and offsets[0] == t["trajectory_offset"]
            for s in steps:
                assert s["in_history"] == (s["offset"] in mt.history)
                assert s["epoch"] == epoch_of[s["offset"]]
            # A turn's steps may be split by a resume (a tool call answered by the new
            # attempt's status check): its number then appears again after the resume.
            numbered = [turn["turn"] for turn in t["turns"] if turn["turn"] not in (-1, None)]
            assert numbered == sorted(numbered)
            assert sorted(set(numbered)) == list(range(traj.turns))
            by_turn: dict[int, list[dict[str, object]]] = {}
            for turn in t["turns"]:
                if turn["turn"] not in (-1, None):
                    by_turn.setdefault(turn["turn"], []).extend(turn["steps"])
            for turn_steps in by_turn.values():
                kinds = [s["kind"] for s in turn_steps]
                assert kinds[0] == "model_call" and kinds.count("model_call") == 1
                requests = [s for s in turn_steps if s["kind"] == "tool_request"]
                answers = [s for s in turn_steps if s["kind"] in ("tool_result", "tool_failure")]
                assert {s["idempotency_key"] for s in answers} <= {
                    s["idempotency_key"] for s in requests
                }
            if traj.resumes:
                resumed_seen += 1
                resumes = [s for s in steps if s["kind"] == "resumed"]
                assert len(resumes) == traj.resumes
                resume = resumes[0]
                before = [s for s in steps if s["offset"] < resume["offset"]]
                assert resume["model_calls_reused"] == sum(
                    s["kind"] == "model_call" for s in before
                )
        assert resumed_seen > 0
        # A whole group: one trajectory per sibling (at least).
        group = next(iter(book))[0]
        assert {t["sibling"] for t in rt.explain_trajectory(store, mt.run_id, group)} == {
            s for g, s in book if g == group
        }


def test_the_cli_shows_a_resumed_trajectory(mt: BuiltMtRun) -> None:
    book = fold_trajectories((epoch, e) for _, epoch, e in mt.turn_events)
    group, sibling = next(k for k, t in book.items() if t.resumes)
    runner = CliRunner()
    spec = f"trajectory:{group}/{sibling}"
    args = ["replay", mt.url, "--run", mt.run_id, "--explain", spec]
    out = runner.invoke(main, [*args, "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    with EventStore.open(mt.url) as store:
        want = rt.explain_trajectory(store, mt.run_id, group, sibling)
    assert data["trajectories"] == json.loads(json.dumps(want, default=str))
    text = runner.invoke(main, args)
    assert text.exit_code == 0, text.output
    assert f"group {group} sibling {sibling}" in text.output
    assert "resumed from epoch" in text.output and "abandoned" in text.output
    assert "turn 0" in text.output and "model call:" in text.output


def test_bad_or_unknown_trajectories_are_refused(mt: BuiltMtRun) -> None:
    runner = CliRunner()
    base = ["replay", mt.url, "--run", mt.run_id, "--explain"]
    for spec in ("trajectory:1/x", "group:1/0", "trajectory:"):
        bad = runner.invoke(main, [*base, spec])
        assert bad.exit_code == 2 and "trajectory:GROUP[/SIBLING]" in bad.output, spec
    missing = runner.invoke(main, [*base, "trajectory:99999"])
    assert missing.exit_code == 1
    assert "no trajectory of trajectory:99999 in run mt" in missing.output
