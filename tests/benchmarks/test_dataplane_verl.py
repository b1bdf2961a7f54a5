"""The data-plane benchmark against verl's own DataProto dispatch: where verl is installed
(.ci/run's verl environment), a quick run of its two paths whose shards equal our
imitation's; where it is not, the one line saying how to get it."""

from __future__ import annotations

import importlib.util
import json

import pytest

from distflow.benchmarks.dataplane import main

HAS_VERL = importlib.util.find_spec("verl") is not None


@pytest.mark.skipif(HAS_VERL, reason="checks the answer without verl")
@pytest.mark.parametrize("where", [["--quick"], ["--cluster"]])
def test_without_verl_the_verl_baseline_says_how_to_get_it(capsys, where):
    with pytest.raises(SystemExit) as e:
        main([*where, "--baseline", "verl"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "error: the verl modes need verl in this Python: python -m venv --system-site-packages .venv-verl && "
        ".venv-verl/bin/pip install verl==0.9.1 torch==2.13.0, then run with .venv-verl/bin/python")


@pytest.mark.verl
@pytest.mark.slow
@pytest.mark.skipif(not HAS_VERL, reason="verl is not installed here (README: Benchmarks; .ci/run runs these)")
def test_verls_own_dispatch_delivers_the_same_rows_as_our_imitation(tmp_path, capsys):
    jsonl, md = tmp_path / "r.jsonl", tmp_path / "R.md"
    assert main(["--quick", "--baseline", "verl", "--json", str(jsonl), "--results-md", str(md)]) == 0
    by_mode = {r["mode"]: r for r in map(json.loads, jsonl.read_text().splitlines()) if "seconds" in r}
    assert set(by_mode) == {"coordinator", "centralized-zerocopy", "centralized-verl-numpy", "centralized-verl"}
    ours = by_mode["centralized-zerocopy"]["shard_digests"]
    assert len(ours) == 2 and len(set(ours)) == 2  # one digest per actor, of different rows
    for mode in ("centralized-verl-numpy", "centralized-verl"):
        r = by_mode[mode]
        assert r["shard_digests"] == ours, mode
        # verl puts each chunk once, however many members of a TP pair read it, and so does our imitation
        # (it put it once per member: more bytes through the driver than verl)
        zerocopy = by_mode["centralized-zerocopy"]["busiest_process_bytes"]
        assert 2 * r["batch_bytes"] <= r["busiest_process_bytes"] == zerocopy
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("N=2: ") and "verl" in l)
    assert "faster than verl's numpy path" in line and "every actor's rows equal to the imitation's" in line
    assert "## Against verl's own dispatch" in md.read_text()
