"""Property-based fuzzing of the decoders that face stored or user-written bytes.

- :meth:`EventCodec.decode` on rows with arbitrary or mutated JSON payloads, random
  types and schema versions: it returns an event of the row's type, or raises a
  :class:`StoreError` subclass whose message names the row's offset. Never anything else.
- :func:`decode_arrays` on random and mutated bytes: a valid result or
  :class:`CorruptPayloadError`.
- The run-config loader on random YAML text and random nested mappings: a valid
  :class:`RunConfig` or :class:`ConfigError`. Never anything else.
"""

from __future__ import annotations

import contextlib
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rolloutlog.controller.config import ConfigError
from rolloutlog.controller.domain.events import CODEC
from rolloutlog.eventstore import (
    CorruptPayloadError,
    EventCodec,
    EventModel,
    StoredEvent,
    StoreError,
    decode_arrays,
    encode_arrays,
)
from rolloutlog.grpo.run_config import RunConfig, load_run_config

FUZZ = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
TS = datetime(2024, 1, 1, tzinfo=UTC)
TYPES = sorted(CODEC.types)

# ---------------------------------------------------------------- strategies

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=5)
    ),
    max_leaves=25,
)


def _sample_payloads() -> dict[str, dict[str, Any]]:
    """One plausible payload dict per registered event type (field names, typed values)."""
    out: dict[str, dict[str, Any]] = {}
    for name, cls in CODEC.types.items():
        payload: dict[str, Any] = {}
        for field, info in cls.model_fields.items():
            ann = str(info.annotation)
            if "int" in ann:
                payload[field] = 1
            elif "float" in ann:
                payload[field] = 0.5
            elif "bool" in ann:
                payload[field] = True
            elif "dict" in ann:
                payload[field] = {}
            elif "list" in ann or "tuple" in ann:
                payload[field] = []
            else:
                payload[field] = "x"
        out[name] = payload
    return out


SAMPLES = _sample_payloads()


@st.composite
def mutated_payload(draw: st.DrawFn, event_type: str) -> str:
    """A near-valid payload: a sample with a field dropped, retyped or added, or its text cut."""
    data = dict(SAMPLES.get(event_type, {}))
    action = draw(st.sampled_from(["drop", "retype", "add", "cut", "keep", "wrap"]))
    if action == "drop" and data:
        data.pop(draw(st.sampled_from(sorted(data))))
    elif action == "retype" and data:
        data[draw(st.sampled_from(sorted(data)))] = draw(json_values)
    elif action == "add":
        data[draw(st.text(min_size=1, max_size=10))] = draw(json_values)
    text = json.dumps(data)
    if action == "cut":
        text = text[: draw(st.integers(0, max(0, len(text) - 1)))]
    elif action == "wrap":
        text = json.dumps([data])
    return text


@st.composite
def stored_rows(draw: st.DrawFn) -> StoredEvent:
    """A stored row with a random or real type, a random version and a fuzzed payload."""
    event_type = draw(st.sampled_from(TYPES) | st.text(max_size=15))
    version = draw(st.integers(-3, 4) | st.integers(-(2**40), 2**40))
    payload = draw(
        mutated_payload(event_type)
        | json_values.map(json.dumps)
        | st.text(max_size=60)
        | st.sampled_from(["", "{", "[]", "null", '"\\ud800"', '{"a":' * 5000, "[" * 5000])
    )
    seq = draw(st.integers(1, 10**9))
    return StoredEvent("r", seq, 1, event_type, version, payload, TS)


def _assert_decodes_or_names_offset(codec: EventCodec, row: StoredEvent) -> None:
    try:
        event = codec.decode(row)
    except StoreError as exc:
        assert f"offset {row.seq}" in str(exc), str(exc)
        return
    assert isinstance(event, EventModel)
    assert type(event).event_type == row.type


# ---------------------------------------------------------------- event decoder


@FUZZ
@given(stored_rows())
def test_codec_decode_returns_an_event_or_a_store_error_naming_the_offset(row: StoredEvent) -> None:
    _assert_decodes_or_names_offset(CODEC, row)


@pytest.mark.parametrize("event_type", TYPES)
def test_sample_payloads_are_meaningful(event_type: str) -> None:
    """The mutation base is a real row: every field of the type is present in the sample."""
    assert set(SAMPLES[event_type]) == set(CODEC.types[event_type].model_fields)


class _V2(EventModel):
    """An event at schema version 3 with upcasters from 1 and 2: the upcasting path."""

    event_type: ClassVar[str] = "Fuzzed"
    schema_version: ClassVar[int] = 3
    count: int
    label: str


_UPCODEC = EventCodec()
_UPCODEC.register(_V2)


@_UPCODEC.upcaster("Fuzzed", 1)
def _v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    return {"count": data["n"], "name": data.get("name", "")}


@_UPCODEC.upcaster("Fuzzed", 2)
def _v2_to_v3(data: dict[str, Any]) -> dict[str, Any]:
    return {"count": int(data["count"]), "label": str(data["name"])[:10]}


@FUZZ
@given(
    version=st.integers(0, 4),
    payload=json_values.map(json.dumps)
    | st.fixed_dictionaries({"n": json_values}, optional={"name": json_values}).map(json.dumps)
    | st.sampled_from(["[" * 5000, '{"n":' * 5000, "{", ""]),
    seq=st.integers(1, 10**6),
)
def test_upcasting_decode_returns_an_event_or_a_store_error(
    version: int, payload: str, seq: int
) -> None:
    row = StoredEvent("r", seq, 1, "Fuzzed", version, payload, TS)
    _assert_decodes_or_names_offset(_UPCODEC, row)


# ---------------------------------------------------------------- payload arrays


@FUZZ
@given(st.binary(max_size=200) | st.binary(max_size=60).map(lambda b: b"RLA1" + b))
def test_decode_arrays_on_random_bytes(data: bytes) -> None:
    try:
        out = decode_arrays(data)
    except CorruptPayloadError as exc:
        assert str(exc)
        return
    assert all(isinstance(v, np.ndarray) and v.ndim == 1 for v in out.values())


@FUZZ
@given(
    arrays=st.dictionaries(
        st.text(max_size=8),
        st.lists(st.integers(-(2**63), 2**63 - 1), max_size=6),
        max_size=3,
    ),
    cut=st.integers(0, 400),
    flip=st.tuples(st.integers(0, 400), st.integers(0, 255)),
)
def test_decode_arrays_on_mutated_blobs(
    arrays: dict[str, list[int]], cut: int, flip: tuple[int, int]
) -> None:
    blob = encode_arrays(arrays)
    round_trip = decode_arrays(blob)
    assert {k: v.tolist() for k, v in round_trip.items()} == arrays
    for mutated in (blob[:cut], _flip(blob, *flip)):
        with contextlib.suppress(CorruptPayloadError):
            decode_arrays(mutated)


def _flip(blob: bytes, index: int, value: int) -> bytes:
    if not blob:
        return blob
    i = index % len(blob)
    return blob[:i] + bytes([value]) + blob[i + 1 :]


# ---------------------------------------------------------------- config loader


def _known_keys() -> list[str]:
    keys = list(RunConfig.model_fields)
    for info in RunConfig.model_fields.values():
        ann = info.annotation
        if isinstance(ann, type) and hasattr(ann, "model_fields"):
            keys.extend(ann.model_fields)
    return keys


KEYS = st.sampled_from(_known_keys()) | st.text(max_size=10)
config_trees = st.recursive(
    json_scalars | st.sampled_from(["in_order", "sibling", "torch", "replace", "1", "-1"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=5),
    max_leaves=20,
)
run_config_dicts = st.dictionaries(
    st.sampled_from(list(RunConfig.model_fields)) | st.text(max_size=8), config_trees, max_size=6
)


def _load_text(tmp_path: Path, text: str) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    try:
        cfg = load_run_config(path)
    except ConfigError as exc:
        assert str(exc)
        return
    assert isinstance(cfg, RunConfig)


@FUZZ
@given(tree=run_config_dicts)
def test_config_loader_on_random_mappings(tmp_path: Path, tree: dict[str, Any]) -> None:
    _load_text(tmp_path, yaml.safe_dump(tree))


@FUZZ
@given(
    text=st.text(max_size=120)
    | st.lists(
        st.sampled_from(
            [
                "steps: 3",
                "rollout:",
                "  group_size: x",
                "  - a",
                "store: {url: 1}",
                ": :",
                "&a [*a]",
                "!!python/object:os.system {}",
                "trainer: {betas: [1]}",
                "\t",
                "'",
                "model: !!binary AAA=",
                "run_id: 2024-01-01",
                "seed: .inf",
                "steps: 1e400",
            ]
        ),
        max_size=6,
    ).map("\n".join)
)
def test_config_loader_on_random_yaml_text(tmp_path: Path, text: str) -> None:
    _load_text(tmp_path, text)
