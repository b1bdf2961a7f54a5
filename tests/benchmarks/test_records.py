import argparse
import json
import sys

from distflow.benchmarks.records import command_line, save_results


def test_save_results_replaces_each_file_given_and_writes_no_other(tmp_path):
    jsonl, page = tmp_path / "r.jsonl", tmp_path / "R.md"
    jsonl.write_text("an older run\n")
    records = [{"mode": "a", "seconds": 1.5}, {"mode": "b", "nodes": {"rollout": 2}}]
    save_results(argparse.Namespace(json=str(jsonl), results_md=str(page)), records, "# the page\n")
    assert [json.loads(line) for line in jsonl.read_text().splitlines()] == records
    assert page.read_text() == "# the page\n"
    save_results(argparse.Namespace(json=None, results_md=None), [{"mode": "c"}], "# another page\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["R.md", "r.jsonl"]
    assert page.read_text() == "# the page\n" and len(jsonl.read_text().splitlines()) == 2


def test_command_line_quotes_what_the_shell_would_split(monkeypatch):
    assert command_line("distflow bench engines", ["--quick", "--json", "my runs/e.jsonl"]) == \
        "distflow bench engines --quick --json 'my runs/e.jsonl'"
    assert command_line("python benchmarks/e2e.py", []) == "python benchmarks/e2e.py"
    monkeypatch.setattr(sys, "argv", ["e2e.py", "--steps", "3"])
    assert command_line("python benchmarks/e2e.py", None) == "python benchmarks/e2e.py --steps 3"
