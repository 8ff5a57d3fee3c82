"""Event codec: typed pydantic events to stored rows and back, with schema upcasting.

This is the mapper between domain events and rows (as in the ``eventsourcing`` library):
the store moves opaque JSON text, the codec knows the types. Decoding the current schema
version goes straight through pydantic's JSON parser; older versions are parsed to a
dict and passed through the registered upcasters, one version step at a time.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import CorruptEventError, NewerSchemaVersionError, UnknownEventTypeError
from .records import NewEvent, StoredEvent


class EventModel(BaseModel):
    """Base of every typed event: frozen, strict about unknown fields, versioned.

    Subclasses set ``event_type`` (the stored type name) and ``schema_version``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    event_type: ClassVar[str] = ""
    schema_version: ClassVar[int] = 1


E = TypeVar("E", bound=type[EventModel])
Upcaster = Callable[[dict[str, Any]], dict[str, Any]]


class EventCodec:
    """A registry of event types with their upcasters; encodes and decodes events."""

    def __init__(self) -> None:
        self._types: dict[str, type[EventModel]] = {}
        self._upcasters: dict[tuple[str, int], Upcaster] = {}

    def register(self, cls: E) -> E:
        """Register an event class (usable as a decorator)."""
        name = cls.event_type
        if not name:
            raise TypeError(f"{cls.__name__} has no event_type")
        if name in self._types and self._types[name] is not cls:
            raise TypeError(f"event type {name!r} is already registered")
        self._types[name] = cls
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
        cls = type(event)
        if self._types.get(cls.event_type) is not cls:
            raise TypeError(f"event class {cls.__name__} is not registered with this codec")
        # What event.model_dump_json() runs, minus its Python wrapper (the append hot
        # path: a third of the cost); the model's serialisation settings apply the same.
        payload = cls.__pydantic_serializer__.to_json(event).decode()
        return NewEvent(cls.event_type, cls.schema_version, payload, recorded_at, derived)

    def encode_many(
        self,
        events: Sequence[EventModel],
        *,
        recorded_at: datetime | Sequence[datetime],
        derived: Sequence[tuple[Any, ...] | None] | None = None,
    ) -> list[NewEvent]:
        """:meth:`encode` of each event, a third cheaper per event (the append hot path).

        ``recorded_at``: one time for every event (a command's events share it) or one
        per event; ``derived``: one tuple (or None) per event, or None for none at all.
        Each class is checked and its serialiser looked up once per call.
        """
        n = len(events)
        stamps = [recorded_at] * n if isinstance(recorded_at, datetime) else recorded_at
        keys: Sequence[tuple[Any, ...] | None] = [None] * n if derived is None else derived
        if len(stamps) != n or len(keys) != n:
            raise ValueError(
                f"{n} events, {len(stamps)} recorded_at values and {len(keys)} derived values"
            )
        seen: dict[type, tuple[str, int, Callable[[Any], bytes]]] = {}
        new = tuple.__new__  # NewEvent's own __new__ is a Python function: same tuple
        out: list[NewEvent] = []
        for event, stamp, key in zip(events, stamps, keys, strict=True):
            cls = type(event)
            spec = seen.get(cls)
            if spec is None:
                if self._types.get(cls.event_type) is not cls:
                    raise TypeError(f"event class {cls.__name__} is not registered with this codec")
                spec = seen[cls] = (
                    cls.event_type,
                    cls.schema_version,
                    cls.__pydantic_serializer__.to_json,
                )
            out.append(new(NewEvent, (spec[0], spec[1], spec[2](event).decode(), stamp, key)))
        return out

    def decode(self, row: StoredEvent) -> EventModel:
        """Turn a stored row back into its typed event, upcasting older schema versions.

        Raises :class:`UnknownEventTypeError`, :class:`NewerSchemaVersionError` or
        :class:`CorruptEventError`, each naming the offset.
        """
        cls = self._types.get(row.type)
        if cls is None:
            raise UnknownEventTypeError(row.seq, row.type, row.schema_version)
        if row.schema_version > cls.schema_version:
            raise NewerSchemaVersionError(row.seq, row.type, row.schema_version, cls.schema_version)
        try:
            if row.schema_version == cls.schema_version:
                # What cls.model_validate_json(payload) runs, minus its Python wrapper
                # (the read hot path; validators and model config apply the same).
                return cls.__pydantic_validator__.validate_json(row.payload)  # type: ignore[no-any-return]
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
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ())) or "payload"
            raise CorruptEventError(row.seq, row.type, f"{where}: {first['msg']}") from exc
        except json.JSONDecodeError as exc:
            raise CorruptEventError(row.seq, row.type, f"invalid JSON: {exc}") from exc
        except RecursionError as exc:
            # json.loads (the upcasting path) recurses once per nesting level.
            raise CorruptEventError(
                row.seq, row.type, "payload nests too deeply to decode (invalid JSON)"
            ) from exc
