"""Prompt datasets in verl's format, from parquet or jsonl files or the built-in task.

verl's columns are read as they are: `data_source`, `prompt` (a list of chat messages),
`reward_model.ground_truth`, `extra_info`. The built-in task produces the very same rows,
so one code path serves both. A malformed row is an error naming the file and row.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from distflow.data.tasks import arith

BUILTIN_PREFIX = "builtin:arith:"
BUILTIN_SIZES = {"train": 20000, "test": 256}


class DatasetError(ValueError):
    """A dataset file or row that cannot be used; one line naming file and row."""


@dataclass(frozen=True)
class PromptRow:
    index: int  # position in the concatenated dataset: the prompt's stable id
    messages: list[dict[str, str]]
    ground_truth: str
    data_source: str
    extra_info: dict[str, Any] = field(default_factory=dict)


def _row(raw: Any, index: int, where: str) -> PromptRow:
    if not isinstance(raw, dict):
        raise DatasetError(f"{where}: row is not a mapping")
    messages = raw.get("prompt")
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f"{where}: 'prompt' must be a non-empty list of chat messages")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or "role" not in m:
            raise DatasetError(f"{where}: each prompt message needs 'role' and a string 'content'")
    reward_model = raw.get("reward_model")
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        raise DatasetError(f"{where}: missing 'reward_model.ground_truth'")
    extra = raw.get("extra_info") or {}
    return PromptRow(
        index=index,
        messages=[{"role": str(m["role"]), "content": m["content"]} for m in messages],
        ground_truth=str(reward_model["ground_truth"]),
        data_source=str(raw.get("data_source") or "unknown"),
        extra_info=dict(extra) if isinstance(extra, dict) else {},
    )


def _read_file(path: str) -> list[Any]:
    if not os.path.isfile(path):
        raise DatasetError(f"{path}: no such file")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several types for a non-parquet file
            raise DatasetError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None
    if path.endswith((".jsonl", ".json")):
        rows = []
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise DatasetError(f"{path}: line {line_no} is not JSON ({e.msg})") from None
        return rows
    raise DatasetError(f"{path}: unknown file type; expected .parquet or .jsonl")


def _builtin(spec: str) -> list[Any]:
    rest = spec[len(BUILTIN_PREFIX):]
    split, _, size = rest.partition(":")
    if split not in BUILTIN_SIZES:
        raise DatasetError(f"{spec}: unknown built-in split; use {BUILTIN_PREFIX}train or {BUILTIN_PREFIX}test")
    num = int(size) if size else BUILTIN_SIZES[split]
    return arith.verl_rows(split, num)


def load_rows(spec: str, limit: int | None = None) -> list[PromptRow]:
    """Rows of every comma-separated source in `spec`, in order, re-indexed from 0."""
    rows: list[PromptRow] = []
    for source in [s.strip() for s in spec.split(",") if s.strip()]:
        raws = _builtin(source) if source.startswith(BUILTIN_PREFIX) else _read_file(os.path.expanduser(source))
        for i, raw in enumerate(raws):
            rows.append(_row(raw, len(rows), f"{source}: row {i}"))
    if not rows:
        raise DatasetError(f"{spec}: the dataset is empty")
    return rows[:limit] if limit is not None else rows
