"""The vLLM engine's sleep and staged wake-up on a GPU, in the order of its calls to vLLM.

vLLM's CPU backend has no sleep mode, so the real engine cannot run this here
(test_vllm_engine.py runs the rest on vLLM itself); a recorder stands in for vLLM's `LLM`."""

from __future__ import annotations

import torch

from distflow.engines.vllm_rollout import VLLMRolloutEngine


class _Recorder:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, kwargs.get("tags", kwargs.get("level"))))


def test_the_weights_wake_for_the_push_and_the_kv_cache_after_it(monkeypatch):
    """After a rollout the engine sleeps (level 1). The push wakes its weights alone, loads the
    new ones, frees the cached blocks, and only then wakes the KV cache: woken together, the KV
    cache was allocated beside the trainer's gathered weights. Generation finds it awake."""
    freed = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: freed.append(len(engine.llm.calls)))
    engine = VLLMRolloutEngine.__new__(VLLMRolloutEngine)
    engine.llm, engine.release_memory_after_rollout, engine._asleep = _Recorder(), True, set()
    engine.sleep()
    engine.sleep()  # asleep already: no second call
    engine.update_weights(iter([("w", torch.zeros(2))]), version=3)
    engine._wake()  # generate's: nothing left asleep
    assert engine.llm.calls == [("sleep", 1), ("wake_up", ["weights"]), ("collective_rpc", None),
                                ("wake_up", ["kv_cache"]), ("reset_prefix_cache", None)]
    assert freed == [3] and engine.weight_version == 3


def test_an_engine_without_a_trainer_beside_it_never_sleeps(monkeypatch):
    """A disaggregated rollout worker's or evaluation's engine has its GPU to itself: sleeping
    cost two copies of the weights and the KV cache's rebuild every step, for nothing."""
    from distflow.config import load_config
    from distflow.engines import vllm_rollout
    from distflow.trainer.loop import make_rollout_engine

    made = []
    monkeypatch.setattr(vllm_rollout, "VLLMRolloutEngine", lambda *args, **kwargs: made.append(kwargs) or object())
    cfg = load_config(None, ["rollout.engine=vllm"])
    make_rollout_engine(cfg, cfg.model.path, None, torch.device("cpu"), actor=None)
    assert made[0]["release_memory_after_rollout"] is False
