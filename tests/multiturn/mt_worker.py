"""A live multi-turn run for the SIGKILL test.

Usage: python mt_worker.py URL LEDGER STEPS
Starts the run, trains step 0, checkpoints (prints ``CKPT <offset>``), then trains on;
the calculator tool prints ``RUNNING <key>`` after its side effect and before its result
(it then sleeps, so a kill lands between the two). Prints ``DONE`` at the end.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from mt_task import Ledger, runtime, start

from rolloutlog.eventstore import EventStore

WEIGHTS = [("w", torch.zeros(1))]


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class LoudLedger(Ledger):
    def add(self, a: int, b: int, idempotency_key: str) -> str:
        result = str(int(a) + int(b))
        with self.path.open("a") as f:
            f.write(f"{idempotency_key}\t{result}\n")
        say(f"RUNNING {idempotency_key}")
        import time

        time.sleep(self.delay_s)
        return result


async def main(url: str, ledger_path: str, steps: int) -> None:
    store = EventStore.open(url)
    ctl = start(store)
    rt, _, _ = runtime(ctl, LoudLedger(Path(ledger_path), delay_s=0.3))
    await rt.start()
    for step in range(steps):
        await rt.next_batch(step, timeout=120)
        await rt.report_trained(step, step + 1)
        await rt.publish_weights(WEIGHTS, step + 1)
        if step == 0:
            say(f"CKPT {await rt.checkpoint(1)}")
    await rt.close()
    ctl.close()
    store.close()
    say("DONE")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
