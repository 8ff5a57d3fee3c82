"""docs/api.md's complete example runs as written and gives the documented result."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

API_MD = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def example_source() -> str:
    """The python block right after the ``<!-- api-example -->`` marker."""
    text = API_MD.read_text()
    match = re.search(r"<!-- api-example -->\s*```python\n(.*?)```", text, re.S)
    assert match is not None, "docs/api.md lost its <!-- api-example --> python block"
    return match.group(1)


def test_api_example_runs_and_restores() -> None:
    namespace: dict[str, object] = {"__name__": "api_example"}  # not "__main__": no print
    exec(compile(example_source(), str(API_MD), "exec"), namespace)
    main = namespace["main"]
    result = asyncio.run(main())  # type: ignore[operator]
    assert result["epoch"] == 2  # the restore opened a new epoch
    assert result["restored_from"] > 0
    assert result["steps_after_restore"] == 2  # steps 2 and 3 trained again
    assert result["train_step"] == 4
    # 2 steps x 4 groups before the checkpoint, 2 x 4 after the restore; the two steps
    # trained after the checkpoint in epoch 1 left the history.
    assert result["trained_groups"] == 16
    # At least the 4 groups of step 2 were live at the checkpoint (step 3 may or may not
    # have been admitted yet, depending on how the pump interleaved).
    assert 4 <= result["recovered_groups"] <= 8
