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
    # the update's peak is above what was held before it, the previous update's gradients
    # included, which it frees first: with those, it holds what the forward kept
    for mode in ("kept", "kept-per-row", "head-chunked"):
        gradients_mb = records[mode]["parameters_millions"] * 1e6 * 4 / 2**20
        assert records[mode]["peak_step_mb"] + gradients_mb >= records[mode]["kept_mb"], mode
    assert records["checkpointed"]["peak_step_mb"] < records["kept"]["peak_step_mb"]
    assert "| checkpointed |" in table.read_text() and "| head-chunked |" in table.read_text()


def test_the_peak_is_the_most_tensor_memory_held_at_once_during_the_run():
    """On CPU, from the profiler's record of torch's allocations and frees: two 4 MiB
    tensors alive together, then a third after one is freed, peak at 8 MiB, whatever
    was held before."""
    import torch

    from distflow.benchmarks.checkpointing import _peak_tensor_mb

    held_before = torch.ones(2**22)  # 16 MiB the run does not count

    def run():
        a, b = torch.empty(2**20), torch.empty(2**20)
        del a
        c = b + 1
        del b, c

    assert abs(_peak_tensor_mb(run, cuda=False) - 8.0) < 0.01
    assert held_before.sum() == 2**22


def test_a_block_held_before_the_run_and_freed_by_it_is_not_counted_again():
    """The profiler records no free of a block allocated before it started: a run that
    frees such a block and allocates one as large holds no more than before (peak 0),
    where counting only its allocations would say 16 MiB."""
    import torch

    from distflow.benchmarks.checkpointing import _peak_tensor_mb

    held = [torch.ones(2**22)]

    def run():
        held.pop()
        held.append(torch.ones(2**22))

    assert _peak_tensor_mb(run, cuda=False) < 0.01
    assert len(held) == 1 and held[0].sum() == 2**22
