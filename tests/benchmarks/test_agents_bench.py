"""The agents benchmark, small: every agent makes its calls (it stops otherwise), and its
records and page carry the engine calls and times (that a turn is one engine call is
tested with the endpoint, tests/engines/test_openai_endpoint.py, where no timing decides it)."""

from __future__ import annotations

import json

from distflow.benchmarks.agents import main


def test_the_agents_engine_calls_and_times_are_recorded(tmp_path):
    records, page = tmp_path / "agents.jsonl", tmp_path / "AGENTS.md"
    assert main(["--agents", "8", "--turns", "2", "--engine-seconds", "0.05", "--repeats", "1", "--json",
                 str(records), "--results-md", str(page)]) == 0
    (row,) = [json.loads(line) for line in records.read_text().splitlines()]
    assert row["agents"] == 8 and row["turns"] == 2 and row["calls"] == [row["engine_calls"]] >= [2]
    assert row["x_least"] == row["median_seconds"] / (2 * 0.05) >= 1.0
    assert f"| 8 | 2 | {row['engine_calls']:g} | {row['median_seconds']:.2f} |" in page.read_text()
