"""The rolloutlog file inside a TRL checkpoint folder (``checkpoint-N/``)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import CheckpointStateMissingError

#: Written by the callback's ``on_save`` next to TRL's own files.
CHECKPOINT_FILE = "rolloutlog_state.json"
_FORMAT = 1


@dataclass(frozen=True)
class RolloutlogCheckpoint:
    """Where the rollout log stood when TRL saved ``checkpoint-N``."""

    run_id: str
    offset: int  # the CheckpointMarked event's offset in the log
    train_step: int  # rolloutlog train steps trained (= TRL optimizer steps of the run)
    weight_version: int
    trl_global_step: int
    trl_model_version: int | None
    dataset_fingerprint: str
    path: str = ""


def write_checkpoint(folder: str | os.PathLike[str], ckpt: RolloutlogCheckpoint) -> Path:
    """Write ``ckpt`` into ``folder`` atomically (a reader never sees half a file)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / CHECKPOINT_FILE
    tmp = folder / f".{CHECKPOINT_FILE}.tmp"
    data = {"format": _FORMAT, **{k: v for k, v in asdict(ckpt).items() if k != "path"}}
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    return final


def read_checkpoint(folder: str | os.PathLike[str]) -> RolloutlogCheckpoint:
    """The rolloutlog state of TRL checkpoint ``folder``; a folder without it (or with an
    unreadable one) is refused with one line."""
    path = Path(folder) / CHECKPOINT_FILE
    if not path.is_file():
        raise CheckpointStateMissingError(
            f"checkpoint {folder} has no {CHECKPOINT_FILE}: it was not saved with "
            "RolloutlogWorker's callback, so the rollout log cannot resume from it"
        )
    try:
        data = json.loads(path.read_text())
        if data.pop("format", None) != _FORMAT:
            raise ValueError("unknown format")
        return RolloutlogCheckpoint(**data, path=str(folder))
    except (ValueError, TypeError) as exc:
        raise CheckpointStateMissingError(
            f"{path} is not a rolloutlog checkpoint file: {exc}"
        ) from exc
