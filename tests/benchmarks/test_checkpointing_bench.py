"""The gradient-checkpointing and chunked-head benchmark, quick: every mode in its own process, its record
and table written."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_quick_run_writes_every_modes_record_and_the_table(tmp_path):
    out, table = tmp_path / "checkpointing.jsonl", tmp_path / "CHECKPOINTING.md"
    proc = subprocess.run([sys.executable, "-m", "distflow.cli", "bench", "checkpointing", "--quick", "--repeats", "1",
                           "--json", str(out), "--results-md", str(table)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {r["mode"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert list(records) == ["kept", "kept-per-row", "checkpointed", "head-chunked", "checkpointed-head-chunked"]
    for r in records.values():
        assert r["kept_mb"] > 0 and r["peak_step_mb"] > 0 and r["peak_score_mb"] > 0 and r["seconds"] > 0
        assert r["model"] == "embedded"
    # the checkpointed layers keep none of their activations for the backward
    assert records["checkpointed"]["kept_mb"] < 0.5 * records["kept"]["kept_mb"]
    # every row runs its prompt: more kept than with the groups' prompts run once
    assert records["kept-per-row"]["kept_mb"] > records["kept"]["kept_mb"]
    # the output head's logits are not kept whole: less kept, with checkpointing or without
    assert records["head-chunked"]["kept_mb"] < records["kept"]["kept_mb"]
    assert records["checkpointed-head-chunked"]["kept_mb"] < records["checkpointed"]["kept_mb"]
    assert "| checkpointed |" in table.read_text() and "| head-chunked |" in table.read_text()
