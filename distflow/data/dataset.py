"""Prompt datasets in verl's format, from parquet or jsonl files or the built-in task.

verl's columns are read as they are: `data_source`, `prompt` (a list of chat messages),
`reward_model.ground_truth`, `extra_info`. The built-in task produces the very same rows,
so one code path serves both. A malformed row is an error naming the file and row;
`PromptReader` applies the run's policy to bad rows and over-long prompts (error, or a
counted skip, or truncation).
"""

from __future__ import annotations

import bisect
import datetime
import decimal
import json
import math
import os
import random
import sys
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

from distflow.data.tasks import arith, dots

BUILTIN_TASKS = {  # builtin:NAME:SPLIT[:SIZE] -> its rows (split, number, seed)
    "arith": arith.verl_rows,
    "arith-tools": lambda split, num, seed=0: arith.verl_rows(split, num, seed, levels=arith.TOOL_TASK_LEVELS),
    "dots": dots.VerlRows,  # images: counting dots
}
BUILTIN_SIZES = {"train": 20000, "test": 256}


class DatasetError(ValueError):
    """A dataset file or row that cannot be used; one line naming file and row."""


@dataclass(frozen=True)
class PromptRow:
    index: int  # position in the concatenated dataset: the prompt's stable id
    messages: list[dict[str, str]]
    ground_truth: Any  # text, a number, or a JSON list or mapping: passed to a reward function as it is
    data_source: str
    extra_info: Any = field(default_factory=dict)  # a mapping in verl's datasets; any JSON value passes
    images: list[Any] = field(default_factory=list)  # verl's `images` column, decoded when the row is encoded


def _beside_data_file(entry: Any, folder: str | None) -> Any:
    """An image entry whose relative path names a file beside its data file, made that
    file's path (LLaMA-Factory's media folder is the data's too); any other entry as it
    is, so a path relative to the working directory (as verl reads it) still works."""
    key = next((k for k in ("path", "image") if isinstance(entry, dict) and entry.get(k)), None)
    path = entry[key] if key and not entry.get("bytes") else entry
    if folder is None or not isinstance(path, str) or os.path.isabs(os.path.expanduser(path)) \
            or path.startswith(("data:", "file://")):
        return entry
    beside = os.path.join(folder, path)
    if not os.path.isfile(beside):
        return entry
    return entry | {key: beside} if isinstance(entry, dict) else beside


# The roles chat templates render (OpenAI's, with developer; Llama 3.1's ipython and the
# older function for tool results)
ROLES = ("system", "developer", "user", "assistant", "tool", "ipython", "function")


def _json_messages(text: str) -> bool:
    """`text` is a JSON list of chat messages ('[{"role": "user", "content": ...}]')."""
    if not text.lstrip().startswith("[{"):
        return False
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value)


def _row(raw: Any, index: int, where: str, folder: str | None = None) -> PromptRow:
    if not isinstance(raw, dict):
        raise DatasetError(f"{where}: row is not a mapping")
    messages = raw.get("prompt")
    if isinstance(messages, str):
        if _json_messages(messages):
            raise DatasetError(f"{where}: 'prompt' is chat messages written as JSON text; store them as a list "
                               "of {role, content} (it would be trained on as one user message holding the JSON)")
        messages = [{"role": "user", "content": messages}]
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f"{where}: 'prompt' must be a non-empty list of chat messages")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or "role" not in m:
            raise DatasetError(f"{where}: each prompt message needs 'role' and a string 'content'")
        if m["role"] not in ROLES:  # a chat template renders nothing of another role: the prompt would lose it
            raise DatasetError(f"{where}: a prompt message has role {m['role']!r}; expected one of "
                               f"{', '.join(ROLES)} (ShareGPT's human and gpt are user and assistant)")
    if not any(m["content"].strip() for m in messages):
        raise DatasetError(f"{where}: the prompt is empty")
    reward_model = raw.get("reward_model")
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        raise DatasetError(f"{where}: missing 'reward_model.ground_truth'")
    truth = reward_model["ground_truth"]
    if not isinstance(truth, (str, int, float, list, tuple, dict)):
        raise DatasetError(f"{where}: 'reward_model.ground_truth' must be a string, a number, or a list or mapping "
                           f"of JSON values, not {type(truth).__name__}")
    extra = raw.get("extra_info")
    if raw.get("videos") is not None and len(raw["videos"]):  # verl's video column: none is read here
        raise DatasetError(f"{where}: 'videos' holds videos, which DistFlow does not read (images only): the row "
                           "would train on its text alone; drop the rows or the column")
    images = raw.get("images")
    if images is not None and not isinstance(images, (list, tuple)):
        raise DatasetError(f"{where}: 'images' must be a list of images, not {type(images).__name__}")
    return PromptRow(
        index=index,
        messages=[{"role": m["role"], "content": m["content"]} for m in messages],
        # a structure (verl's search data: {"target": [...]}) as JSON gives it back, as extra_info
        ground_truth=_json_values(truth, where, "reward_model.ground_truth") if isinstance(truth, (list, tuple, dict))
        else truth,
        data_source=str(raw.get("data_source") or "unknown"),
        extra_info={} if extra is None else _json_values(extra, where),  # as verl passes it: any JSON value
        images=[_beside_data_file(entry, folder) for entry in images or []],
    )


def _json_values(value: Any, where: str, key: str = "extra_info") -> Any:
    """`extra_info` (or a structured ground truth) as JSON gives it back (tuples as lists,
    keys as strings): rows that move between workers travel as JSON, so every row, moved
    or kept, reaches the reward function alike. A value JSON cannot hold is a bad row."""
    try:
        return json.loads(json.dumps(value, default=_as_json))
    except (TypeError, ValueError) as e:
        raise DatasetError(f"{where}: '{key}' must hold JSON values (strings, numbers, booleans, lists, "
                           f"mappings): {e}") from None


def _as_json(value: Any) -> Any:
    """What parquet holds beyond JSON, as JSON: dates and times as ISO text, decimals as
    their text (exact); anything else stays refused."""
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def parse_builtin(spec: str) -> tuple[str, str, int]:
    """(task, split, rows) of `builtin:TASK:SPLIT[:ROWS]`, without making a row."""
    name, _, rest = spec.removeprefix("builtin:").partition(":")
    split, _, size = rest.partition(":")
    if name not in BUILTIN_TASKS or split not in BUILTIN_SIZES or (size and not size.isdigit()):
        raise DatasetError(f"{spec}: unknown built-in dataset; use builtin:TASK:train or builtin:TASK:test "
                           f"(optionally :ROWS) with TASK one of {', '.join(BUILTIN_TASKS)}")
    return name, split, int(size) if size else BUILTIN_SIZES[split]


def _builtin(spec: str) -> Sequence[Any]:
    name, split, num = parse_builtin(spec)
    try:
        return BUILTIN_TASKS[name](split, num)
    except ValueError as e:  # more rows than the task has
        raise DatasetError(f"{spec}: {e}") from None


def write_builtin_parquet(path: str, task: str, split: str, num: int, seed: int = 0) -> str:
    """A built-in task's rows as a parquet file in verl's schema (`distflow make-data`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(list(BUILTIN_TASKS[task](split, num, seed))), path)
    return path


def load_rows(spec: str, limit: int | None = None) -> list[PromptRow]:
    """All rows (or the first `limit`) of the comma-separated sources in `spec`."""
    data = ShardedDataset(spec)
    return data.rows(list(range(len(data) if limit is None else min(limit, len(data)))))


# ---------------------------------------------------------------------------- sharded reading


class _ParquetSource:
    """Reads only the row groups that hold requested rows (the footer gives the layout),
    and of those only the columns a row is made of; the last group read is kept as Arrow
    columns, and only the rows asked for become Python objects."""

    COLUMNS = ("prompt", "reward_model", "data_source", "extra_info", "images", "videos")

    def __init__(self, path: str):
        import pyarrow.parquet as pq

        if not os.path.isfile(path):
            raise DatasetError(f"{path}: no such file")
        try:
            self.file = pq.ParquetFile(path)
        except Exception as e:  # pyarrow raises several types for a non-parquet file
            raise DatasetError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None
        meta = self.file.metadata
        self.starts = [0]
        for g in range(meta.num_row_groups):
            self.starts.append(self.starts[-1] + meta.row_group(g).num_rows)
        self.columns = [c for c in self.COLUMNS if c in self.file.schema_arrow.names]
        self.num_rows, self.rows_read, self._group, self._table = self.starts[-1], 0, None, None
        self._lock = threading.Lock()  # the prefetch thread and a refill round read alike

    def read(self, index: int) -> Any:
        group = bisect.bisect_right(self.starts, index) - 1
        with self._lock:
            if group != self._group:
                self._table = self.file.read_row_group(group, columns=self.columns)  # keep one group
                self._group = group
                self.rows_read += self._table.num_rows
            # a map column (Spark's MapType) as a dict, as a struct reads: to_pylist gives a list of pairs
            return self._table.slice(index - self.starts[group], 1).to_pylist(maps_as_pydicts="strict")[0]


class _JsonlSource:
    """Indexes line offsets once (bytes only, no parsing); parses only requested lines."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise DatasetError(f"{path}: no such file")
        self.path, self.offsets, self.line_numbers, self.rows_read = path, [], [], 0
        with open(path, "rb") as f:
            offset = 0
            for line_no, line in enumerate(f, 1):
                if not _blank(line, first=offset == 0):
                    self.offsets.append(offset)
                    self.line_numbers.append(line_no)
                offset += len(line)
        self.num_rows = len(self.offsets)

    def read(self, index: int) -> Any:
        with open(self.path, "rb") as f:
            f.seek(self.offsets[index])
            line = f.readline()
        self.rows_read += 1
        try:  # a file saved with a byte-order mark has it before its first row
            return json.loads((line.removeprefix(_BOM) if self.offsets[index] == 0 else line).decode("utf-8"))
        except json.JSONDecodeError as e:
            raise DatasetError(f"{self.path}: line {self.line_numbers[index]} is not UTF-8 JSON "
                               f"({e.msg}, column {e.colno})") from None
        except UnicodeDecodeError as e:
            raise DatasetError(f"{self.path}: line {self.line_numbers[index]} is not UTF-8 JSON "
                               f"(byte {e.start + 1} is not UTF-8)") from None


class _ListSource:
    def __init__(self, rows: Sequence[Any]):
        self.rows, self.num_rows, self.rows_read = rows, len(rows), 0

    def read(self, index: int) -> Any:
        self.rows_read += 1
        return self.rows[index]


_BOM = b"\xef\xbb\xbf"


def _blank(line: bytes, first: bool) -> bool:
    """A line of white space alone, Unicode's too (a no-break space), after a byte-order
    mark on the `first` line; bytes that are no UTF-8 are not blank (the row fails where
    it is read, naming its line)."""
    stripped = (line.removeprefix(_BOM) if first else line).strip()
    if not stripped or stripped.startswith(b"{") or stripped.isascii():  # a row: no decoding of it here
        return not stripped
    try:
        return not stripped.decode("utf-8").strip()
    except UnicodeDecodeError:
        return False


def _head(path: str) -> bytes:
    """A file's first bytes, without a UTF-8 byte-order mark and leading white space."""
    with open(os.path.expanduser(path), "rb") as f:
        return f.read(4096).removeprefix(_BOM).lstrip()


def has_a_row(path: str) -> bool:
    """Whether a JSON-lines file has a line that is not blank (read up to the first one),
    or a JSON array an element (`[]` has none), without reading the file through."""
    head = _head(path)
    if head.startswith(b"["):
        return not head[1:].lstrip().startswith(b"]")
    with open(os.path.expanduser(path), "rb") as f:
        return any(not _blank(line, first=i == 0) for i, line in enumerate(f))


def _json_array(path: str) -> _ListSource | None:
    """A .json file holding one JSON array of rows (`json.dump(rows)`, pandas' `to_json(orient="records")`),
    read whole; None for JSON lines."""
    if not _head(path).startswith(b"["):
        return None
    try:
        with open(path, encoding="utf-8-sig") as f:
            rows = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DatasetError(f"{path}: not a UTF-8 JSON array of rows ({type(e).__name__}: {e})") from None
    return _ListSource(rows)


def open_source(source: str):
    if source.startswith("builtin:"):
        return _ListSource(_builtin(source))
    path = os.path.expanduser(source)
    if path.endswith(".parquet"):
        return _ParquetSource(path)
    if path.endswith(".json") and os.path.isfile(path) and (array := _json_array(path)) is not None:
        return array
    if path.endswith((".jsonl", ".json")):
        return _JsonlSource(path)
    if not os.path.isfile(path):
        raise DatasetError(f"{path}: no such file")
    raise DatasetError(f"{path}: unknown file type; expected .parquet, .jsonl or .json")


class ShardedDataset:
    """The concatenated sources as one indexable dataset that reads rows on demand, so a
    worker reads (and validates) only the rows of its own shard."""

    def __init__(self, spec: str):
        self.names = [s.strip() for s in spec.split(",") if s.strip()]
        self.sources = [open_source(s) for s in self.names]
        # where a row's relative image paths are looked for first
        self.folders = [None if name.startswith("builtin:") else os.path.dirname(os.path.abspath(
            os.path.expanduser(name))) for name in self.names]
        self.starts = [0]
        for src in self.sources:
            self.starts.append(self.starts[-1] + src.num_rows)
        if not len(self):
            raise DatasetError(f"{spec}: the dataset is empty")

    def __len__(self) -> int:
        return self.starts[-1]

    @property
    def rows_read(self) -> int:
        return sum(s.rows_read for s in self.sources)

    def locate(self, index: int) -> tuple[int, str]:
        """(source number, "<file>: row <n>") of a dataset index: the row counted from 0, or in
        a JSON-lines file its line, counted from 1 as editors do (as its parse errors say)."""
        which = bisect.bisect_right(self.starts, index) - 1
        lines = getattr(self.sources[which], "line_numbers", None)
        if lines is not None:
            return which, f"{self.names[which]}: line {lines[index - self.starts[which]]}"
        return which, f"{self.names[which]}: row {index - self.starts[which]}"

    def __getitem__(self, index: int) -> PromptRow:
        which, where = self.locate(index)
        return _row(self.sources[which].read(index - self.starts[which]), index, where, self.folders[which])

    def rows(self, indices: list[int]) -> list[PromptRow]:
        # sorted reads keep a row group in the one-group cache while its rows are taken
        by_index = {i: self[i] for i in sorted(set(indices))}
        return [by_index[i] for i in indices]


# ---------------------------------------------------------------------------- the bad-row policy

BAD_ROW_POLICIES = ("error", "skip")
LONG_PROMPT_POLICIES = ("error", "skip", "truncate")
MAX_REPLACEMENTS = 64


class PromptReader:
    """Rows and their prompt token ids under the run's policy.

    `on_bad_row`: a malformed row (missing field, wrong type, empty prompt, non-UTF-8) is
    an error naming file and row, or is skipped. `on_long_prompt`: a prompt over
    `max_len` tokens is an error, skipped, or truncated from the left (the end of a
    prompt holds the question and the assistant turn). A skipped row is replaced (every
    worker keeps its batch size; no worker runs empty) by a row outside the step's draw,
    chosen by its position in the draw (`_Replacements`): the same on any number of
    workers, and never the replacement of another position."""

    def __init__(self, data: ShardedDataset, max_len: int, on_bad_row: str = "error",
                 on_long_prompt: str = "error", seed: int = 0):
        assert on_bad_row in BAD_ROW_POLICIES and on_long_prompt in LONG_PROMPT_POLICIES
        self.data, self.max_len, self.seed = data, max_len, seed
        self.on_bad_row, self.on_long_prompt = on_bad_row, on_long_prompt
        self._reported = False

    def take(self, indices: list[int], encode: Callable[[PromptRow], list[int]], replace: bool = True,
             draw: Sequence[int] | None = None, positions: Sequence[int] | None = None
             ) -> tuple[list[tuple[PromptRow, list[int]]], Counter[str]]:
        """One (row, ids) per index, and the counts of `skipped_rows` and
        `truncated_prompts`; under a skip policy a bad row is replaced (`replace`) or dropped.
        `draw`: the step's whole draw, on every worker alike, and `positions`: each index's
        position in it (by default `indices` are the whole draw). A replacement is a row not
        in the draw, and each (position, attempt) gets a row of its own."""
        if draw is None:
            draw, positions = indices, range(len(indices))
        replacements = _Replacements(len(self.data), draw, self.seed)
        taken, counts = {}, Counter()
        for slot in sorted(range(len(indices)), key=indices.__getitem__):  # in file order: each row group once
            index, position = indices[slot], positions[slot]
            for attempt in range(MAX_REPLACEMENTS + 1):
                try:
                    row, ids = self.data[index], None
                    try:
                        ids = encode(row)
                    except DatasetError as e:  # found while encoding (an image): name the row
                        raise DatasetError(f"{self.data.locate(index)[1]}: {e}") from None
                    except Exception as e:  # the chat template refusing the messages, an image the processor
                        # cannot take: a bad row, under the same policy
                        raise DatasetError(f"{self.data.locate(index)[1]}: the prompt could not be encoded "
                                           f"({type(e).__name__}: {e})") from None
                    if len(ids) > self.max_len:
                        raise PromptTooLong(f"{self.data.locate(index)[1]}: the prompt has {len(ids)} tokens > "
                                            f"data.max_prompt_length={self.max_len}")
                    taken[slot] = (row, ids)
                    break
                except DatasetError as e:
                    long = isinstance(e, PromptTooLong)
                    policy = self.on_long_prompt if long else self.on_bad_row
                    if policy == "error":
                        hint = "data.on_long_prompt=skip or truncate" if long else "data.on_bad_row=skip"
                        raise DatasetError(f"{e} ({hint} to go on)") from None
                    if policy == "truncate" and getattr(ids, "pixel_values", None) is not None:
                        raise DatasetError(f"{e}; a prompt with images cannot be truncated (raise "
                                           f"data.max_prompt_length or use data.on_long_prompt=skip)") from None
                    if policy == "truncate":
                        counts["truncated_prompts"] += 1
                        taken[slot] = (row, ids[-self.max_len:])
                        break
                    counts["skipped_rows"] += 1
                    self._report(e)
                    if not replace:
                        break
                    index = replacements.row(position + attempt * len(draw))
            else:
                raise DatasetError(f"{','.join(self.data.names)}: {MAX_REPLACEMENTS} replacement rows in a row "
                                   f"were bad as well; the dataset looks broken")
        return [taken[slot] for slot in sorted(taken)], counts

    def _report(self, error: Exception) -> None:
        if not self._reported:
            self._reported = True
            print(f"distflow: skipping a bad row (counted in data/skipped_rows; only the first is printed): "
                  f"{error}", file=sys.stderr, flush=True)


class _Replacements:
    """The rows outside a draw, in an order seeded by the run's seed and the draw (a
    step's draw is the same on every worker, and each step orders them anew): `row(k)`
    is the k-th of them, so distinct k give distinct rows (until the rows outside the draw
    run out). The order is the permutation x -> (a x + b) mod n with a prime to n, so
    finding the k-th row costs a sort of the draw, not a pass over the dataset."""

    def __init__(self, num_rows: int, draw: Sequence[int], seed: int):
        rng = random.Random(f"{seed}-{','.join(map(str, draw[:16]))}")
        self.n = num_rows
        self.a = rng.randrange(1, max(num_rows, 2))
        while math.gcd(self.a, num_rows) != 1:
            self.a = rng.randrange(1, num_rows)
        self.b = rng.randrange(num_rows)
        self.draw = draw
        self._taken: list[int] | None = None  # the draw's positions in the order, sorted; made when first asked

    def row(self, k: int) -> int:
        if self._taken is None:
            inverse = pow(self.a, -1, self.n) if self.n > 1 else 0
            self._taken = sorted({(inverse * (d - self.b)) % self.n for d in self.draw})
        free = self.n - len(self._taken)
        if free <= 0:  # the draw holds every row: a repeat cannot be avoided
            return (self.a * k + self.b) % self.n
        k %= free
        j = k  # the k-th position not taken: the fixed point of j = k + (taken positions <= j)
        while (moved := k + bisect.bisect_right(self._taken, j)) != j:
            j = moved
        return (self.a * j + self.b) % self.n


class PromptTooLong(DatasetError):
    """A prompt over data.max_prompt_length tokens."""
