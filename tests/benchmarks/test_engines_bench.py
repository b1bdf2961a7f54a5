"""The rollout-engine benchmark: one quick real run where vLLM is installed, and the one
line it answers with where it is not."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def _bench(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "distflow.cli", "bench", "engines", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(HAS_VLLM, reason="checks the answer without vLLM")
def test_without_vllm_the_benchmark_says_so_in_one_line(tmp_path):
    proc = _bench(tmp_path, "--quick")
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("distflow bench engines: vLLM is not importable in this Python "
                                   "(README: Rollout on vLLM)")


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed here (README: Rollout on vLLM; .ci/run runs these)")
def test_quick_benchmark_measures_both_engines_on_the_same_prompts(tmp_path):
    proc = _bench(tmp_path, "--quick", "--json", str(tmp_path / "e.jsonl"), "--results-md", str(tmp_path / "E.md"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (record,) = [json.loads(line) for line in (tmp_path / "e.jsonl").read_text().splitlines()]
    assert record["model"] == "embedded" and record["batch"] == 8
    assert record["hf_tokens_per_s"] > 0 and record["vllm_tokens_per_s"] > 0
    assert record["speedup"] == pytest.approx(record["vllm_tokens_per_s"] / record["hf_tokens_per_s"])
    assert 0 < record["vllm_sync_s_per_100mb"] < 60 and record["vllm_startup_s"] > 0
    # per 100 MB of the weights pushed, each once: the tied head is the embedding
    from distflow.config import BUILTIN_MODEL
    from distflow.engines.common import load_causal_lm

    model = load_causal_lm(BUILTIN_MODEL)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    assert record["vllm_sync_s_per_100mb"] == pytest.approx(record["vllm_sync_s"] / (size / 100e6))
    assert "| embedded | 0.87M | 8 |" in (tmp_path / "E.md").read_text()
