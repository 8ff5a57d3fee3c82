"""rolloutlog's own options in a database URL's query (``?synchronous=FULL``,
``?append_chunk_events=250``): read and checked in one way for both dialects."""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine.url import URL

from .errors import StoreUrlError


def whole_number_option(url: URL, raw: Any, name: str, unit: str) -> int:
    """``raw`` (the value of option ``name`` in ``url``) as a whole number >= 0.

    Raises :class:`StoreUrlError` naming the option, its value and what it must be.
    """
    try:
        value = int(str(raw))
    except ValueError:
        value = -1
    if value < 0:
        raise StoreUrlError(
            f"{name}={raw!r} in {url.render_as_string(hide_password=True)}: "
            f"a whole number of {unit} >= 0"
        )
    return value
