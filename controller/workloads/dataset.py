"""Prompts from a local dataset file (JSONL, JSON, Parquet, CSV) through ``datasets``.

:class:`PromptDataset` is a ``PromptSource`` (see :mod:`rolloutlog.controller.rollout_runtime`):
prompt ``index`` is the ``index``-th row kept from the file (rows refused as too long are not
kept), tokenized once up front; ``reward`` decodes a completion and scores it with the
configured :class:`~rolloutlog.controller.workloads.rewards.Reward`.

Only local files are read, through the file-format readers of ``datasets``
(``Dataset.from_json`` and its kin), which never resolve a name on a hub; the path must
exist. Nothing of the process is changed (no environment variable, no progress-bar or
logging setting): ``datasets`` shows its progress bars as its user configured them.
The fingerprint covers the file's bytes, every dataset setting that shapes prompts
(field, template, chat template, length policy), the tokenizer and the reward, so a log
written for other prompts or another reward is refused on restore.
"""

from __future__ import annotations

import csv
import hashlib
import json
import re
import string
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rolloutlog.eventstore.errors import RolloutlogError

from .rewards import (
    Reward,
    RewardConfig,
    RewardFailedError,
    RewardFailureLimitError,
    RewardResult,
)

DatasetFormat = Literal["auto", "jsonl", "json", "parquet", "csv"]
TooLong = Literal["skip", "truncate", "error"]

#: Bumped whenever prompt building or the fingerprint's recipe changes meaning.
DATASET_VERSION = 1
_BUILDERS = {"jsonl": "json", "json": "json", "parquet": "parquet", "csv": "csv"}
_SUFFIXES = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DatasetError(RolloutlogError, ValueError):
    """A dataset file or row that cannot become prompts (the message names it)."""


class DatasetConfig(BaseModel):
    """Where the prompts come from and how a row becomes a prompt."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(..., min_length=1, description="Local dataset file (relative to the cwd).")
    format: DatasetFormat = Field(
        "auto", description="jsonl, json, parquet or csv; auto: from the file's suffix."
    )
    prompt_field: str = Field(
        "prompt", min_length=1, description="Row field holding the prompt text (no template)."
    )
    template: str | None = Field(
        None,
        description="Prompt template filled with the row's fields, e.g. \"Question: "
        '{question}\\nAnswer:" (replaces prompt_field).',
    )
    answer_field: str | None = Field(
        "answer", description="Row field passed to the reward as the answer (null: none)."
    )
    chat_template: bool = Field(
        False,
        description="Wrap the prompt as one user message with the tokenizer's chat template "
        "(and its generation prompt).",
    )
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="Longest prompt in tokens (null: the model's limit applies)."
    )
    max_prompts: int | None = Field(
        None,
        ge=1,
        description="Use only the first N prompts kept from the file (null: all of them).",
    )
    too_long: TooLong = Field(
        "skip",
        description="A prompt over max_prompt_tokens: skip the row, truncate it (keeps the "
        "start token and the end of the prompt), or error (refuse the dataset). Counted.",
    )

    @model_validator(mode="after")
    def _format_known(self) -> DatasetConfig:
        self.resolved_format()
        return self

    def resolved_format(self) -> str:
        """The file format (``format``, or the suffix's under ``auto``)."""
        if self.format != "auto":
            return self.format
        suffix = Path(self.path).suffix.lower()
        if suffix not in _SUFFIXES:
            raise ValueError(
                f"cannot tell the format of {self.path!r} from its suffix; set dataset.format "
                f"to one of {', '.join(sorted(_BUILDERS))}"
            )
        return _SUFFIXES[suffix]


@dataclass
class DatasetStats:
    """What loading the dataset and scoring completions counted."""

    rows: int = 0
    prompts: int = 0
    too_long_skipped: int = 0
    too_long_truncated: int = 0
    reward_failures: int = 0
    #: Completions scored (failed or not).
    rewards_scored: int = 0
    #: The last few reward failure messages, as ``(prompt index, message)``.
    reward_errors: list[tuple[int, str]] = field(default_factory=list)
    #: The first reward failure, as ``(prompt index, message)``.
    reward_first_error: tuple[int, str] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain numbers (and the first reward error) for a run summary."""
        return {
            "dataset_rows": self.rows,
            "dataset_prompts": self.prompts,
            "prompts_too_long_skipped": self.too_long_skipped,
            "prompts_too_long_truncated": self.too_long_truncated,
            "rewards_scored": self.rewards_scored,
            "reward_failures": self.reward_failures,
            "reward_first_error": None
            if self.reward_first_error is None
            else self.reward_first_error[1],
        }


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes (read in chunks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def vocab_fingerprint(tokenizer: Any) -> str:
    """A hash of a tokenizer object's vocabulary, special tokens and chat template (for a
    tokenizer that was not loaded from a directory)."""
    payload = {
        "class": type(tokenizer).__name__,
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": sorted(str(t) for t in tokenizer.all_special_tokens),
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    return hashlib.sha256(json.dumps(payload, default=str).encode()).hexdigest()[:16]


def load_rows(config: DatasetConfig) -> list[dict[str, Any]]:
    """Every row of the local file, as dicts, in file order (``datasets``, offline)."""
    path = Path(config.path)
    if not path.is_file():
        raise DatasetError(f"dataset file {path} does not exist")
    try:
        import datasets
    except ImportError as exc:  # an optional extra: say how to get it
        raise DatasetError(
            f"reading {path} needs the datasets library: pip install 'rolloutlog[data]'"
        ) from exc

    # The format's own reader, not load_dataset: no name is looked up on a hub, so no
    # offline switch of the process is needed.
    reader = getattr(datasets.Dataset, f"from_{_BUILDERS[config.resolved_format()]}")
    threads_before = {t.ident for t in threading.enumerate()}
    try:
        ds = reader(str(path), split="train")
    except Exception as exc:  # the library's errors vary by format; name the file
        raise DatasetError(
            f"cannot read {path} as {config.resolved_format()}: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        _stop_new_tqdm_monitors(threads_before)
    return [dict(row) for row in ds]


def _stop_new_tqdm_monitors(threads_before: set[int | None]) -> None:
    """Stop a tqdm monitor thread the read started, once no bar of its class is left.

    tqdm starts that thread with the first progress bar of a process and never stops
    it; the loader must not leave a thread behind that was not there before it ran.
    """
    for thread in threading.enumerate():
        bars = getattr(thread, "tqdm_cls", None)
        if thread.ident in threads_before or bars is None or not hasattr(thread, "exit"):
            continue
        with bars.get_lock():
            if bars._instances:
                continue  # a bar of someone else's is still shown
            if getattr(bars, "monitor", None) is thread:
                bars.monitor = None
        thread.exit()


def scan_rows(config: DatasetConfig) -> list[int] | None:
    """The 1-based line number where each row of a JSONL or CSV file starts (``None`` for
    JSON and Parquet, whose rows are named by index), read before ``datasets`` sees the
    file so that errors name the line.

    Refuses (:class:`DatasetError`) an empty file and a JSONL line that is not a JSON
    object, naming the line."""
    path = Path(config.path)
    fmt = config.resolved_format()
    if not path.is_file():
        raise DatasetError(f"dataset file {path} does not exist")
    if fmt in ("json", "parquet"):
        if path.stat().st_size == 0 or (fmt == "json" and not path.read_bytes().strip()):
            raise DatasetError(f"dataset file {path} is empty")
        return None
    lines: list[int] = []
    with open(path, encoding="utf-8", newline="") as fh:
        if fmt == "jsonl":
            for number, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line.rstrip("\r\n"))
                except json.JSONDecodeError as exc:
                    raise DatasetError(
                        f"{path} line {number}: not valid JSON: {exc.msg} (column {exc.colno})"
                    ) from exc
                if not isinstance(value, dict):
                    raise DatasetError(
                        f"{path} line {number}: a JSON {type(value).__name__}, not an object"
                    )
                lines.append(number)
        else:
            reader = csv.reader(fh)
            start = 1
            header = False
            for record in reader:
                if record and header:
                    lines.append(start)
                header = header or bool(record)
                start = reader.line_num + 1
            if header and not lines:
                raise DatasetError(f"dataset file {path} has a header line but no rows")
    if not lines:
        raise DatasetError(f"dataset file {path} is empty")
    return lines


class PromptDataset:
    """A dataset file as token-level prompts and a reward (a ``PromptSource``).

    Args:
        config: the dataset settings.
        reward: the reward settings.
        tokenizer: the policy's tokenizer.
        tokenizer_fingerprint: a hash of the tokenizer's files (see
            :func:`rolloutlog.controller.backends.model_loader.tokenizer_fingerprint`);
            default: a hash of its vocabulary, special tokens and chat template.
        rows: the rows, when already loaded (default: read ``config.path``).
        failure_window: completions scored before ``reward.max_failure_fraction`` is
            judged at each failure (``rolloutlog run`` passes a step's worth: groups per
            step x group size); ``None``: only :meth:`failure_limit` judges it.
    """

    def __init__(
        self,
        config: DatasetConfig,
        reward: RewardConfig,
        tokenizer: Any,
        *,
        tokenizer_fingerprint: str | None = None,
        rows: Sequence[Mapping[str, Any]] | None = None,
        failure_window: int | None = None,
    ) -> None:
        self.config = config
        self.failure_window = failure_window
        self.reward_config = reward
        self.tokenizer = tokenizer
        self._reward = Reward(reward)
        self.stats = DatasetStats()
        #: Where each file row starts (JSONL, CSV), for messages that name a row.
        self._lines: list[int] | None = None
        if rows is None:
            self._lines = scan_rows(config)
        all_rows = [dict(r) for r in rows] if rows is not None else load_rows(config)
        self.stats.rows = len(all_rows)
        self._rows: list[dict[str, Any]] = []
        self._prompts: list[tuple[int, ...]] = []
        #: Row number in the file of each prompt index (rows may be skipped).
        self.source_rows: list[int] = []
        for number, row in enumerate(all_rows):
            if config.max_prompts is not None and len(self._prompts) >= config.max_prompts:
                break
            ids = self._tokenize(number, row)
            if ids is None:
                continue
            self._rows.append(row)
            self._prompts.append(ids)
            self.source_rows.append(number)
        self.stats.prompts = len(self._prompts)
        if not self._prompts:
            raise DatasetError(
                f"dataset {config.path} yields no prompts ({self.stats.rows} rows, "
                f"{self.stats.too_long_skipped} skipped as longer than "
                f"{config.max_prompt_tokens} tokens)"
            )
        tok_fp = tokenizer_fingerprint or vocab_fingerprint(tokenizer)
        canonical = json.dumps(
            {
                "dataset": DATASET_VERSION,
                "file_sha256": file_digest(Path(config.path)) if rows is None else None,
                "rows_sha256": None if rows is None else _rows_digest(all_rows),
                "config": config.model_dump(exclude={"path"}),
                "tokenizer": tok_fp,
                # The failure limit is how the run reacts, not what it computes.
                "reward": reward.model_dump(mode="json", exclude={"max_failure_fraction"}),
            },
            sort_keys=True,
            default=str,
        )
        digest = hashlib.sha256(canonical.encode()).hexdigest()[:16]
        self._fingerprint = f"data-v{DATASET_VERSION}-{digest}"

    # ------------------------------------------------------------------ prompts

    def where(self, number: int) -> str:
        """File row ``number`` (0-based) as a message names it: ``line N`` (1-based) of a
        JSONL or CSV file, ``row index N`` (0-based) otherwise."""
        if self._lines is not None and 0 <= number < len(self._lines):
            return f"line {self._lines[number]}"
        return f"row index {number}"

    def prompt_text(self, number: int, row: Mapping[str, Any]) -> str:
        """The prompt text of file row ``number`` (template filled, or the prompt field)."""
        cfg = self.config
        # ``datasets`` unifies the rows' schema: a key one row lacks is None there, and
        # would be formatted as the text "None".
        present = ", ".join(sorted(k for k, v in row.items() if v is not None))
        if cfg.template is not None:
            try:
                names = {
                    re.split(r"[.\[]", name, maxsplit=1)[0]
                    for _, name, _, _ in string.Formatter().parse(cfg.template)
                    if name
                }
            except ValueError as exc:
                raise DatasetError(f"template {cfg.template!r}: {exc}") from exc
            for name in sorted(names):
                if not name.isdigit() and row.get(name) is None:
                    raise DatasetError(
                        f"{cfg.path} {self.where(number)}: template field {name!r} missing "
                        f"(fields: {present})"
                    )
            try:
                return cfg.template.format_map(row)
            except (IndexError, KeyError, ValueError, AttributeError) as exc:
                raise DatasetError(f"template {cfg.template!r}: {exc!r}") from exc
        value = row.get(cfg.prompt_field)
        if not isinstance(value, str):
            raise DatasetError(
                f"{cfg.path} {self.where(number)}: prompt field {cfg.prompt_field!r} is "
                f"{'missing' if value is None else type(value).__name__}, not text (fields: "
                f"{present})"
            )
        return value

    def _tokenize(self, number: int, row: Mapping[str, Any]) -> tuple[int, ...] | None:
        cfg = self.config
        text = self.prompt_text(number, row)
        if cfg.answer_field is not None and row.get(cfg.answer_field) is None:
            raise DatasetError(
                f"{cfg.path} {self.where(number)}: answer field {cfg.answer_field!r} missing"
            )
        if cfg.chat_template:
            if not getattr(self.tokenizer, "chat_template", None):
                raise DatasetError("dataset.chat_template is set but the tokenizer has none")
            out = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            ids = list(out["input_ids"] if isinstance(out, Mapping) else out)
        else:
            ids = list(self.tokenizer.encode(text, add_special_tokens=True))
        if not ids:
            raise DatasetError(
                f"{cfg.path} {self.where(number)}: prompt {text!r} encodes to no tokens"
            )
        limit = cfg.max_prompt_tokens
        if limit is not None and len(ids) > limit:
            if cfg.too_long == "error":
                raise DatasetError(
                    f"{cfg.path} {self.where(number)}: prompt is {len(ids)} tokens, over "
                    f"max_prompt_tokens {limit} (too_long: error)"
                )
            if cfg.too_long == "skip":
                self.stats.too_long_skipped += 1
                return None
            self.stats.too_long_truncated += 1
            # Keep a leading start token and the end of the prompt, where the question and
            # the answer cue sit.
            bos = self.tokenizer.bos_token_id
            if bos is not None and ids[0] == bos and limit > 1:
                ids = [ids[0], *ids[len(ids) - limit + 1 :]]
            else:
                ids = ids[len(ids) - limit :]
        return tuple(int(t) for t in ids)

    @property
    def fingerprint(self) -> str:
        """Identifies the file contents, prompt settings, tokenizer and reward."""
        return self._fingerprint

    @property
    def num_prompts(self) -> int:
        """Prompts kept from the file."""
        return len(self._prompts)

    def _check_index(self, index: int) -> None:
        if not 0 <= index < len(self._prompts):
            raise IndexError(f"prompt index {index} outside [0, {len(self._prompts)})")

    def prompt_token_ids(self, index: int) -> list[int]:
        """Token ids of prompt ``index``."""
        self._check_index(index)
        return list(self._prompts[index])

    def example(self, index: int) -> dict[str, Any]:
        """The dataset row of prompt ``index``."""
        self._check_index(index)
        return dict(self._rows[index])

    def answer(self, index: int) -> str | None:
        """The answer of prompt ``index`` (``None`` without ``answer_field``)."""
        self._check_index(index)
        field_name = self.config.answer_field
        return None if field_name is None else str(self._rows[index][field_name])

    # ------------------------------------------------------------------ reward

    def completion_text(self, completion_token_ids: Sequence[int]) -> str:
        """The decoded completion: tokens before the first eos, special tokens dropped."""
        ids = [int(t) for t in completion_token_ids]
        eos = self.tokenizer.eos_token_id
        if eos is not None and eos in ids:
            ids = ids[: ids.index(eos)]
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def score(self, index: int, completion_token_ids: Sequence[int]) -> RewardResult:
        """The reward of a completion of prompt ``index`` as a result (never raises for a
        failing reward function)."""
        self._check_index(index)
        text = self.completion_text(completion_token_ids)
        return self._reward.score(text, self.answer(index), self._rows[index])

    def reward(self, index: int, completion_token_ids: Sequence[int]) -> float:
        """The reward (``PromptSource``), with ``reward.on_error`` applied to a failure:
        ``zero`` returns 0.0, ``drop_group`` raises :class:`RewardFailedError` (the runtime
        records it as a failed sibling, without retry). Either way it is counted, and a
        failure past :meth:`failure_limit` raises :class:`RewardFailureLimitError` (the
        runtime records the failure and stops the run)."""
        result = self.score(index, completion_token_ids)
        stats = self.stats
        stats.rewards_scored += 1
        if result.error is None:
            assert result.value is not None
            return result.value
        stats.reward_failures += 1
        stats.reward_errors = [*stats.reward_errors[-19:], (index, result.error)]
        if stats.reward_first_error is None:
            stats.reward_first_error = (index, result.error)
        limit = None if self.failure_window is None else self.failure_limit()
        if limit is not None:
            raise RewardFailureLimitError(limit)
        if self.reward_config.on_error == "zero":
            return 0.0
        raise RewardFailedError(f"prompt {index}: {result.error}")

    def failure_limit(self, *, final: bool = False) -> str | None:
        """Why the reward failures so far stop the run, or ``None``: once
        ``failure_window`` completions were scored (``final``: at any count, for a run
        that ends before), every one of them failed or more than
        ``reward.max_failure_fraction`` of them did."""
        stats = self.stats
        failed, scored = stats.reward_failures, stats.rewards_scored
        window = self.failure_window if self.failure_window is not None else 1
        if failed == 0 or (not final and scored < window):
            return None
        fraction = self.reward_config.max_failure_fraction
        if failed < scored and failed <= fraction * scored:
            return None
        assert stats.reward_first_error is not None
        index, first = stats.reward_first_error
        return (
            f"the reward {self.reward_config.name!r} failed on {failed} of the {scored} "
            f"completions scored (reward.max_failure_fraction: {fraction}); its first "
            f"error, on prompt {index} ({self.config.path} "
            f"{self.where(self.source_rows[index])}): {first}"
        )


def _rows_digest(rows: Sequence[Mapping[str, Any]]) -> str:
    text = json.dumps([dict(r) for r in rows], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


__all__ = [
    "DATASET_VERSION",
    "DatasetConfig",
    "DatasetError",
    "DatasetFormat",
    "DatasetStats",
    "PromptDataset",
    "TooLong",
    "file_digest",
    "load_rows",
    "scan_rows",
    "vocab_fingerprint",
]
