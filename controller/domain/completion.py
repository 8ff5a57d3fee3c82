"""The one record of a finished sibling attempt, shared by every layer that handles one.

A backend's result becomes a :class:`Completion` (``SiblingResult.completion``), the
``CompleteSibling`` command carries it, ``SiblingCompleted`` stores its fields flat
(``SiblingCompleted.of`` / ``SiblingCompleted.completion``), and a restore salvages it
from the abandoned part of the log. Keeping one type means a new field is added in one
place, not in four near-copies that drift apart. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True, slots=True)
class Completion:
    """The one record of a finished sibling attempt.

    The token ids and logprobs are not in it: they are the payload ``payload_id``, stored
    beside the event, so the record stays small enough to fold millions of times.
    """

    group_id: int
    sibling: int
    attempt: int
    weight_version: int  # the weights that generated it
    prompt_tokens: int
    completion_tokens: int
    reward: float
    payload_id: str
    finish_reason: str  # "stop" | "length"
    engine_id: str | None = None  # the engine that generated it, when known


#: Its field names, in order: the fields ``SiblingCompleted`` records it with.
COMPLETION_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Completion))
