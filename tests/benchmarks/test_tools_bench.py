"""The tools benchmark, small: both settings make the same episodes, every one of which
called the python tool once, and its records and page carry them."""

from __future__ import annotations

import json

from distflow.benchmarks.tools import main


def test_both_settings_run_the_same_tool_calls_and_are_recorded(tmp_path, capsys):
    records, page = tmp_path / "tools.jsonl", tmp_path / "TOOLS.md"
    assert main(["--episodes", "4", "--repeats", "1", "--json", str(records), "--results-md", str(page)]) == 0
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    assert [r["env_workers"] for r in rows] == [1, 8] and [r["tool_calls"] for r in rows] == [4.0, 4.0]
    assert rows[0]["x_first"] == 1.0 and all(r["median_seconds"] > 0 for r in rows)
    assert "| 8 | 4 | 4 |" in page.read_text()
