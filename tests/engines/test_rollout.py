import pytest
import torch

from distflow.engines.common import forward_response, load_causal_lm, load_tokenizer
from distflow.engines.rollout import (HFRolloutEngine, PerSequenceSampler, SamplingParams, left_pad,
                                      response_mask_from, sample_seed)


def _engine(path, micro=128):
    tok = load_tokenizer(path)
    return HFRolloutEngine(load_causal_lm(path), tok, micro), tok


def _prompts(tok, texts):
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_sampling_is_placement_invariant(random_model_dir):
    """The same (prompt, seed) gives the same response alone or batched with others."""
    engine, tok = _engine(random_model_dir)
    prompts = _prompts(tok, ["Ann has 3 pens.\nA: ", "Bo buys 4 bags of 5 cups. How many?\nA: ", "x\nA: "])
    seeds = [sample_seed(1, 2, i) for i in range(3)]
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    together = engine.generate(prompts, seeds, params)
    for i in range(3):
        alone = engine.generate([prompts[i]], [seeds[i]], params)
        n = int(alone["response_mask"][0].sum())
        assert torch.equal(alone["responses"][0, :n], together["responses"][i, :n])
    again = engine.generate(prompts, seeds, params)
    assert torch.equal(again["responses"], together["responses"])
    other = engine.generate(prompts, [s + 1 for s in seeds], params)
    assert not torch.equal(other["responses"], together["responses"])
    assert len(engine.generate([], [], params)) == 0  # a rank with no prompts (it failed in Batch.concat)


def test_rows_sharing_a_prompt_prefill_it_once_and_sample_as_alone(random_model_dir):
    """GRPO's n samples of a prompt: the engine runs the prompt's prefill once for them
    (counted at the embedding), and each row's response and log-probs are those it gets
    generated alone."""
    engine, tok = _engine(random_model_dir)
    texts = ["Ann has 3 pens.\nA: ", "Bo buys 4 bags of 5 cups. How many?\nA: "]
    prompts = _prompts(tok, texts * 3)  # each prompt three times, interleaved
    seeds = [sample_seed(3, i) for i in range(6)]
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    seen = []
    hook = engine.model.get_input_embeddings().register_forward_hook(lambda m, i, o: seen.append(i[0].shape))
    together = engine.generate(prompts, seeds, params)
    hook.remove()
    width = max(map(len, prompts))
    assert seen[0] == (2, width - 1) and seen[1] == (6, 1)  # two prompts' prefill, then each row's last token
    for i in range(6):
        alone = engine.generate([prompts[i]], [seeds[i]], params)
        n = int(alone["response_mask"][0].sum())
        assert torch.equal(alone["responses"][0, :n], together["responses"][i, :n])
        assert torch.allclose(alone["rollout_log_probs"][0], together["rollout_log_probs"][i], atol=1e-5)
    assert len({tuple(r.tolist()) for r in together["responses"]}) > 2  # the samples of a prompt differ


def test_seeded_sampler_matches_softmax_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = torch.softmax(logits / 0.7, -1)[0]
    counts = torch.zeros(4)
    for s in range(4000):
        counts[int(PerSequenceSampler([s], 0.7, 1.0)(None, logits).argmax())] += 1
    assert torch.allclose(counts / 4000, probs, atol=0.03)


def test_top_p_keeps_the_nucleus_only():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = {int(PerSequenceSampler([s], 1.0, 0.7)(None, logits).argmax()) for s in range(300)}
    assert seen == {0, 1}  # 0.5 < 0.7 so token 1 (crossing 0.7) is kept, 2 and 3 never


def test_greedy_matches_plain_hf_generate(random_model_dir):
    engine, tok = _engine(random_model_dir)
    prompts = _prompts(tok, ["Ann has 3 pens.\nA: ", "Q\nA: "])
    out = engine.generate(prompts, None, SamplingParams(max_new_tokens=10, greedy=True))
    for i, p in enumerate(prompts):
        ref = engine.model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                    do_sample=False, max_new_tokens=10, pad_token_id=tok.pad_token_id,
                                    eos_token_id=tok.eos_token_id)[0, len(p):]
        n = min(len(ref), 10)
        assert torch.equal(out["responses"][i, :n], ref[:n])


def test_response_mask_stops_after_the_first_stop_token():
    eos, end_of_turn = 2, 8
    resp = torch.tensor([[5, 6, eos, 0, 0], [5, eos, 7, eos, 0], [5, 6, 7, 8, 9]])
    assert response_mask_from(resp, [eos]).tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert response_mask_from(resp, [eos, end_of_turn]).tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0],
                                                                      [1, 1, 1, 1, 0]]


def test_the_models_own_generation_config_does_not_change_what_is_sampled(random_model_dir):
    """Fields of the model's generation_config that HF turns into logits processors ahead
    of ours (suppressed tokens, a forced EOS, a minimum length) leave the samples and their
    log-probs as the policy's (as vLLM with generation_config="vllm")."""
    engine, tok = _engine(random_model_dir)
    prompts = _prompts(tok, ["Ann has 3 pens.\nA: ", "Q\nA: "])
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    plain = engine.generate(prompts, [1, 2], params)
    own = engine.model.generation_config
    own.suppress_tokens, own.forced_eos_token_id = [int(plain["responses"][0, 0])], tok.eos_token_id
    own.min_length = 64
    out = engine.generate(prompts, [1, 2], params)
    assert torch.equal(out["responses"], plain["responses"])
    assert torch.equal(out["rollout_log_probs"], plain["rollout_log_probs"])
    assert engine.model.generation_config is own and own.min_length == 64  # the model's own config is kept


def test_without_generation_config_json_both_engines_stop_where_config_json_says(random_model_dir, tmp_path):
    """A folder with no generation_config.json whose config.json lists two EOS ids: the HF
    engine stopped at both, the vLLM engine at the tokenizer's alone."""
    import json
    import shutil

    from distflow.engines.rollout import stop_token_ids
    from distflow.engines.vllm_rollout import _generation_config

    folder = tmp_path / "model"
    shutil.copytree(random_model_dir, folder)
    (folder / "generation_config.json").unlink(missing_ok=True)
    tok = load_tokenizer(str(folder))
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = [tok.eos_token_id, 5]
    (folder / "config.json").write_text(json.dumps(config))
    hf = HFRolloutEngine(load_causal_lm(str(folder)), tok)
    assert hf.stop_token_ids == (tok.eos_token_id, 5)
    assert stop_token_ids(tok, _generation_config(str(folder))) == hf.stop_token_ids


def test_an_end_of_turn_the_generation_config_names_ends_a_response(random_model_dir):
    """An instruct model whose end of turn is not its tokenizer's EOS (Gemma's
    <end_of_turn>, Llama-3's <|eot_id|>) lists it in generation_config.eos_token_id: the
    response ends there, as HF's and vLLM's own generation stop, not at the budget."""
    engine, tok = _engine(random_model_dir)
    prompts = _prompts(tok, ["Ann has 3 pens.\nA: ", "Q\nA: "])
    params = SamplingParams(max_new_tokens=10, greedy=True)
    free = engine.generate(prompts, None, params)
    end_of_turn = int(free["responses"][0, 3])  # the fourth token the model writes: an end of turn from now on
    assert end_of_turn != tok.eos_token_id
    engine.model.generation_config.eos_token_id = [tok.eos_token_id, end_of_turn]
    engine = HFRolloutEngine(engine.model, tok)
    assert engine.stop_token_ids == (tok.eos_token_id, end_of_turn)
    out = engine.generate(prompts, None, params)
    first = (free["responses"][0] == end_of_turn).nonzero()[0, 0]
    assert out["response_mask"][0].sum() == first + 1 and torch.equal(out["responses"][0, :first + 1],
                                                                        free["responses"][0, :first + 1])
    assert (out["responses"][0, first + 1:] == tok.pad_token_id).all()


def test_log_probs_with_left_padding_match_unpadded(random_model_dir):
    """The training forward scores a padded batch exactly like each sequence alone."""
    engine, tok = _engine(random_model_dir, micro=2)
    prompts = _prompts(tok, ["Ann has 3 pens and more.\nA: ", "Q\nA: "])
    out = engine.generate(prompts, [11, 12], SamplingParams(max_new_tokens=8))
    lp, ent = forward_response(engine.model, out["prompts"], out["prompt_mask"], out["responses"],
                               out["response_mask"], with_entropy=True)
    assert lp.shape == out["responses"].shape and ent.shape == lp.shape
    for i, p in enumerate(prompts):
        ids, mask = left_pad([p], tok.pad_token_id)
        lp_i, _ = forward_response(engine.model, ids, mask, out["responses"][i:i + 1], out["response_mask"][i:i + 1])
        m = out["response_mask"][i].bool()
        assert torch.allclose(lp[i][m], lp_i[0][m], atol=1e-5)
    # and they are the log-probs of a real distribution: the sampled tokens are plausible
    assert (lp[out["response_mask"].bool()] <= 0).all()


def test_engine_log_probs_match_the_trainers_forward(random_model_dir):
    """The engine returns each sampled token's log-prob; in fp32 they equal the trainer's
    own forward pass over the same sequences to 1e-4 (other kernels: a KV cache, per-step
    logits), and are 0 where the response is masked."""
    engine, tok = _engine(random_model_dir)
    prompts = _prompts(tok, ["Ann has 3 pens.\nA: ", "Bo buys 4 bags of 5 cups. How many?\nA: ", "x\nA: "])
    out = engine.generate(prompts, [sample_seed(1, i) for i in range(3)], SamplingParams(max_new_tokens=12))
    mask = out["response_mask"].bool()
    trainer, _ = forward_response(engine.model, out["prompts"], out["prompt_mask"], out["responses"],
                                  out["response_mask"])
    assert torch.all(out["rollout_log_probs"][~mask] == 0) and torch.all(out["rollout_log_probs"][mask] < 0)
    torch.testing.assert_close(out["rollout_log_probs"][mask], trainer[mask], atol=1e-4, rtol=0)
    hot = engine.generate(prompts, [sample_seed(1, i) for i in range(3)],
                          SamplingParams(max_new_tokens=12, temperature=2.0))
    first = hot["rollout_log_probs"][:, 0]  # the first token: the same logits as the trainer's, / T
    logits = engine.model(input_ids=hot["prompts"], attention_mask=hot["prompt_mask"],
                          position_ids=(hot["prompt_mask"].cumsum(-1) - 1).clamp(min=0)).logits[:, -1].float()
    expected = torch.log_softmax(logits / 2.0, -1).gather(-1, hot["responses"][:, :1]).squeeze(-1)
    torch.testing.assert_close(first, expected, atol=1e-4, rtol=0)


def test_the_trainer_scores_at_the_rollouts_temperature(random_model_dir):
    """At temperature 2 the actor and the reference score the sampled tokens under the
    distribution the engine sampled from, so PPO's ratio and the rollout correction
    compare like with like (verl divides the actor's logits by the temperature too)."""
    from distflow.engines.actor import Actor, OptimConfig, ReferenceModel

    engine, tok = _engine(random_model_dir)
    prompts = _prompts(tok, ["Ann has 3 pens.\nA: ", "Bo buys 4 bags of 5 cups. How many?\nA: "])
    out = engine.generate(prompts, [sample_seed(2, i) for i in range(2)],
                          SamplingParams(max_new_tokens=10, temperature=2.0))
    mask = out["response_mask"].bool()
    actor = Actor(load_causal_lm(random_model_dir), OptimConfig(lr=1e-3), torch.device("cpu"), temperature=2.0)
    ref = ReferenceModel(load_causal_lm(random_model_dir), torch.device("cpu"), temperature=2.0)
    for scorer in (actor, ref):
        scored = scorer.compute_log_probs(out, [[0, 1]])
        torch.testing.assert_close(scored[mask], out["rollout_log_probs"][mask], atol=1e-4, rtol=0)
    cold = ReferenceModel(load_causal_lm(random_model_dir), torch.device("cpu")).compute_log_probs(out, [[0, 1]])
    assert (cold[mask] - out["rollout_log_probs"][mask]).abs().max() > 1e-2  # at T=1 they would not match


def test_partial_rollout_swaps_weights_between_tokens(random_model_dir):
    """rollout.partial: weights that arrive while token 3 is sampled compute token 4 on.
    Tokens 0-3 and their log-probs are those of the unchanged engine, every token is
    tagged with the version that computed it, and later tokens score under the new
    weights (their log-probs differ)."""
    engine, tok = _engine(random_model_dir)
    prompts = _prompts(tok, ["Ann has 3 pens.\nA: ", "Bo buys 4 bags of 5 cups. How many?\nA: "])
    seeds, params = [sample_seed(3, i) for i in range(2)], SamplingParams(max_new_tokens=10)
    unchanged = engine.generate(prompts, seeds, params)
    assert "rollout_weight_version" not in unchanged.tensors  # only with rollout.partial
    torch.manual_seed(0)
    policy = load_causal_lm(random_model_dir)
    for p in policy.parameters():  # tied weights stay tied
        p.data.add_(0.5 * torch.randn_like(p))
    newer = policy.state_dict()
    arrivals = iter([None, None, None, (7, newer.items())])
    engine.newer_weights = lambda: next(arrivals, None)
    swapped = engine.generate(prompts, seeds, params)
    assert swapped["rollout_weight_version"].tolist() == [[0, 0, 0, 0] + [7] * 6] * 2
    assert engine.weight_version == 7
    assert torch.equal(swapped["responses"][:, :4], unchanged["responses"][:, :4])
    torch.testing.assert_close(swapped["rollout_log_probs"][:, :4], unchanged["rollout_log_probs"][:, :4])
    assert (swapped["rollout_log_probs"][:, 4:] - unchanged["rollout_log_probs"][:, 4:]).abs().max() > 1e-2
    for name, value in engine.model.state_dict().items():
        assert torch.equal(value, newer[name])


def test_the_engine_on_the_actors_weights_generates_in_its_compute_dtype(random_model_dir):
    """model.dtype=bfloat16 with the HF engine on the actor's own (fp32 master) weights: the
    rollout computes in bf16, as the actor's forwards do (it generated in fp32, at twice the
    memory traffic, and from a slightly different policy than the one the update scores)."""
    from distflow.config import load_config
    from distflow.engines.actor import Actor, OptimConfig
    from distflow.trainer.loop import make_rollout_engine

    cpu = torch.device("cpu")
    actor = Actor(load_causal_lm(random_model_dir), OptimConfig(lr=1e-3), cpu, compute_dtype=torch.bfloat16)
    tok = load_tokenizer(random_model_dir)
    engine = make_rollout_engine(load_config(None, ["model.dtype=bfloat16"]), random_model_dir, tok, cpu, actor)
    assert engine.model is actor.module
    head_dtypes = []
    actor.module.get_output_embeddings().register_forward_hook(lambda m, i, out: head_dtypes.append(out.dtype))
    out = engine.generate(_prompts(tok, ["Ann has 3 pens.\nA: "] * 2), [1, 2], SamplingParams(max_new_tokens=6))
    assert head_dtypes and set(head_dtypes) == {torch.bfloat16}
    assert next(actor.module.parameters()).dtype == torch.float32  # the master weights stay fp32
    assert out["rollout_log_probs"].dtype == torch.float32 and torch.isfinite(out["rollout_log_probs"]).all()


HYBRIDS = {  # tiny random models of hybrid architectures: linear attention (Qwen3-Next), Mamba (Jamba)
    "qwen3_next": dict(head_dim=8, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
                       num_experts_per_tok=2, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                       linear_value_head_dim=8, full_attention_interval=2, decoder_sparse_step=1),
    "jamba": dict(num_experts=2, num_experts_per_tok=1, attn_layer_period=2, attn_layer_offset=1,
                  expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_dt_rank=4,
                  use_mamba_kernels=False),
}


@pytest.mark.parametrize("model_type", sorted(HYBRIDS))
def test_a_hybrid_models_rows_that_share_a_prompt_each_run_it(model_type):
    """A linear-attention or SSM layer's cache state cannot be handed row by row as keys and
    values can: GRPO's groups (rows sharing a prompt) failed on the first rollout and in
    every scoring forward. Such a model's rows run their prompts each, in both places, and
    the engine's log-probs are the trainer's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, **HYBRIDS[model_type])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    prompts = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10, 11], [9, 10, 11]]
    ids, mask = left_pad(prompts, 0)

    class Tokenizer:
        pad_token_id, eos_token_id = 0, 1

    out = HFRolloutEngine(model, Tokenizer(), shares_trainer_weights=True).generate(
        prompts, [1, 2, 3, 4], SamplingParams(max_new_tokens=6))
    with torch.no_grad():
        each, _ = forward_response(model, ids, mask, out["responses"], out["response_mask"])
        once, _ = forward_response(model, ids, mask, out["responses"], out["response_mask"], prompt_once=True)
    generated = out["response_mask"].bool()
    assert torch.equal(each, once)
    assert (each - out["rollout_log_probs"])[generated].abs().max() < 1e-5
