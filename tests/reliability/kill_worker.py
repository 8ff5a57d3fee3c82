"""A live run process for the kill and takeover tests.

Usage: python kill_worker.py URL RUN_ID start|open|restore STEPS
Prints ``READY``, then ``ACK <offset>`` each time flush() acknowledged durability, and
``DONE`` at the end. On losing the run to another epoch it prints ``FENCED <message>``
and exits with status 3.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reliability_harness import WEIGHTS, Prompts, backend, rollout_config

from rolloutlog.controller.config import StoreConfig
from rolloutlog.controller.rollout_controller import RolloutController
from rolloutlog.controller.rollout_runtime import GenerationConfig, RolloutRuntime
from rolloutlog.eventstore import EpochFencedError, EventStore


class BigPrompts(Prompts):
    """Enough prompts that a run never runs out during the kill loop."""

    num_prompts = 1_000_000


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def fenced_cause(exc: BaseException) -> EpochFencedError | None:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, EpochFencedError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


async def main(url: str, run_id: str, mode: str, steps: int) -> int:
    store = EventStore.open(url)
    cfg = StoreConfig(group_commit_window_ms=2, snapshot_interval=200)
    if mode == "start":
        ctl = RolloutController.start(
            store,
            run_id,
            rollout_config(),
            dataset_fingerprint=BigPrompts.fingerprint,
            dataset_size=BigPrompts.num_prompts,
            store_config=cfg,
        )
        say(f"ACK {ctl.checkpoint(0)}")
    elif mode == "open":
        ctl = RolloutController.open(store, run_id, store_config=cfg)
    else:
        offset = max(r.seq for r in store.read_history(run_id) if r.type == "CheckpointMarked")
        ctl, _report = RolloutController.restore(store, run_id, offset, store_config=cfg)
    runtime = RolloutRuntime(ctl, backend(), BigPrompts(), GenerationConfig(max_tokens=4))
    await runtime.start()
    say(f"READY epoch={ctl.epoch} step={ctl.state.train_step}")
    try:
        await runtime.sync_weights(WEIGHTS, ctl.state.weight_version)
        while ctl.state.train_step < steps:
            step = ctl.state.train_step
            await runtime.next_batch(step, timeout=60)
            say(f"ACK {ctl.committer.durable_seq}")
            await runtime.report_trained(step, step + 1)
            await runtime.publish_weights(WEIGHTS, step + 1)
            say(f"ACK {await runtime.checkpoint(step + 1)}")
        say("DONE")
        return 0
    except Exception as exc:
        cause = fenced_cause(exc)
        if cause is not None:
            say(f"FENCED {cause}")
            return 3
        raise
    finally:
        try:
            await runtime.close()  # raises a failed final flush (a fenced one here)
        except Exception as exc:
            if fenced_cause(exc) is None:
                raise
        try:
            ctl.close()
        except Exception as exc:
            if fenced_cause(exc) is None:
                raise


if __name__ == "__main__":
    url, run_id, mode, steps = sys.argv[1:5]
    sys.exit(asyncio.run(main(url, run_id, mode, int(steps))))
