"""A user's own HF folder of a real architecture (Qwen2, bf16 weights, its own BPE
tokenizer and chat template; conftest's `qwen2_model_dir`): the chat template and the
special tokens are used as the folder defines them, and the whole run works: GRPO steps
on 2 workers tracked by TensorBoard, W&B and MLflow, checkpoints, an exact resume,
`distflow export`, and `distflow eval` repeating the run's final held-out number."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from distflow.data.dataset import PromptRow
from distflow.engines.common import load_causal_lm, load_tokenizer
from distflow.engines.rollout import HFRolloutEngine, SamplingParams
from distflow.trainer.nodes import encode_prompt
from helpers import distflow_sweep


def test_the_folders_chat_template_and_special_tokens_are_used(qwen2_model_dir):
    tok = load_tokenizer(qwen2_model_dir)
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    row = PromptRow(index=0, messages=[{"role": "user", "content": "What is 2 plus 3?"}], ground_truth="5",
                    data_source="x")
    ids = encode_prompt(tok, row)
    assert tok.decode(ids) == "<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n"
    model = load_causal_lm(qwen2_model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.dtype == torch.float32  # bf16 on disk, fp32 master
    # generation stops at the folder's eos: the mask covers up to and including it, pad after
    out = HFRolloutEngine(model, tok).generate([ids] * 16, list(range(16)), SamplingParams(max_new_tokens=24))
    resp, mask = out["responses"], out["response_mask"]
    for r, m in zip(resp.tolist(), mask.tolist()):
        n = sum(m)
        assert all(t != tok.eos_token_id for t in r[: n - 1])
        if n < 24:
            assert r[n - 1] == tok.eos_token_id and set(r[n:]) <= {tok.pad_token_id}


def _cli(args, cwd):
    return subprocess.run([sys.executable, "-m", "distflow.cli", *args], cwd=cwd, capture_output=True, text=True,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"), timeout=400)


@pytest.mark.slow
def test_a_real_architecture_trains_tracked_resumes_evaluates_and_exports(qwen2_model_dir, tmp_path):
    from tracking_readers import check_trackers_hold

    common = [f"model.path={qwen2_model_dir}", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
              "algorithm.group_size=4", "data.val_max_samples=16", "rollout.max_new_tokens=24",
              "trainer.eval_every=0", "trainer.progress=false", "runtime.launcher=torchrun", "trainer.total_steps=3",
              "model.dtype=bfloat16"]
    # one 2-worker launch: the tracked run, then trainer.resume=PATH from its step 2 into a new folder
    resume = f"trainer.resume={tmp_path / 'straight' / 'checkpoints' / 'step_2'}"
    runs = distflow_sweep({"straight": ["trainer.save_every=2", "trainer.logger=jsonl,tensorboard,wandb,mlflow"],
                           "resumed": [resume]}, 2, tmp_path, common)
    straight, resumed = runs["straight"], runs["resumed"]
    want = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in want] == [0, 1, 2, 3] and want[3]["actor/grad_norm"] > 0
    check_trackers_hold(straight, want)  # TensorBoard, W&B and MLflow hold what metrics.jsonl holds
    got = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    for key in ("reward/mean", "response/length_mean", "tokens/total"):
        assert got[3][key] == want[3][key], key
    for key in [k for k in want[3] if k.startswith("actor/")]:
        assert got[3][key] == pytest.approx(want[3][key], rel=1e-4, abs=1e-6), key
    exported = tmp_path / "exported"
    proc = _cli(["export", str(straight / "checkpoints" / "final"), "--out", str(exported)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (exported / "optimizer.safetensors").exists() and (exported / "model.safetensors").is_file()
    out = tmp_path / "eval"
    proc = _cli(["eval", f"model.path={exported}", "data.val_max_samples=16", "rollout.max_new_tokens=24",
                 "runtime.launcher=torchrun", "runtime.num_workers=1", f"trainer.output_dir={out}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "eval.json").read_text())["metrics"]
    assert report["rows"] == 16 and report["accuracy"] == want[3]["val/accuracy"]
