"""What the launcher process takes in from a run, measured rather than assumed.

Every object the launcher gets from Ray (`ray.get` results: the rendezvous address,
each worker's return value, a worker's error) and every file it reads while the run
goes on (rank 0's `metrics.jsonl` for the progress bar, status files when a worker
fails) goes through one `LauncherMeter`. Each is split into

- payload: what a batch is made of. Tensor, array and bytes content, and any sequence
  of two or more numbers (a list of token ids, log-probs or rewards is batch data
  however it is serialised), found anywhere inside dicts, lists and objects, and
  inside the JSON of a file;
- control: the whole size received (pickled, or the file's bytes).

The launcher writes both, per source, to the run's `launcher.json`; the
multi-controller promise is payload == 0, and a test also leaks a batch on purpose to
see the count rise.
"""

from __future__ import annotations

import json
import numbers
import pickle
from collections import Counter
from pathlib import Path
from typing import Any

_NUMBER_BYTES = 8  # a number in a sequence counts as an int64 / float64


def payload_bytes(obj: Any) -> int:
    """Bytes of batch data inside `obj` (recursively)."""
    import numpy as np
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return len(obj)
    if isinstance(obj, dict):
        return sum(payload_bytes(k) + payload_bytes(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set)):
        if len(obj) >= 2 and all(isinstance(x, numbers.Number) and not isinstance(x, bool) for x in obj):
            return _NUMBER_BYTES * len(obj)  # token ids, log-probs, rewards: data, not control
        return sum(payload_bytes(x) for x in obj)
    if hasattr(obj, "__dict__"):
        return payload_bytes(vars(obj))
    return 0


class LauncherMeter:
    """Counts what the launcher receives, by source ("result", "rendezvous", a file name)."""

    def __init__(self) -> None:
        self.payload: Counter[str] = Counter()
        self.control: Counter[str] = Counter()

    def received(self, obj: Any, source: str) -> Any:
        """An object from Ray; returned unchanged."""
        self.payload[source] += payload_bytes(obj)
        try:
            self.control[source] += len(pickle.dumps(obj))
        except Exception:  # an object Ray could send but pickle cannot size: count its repr
            self.control[source] += len(repr(obj))
        return obj

    def read_text(self, path: Path, offset: int = 0) -> str:
        """A file the launcher reads, from byte `offset` on; JSON in it (one document, or
        one per line) is searched for payload like an object."""
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode()
        source = Path(path).name
        self.control[source] += len(text.encode())
        for line in text.splitlines() if "\n" in text.strip() else [text]:
            try:
                self.payload[source] += payload_bytes(json.loads(line))
            except ValueError:  # not JSON (a traceback, a half-written line): text is control
                pass
        return text

    def summary(self) -> dict[str, Any]:
        return {"payload_bytes_received": sum(self.payload.values()),
                "control_bytes_received": sum(self.control.values()),
                "received_by_source": {s: {"payload": self.payload[s], "control": self.control[s]}
                                       for s in sorted(self.control)}}
