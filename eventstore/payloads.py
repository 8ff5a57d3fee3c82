"""Compact binary encoding of named numeric arrays (token ids, logprobs). Never pickle.

Layout (little-endian): magic ``RLA1``, u32 count, then per array: u16 name length,
UTF-8 name, 1-byte dtype code, u64 element count, raw elements.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Mapping, Sequence

import numpy as np

from .errors import CorruptPayloadError

_MAGIC = b"RLA1"
_DTYPES: dict[bytes, np.dtype] = {
    b"i": np.dtype("<i4"),
    b"l": np.dtype("<i8"),
    b"f": np.dtype("<f4"),
    b"d": np.dtype("<f8"),
}
_CODES = {dt: code for code, dt in _DTYPES.items()}


#: The stdlib array codes of the fast path, when they have the payload's item sizes and
#: the machine is little-endian (the payload's byte order).
_FAST = sys.byteorder == "little" and array("i").itemsize == 4 and array("q").itemsize == 8


def _plain(values: object) -> tuple[bytes, bytes, int] | None:
    """(dtype code, raw elements, count) of a list or tuple of plain ints (int32, or
    int64 when one is beyond int32) or plain floats (float64, what numpy makes of them),
    through the stdlib's C loop; None for anything else (numpy decides)."""
    if not _FAST or not isinstance(values, list | tuple) or not values:
        return None
    kinds = set(map(type, values))
    try:
        if kinds == {int}:
            try:
                return b"i", array("i", values).tobytes(), len(values)
            except OverflowError:
                return b"l", array("q", values).tobytes(), len(values)
        if kinds == {float}:
            return b"d", array("d", values).tobytes(), len(values)
    except OverflowError:
        return None  # beyond int64: numpy's path names the array
    return None


def encode_arrays(arrays: Mapping[str, np.ndarray | Sequence[int] | Sequence[float]]) -> bytes:
    """Encode named 1-D arrays. Python int lists become int32 (int64 when a value needs
    it), float lists float64."""
    parts = [_MAGIC, struct.pack("<I", len(arrays))]
    for name, values in arrays.items():
        plain = _plain(values)
        if plain is not None:
            code, raw, count = plain
            raw_name = name.encode()
            parts += (struct.pack("<H", len(raw_name)), raw_name, code, struct.pack("<Q", count))
            parts.append(raw)
            continue
        arr = np.asarray(values)
        if arr.ndim != 1:
            raise ValueError(f"array {name!r} must be 1-D, got shape {arr.shape}")
        if arr.dtype.kind in "iu":
            if arr.size and arr.max() >= 2**63:
                # astype("<i8") would wrap these silently to negative numbers.
                raise ValueError(f"array {name!r} has values beyond the int64 range")
            if arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
                arr = arr.astype("<i8")
            else:
                arr = arr.astype("<i4")
        elif arr.dtype.kind == "f":
            arr = arr.astype("<f8" if arr.dtype.itemsize == 8 else "<f4")
        elif arr.size == 0:
            arr = arr.astype("<i4")
        else:
            raise ValueError(f"array {name!r} has unsupported dtype {arr.dtype}")
        raw_name = name.encode()
        parts.append(struct.pack("<H", len(raw_name)))
        parts.append(raw_name)
        parts.append(_CODES[arr.dtype])
        parts.append(struct.pack("<Q", arr.size))
        parts.append(arr.tobytes())
    return b"".join(parts)


def decode_arrays(data: bytes) -> dict[str, np.ndarray]:
    """Decode what :func:`encode_arrays` produced; a truncated or foreign blob is an error."""
    view = memoryview(data)
    if bytes(view[:4]) != _MAGIC:
        raise CorruptPayloadError("payload does not start with the rolloutlog array magic 'RLA1'")
    try:
        (count,) = struct.unpack_from("<I", view, 4)
        pos = 8
        out: dict[str, np.ndarray] = {}
        for _ in range(count):
            (name_len,) = struct.unpack_from("<H", view, pos)
            pos += 2
            name = bytes(view[pos : pos + name_len]).decode()
            pos += name_len
            code = bytes(view[pos : pos + 1])
            pos += 1
            dtype = _DTYPES.get(code)
            if dtype is None:
                raise CorruptPayloadError(f"payload array {name!r} has unknown dtype code {code!r}")
            (size,) = struct.unpack_from("<Q", view, pos)
            pos += 8
            nbytes = size * dtype.itemsize
            if pos + nbytes > len(view):
                raise CorruptPayloadError(f"payload array {name!r} is truncated")
            out[name] = np.frombuffer(view[pos : pos + nbytes], dtype=dtype).copy()
            pos += nbytes
    except (struct.error, UnicodeDecodeError) as exc:
        raise CorruptPayloadError(f"payload is truncated or malformed: {exc}") from exc
    if pos != len(view):
        raise CorruptPayloadError(f"payload has {len(view) - pos} trailing bytes")
    return out
