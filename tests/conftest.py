"""Shared fixtures. CPU only; multi-process tests use gloo on loopback."""

from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

# Tests import helpers from the tests folder itself (tests/helpers.py).
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory) -> str:
    """An untrained tiny Llama + char tokenizer saved as a HF folder (fast to build)."""
    from distflow.engines.tiny_model import TinyModelSpec, build_model, build_tokenizer

    path = tmp_path_factory.mktemp("random_model")
    tok = build_tokenizer()
    model = build_model(tok, TinyModelSpec(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128), seed=0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)
