"""The shipped arithmetic dataset: single-digit word problems with answers (JSONL).

Generated locally and deterministically (a seeded :class:`random.Random`, no clock):
``python -m rolloutlog.controller.workloads.arith configs/data/arith.jsonl`` rewrites the
committed file byte for byte. Every answer is one digit, so the tiny character-level
policy can be rewarded on its first character; the text uses only characters of the
tiny tokenizer's alphabet (lower-cased on encoding).

Each row: ``{"question": ..., "answer": "7", "a": 3, "b": 4, "op": "+"}``.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

_FORMS: tuple[tuple[str, str], ...] = (
    ("+", "what is {a} + {b}?"),
    ("-", "what is {a} - {b}?"),
    ("+", "{a} + {b} = ?"),
    ("-", "{a} - {b} = ?"),
    ("+", "tom has {a} apples and gets {b} more. how many now?"),
    ("-", "ann has {a} pens and gives {b} away. how many pens are left?"),
)


def generate_arith(num_rows: int = 500, seed: int = 0) -> list[dict[str, Any]]:
    """``num_rows`` problems drawn with ``seed``: sums and differences of single digits
    whose result is a single digit (0-9)."""
    if num_rows < 1:
        raise ValueError(f"num_rows {num_rows} must be >= 1")
    rng = random.Random(f"rolloutlog-arith:{seed}")
    rows: list[dict[str, Any]] = []
    while len(rows) < num_rows:
        op, form = rng.choice(_FORMS)
        if op == "+":
            a = rng.randint(0, 9)
            b = rng.randint(0, 9 - a)
            value = a + b
        else:
            a = rng.randint(0, 9)
            b = rng.randint(0, a)
            value = a - b
        rows.append(
            {"question": form.format(a=a, b=b), "answer": str(value), "a": a, "b": b, "op": op}
        )
    return rows


def write_arith(path: Path, num_rows: int = 500, seed: int = 0) -> Path:
    """Write :func:`generate_arith`'s rows to ``path`` as JSONL (one row a line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r, sort_keys=True) for r in generate_arith(num_rows, seed)]
    path.write_text("\n".join(lines) + "\n")
    return path


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "configs/data/arith.jsonl")
    print(write_arith(target))
