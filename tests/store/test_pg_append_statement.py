"""The PostgreSQL append statement's shape: packed text where the batch allows it, arrays
where it does not (a raw U+001E in a type or payload, a naive timestamp). Pure: no
database; the round trip of both shapes is in test_store_roundtrip.py."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from rolloutlog.eventstore import NewEvent
from rolloutlog.eventstore.pg_append import SEPARATOR, DerivedTable, PgAppendStatement

T = datetime(2026, 12, 2, 1, 2, 3, 456789, tzinfo=UTC)


def _statement(batch: list[NewEvent]) -> tuple[str, dict[str, object]]:
    return PgAppendStatement().statement("r", 5, 1, batch, (), (), ())


def test_a_plain_batch_goes_as_packed_text() -> None:
    batch = [
        NewEvent("A", 1, '{"a":1}', T),
        NewEvent("B", 2, "{}", datetime(1969, 1, 1, tzinfo=UTC)),
    ]
    sql, params = _statement(batch)
    assert "string_to_array(%(payloads)s, chr(30))" in sql and "%(payloads)b" not in sql
    assert params["types"] == "A" + SEPARATOR + "B"
    assert params["payloads"] == '{"a":1}' + SEPARATOR + "{}"
    assert params["versions"] == "1,2"
    micros = [int(ts.timestamp()) * 10**6 + ts.microsecond for ts in (T, batch[1].recorded_at)]
    assert params["stamps"] == f"{micros[0]},{micros[1]}" and micros[1] < 0
    assert "packed" not in params  # not a statement parameter
    assert (params["expected_last"], params["first_prev"], params["last"]) == (4, 4, 6)


@pytest.mark.parametrize(
    "odd",
    [
        NewEvent("A", 1, '{"a": "x\x1ey"}', T),  # a raw separator in a payload
        NewEvent("A\x1eB", 1, "{}", T),  # ... in a type
        NewEvent("A", 1, "{}", T.replace(tzinfo=None)),  # a naive timestamp
        NewEvent("A", 1, None, T),  # type: ignore[arg-type]  # not text: the database refuses
    ],
)
def test_a_batch_it_cannot_pack_goes_as_arrays(odd: NewEvent) -> None:
    _assert_arrays([NewEvent("Z", 1, "{}", T), odd])


@pytest.mark.parametrize(
    "alone",
    [NewEvent("A", 1, "", T), NewEvent("", 1, "{}", T)],  # string_to_array('') is {}
)
def test_one_event_with_an_empty_text_goes_as_arrays(alone: NewEvent) -> None:
    _assert_arrays([alone])
    # Among others the join is not empty, and an empty element splits out as itself.
    sql, _ = _statement([NewEvent("Z", 1, "{}", T), alone])
    assert "string_to_array" in sql


def _assert_arrays(batch: list[NewEvent]) -> None:
    sql, params = _statement(batch)
    assert "%(payloads)b::text[]" in sql and "string_to_array" not in sql
    assert params["types"] == [ev.type for ev in batch]
    assert params["payloads"] == [ev.payload for ev in batch]
    assert params["stamps"] == [ev.recorded_at for ev in batch]
    assert params["versions"] == [ev.schema_version for ev in batch]


KEYS = DerivedTable("keys", ("run_id", "seq", "k"), ("character varying(128)", "bigint", "bigint"))


def _derived(rows: list[tuple[object, ...]]) -> tuple[str, dict[str, object]]:
    batch = [NewEvent("A", 1, "{}", T) for _ in rows] or [NewEvent("A", 1, "{}", T)]
    return PgAppendStatement().statement("r", 1, 1, batch, (), [rows], [KEYS])


def test_derived_integers_and_text_go_packed_with_null_as_an_empty_element() -> None:
    sql, params = _derived([("r", 1, None), ("r", 2, -7)])
    assert params["d0_0"] == "r" + SEPARATOR + "r"
    assert (params["d0_1"], params["d0_2"]) == ("1,2", ",-7")
    assert "string_to_array(%(d0_2)s, ',', '')::bigint[]" in sql
    assert "string_to_array(%(d0_0)s, chr(30))::character varying(128)[]" in sql


@pytest.mark.parametrize(
    ("rows", "column", "why"),
    [
        ([("r", 1, None)], "d0_2", "a lone NULL would pack to '', which splits to nothing"),
        ([("r", 1, True)], "d0_2", "not exactly an int"),
        ([("r", 1, 1.5)], "d0_2", "not an int at all"),
        ([("r\x1ex", 1, 1)], "d0_0", "a separator inside a text"),
        ([(None, 1, 1)], "d0_0", "a NULL text"),
    ],
)
def test_derived_columns_that_cannot_pack_go_as_arrays(
    rows: list[tuple[object, ...]], column: str, why: str
) -> None:
    sql, params = _derived(rows)
    assert params[column] == [rows[0][int(column[-1])]], why
    assert f"%({column})b::" in sql, why
