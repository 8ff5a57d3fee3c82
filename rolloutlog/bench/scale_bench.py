"""``rolloutlog bench scale``: does the log keep its costs as history grows?

Two logs of the same realistic run (:func:`domain_bench.generate_log`): a baseline of
100k events and one of ``--events`` (default 10M). On each, in the same process:

* **audit lookups** (SQLite): median of random lookups of a prompt's history and of a
  step's batch (:func:`rolloutlog.controller.rollout_index.read_where`, the
  :class:`SqlAudit` canned queries, and, a few times, the view-based queries they
  replaced). Target: < 50 ms at 10M.
* **restore** of the checkpoint at the end of each log. Target: ratio 10M / 100k <= 1.5.
* **append rate** of ``--window`` more events, alternating batch by batch between the
  logs. Target: ratio >= 0.8.

``reuse_dir`` keeps and reuses generated logs (``scale-<N>.db`` and ``.json``).
"""

from __future__ import annotations

import gc
import json
import math
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from rolloutlog.controller.rollout_controller import replay
from rolloutlog.controller.rollout_index import attach, read_indexed, read_where
from rolloutlog.controller.sql_audit import Q_PROMPT_VIEW, Q_STEP_VIEW, SqlAudit
from rolloutlog.eventstore import EventStore, NewEvent, migrate

from . import domain_bench
from ._common import sqlite_file_bytes
from .domain_bench import FULL_SIZES, GeneratedLog, generate_log, machine_info, size_label

TARGETS: dict[str, tuple[str, float]] = {
    "append_10m_vs_100k": (">=", 0.8),
    "restore_10m_vs_100k": ("<=", 1.5),
}
#: Lookups slower than this at the large size miss the target.
LOOKUP_TARGET_MS = 50.0
_ProgressFn = Callable[[str], None]


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3 if xs else math.nan


def _meta_path(db: Path) -> Path:
    return db.with_suffix(".json")


def obtain_log(db_dir: Path, events: int, *, reuse: bool, progress: _ProgressFn) -> GeneratedLog:
    """Generate (or, with ``reuse``, load) the ``events``-event log in ``db_dir``."""
    db = db_dir / f"scale-{events}.db"
    meta = _meta_path(db)
    run_id = f"scale-{events}"
    rollout = domain_bench.workload_config(FULL_SIZES.groups_per_step, FULL_SIZES.group_size)
    if reuse and db.exists() and meta.exists():
        info = json.loads(meta.read_text())
        url = f"sqlite:///{db}"
        engine = sa.create_engine(url)
        try:
            with engine.connect() as conn:
                current = migrate.current_revision(conn)
            if current != migrate.head_revision():
                progress(f"scale: upgrading {db.name} from {current} to the current schema")
                migrate.upgrade(engine)
        finally:
            engine.dispose()
        store = EventStore.open(url)
        try:
            state = replay(store, run_id, info["checkpoint_offset"]).state
        finally:
            store.close()
        progress(f"scale: reusing the {size_label(events)}-event log {db}")
        return GeneratedLog(
            url=url, run_id=run_id, rollout=rollout,
            checkpoint_offset=info["checkpoint_offset"], events=info["events"],
            snapshot_offsets=info.get("snapshot_offsets", []), generate_s=info["generate_s"],
            writer_busy_s=info.get("writer_busy_s", math.nan), verify_s=0.0,
            db_bytes=sqlite_file_bytes(db), state=state,
        )  # fmt: skip
    for stale in db_dir.glob(db.name + "*"):
        stale.unlink()
    progress(f"scale: generating the {size_label(events)}-event log")
    log = generate_log(db, run_id, events, FULL_SIZES, progress=progress)
    meta.write_text(
        json.dumps(
            {
                "checkpoint_offset": log.checkpoint_offset,
                "events": log.events,
                "snapshot_offsets": log.snapshot_offsets,
                "generate_s": log.generate_s,
                "writer_busy_s": log.writer_busy_s,
            }
        )
    )
    return log


# ---------------------------------------------------------------------------- lookups
def time_lookups(
    log: GeneratedLog, lookups: int, view_repeats: int, seed: int = 7
) -> dict[str, Any]:
    """Median latency (ms) of random prompt and step lookups on ``log``."""
    rng = random.Random(seed)
    prompts = rng.choices(range(max(1, log.state.dataset_cursor)), k=lookups)
    steps = rng.choices(range(max(1, log.state.train_step)), k=lookups)
    store = EventStore.open(log.url)
    audit = SqlAudit(log.url, limit=None, timeout_s=None)
    samples: dict[str, list[float]] = {
        "read_where_prompt": [],
        "sql_prompt_history": [],
        "read_where_step": [],
        "sql_step_batch": [],
    }
    rows: dict[str, int] = dict.fromkeys(samples, 0)
    try:
        for p, s in zip(prompts, steps, strict=True):
            for name, call in (
                ("read_where_prompt", lambda p=p: read_where(store, log.run_id, prompt_index=p)),
                ("sql_prompt_history", lambda p=p: audit.prompt_history(log.run_id, p).rows),
                ("read_where_step", lambda s=s: read_where(store, log.run_id, train_step=s)),
                ("sql_step_batch", lambda s=s: audit.step_batch(log.run_id, s).rows),
            ):
                t0 = time.perf_counter()
                got = call()
                samples[name].append(time.perf_counter() - t0)
                rows[name] += len(got)
        views: dict[str, list[float]] = {"view_prompt_history": [], "view_step_batch": []}
        for i in range(view_repeats):
            for name, sql, params in (
                ("view_prompt_history", Q_PROMPT_VIEW, {"prompt_index": prompts[i]}),
                ("view_step_batch", Q_STEP_VIEW, {"train_step": steps[i]}),
            ):
                t0 = time.perf_counter()
                audit.select(sql, {"run_id": log.run_id, **params}, limit=None)
                views[name].append(time.perf_counter() - t0)
    finally:
        audit.close()
        store.close()
    out: dict[str, Any] = {f"{k}_ms": _median_ms(v) for k, v in samples.items()}
    out.update({f"{k}_ms": _median_ms(v) for k, v in views.items()})
    out["lookups"] = lookups
    out["view_repeats"] = view_repeats
    out["mean_rows"] = {k: v / max(1, lookups) for k, v in rows.items()}
    return out


# ---------------------------------------------------------------------------- appends
def _append_source(log: GeneratedLog, window: int) -> list[NewEvent]:
    """``window`` realistic events (the start of ``log``'s run) as new events."""
    store = EventStore.open(log.url)
    try:
        # The controller's derived keys, as rollout_index.encode attaches them.
        return [
            NewEvent(
                r.type,
                r.schema_version,
                r.payload,
                r.recorded_at,
                (r.group_id, r.prompt_index, r.target_step, r.train_step, r.weight_version),
            )
            for r in read_indexed(store, log.run_id, 1, window)
        ]
    finally:
        store.close()


def _shifted(events: list[NewEvent], group_shift: int, prompt_shift: int) -> list[NewEvent]:
    out = []
    for e in events:
        assert e.derived is not None
        gid, pidx, *rest = e.derived
        gid = None if gid is None else gid + group_shift
        pidx = None if pidx is None else pidx + prompt_shift
        out.append(e._replace(derived=(gid, pidx, *rest)))
    return out


def time_appends(
    logs: dict[str, GeneratedLog], source: list[NewEvent], batch: int
) -> dict[str, dict[str, Any]]:
    """Append ``source`` to the end of each log, batch by batch, alternating logs."""
    stores = {label: EventStore.open(log.url) for label, log in logs.items()}
    for store in stores.values():
        attach(store)
    plans: dict[str, list[NewEvent]] = {}
    state: dict[str, list[int]] = {}
    busy: dict[str, list[float]] = {label: [] for label in logs}
    try:
        for label, log in logs.items():
            store = stores[label]
            with store.engine.connect() as conn:
                gmax, pmax = conn.exec_driver_sql(
                    "SELECT MAX(group_id), MAX(prompt_index) FROM rollout_index WHERE run_id = ?",
                    (log.run_id,),
                ).one()
            plans[label] = _shifted(source, (gmax or 0) + 1, (pmax or 0) + 1)
            info = store.get_run(log.run_id)
            state[label] = [info.last_seq + 1, info.current_epoch, info.last_seq]
        gc.collect()
        for i in range(0, len(source), batch):
            order = list(logs) if (i // batch) % 2 == 0 else list(reversed(list(logs)))
            for label in order:
                nxt, epoch, _ = state[label]
                chunk = plans[label][i : i + batch]
                t0 = time.perf_counter()
                stores[label].append(logs[label].run_id, chunk, expected_seq=nxt, epoch=epoch)
                busy[label].append(time.perf_counter() - t0)
                state[label][0] = nxt + len(chunk)
    finally:
        for store in stores.values():
            store.close()
    out: dict[str, dict[str, Any]] = {}
    for label in logs:
        total = sum(busy[label])
        out[label] = {
            "log_events_before": state[label][2],
            "appended": len(source),
            "batch": batch,
            "seconds": total,
            "events_per_s": len(source) / total if total else math.nan,
            "batch_median_ms": _median_ms(busy[label]),
        }
    return out


# ---------------------------------------------------------------------------- the benchmark
def run_scale_benchmark(
    *,
    events: int = 10_000_000,
    baseline_events: int = 100_000,
    window: int = 100_000,
    batch: int = 2_000,
    lookups: int = 200,
    view_repeats: int = 2,
    restore_repeats: int = 3,
    db_dir: Path,
    reuse: bool = True,
    progress: _ProgressFn | None = None,
) -> dict[str, Any]:
    """Run every part; returns the JSON-ready result with ``ratios`` and lookup latencies."""
    say = progress or (lambda _msg: None)
    if events <= baseline_events:
        raise ValueError(f"--events ({events}) must exceed the baseline ({baseline_events})")
    if window > baseline_events:
        raise ValueError(f"the window ({window}) must not exceed the baseline log")
    db_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    logs = {
        "small": obtain_log(db_dir, baseline_events, reuse=reuse, progress=say),
        "large": obtain_log(db_dir, events, reuse=reuse, progress=say),
    }
    result: dict[str, Any] = {
        "benchmark": "scale",
        "machine": machine_info(),
        "sizes": {"small": baseline_events, "large": events, "window": window, "batch": batch},
        "logs": {k: v.to_dict() for k, v in logs.items()},
    }
    say(f"scale: {lookups} random prompt and step lookups on each log")
    result["lookups"] = {k: time_lookups(v, lookups, view_repeats) for k, v in logs.items()}
    say(f"scale: timing {restore_repeats} restores of each log")
    restores = domain_bench.time_restores(logs, restore_repeats)
    result["restore"] = restores
    say(f"scale: appending {window:,} events to each log (batches of {batch})")
    source = _append_source(logs["small"], window)
    result["append"] = time_appends(logs, source, batch)
    ratios = {
        "append_10m_vs_100k": domain_bench._ratio(
            result["append"]["large"]["events_per_s"], result["append"]["small"]["events_per_s"]
        ),
        "restore_10m_vs_100k": domain_bench._ratio(
            restores["large"]["restore"]["median_s"], restores["small"]["restore"]["median_s"]
        ),
    }
    result["ratios"] = ratios
    targets: dict[str, Any] = {}
    for name, (op, bound) in TARGETS.items():
        value = ratios[name]
        met = value is not None and (value >= bound if op == ">=" else value <= bound)
        targets[name] = {"op": op, "bound": bound, "met": met}
    large = result["lookups"]["large"]
    for key in ("read_where_prompt_ms", "sql_prompt_history_ms", "read_where_step_ms",
                "sql_step_batch_ms"):  # fmt: skip
        targets[f"lookup_{key}"] = {
            "op": "<",
            "bound": LOOKUP_TARGET_MS,
            "met": large[key] < LOOKUP_TARGET_MS,
        }
    result["targets"] = targets
    result["lookup_latency_ms"] = {
        label: {k: v for k, v in lk.items() if k.endswith("_ms")}
        for label, lk in result["lookups"].items()
    }
    result["total_s"] = time.perf_counter() - started
    return domain_bench._json_safe(result)  # type: ignore[no-any-return]


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def print_scale_report(result: dict[str, Any]) -> None:
    """Plain-text tables of the ratios and latencies."""
    small, large = (size_label(result["sizes"][k]) for k in ("small", "large"))
    print(f"rolloutlog bench scale: {large} events vs {small} (same run, same machine)")
    print(f"{'ratio':<26}{'value':>10}  target")
    for name, value in result["ratios"].items():
        t = result["targets"][name]
        shown = "-" if value is None else f"{value:.3f}"
        print(f"{name:<26}{shown:>10}  {t['op']} {t['bound']}  {'met' if t['met'] else 'MISSED'}")
    print(f"\n{'lookup (median ms)':<26}{small:>10}{large:>10}")
    for key in result["lookup_latency_ms"]["small"]:
        a = result["lookup_latency_ms"]["small"][key]
        b = result["lookup_latency_ms"]["large"][key]
        print(f"{key:<26}{_fmt(a):>10}{_fmt(b):>10}")
    for label in ("small", "large"):
        ap, rs = result["append"][label], result["restore"][label]
        print(
            f"\n{label}: append {ap['events_per_s']:,.0f} ev/s into {ap['log_events_before']:,} "
            f"events; restore median {rs['restore']['median_s']:.3f} s "
            f"({rs['events_replayed']:,} events replayed after the snapshot)"
        )
