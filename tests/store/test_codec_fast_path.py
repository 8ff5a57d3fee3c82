"""The codec's fast path (eventstore/codec.py): events of plain-field classes are written
by msgspec; the JSON must be pydantic's document (same keys in the same order, same
values), decode back to an equal event, and every class that pydantic would write
differently must stay on pydantic's serialiser."""

from __future__ import annotations

import json
import math
import warnings
from datetime import UTC, datetime
from typing import Annotated, Any, ClassVar, Literal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import (
    ConfigDict,
    Field,
    PlainSerializer,
    PydanticDeprecatedSince20,
    Strict,
    computed_field,
    field_serializer,
    model_serializer,
)
from pydantic_core import PydanticSerializationError

from rolloutlog.controller.domain.events import CODEC
from rolloutlog.eventstore import EventCodec, EventModel, StoredEvent
from rolloutlog.eventstore.codec import plain_fields

NOW = datetime(2026, 12, 3, tzinfo=UTC)


def _pydantic_json(event: EventModel) -> str:
    return event.model_dump_json()


def _stored(row: Any, seq: int = 1) -> StoredEvent:
    return StoredEvent("r", seq, 1, row.type, row.schema_version, row.payload, row.recorded_at)


def _same_document(codec: EventCodec, event: EventModel) -> None:
    """The codec's payload is pydantic's JSON document and reads back as ``event``."""
    row = codec.encode(event, recorded_at=NOW)
    ours, theirs = json.loads(row.payload), json.loads(_pydantic_json(event))
    assert list(ours) == list(theirs)  # same keys, same order
    for key in theirs:
        a, b = ours[key], theirs[key]
        assert type(a) is type(b) and (a == b or (isinstance(a, float) and math.isnan(a))), key
    assert codec.decode(_stored(row)) == event


# ------------------------------------------------------------------ which classes are plain
class _OwnMarker:
    """A marker with a core-schema hook of its own: it could write anything."""

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        return handler(source)


class Plain(EventModel):
    event_type: ClassVar[str] = "Plain"
    i: int
    f: float
    s: str
    b: bool
    o: int | None = None
    lit: Literal["a", "b", 3] = "a"


class WithList(EventModel):
    event_type: ClassVar[str] = "WithList"
    xs: list[int]


class WithDict(EventModel):
    event_type: ClassVar[str] = "WithDict"
    d: dict[str, Any]


class WithFieldSerializer(EventModel):
    event_type: ClassVar[str] = "WithFieldSerializer"
    x: int

    @field_serializer("x")
    def _doubled(self, x: int) -> int:
        return 2 * x


class WithModelSerializer(EventModel):
    event_type: ClassVar[str] = "WithModelSerializer"
    x: int

    @model_serializer
    def _whole(self) -> dict[str, Any]:
        return {"y": self.x}


class WithAlias(EventModel):
    event_type: ClassVar[str] = "WithAlias"
    x: int = Field(serialization_alias="why")


class WithExcluded(EventModel):
    event_type: ClassVar[str] = "WithExcluded"
    x: int
    secret: str = Field(default="", exclude=True)


class WithComputed(EventModel):
    event_type: ClassVar[str] = "WithComputed"
    x: int

    @computed_field  # type: ignore[prop-decorator]
    @property
    def twice(self) -> int:
        return 2 * self.x


class WithInfAsText(EventModel):
    model_config = ConfigDict(ser_json_inf_nan="strings")
    event_type: ClassVar[str] = "WithInfAsText"
    f: float


class WithAnnotatedSerializer(EventModel):
    event_type: ClassVar[str] = "WithAnnotatedSerializer"
    x: Annotated[int, PlainSerializer(lambda v: 2 * v)]


class WithOwnMarker(EventModel):
    event_type: ClassVar[str] = "WithOwnMarker"
    x: Annotated[int, _OwnMarker()]


with warnings.catch_warnings():  # json_encoders is deprecated, and still honoured
    warnings.simplefilter("ignore", PydanticDeprecatedSince20)

    class WithJsonEncoders(EventModel):
        model_config = ConfigDict(json_encoders={float: lambda v: round(v)})
        event_type: ClassVar[str] = "WithJsonEncoders"
        f: float


class WithConstraints(EventModel):
    event_type: ClassVar[str] = "WithConstraints"
    f: float = Field(ge=0, allow_inf_nan=False)
    s: str = Field(max_length=8, pattern="^[a-z]*$")
    i: Annotated[int, Strict()] = 0


class WithExtra(EventModel):
    model_config = ConfigDict(extra="allow")
    event_type: ClassVar[str] = "WithExtra"
    x: int


@pytest.mark.parametrize(
    ("cls", "plain"),
    [
        (Plain, True),
        (WithList, False),
        (WithDict, False),
        (WithFieldSerializer, False),
        (WithModelSerializer, False),
        (WithAlias, False),
        (WithExcluded, False),
        (WithComputed, False),
        (WithInfAsText, False),
        (WithExtra, False),
        (WithAnnotatedSerializer, False),
        (WithOwnMarker, False),
        (WithJsonEncoders, False),
        (WithConstraints, True),
    ],
)
def test_plain_fields(cls: type[EventModel], plain: bool) -> None:
    assert plain_fields(cls) is plain


def _codec(*classes: type[EventModel]) -> EventCodec:
    codec = EventCodec()
    for cls in classes:
        codec.register(cls)
    return codec


def test_classes_pydantic_writes_differently_keep_pydantics_output() -> None:
    codec = _codec(
        WithFieldSerializer, WithModelSerializer, WithAlias, WithExcluded, WithComputed,
        WithInfAsText, WithExtra, WithList, WithAnnotatedSerializer, WithJsonEncoders,
    )  # fmt: skip
    events: list[EventModel] = [
        WithFieldSerializer(x=2),
        WithModelSerializer(x=2),
        WithAlias(x=2),
        WithExcluded(x=2, secret="s"),
        WithComputed(x=2),
        WithInfAsText(f=math.inf),
        WithExtra(x=2, more="kept"),  # type: ignore[call-arg]
        WithList(xs=[1, 2]),
        WithAnnotatedSerializer(x=2),
        WithJsonEncoders(f=2.6),
    ]
    rows = codec.encode_many(events, recorded_at=NOW)
    assert [r.payload for r in rows] == [_pydantic_json(e) for e in events]
    assert json.loads(rows[8].payload) == {"x": 4}
    # An alias is written only by_alias; the class stays off the fast path all the same.
    assert [json.loads(r.payload) for r in rows[:4]] == [
        {"x": 4}, {"y": 2}, {"x": 2}, {"x": 2},
    ]  # fmt: skip


def test_a_value_msgspec_refuses_fails_as_pydantic_says() -> None:
    codec = _codec(Plain)
    event = Plain(i=1, f=0.5, s="\ud800", b=True)  # a lone surrogate: no UTF-8 for it
    with pytest.raises(PydanticSerializationError, match="surrogates not allowed"):
        _pydantic_json(event)
    with pytest.raises(PydanticSerializationError, match="surrogates not allowed"):
        codec.encode(event, recorded_at=NOW)


def test_big_and_small_floats_differ_only_in_the_exponents_spelling() -> None:
    codec = _codec(Plain)
    for f in (1e20, -1.5e300, 1e-7, 5e-324, 1.7976931348623157e308, 123456789012345678.0):
        event = Plain(i=1, f=f, s="", b=False)
        _same_document(codec, event)
        ours = codec.encode(event, recorded_at=NOW).payload
        assert ours.replace("e+", "e") == _pydantic_json(event).replace("e+", "e")


def test_fast_json_off_writes_pydantics_text_byte_for_byte() -> None:
    codec = EventCodec(fast_json=False)
    codec.register(Plain)
    event = Plain(i=1, f=1e20, s="é", b=True)
    assert codec.encode(event, recorded_at=NOW).payload == _pydantic_json(event)
    assert _codec(Plain).encode(event, recorded_at=NOW).payload != _pydantic_json(event)


# ------------------------------------------------------------------ properties
_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
_floats = st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([math.inf, -0.0])
_ints = st.integers(min_value=-(2**70), max_value=2**70)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(
    i=_ints,
    f=_floats,
    s=_text,
    b=st.booleans(),
    o=st.none() | _ints,
    lit=st.sampled_from(["a", "b", 3]),
)
def test_plain_events_are_pydantics_document(
    i: int, f: float, s: str, b: bool, o: int | None, lit: Any
) -> None:
    codec = _codec(Plain)
    event = Plain(i=i, f=f, s=s, b=b, o=o, lit=lit)
    if math.isinf(f):  # written as null by both: the row cannot be read back (as before)
        assert json.loads(codec.encode(event, recorded_at=NOW).payload)["f"] is None
        assert json.loads(_pydantic_json(event))["f"] is None
        return
    _same_document(codec, event)


_DOMAIN_PLAIN = sorted(
    (cls for cls in CODEC.types.values() if plain_fields(cls)), key=lambda c: c.event_type
)


def test_the_sibling_events_take_the_fast_path() -> None:
    names = {cls.event_type for cls in _DOMAIN_PLAIN}
    assert {"SiblingDispatched", "SiblingCompleted", "SiblingFailed", "SiblingAborted"} <= names


@pytest.mark.parametrize("cls", _DOMAIN_PLAIN, ids=lambda c: c.event_type)
@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_plain_domain_event_is_pydantics_document(
    cls: type[EventModel], data: st.DataObject
) -> None:
    event = data.draw(
        st.builds(cls, **{name: _for(f.annotation) for name, f in cls.model_fields.items()})
    )
    _same_document(CODEC, event)


def _for(annotation: Any) -> st.SearchStrategy[Any]:
    """Finite values of a plain annotation (the domain's validators may refuse some:
    those are filtered by ``st.builds`` raising, so draw what validates)."""
    return st.from_type(annotation).filter(
        lambda v: not (isinstance(v, float) and not math.isfinite(v))
    )
