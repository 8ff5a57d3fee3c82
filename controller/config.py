"""Run configuration: one pydantic model, validated up front, every knob with its default.

Operator decisions (sampler, staleness bound, retry limits, commit window, telemetry)
live here, not in module constants. Unknown fields are rejected with their name.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

SamplerKind = Literal["in_order", "windowed", "weight_fifo", "ready_first"]
DropPolicy = Literal["replace", "shrink", "fail"]
RecoveryGranularity = Literal["sibling", "group"]


class RolloutConfig(BaseModel):
    """The rollout state machine's rules. Part of the run's fingerprint."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    group_size: int = Field(4, ge=1, description="Completions (siblings) per prompt.")
    groups_per_step: int = Field(8, ge=1, description="Groups in one training batch.")
    sampler: SamplerKind = Field(
        "in_order",
        description="in_order: exact target step; windowed: weights within the staleness "
        "window; weight_fifo: oldest weights first; ready_first: first ready, never evicts.",
    )
    staleness_bound: int = Field(
        1, ge=0, description="S: largest allowed trainer weight version - oldest sibling version."
    )
    lookahead: int = Field(
        1, ge=0, description="L: steps the dispatch cursor may run ahead of the train step."
    )
    spare_pool_size: int = Field(
        2, ge=0, description="Prompts pulled ahead to replace dropped or evicted prompts."
    )
    drop_policy: DropPolicy = Field(
        "replace",
        description="What a dropped prompt does to its step: replace it with a spare (or "
        "borrow), shrink the step, or fail the run.",
    )
    min_step_fraction: float = Field(
        0.5,
        gt=0,
        le=1,
        description="shrink: the smallest fraction of groups_per_step a step may train.",
    )
    attempts_per_sibling: int = Field(
        3, ge=1, description="Dispatch attempts of one sibling before its prompt is dropped."
    )
    recovery_granularity: RecoveryGranularity = Field(
        "sibling",
        description="At restore, reuse finished siblings of unfinished groups (sibling) or "
        "re-run whole groups (group).",
    )
    abort_stale_at_weight_sync: bool = Field(
        True,
        description="Gated samplers (all but ready_first) abort in-flight siblings that "
        "would be stale when new weights are published.",
    )


class StoreConfig(BaseModel):
    """Where the log lives and how it is written."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    url: str = Field(
        "sqlite:///runs/rolloutlog.db", description="sqlite:///PATH or postgresql+psycopg://..."
    )
    group_commit_window_ms: float = Field(
        5.0, ge=0, description="Longest a submitted event waits for its batch's transaction."
    )
    group_commit_max_batch: int = Field(2000, ge=1, description="Most events per transaction.")
    commit_writer: Literal["auto", "thread", "process"] = Field(
        "thread",
        description="Where appends run: on the group committer's thread in this process "
        "(the default), or, opted in, in a writer process of their own (its own "
        "connection, on another core; this process only serialises each command, so a "
        "busy event loop or trainer neither slows commits nor is slowed by them; POSIX "
        "only). auto: the process wherever the log is a database file or server, the "
        "thread for the in-memory store.",
    )
    writer_start_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Longest a writer process may take to open the database before the "
        "committer fails (WriterProcessError).",
    )
    writer_reply_timeout_s: float = Field(
        120.0,
        gt=0,
        description="Longest a writer process may go without answering while commands "
        "wait to be committed (plus writer_lock_timeout_s) before it is killed and the "
        "committer fails (WriterProcessError).",
    )
    log_check_threads: int = Field(
        2,
        ge=1,
        description="Threads that check, while a restore or takeover replays the tail "
        "after a snapshot, that every event before the snapshot is stored (a count over "
        "the run's offsets, in the database: it grows with the log, so it is split into "
        "this many ranges counted at once).",
    )
    snapshot_interval: int = Field(
        50_000, ge=0, description="Events between state snapshots (0: never snapshot)."
    )
    snapshot_slice_ms: float = Field(
        5.0,
        gt=0,
        description="Once a snapshot is due, a command re-encodes the groups it and earlier "
        "commands touched until this long after it started (its own work counts; at least "
        "32 groups each, so a snapshot progresses behind long commands too). The snapshot "
        "is taken when none is left; joining and compressing run on the snapshot thread.",
    )
    require_stored_payloads: bool = Field(
        True,
        description="Refuse a CompleteSibling whose payload is neither put with it nor "
        "stored (false: skip the check, for synthetic benchmarks that store no payloads).",
    )
    writer_lock_timeout_s: float = Field(
        60.0,
        gt=0,
        description="PostgreSQL: longest a commit waits for the run's row lock before it fails.",
    )
    takeover_timeout_s: float = Field(
        30.0,
        gt=0,
        description="PostgreSQL: longest a takeover (open, restore) waits for the run's row lock "
        "held by another writer before it fails naming that writer.",
    )


class TelemetryConfig(BaseModel):
    """Metrics export. Telemetry never stops a run."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    enabled: bool = Field(False, description="Serve Prometheus metrics while running.")
    port: int = Field(9400, ge=0, le=65535, description="HTTP port of the metrics exporter.")
    host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="Address the metrics exporter listens on (0.0.0.0: every interface).",
    )
    tensorboard_dir: str | None = Field(
        None,
        description="Write per-step scalars as TensorBoard event files under "
        "TENSORBOARD_DIR/<run_id> while training (independent of enabled).",
    )
    max_engine_labels: int = Field(
        16,
        ge=1,
        description="Engines that get their own value of the engine label of the per-engine "
        'metrics (in order of first appearance); later engines are counted as engine="other", '
        "so a fleet that churns engine ids cannot grow the series without bound.",
    )


def fingerprint(data: object) -> str:
    """A stable short hash of JSON-serialisable data."""
    raw = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(raw).hexdigest()[:32]


class ConfigError(ValueError):
    """A configuration file or value is invalid; the message names the field."""


def describe_validation_error(exc: ValidationError, source: str) -> str:
    """One line per invalid field: ``field.path: message``."""
    lines = [f"invalid configuration in {source}:"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(root)"
        lines.append(f"  {loc}: {err['msg']}")
    return "\n".join(lines)


def load_yaml(path: Path, model: type[BaseModel]) -> BaseModel:
    """Load and validate a YAML file into ``model``; errors name the offending field."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read configuration {path}: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"configuration {path} is not UTF-8 text (byte {exc.start}: {exc.reason}); "
            "save it as UTF-8"
        ) from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"configuration {path} is not valid YAML: {exc}") from exc
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"configuration {path} must be a mapping, got {type(raw).__name__}")
    # YAML's true/false are not numbers: `steps: true` must not run one step.
    problems = _booleans_as_numbers(raw, model)
    if problems:
        raise ConfigError("\n".join([f"invalid configuration in {path}:", *problems]))
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, str(path))) from exc


def _allows_bool(annotation: Any) -> bool:
    if annotation is bool or annotation is Any:
        return True
    if get_origin(annotation) is Literal:
        return any(isinstance(a, bool) for a in get_args(annotation))
    return any(_allows_bool(a) for a in get_args(annotation))


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _nested_model(arg)
        if found is not None:
            return found
    return None


def _booleans_as_numbers(
    raw: dict[str, Any], model: type[BaseModel], prefix: str = ""
) -> list[str]:
    """One line per field given a boolean where the model wants no boolean (any section)."""
    problems: list[str] = []
    for key, value in raw.items():
        field = model.model_fields.get(str(key))
        if field is None:
            continue  # unknown fields are reported by validation, with their name
        where = f"{prefix}{key}"
        if isinstance(value, bool) and not _allows_bool(field.annotation):
            problems.append(
                f"  {where}: a boolean ({str(value).lower()}) is not a valid value here"
            )
        elif isinstance(value, dict):
            nested = _nested_model(field.annotation)
            if nested is not None:
                problems.extend(_booleans_as_numbers(value, nested, f"{where}."))
    return problems
