"""Event codec: typed pydantic events to stored rows and back, with schema upcasting.

This is the mapper between domain events and rows (as in the ``eventsourcing`` library):
the store moves opaque JSON text, the codec knows the types. Decoding the current schema
version goes straight through pydantic's JSON parser; older versions are parsed to a
dict and passed through the registered upcasters, one version step at a time.

Encoding: an event class whose every field is a plain JSON scalar (``int``, ``float``,
``str``, ``bool``, ``None``, a ``Literal`` of those, or a union of them) and which
declares no serialiser, alias, exclusion or computed field (:func:`plain_fields`) is
written by ``msgspec`` from its validated field values: the same JSON document as
pydantic's serialiser, in ~40 % of the time (the append hot path; docs/benchmarks.md).
Only the spelling of a float's exponent can differ (``1e20`` for pydantic's ``1e+20``);
the value read back is the same float. Every other class goes through pydantic.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, ClassVar, Literal, TypeVar

import annotated_types
import msgspec
from pydantic import BaseModel, ConfigDict, PlainSerializer, ValidationError, WrapSerializer

from .errors import CorruptEventError, NewerSchemaVersionError, UnknownEventTypeError
from .records import EventRow, NewEvent


class EventModel(BaseModel):
    """Base of every typed event: frozen, strict about unknown fields, versioned.

    Subclasses set ``event_type`` (the stored type name) and ``schema_version``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    event_type: ClassVar[str] = ""
    schema_version: ClassVar[int] = 1


E = TypeVar("E", bound=type[EventModel])
Upcaster = Callable[[dict[str, Any]], dict[str, Any]]

#: Field types whose validated values msgspec writes as pydantic does.
_SCALARS: frozenset[Any] = frozenset({int, float, str, bool, type(None)})
_UNIONS = (typing.Union, types.UnionType)
_msgspec_json = msgspec.json.Encoder().encode


def _plain(annotation: Any) -> bool:
    """A JSON scalar type, a ``Literal`` of scalars, or a union of those."""
    if annotation in _SCALARS:
        return True
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return all(type(v) in _SCALARS for v in typing.get_args(annotation))
    if origin in _UNIONS:
        return all(_plain(a) for a in typing.get_args(annotation))
    return False


def _harmless(metadata: Any) -> bool:
    """Field metadata that leaves the JSON of a validated value alone: constraints
    (``annotated_types``, pydantic's own markers), not serialisers; anything else (a
    type's own core schema hook...) is taken to change it."""
    if isinstance(metadata, PlainSerializer | WrapSerializer):
        return False
    return (
        isinstance(metadata, annotated_types.BaseMetadata)
        or type(metadata).__module__.split(".")[0] == "pydantic"
    )


def plain_fields(cls: type[BaseModel]) -> bool:
    """Whether ``cls``'s JSON is its validated field values as plain scalars, in field
    order: every field :func:`_plain`, and nothing that changes the output (a field or
    model serialiser, one in a field's ``Annotated`` metadata, an alias, an excluded
    field, a computed field, extra fields kept, ``json_encoders``, infinities and NaN
    written other than as ``null``). Then msgspec writes the instance's
    ``__dict__`` as pydantic's serialiser would (the codec's fast path)."""
    decorators = cls.__pydantic_decorators__
    config = cls.model_config
    if (
        decorators.field_serializers
        or decorators.model_serializers
        or cls.model_computed_fields
        or config.get("extra") == "allow"
        or config.get("json_encoders")
        or config.get("ser_json_inf_nan", "null") != "null"
    ):
        return False
    return all(
        _plain(f.annotation)
        and f.alias is None
        and f.serialization_alias is None
        and not f.exclude
        and getattr(f, "exclude_if", None) is None
        and all(_harmless(m) for m in f.metadata)
        for f in cls.model_fields.values()
    )


class EventCodec:
    """A registry of event types with their upcasters; encodes and decodes events."""

    def __init__(self, *, fast_json: bool = True) -> None:
        """``fast_json``: write the events of :func:`plain_fields` classes with msgspec
        (False: every event through pydantic's serialiser, byte for byte its text)."""
        self.fast_json = fast_json
        self._types: dict[str, type[EventModel]] = {}
        self._upcasters: dict[tuple[str, int], Upcaster] = {}
        # Per class, for encode_many: (type name, schema version, plain_fields(cls),
        # pydantic's serialiser).
        self._writers: dict[type, tuple[str, int, bool, Callable[[Any], bytes]]] = {}
        # Per type name, for decode's hot path: (schema version, pydantic's JSON validator).
        self._readers: dict[str, tuple[int, Callable[[str], Any]]] = {}

    def register(self, cls: E) -> E:
        """Register an event class (usable as a decorator)."""
        name = cls.event_type
        if not name:
            raise TypeError(f"{cls.__name__} has no event_type")
        if name in self._types and self._types[name] is not cls:
            raise TypeError(f"event type {name!r} is already registered")
        self._types[name] = cls
        self._readers[name] = (cls.schema_version, cls.__pydantic_validator__.validate_json)
        self._writers[cls] = (
            name,
            cls.schema_version,
            self.fast_json and plain_fields(cls),
            cls.__pydantic_serializer__.to_json,
        )
        return cls

    def upcaster(self, event_type: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
        """Register ``fn(payload_dict) -> payload_dict`` turning ``from_version`` into the next."""

        def deco(fn: Upcaster) -> Upcaster:
            self._upcasters[(event_type, from_version)] = fn
            return fn

        return deco

    @property
    def types(self) -> dict[str, type[EventModel]]:
        """Registered event classes by type name."""
        return dict(self._types)

    def encode(
        self,
        event: EventModel,
        *,
        recorded_at: datetime,
        derived: tuple[Any, ...] | None = None,
    ) -> NewEvent:
        """Turn a typed event into a row ready to append.

        ``derived``: values for the store's indexers (opaque here; see
        :attr:`NewEvent.derived`).
        """
        return self.encode_many([event], recorded_at=recorded_at, derived=[derived])[0]

    def encode_many(
        self,
        events: Sequence[EventModel],
        *,
        recorded_at: datetime | Sequence[datetime],
        derived: Sequence[tuple[Any, ...] | None] | None = None,
    ) -> list[NewEvent]:
        """:meth:`encode` of each event, in one call (the append hot path).

        ``recorded_at``: one time for every event (a command's events share it) or one
        per event; ``derived``: one tuple (or None) per event, or None for none at all.
        An event of a :func:`plain_fields` class is written by msgspec, any other by
        pydantic's serialiser (the module docstring says why, and what can differ).
        """
        n = len(events)
        stamps = [recorded_at] * n if isinstance(recorded_at, datetime) else recorded_at
        keys: Sequence[tuple[Any, ...] | None] = [None] * n if derived is None else derived
        if len(stamps) != n or len(keys) != n:
            raise ValueError(
                f"{n} events, {len(stamps)} recorded_at values and {len(keys)} derived values"
            )
        writers = self._writers
        fast = _msgspec_json
        new = tuple.__new__  # NewEvent's own __new__ is a Python function: same tuple
        out: list[NewEvent] = []
        for event, stamp, key in zip(events, stamps, keys, strict=True):
            writer = writers.get(type(event))
            if writer is None:
                raise TypeError(
                    f"event class {type(event).__name__} is not registered with this codec"
                )
            if writer[2]:  # plain_fields: msgspec writes the validated values
                try:
                    payload = fast(event.__dict__).decode()
                except (TypeError, ValueError, OverflowError, UnicodeError):
                    # What pydantic rejects too (a lone surrogate...): it says so, its way.
                    payload = writer[3](event).decode()
            else:
                # What model_dump_json() runs, minus its Python wrapper.
                payload = writer[3](event).decode()
            out.append(new(NewEvent, (writer[0], writer[1], payload, stamp, key)))
        return out

    def decode(self, row: EventRow) -> EventModel:
        """Turn a stored row back into its typed event, upcasting older schema versions.

        Raises :class:`UnknownEventTypeError`, :class:`NewerSchemaVersionError` or
        :class:`CorruptEventError`, each naming the offset.
        """
        reader = self._readers.get(row.type)
        if reader is not None and row.schema_version == reader[0]:
            # The read hot path, a row of the current schema version: what
            # cls.model_validate_json(payload) runs, minus its Python wrapper (validators
            # and model config apply the same), and no other lookup.
            try:
                return reader[1](row.payload)  # type: ignore[no-any-return]
            except ValidationError as exc:
                raise _invalid(row, exc) from exc
            except RecursionError as exc:
                raise _too_deep(row) from exc
        return self._decode_checked(row)

    def _decode_checked(self, row: EventRow) -> EventModel:
        """:meth:`decode` of a row the hot path does not take: an unknown type, a newer
        or an older schema version (upcast here), each error naming the offset."""
        cls = self._types.get(row.type)
        if cls is None:
            raise UnknownEventTypeError(row.seq, row.type, row.schema_version)
        if row.schema_version > cls.schema_version:
            raise NewerSchemaVersionError(row.seq, row.type, row.schema_version, cls.schema_version)
        # The current version took decode's hot path: this row is older, to upcast.
        try:
            data = json.loads(row.payload)
            if not isinstance(data, dict):
                raise CorruptEventError(row.seq, row.type, "payload is not a JSON object")
            for version in range(row.schema_version, cls.schema_version):
                step = self._upcasters.get((row.type, version))
                if step is None:
                    raise CorruptEventError(
                        row.seq,
                        row.type,
                        f"no upcaster from schema version {version} to {version + 1}",
                    )
                try:
                    data = step(data)
                except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
                    # An old row the upcaster cannot read is a corrupt row: name its offset.
                    raise CorruptEventError(
                        row.seq,
                        row.type,
                        f"upcasting from schema version {version} failed: {exc!r}",
                    ) from exc
            return cls.model_validate(data)
        except ValidationError as exc:
            raise _invalid(row, exc) from exc
        except json.JSONDecodeError as exc:
            raise CorruptEventError(row.seq, row.type, f"invalid JSON: {exc}") from exc
        except RecursionError as exc:
            # json.loads (the upcasting path) recurses once per nesting level.
            raise _too_deep(row) from exc


def _invalid(row: EventRow, exc: ValidationError) -> CorruptEventError:
    """The error for a payload pydantic rejects: its first complaint, at the offset."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ())) or "payload"
    return CorruptEventError(row.seq, row.type, f"{where}: {first['msg']}")


def _too_deep(row: EventRow) -> CorruptEventError:
    """The error for a payload nested past the parser's recursion limit."""
    return CorruptEventError(row.seq, row.type, "payload nests too deeply to decode (invalid JSON)")
