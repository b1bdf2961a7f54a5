"""The actor on 2 gloo ranks, as DDP replicas or FSDP2 shards, == the same actor in one
process (the loss normalisation and the gradient averaging cancel exactly)."""

import math
import threading
import weakref

import pytest
import torch
import torch.distributed as dist

from distflow.config import load_config
from distflow.data.batch import Batch
from distflow.engines.actor import Actor, OptimConfig
from distflow.engines.common import load_causal_lm, load_tokenizer
from distflow.engines.rollout import HFRolloutEngine, SamplingParams
from distflow.trainer.nodes import make_policy_loss
from helpers import run_gloo


def _batch(model_dir: str) -> Batch:
    tok = load_tokenizer(model_dir)
    engine = HFRolloutEngine(load_causal_lm(model_dir), tok)
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in
               ["Ann has 3 pens.\nA: ", "Bo buys 4 bags.\nA: ", "Cy\nA: ", "Di has 12 hats, gets 4.\nA: "]]
    out = engine.generate(prompts, [1, 2, 3, 4], SamplingParams(max_new_tokens=10))
    gen = torch.Generator().manual_seed(0)
    # advantages of very different magnitudes so a mis-summed rank would show
    out.tensors["advantages"] = torch.tensor([4.5, -45.0, 450.0, -0.45])[:, None] * out["response_mask"]
    out.tensors["ref_log_probs"] = -torch.rand(out["responses"].shape, generator=gen)
    return out


def _grouped_batch(model_dir: str) -> Batch:
    """Three prompts of different lengths, sampled three times each (GRPO's groups), and
    one prompt sampled once; the rows of a group are not next to each other."""
    tok = load_tokenizer(model_dir)
    engine = HFRolloutEngine(load_causal_lm(model_dir), tok)
    texts = ["Ann has 3 pens.\nA: ", "Cy\nA: ", "Di has 12 hats, gets 4.\nA: "] * 3 + ["Bo buys 4 bags.\nA: "]
    out = engine.generate([tok(t, add_special_tokens=False)["input_ids"] for t in texts], list(range(10)),
                          SamplingParams(max_new_tokens=10))
    gen = torch.Generator().manual_seed(1)
    out.tensors["advantages"] = torch.randn(len(out), 1, generator=gen) * out["response_mask"]
    out.tensors["ref_log_probs"] = -torch.rand(out["responses"].shape, generator=gen)
    return out


def _grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[name] = g.detach().clone()
    return out


def _train(rank: int, world: int, model_dir: str, strategy: str = "auto", gradient_checkpointing: bool = False,
           head_chunk_tokens: int = 0):
    cfg = load_config(None, [f"runtime.num_workers={world}", "data.train_batch_size=4",
                             "actor.ppo_mini_batch_size=4", "algorithm.kl_coef=0.1"])
    batch = _batch(model_dir)
    local = batch.select(list(range(rank, len(batch), world)))
    num_tokens, num_seqs = float(batch["response_mask"].sum()), float(len(batch))
    actor = Actor(load_causal_lm(model_dir), OptimConfig(lr=1e-3, grad_clip=1e9), torch.device("cpu"),
                  strategy=strategy, gradient_checkpointing=gradient_checkpointing, head_chunk_tokens=head_chunk_tokens)
    # two micro-batches per rank: DDP all-reduces once, in the second backward
    sums = actor.train_mini_batch(local, [[i] for i in range(len(local))], make_policy_loss(cfg, num_tokens, num_seqs))
    state = {k: v.clone() for k, v in actor.full_state_dict().items()}
    return _grads(actor.module), sums["grad_norm"], state, actor.strategy


def _score_head_chunked(rank: int, world: int, model_dir: str, strategy: str):
    """A rank's log-probs (no gradients: FSDP2's forward then gathers and frees the
    weights itself) with the output head chunked and kept whole."""
    local = _batch(model_dir).select([rank, rank + world])
    return [Actor(load_causal_lm(model_dir), OptimConfig(lr=1e-3), torch.device("cpu"), strategy=strategy,
                  head_chunk_tokens=chunk).compute(local, [[0], [1]]) for chunk in (3, 0)]


def _score_with_rank_1_empty(rank: int, world: int, model_dir: str, strategy: str):
    """Rank 0 scores two rows; rank 1 holds none (a filter left it none, or its layout has
    fewer groups than ranks) and still joins the lockstep forward."""
    rows = [0, 1] if rank == 0 else []
    local = _batch(model_dir).select(rows)
    actor = Actor(load_causal_lm(model_dir), OptimConfig(lr=1e-3), torch.device("cpu"), strategy=strategy)
    return actor.compute(local, [rows])


def _train_prompt_once(rank: int, world: int, model_dir: str, prompt_once: bool):
    """One update on the grouped batch, rank r holding every sample of its prompts, in
    one micro-batch (so that rows share their prompt's forward)."""
    cfg = load_config(None, [f"runtime.num_workers={world}", "data.train_batch_size=4",
                             "actor.ppo_mini_batch_size=4", "algorithm.kl_coef=0.1"])
    batch = _grouped_batch(model_dir)
    local = batch.select([i for i in range(len(batch)) if (i % 3 if i < 9 else 3) % world == rank])
    actor = Actor(load_causal_lm(model_dir), OptimConfig(lr=1e-3, grad_clip=1e9), torch.device("cpu"),
                  prompt_once=prompt_once)
    sums = actor.train_mini_batch(local, [list(range(len(local)))],
                                  make_policy_loss(cfg, float(batch["response_mask"].sum()), float(len(batch))))
    return _grads(actor.module), sums["grad_norm"], actor.strategy


STRATEGIES = ["ddp", "fsdp2", "auto"]
EXPLICIT = ["ddp", "fsdp2"]  # auto resolves to one of these


def _on_two_ranks(rank: int, world: int, model_dir: str) -> dict:
    """Every two-rank check of this module, in one launch (a launch's start-up costs more
    than the checks)."""
    return {"train": {s: _train(rank, world, model_dir, s) for s in STRATEGIES},
            "checkpointed": {s: _train(rank, world, model_dir, s, gradient_checkpointing=True) for s in EXPLICIT},
            "head_chunked": {s: _train(rank, world, model_dir, s, head_chunk_tokens=3) for s in EXPLICIT},
            "head_chunked_scores": {s: _score_head_chunked(rank, world, model_dir, s) for s in EXPLICIT},
            "rank_1_empty": {s: _score_with_rank_1_empty(rank, world, model_dir, s) for s in EXPLICIT},
            "load": {s: _load_full_state(rank, world, model_dir, s) for s in EXPLICIT},
            "bf16": {s: _train_bf16(rank, world, model_dir, s) for s in EXPLICIT},
            "prompt_once": _train_prompt_once(rank, world, model_dir, True),
            "pushed": _pushed_weights()}


def _pushed_weights() -> dict:
    """What an FSDP2 actor hands a rollout engine, on each rank, against the model's own
    weights: a small Qwen2-MoE, whose shared-expert gate ([1, hidden]) leaves rank 1 an
    empty shard, with its output head tied to the embedding."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                         shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = Qwen2MoeForCausalLM(cfg)
    full = {k: v.clone() for k, v in model.state_dict().items()}
    actor = Actor(model, OptimConfig(lr=1e-3), torch.device("cpu"), strategy="fsdp2")
    pushed = dict(actor.iter_full_weights())  # a collective per tensor: ranks out of step fail here
    return {"names": sorted(pushed), "expected": sorted(set(full) - {"lm_head.weight"}),
            "equal": all(torch.equal(pushed[k], full[k]) for k in pushed)}


def test_fsdp2_pushes_every_weight_once_also_where_a_ranks_shard_is_empty(two_ranks):
    """Ties are read from the module, not from the shards' memory: every empty shard's
    data_ptr is 0, so rank 1 took its empty gate shard for a tie and skipped it (and every
    weight after another empty shard), and the ranks' all-gathers went out of step."""
    for ranks in two_ranks:
        pushed = ranks["pushed"]
        assert pushed["names"] == pushed["expected"] and pushed["equal"]


@pytest.fixture(scope="module")
def two_ranks(random_model_dir) -> list[dict]:
    return run_gloo(_on_two_ranks, 2, random_model_dir, timeout=240.0)


@pytest.mark.parametrize("strategy, run", [(s, "train") for s in STRATEGIES] +
                         [(s, run) for s in EXPLICIT for run in ("checkpointed", "head_chunked")])
def test_two_ranks_match_one_process(random_model_dir, two_ranks, strategy, run):
    """Also with gradient checkpointing, or the output head chunked, on the two ranks
    (FSDP2's hooks stay outside the recomputed layers; the head's weight, read after the
    forward, is FSDP2's gathered one and its gradient reaches the reduce-scatter): the
    update of one process without either."""
    ref_grads, ref_norm, ref_state, alone = _train(0, 1, random_model_dir)
    assert alone == "none"
    for grads, norm, state, used in (ranks[run][strategy] for ranks in two_ranks):
        assert used == ("ddp" if strategy == "auto" else strategy)  # auto: a 0.1M-parameter model fits anywhere
        assert abs(norm - ref_norm) < 1e-4 * max(1.0, ref_norm)
        assert ref_norm > 0
        for name, g in ref_grads.items():  # chunked, the head's gradient sums its chunks in another order
            assert (_same_gradient(grads[name], g) if run == "head_chunked" else
                    torch.allclose(grads[name], g, atol=1e-6, rtol=1e-4)), name
        for name, w in ref_state.items():
            assert torch.allclose(state[name], w, atol=1e-6), name


def _load_full_state(rank, world, model_dir, strategy):
    actor = Actor(load_causal_lm(model_dir), OptimConfig(lr=1e-3), torch.device("cpu"), strategy=strategy)
    full = actor.full_state_dict()
    plain = load_causal_lm(model_dir)
    with torch.no_grad():
        for p in plain.parameters():
            p.zero_()  # so that every value compared below came through the load
    plain.load_state_dict(full, strict=True)  # every key, no extra one
    original = load_causal_lm(model_dir).state_dict()
    differ = [k for k, v in plain.state_dict().items() if not torch.equal(v, original[k])]
    return differ, sorted(full) == sorted(original), dist.get_world_size()


@pytest.mark.parametrize("strategy", EXPLICIT)
def test_chunked_head_scores_like_the_whole_logits_on_two_ranks(two_ranks, strategy):
    for chunked, whole in (ranks["head_chunked_scores"][strategy] for ranks in two_ranks):
        assert whole.abs().sum() > 0
        torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-5)


@pytest.mark.parametrize("strategy", EXPLICIT)
def test_a_rank_without_rows_joins_the_scoring_forward(random_model_dir, two_ranks, strategy):
    """A scoring forward outside the training layout (the reference's or old log-probs'
    after a filter, in the groups' layout) can leave a rank no rows: it runs a blank row
    with the others (it failed on `row 0` of nothing), and theirs are scored as alone."""
    alone = Actor(load_causal_lm(random_model_dir), OptimConfig(lr=1e-3), torch.device("cpu")).compute(
        _batch(random_model_dir).select([0, 1]), [[0, 1]])
    scored, empty = (ranks["rank_1_empty"][strategy] for ranks in two_ranks)
    torch.testing.assert_close(scored, alone, rtol=0, atol=1e-5)
    assert empty.shape[0] == 0


@pytest.mark.parametrize("strategy", EXPLICIT)
def test_full_state_dict_loads_into_plain_model(two_ranks, strategy):
    for differ, same_keys, world in (ranks["load"][strategy] for ranks in two_ranks):
        assert differ == [] and same_keys and world == 2


def test_a_non_finite_update_leaves_weights_and_adamw_moments_untouched(random_model_dir):
    cfg = load_config(None, ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4"])
    batch = _batch(random_model_dir)
    actor = Actor(load_causal_lm(random_model_dir), OptimConfig(lr=1e-2), torch.device("cpu"))
    micro = [[0, 1], [2, 3]]
    loss = make_policy_loss(cfg, float(batch["response_mask"].sum()), float(len(batch)))
    assert actor.train_mini_batch(batch, micro, loss)["skipped"] == 0.0  # a real step: moments exist
    weights = {k: v.clone() for k, v in actor.model.state_dict().items()}
    moments = {id(p): {k: v.clone() for k, v in s.items()} for p, s in actor.optimizer.state.items()}
    batch.tensors["advantages"] = batch["advantages"] * float("nan")
    sums = actor.train_mini_batch(batch, micro, loss)
    assert sums["skipped"] == 1.0 and sums["grad_norm"] == 0.0
    assert all(torch.equal(v, weights[k]) for k, v in actor.model.state_dict().items())
    for p, state in actor.optimizer.state.items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[name], moments[id(p)][name]), name


def test_lr_schedule_hand_values():
    from distflow.engines.actor import lr_factor

    warm = [lr_factor(s, 10, 3, "cosine", 0.1) for s in (1, 2, 3)]
    assert warm == [0.25, 0.5, 0.75]  # linear warm-up, never 0
    # after warm-up, progress (s - 4) / 7: the peak first (it was never applied), then a cosine towards
    # min_ratio 0.1, one step short of it at the last step (which trained at lr 0 under min_ratio 0)
    assert lr_factor(4, 10, 3, "cosine", 0.1) == 1.0
    assert lr_factor(5, 10, 3, "cosine", 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 7)))
    assert lr_factor(10, 10, 3, "cosine", 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(6 * math.pi / 7)))
    assert lr_factor(10, 10, 3, "linear", 0.1) == pytest.approx(0.1 + 0.9 / 7)
    assert [lr_factor(s, 4, 0, "linear", 0.0) for s in (1, 2, 3, 4)] == [1.0, 0.75, 0.5, 0.25]
    assert lr_factor(7, 10, 3, "constant", 0.1) == 1.0


def _train_bf16(rank: int, world: int, model_dir: str, strategy: str):
    """One update with bf16 compute; what stays fp32 and what the forward computes in."""
    cfg = load_config(None, [f"runtime.num_workers={world}", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4"])
    batch = _batch(model_dir)
    local = batch.select(list(range(rank, len(batch), world)))
    actor = Actor(load_causal_lm(model_dir), OptimConfig(lr=1e-3), torch.device("cpu"), strategy=strategy,
                  compute_dtype=torch.bfloat16)
    fp32 = Actor(load_causal_lm(model_dir), OptimConfig(lr=1e-3), torch.device("cpu"), strategy=strategy)
    micro = [[i] for i in range(len(local))]
    gap = (actor.compute(local, micro) - fp32.compute(local, micro)).abs().max().item()
    before = {k: v.clone() for k, v in actor.full_state_dict().items()}
    sums = actor.train_mini_batch(local, micro, make_policy_loss(cfg, float(batch["response_mask"].sum()),
                                                                  float(len(batch))))
    after = actor.full_state_dict()
    moments = [s["exp_avg"].dtype for s in actor.optimizer.state.values()]
    return {"gap": gap, "strategy": actor.strategy, "grad_norm": sums["grad_norm"],
            "dtypes": {v.dtype for v in after.values()}, "moments": set(moments),
            "moved": any(not torch.equal(before[k], after[k]) for k in after)}


@pytest.mark.parametrize("strategy", EXPLICIT)
def test_bf16_compute_keeps_fp32_master_weights_and_moments(two_ranks, strategy):
    """model.dtype=bfloat16: the log-probs come from a bf16 forward (they differ from the
    fp32 ones by bf16 rounding, not more), the update lands on fp32 weights, AdamW's
    moments are fp32."""
    for out in (ranks["bf16"][strategy] for ranks in two_ranks):
        assert out["strategy"] == strategy and out["grad_norm"] > 0 and out["moved"]
        assert 1e-4 < out["gap"] < 0.1, out["gap"]  # bf16 really ran, and only its rounding shows
        assert out["dtypes"] == {torch.float32} and out["moments"] == {torch.float32}


def test_the_reference_computes_as_the_actor_under_bf16(random_model_dir):
    """model.dtype=bfloat16 beside a DDP or one-worker actor (fp32 weights under bf16
    autocast): the reference's log-probs are the actor's before any update, so the KL
    starts at 0 (a reference of bf16 weights without autocast differed by up to 0.07 nats
    a token: a KL pulling the policy to bf16 rounding). Beside FSDP2, whose forwards run
    on weights cast to bf16, the reference holds bf16 weights."""
    from distflow.config import load_config
    from distflow.trainer.loop import reference_model

    cfg = load_config(None, [f"model.path={random_model_dir}", "model.dtype=bfloat16"])
    actor = Actor(load_causal_lm(random_model_dir), OptimConfig(lr=1e-3), torch.device("cpu"),
                  compute_dtype=torch.bfloat16)
    ref = reference_model(cfg, actor, torch.device("cpu"))
    batch = _batch(random_model_dir)
    micro = [[0, 1], [2, 3]]
    assert torch.equal(ref.compute_log_probs(batch, micro), actor.compute_log_probs(batch, micro))
    assert next(ref.model.parameters()).dtype == torch.float32
    actor.strategy = "fsdp2"  # stood in: what the choice is made from
    assert next(reference_model(cfg, actor, torch.device("cpu")).model.parameters()).dtype == torch.bfloat16


def _same_gradient(shared: torch.Tensor, alone: torch.Tensor) -> bool:
    """A shared prompt's gradient sums its rows' float32 contributions in another order:
    here within 1e-6 of the gradient's largest entry (1-3 threads), but a few 1e-6 off in
    absolute terms, which a per-entry atol of 1e-6 failed now and then."""
    return bool((shared - alone).abs().max() <= 1e-5 * alone.abs().max())


def test_a_shared_prompt_forward_gives_the_log_probs_and_gradients_of_one_forward_per_row(random_model_dir):
    """actor.forward_prompt_once: rows with the same prompt run it once, then their
    responses on its keys and values; the same numbers as one forward per row, in fewer
    token forwards (counted at the embedding), also with an environment's tokens in the
    responses (a multi-turn episode)."""
    from distflow.engines.common import forward_response, unwrapped

    batch = _grouped_batch(random_model_dir)
    assert batch["prompt_mask"].sum(1).unique().numel() == 3  # left padding of three widths
    model = load_causal_lm(random_model_dir)
    seen = []
    unwrapped(model).get_input_embeddings().register_forward_hook(lambda m, i, o: seen.append(i[0].numel()))
    observed = torch.zeros_like(batch["response_mask"])
    observed[:, 2:4] = batch["response_mask"][:, 2:4]  # two response tokens came from the environment
    for observation in (None, observed):
        outs = {}
        for once in (False, True):
            model.zero_grad()
            seen.clear()
            loss_mask = batch["response_mask"] - (observation if observation is not None else 0)
            lp, ent = forward_response(model, batch["prompts"], batch["prompt_mask"], batch["responses"], loss_mask,
                                       with_entropy=True, observation_mask=observation, prompt_once=once)
            ((lp * batch["advantages"]).sum() + (ent * loss_mask).sum()).backward()
            outs[once] = (lp, ent, {n: q.grad.clone() for n, q in model.named_parameters()}, sum(seen))
        (lp, ent, grads, tokens), (lp1, ent1, grads1, tokens1) = outs[False], outs[True]
        assert torch.allclose(lp1, lp, atol=1e-5) and torch.allclose(ent1, ent, atol=1e-5)
        assert lp.abs().sum() > 0
        for name, g in grads.items():
            assert _same_gradient(grads1[name], g), name
        prompt_width = batch["prompts"].shape[1]
        assert tokens1 == tokens - 6 * prompt_width  # 4 distinct prompts of 10 rows ran once each
    distinct = batch.select([0, 1, 2, 9])  # no prompt twice: the one forward per row
    seen.clear()
    forward_response(model, distinct["prompts"], distinct["prompt_mask"], distinct["responses"],
                     distinct["response_mask"], prompt_once=True)
    assert len(seen) == 1


def test_ddp_ranks_sharing_prompt_forwards_match_one_process_without(random_model_dir, two_ranks):
    """Under DDP the prompts' forward runs outside the wrapper; their gradients still reach
    its all-reduce (through the responses' backward): the update of one process without."""
    ref_grads, ref_norm, _ = _train_prompt_once(0, 1, random_model_dir, False)
    for grads, norm, strategy in (ranks["prompt_once"] for ranks in two_ranks):
        assert strategy == "ddp" and abs(norm - ref_norm) < 1e-4 * max(1.0, ref_norm) and ref_norm > 0
        for name, g in ref_grads.items():
            assert _same_gradient(grads[name], g), name


@pytest.mark.parametrize("trainable", ["actor", "critic"])
def test_gradient_checkpointing_keeps_less_for_the_backward_and_gives_the_same_update(random_model_dir, trainable):
    """actor/critic.gradient_checkpointing: the same gradients, with a quarter or less of the
    bytes autograd keeps from the forward (counted by a saved-tensors hook, which sees
    what the recomputed layers do not keep). The actor's update then runs every row's
    prompt itself (checkpointed layers take no cache in a forward with gradients), while
    its scoring forward still runs each shared prompt once (tokens at the embedding)."""
    from distflow.engines.common import unwrapped
    from distflow.engines.critic import Critic
    from distflow.trainer.nodes import make_value_loss

    batch = _grouped_batch(random_model_dir)
    batch.tensors["values"] = torch.zeros(batch["responses"].shape)
    batch.tensors["returns"] = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(2))
    cfg = load_config(None, ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "algorithm.kl_coef=0.1"])
    counts = float(batch["response_mask"].sum()), float(len(batch))
    make_loss = make_policy_loss if trainable == "actor" else make_value_loss
    runs = {}
    for checkpointing in (False, True):
        optim = OptimConfig(lr=1e-3, grad_clip=1e9)
        engine = (Actor(load_causal_lm(random_model_dir), optim, torch.device("cpu"), prompt_once=True,
                        gradient_checkpointing=checkpointing) if trainable == "actor" else
                  Critic(load_causal_lm(random_model_dir), optim, torch.device("cpu"),
                         gradient_checkpointing=checkpointing))
        tokens, kept = [], []
        embeddings = engine.module.get_input_embeddings() if trainable == "actor" else engine.module.body.embed_tokens
        embeddings.register_forward_hook(lambda m, i, o: tokens.append(i[0].numel()))
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            sums = engine.train_mini_batch(batch, [list(range(len(batch)))], make_loss(cfg, *counts))
        trained = sum(tokens)
        tokens.clear()
        engine.compute(batch, [list(range(len(batch)))])
        runs[checkpointing] = (_grads(unwrapped(engine.model)), sums["grad_norm"], sum(kept), trained, sum(tokens))
    (grads, norm, kept, trained, scored), (grads1, norm1, kept1, trained1, scored1) = runs[False], runs[True]
    assert norm > 0 and abs(norm1 - norm) < 1e-4 * norm
    for name, g in grads.items():
        assert _same_gradient(grads1[name], g), name
    assert kept1 < 0.25 * kept, (kept1, kept)
    assert scored1 == scored
    if trainable == "actor":
        assert scored < trained1 and trained == scored  # one forward per row in the checkpointed update only


def test_the_output_head_runs_on_the_scored_positions_only(random_model_dir):
    """forward_response asks the model for the logits of the last R' + 1 positions (from
    the last prompt token on): the log-probs of slicing the full logits, with the output
    head run on R' + 1 positions instead of P + R'."""
    from distflow.algos.core import log_probs_from_logits
    from distflow.engines.common import forward_response, trim_padding

    batch = _batch(random_model_dir)
    model = load_causal_lm(random_model_dir)
    positions = []
    model.get_output_embeddings().register_forward_hook(lambda m, i, o: positions.append(o.shape[1]))
    log_probs, _ = forward_response(model, batch["prompts"], batch["prompt_mask"], batch["responses"],
                                    batch["response_mask"])
    p, pm, r, rm = trim_padding(batch["prompts"], batch["prompt_mask"], batch["responses"], batch["response_mask"])
    attention = torch.cat([pm, rm], dim=1)
    full = model(input_ids=torch.cat([p, r], dim=1), attention_mask=attention,
                 position_ids=(attention.cumsum(-1) - 1).clamp(min=0)).logits
    want = log_probs_from_logits(full[:, p.shape[1] - 1: p.shape[1] - 1 + r.shape[1]], r)
    assert positions == [r.shape[1] + 1, p.shape[1] + r.shape[1]] and p.shape[1] > 1
    torch.testing.assert_close(log_probs[:, :r.shape[1]], want, rtol=0, atol=1e-6)
    assert log_probs.abs().sum() > 0


def test_a_chunked_output_head_gives_the_log_probs_entropy_and_gradients_of_the_whole_logits(random_model_dir):
    """actor.output_head_chunk_tokens: the model's final hidden states go through the
    head a few tokens at a time, in the forward and again in the backward; the same
    log-probs, entropy and gradients as the whole logits, at a temperature, with shared
    prompt forwards or not, in fp32 and under bf16 autocast; nothing of the logits' size
    kept for the backward (a saved-tensors hook counts what is)."""
    from distflow.engines.common import forward_response

    batch = _grouped_batch(random_model_dir)
    model = load_causal_lm(random_model_dir)
    vocab = model.config.vocab_size
    for once, dtype in ((False, torch.float32), (True, torch.float32), (False, torch.bfloat16)):
        outs = {}
        for chunk in (0, 7):
            model.zero_grad()
            kept = []
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16), \
                    torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.shape) or t, lambda t: t):
                lp, ent = forward_response(model, batch["prompts"], batch["prompt_mask"], batch["responses"],
                                           batch["response_mask"], with_entropy=True, temperature=0.7,
                                           prompt_once=once, head_chunk_tokens=chunk)
            ((lp * batch["advantages"]).sum() + 0.3 * (ent * batch["response_mask"]).sum()).backward()
            logits_like = [t for t in kept if len(t) == 3 and t[-1] == vocab]  # (rows, positions, vocab)
            outs[chunk] = (lp, ent, {n: q.grad.clone() for n, q in model.named_parameters()}, logits_like)
        (lp, ent, grads, logits_like), (lp1, ent1, grads1, logits_like1) = outs[0], outs[7]
        assert lp.abs().sum() > 0 and ent.abs().sum() > 0
        exact = dtype == torch.float32
        torch.testing.assert_close(lp1, lp, rtol=0, atol=1e-5 if exact else 1e-2)
        torch.testing.assert_close(ent1, ent, rtol=0, atol=1e-5 if exact else 1e-2)
        for name, g in grads.items():
            gap = (grads1[name] - g).abs().max() / g.abs().max()
            assert gap <= (1e-5 if exact else 2e-2), (name, once, dtype, gap)
        assert logits_like and not logits_like1


def test_scoring_with_a_chunked_output_head_keeps_no_earlier_layer_s_hidden_states(random_model_dir):
    """Scoring (no gradients) with a chunked output head holds one layer's hidden states
    at a time, as a forward for the logits does: when the final norm runs, no earlier
    decoder layer's output is alive, with shared prompt forwards or not. The probe itself:
    a forward with `output_hidden_states` keeps them, and it counts them."""
    from distflow.engines.common import forward_response

    batch = _grouped_batch(random_model_dir)
    model = load_causal_lm(random_model_dir)
    outputs, alive = [], []
    for layer in model.model.layers:
        layer.register_forward_hook(lambda m, i, o: outputs.append(weakref.ref(o[0] if isinstance(o, tuple) else o)))
    # at the final norm, every layer has run; its input is the last layer's output
    model.model.norm.register_forward_pre_hook(
        lambda m, i: alive.append(sum(ref() is not None for ref in outputs[:-1])) or outputs.clear())
    with torch.no_grad():
        model(input_ids=batch["prompts"], attention_mask=batch["prompt_mask"], output_hidden_states=True)
        assert alive == [len(model.model.layers) - 1] and alive[0] > 0
        for once in (False, True):
            alive.clear()
            forward_response(model, batch["prompts"], batch["prompt_mask"], batch["responses"],
                             batch["response_mask"], with_entropy=True, prompt_once=once, head_chunk_tokens=7)
            assert alive == [0] * (2 if once else 1), once


def test_a_chunked_output_head_leaves_another_thread_s_forward_its_logits(random_model_dir):
    """The chunked head's hook is the module's: a forward of the same model in another
    thread meanwhile (one worker's HF engine generating ReMax's greedy baseline beside the
    scoring) got an empty head input and no logits."""
    from distflow.engines.common import forward_response

    batch = _grouped_batch(random_model_dir)
    model = load_causal_lm(random_model_dir)
    seen = []

    def other_thread_forward():
        with torch.no_grad():
            seen.append(tuple(model(input_ids=batch["prompts"][:1]).logits.shape))

    def beside(module, args):  # while this thread's forward holds the hook, another thread runs one
        if threading.current_thread() is threading.main_thread() and not seen:
            thread = threading.Thread(target=other_thread_forward)
            thread.start()
            thread.join(60)

    model.model.norm.register_forward_pre_hook(beside)
    with torch.no_grad():
        forward_response(model, batch["prompts"], batch["prompt_mask"], batch["responses"], batch["response_mask"],
                         head_chunk_tokens=7)
    assert seen == [(1, batch["prompts"].shape[1], model.config.vocab_size)]


def test_scoring_with_shared_prompt_forwards_keeps_no_earlier_layer_s_keys_and_values(random_model_dir):
    """Scoring (no gradients) with a group's prompt run once: the prompt's forward keeps
    its keys and values for the responses, and the responses' forward hands each layer
    its rows' prompt keys and values joined to theirs, then lets them go: when the final
    norm runs, no earlier layer's are alive (HF's cache would keep every layer's), with
    the whole logits and with a chunked head. The probe: an attention function that
    records each layer's keys (transformers' AttentionInterface)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from distflow.engines.common import forward_response

    keys, alive = [], []

    def recording(module, query, key, *args, **kwargs):
        keys.append(weakref.ref(key))
        return sdpa_attention_forward(module, query, key, *args, **kwargs)

    AttentionInterface.register("distflow_test_recording", recording)
    batch = _grouped_batch(random_model_dir)
    model = load_causal_lm(random_model_dir)
    model.set_attn_implementation("distflow_test_recording")
    model.model.norm.register_forward_pre_hook(
        lambda m, i: alive.append(sum(ref() is not None for ref in keys[:-1])) or keys.clear())
    layers = len(model.model.layers)
    with torch.no_grad():
        for chunk in (0, 7):
            alive.clear()
            forward_response(model, batch["prompts"], batch["prompt_mask"], batch["responses"],
                             batch["response_mask"], prompt_once=True, head_chunk_tokens=chunk)
            assert alive == [layers - 1, 0], chunk  # the prompt's forward, then the responses'


def test_a_chunked_output_head_says_so_where_the_forward_does_not_run_the_head_module(random_model_dir):
    """The final hidden states come from the head module's input: a model whose forward
    computes its logits some other way gets a one-line error naming the option."""
    from distflow.engines.common import forward_response

    batch = _batch(random_model_dir)
    model = load_causal_lm(random_model_dir)
    stray = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    model.get_output_embeddings = lambda: stray  # a plain linear head the forward never calls
    with pytest.raises(RuntimeError, match=r"actor.output_head_chunk_tokens: .* did not run its output head"):
        forward_response(model, batch["prompts"], batch["prompt_mask"], batch["responses"], batch["response_mask"],
                         head_chunk_tokens=7)


def test_a_chunked_output_head_is_refused_where_the_head_is_not_a_plain_linear_layer(random_model_dir):
    """A LoRA adapter on the output head (lm_head in lora_target_modules) has no weight to
    chunk with: a one-line error naming the option, at the actor's construction."""
    from peft import LoraConfig, get_peft_model

    from distflow.config import ConfigError

    model = get_peft_model(load_causal_lm(random_model_dir), LoraConfig(r=2, target_modules=["lm_head", "q_proj"]))
    with pytest.raises(ConfigError, match=r"actor.output_head_chunk_tokens: .* use 0"):
        Actor(model, OptimConfig(lr=1e-3), torch.device("cpu"), head_chunk_tokens=8)


_TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=2)


@pytest.mark.parametrize("architecture, settings, changes_logits", [
    ("Gemma2", {"final_logit_softcapping": 30.0, "head_dim": 8}, True),  # tanh soft-capping after the head
    ("Gemma2", {"final_logit_softcapping": None, "head_dim": 8}, False),
    ("Granite", {"logits_scaling": 8.0}, True),  # logits divided after the head
    ("Cohere", {"logit_scale": 0.0625}, True),  # logits multiplied after the head
    ("Llama", {}, False),
])
def test_a_chunked_output_head_is_refused_where_the_forward_changes_the_head_s_logits(architecture, settings,
                                                                                     changes_logits):
    """The chunked head's logits are the head's output: a model whose forward caps or
    scales them afterwards would be scored and trained on other logits than its own, so
    the actor refuses it at construction with a one-line error naming the option."""
    import transformers

    from distflow.config import ConfigError

    config = getattr(transformers, f"{architecture}Config")(**_TINY, **settings)
    model = getattr(transformers, f"{architecture}ForCausalLM")(config)
    if changes_logits:
        with pytest.raises(ConfigError, match=rf"actor.output_head_chunk_tokens: {architecture}ForCausalLM's "
                                              r"forward changes its output head's logits .* use 0"):
            Actor(model, OptimConfig(lr=1e-3), torch.device("cpu"), head_chunk_tokens=8)
    else:
        Actor(model, OptimConfig(lr=1e-3), torch.device("cpu"), head_chunk_tokens=8)


def test_the_value_model_returns_a_tensor_of_its_own_one_value_per_token(random_model_dir):
    """Not a view of the value head's output: FSDP2 hooks the backward on a module's output
    and warns that an in-place op on a view would skip it."""
    from distflow.engines.critic import ValueModel

    model = ValueModel(load_causal_lm(random_model_dir))
    torch.nn.init.normal_(model.value_head.weight, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(3, 50, (2, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    values = model(ids, mask, mask.cumsum(-1) - 1)
    hidden = model.body(input_ids=ids, attention_mask=mask, position_ids=mask.cumsum(-1) - 1).last_hidden_state
    assert values.shape == (2, 5) and values.dtype == torch.float32 and not values._is_view()
    torch.testing.assert_close(values, model.value_head(hidden)[..., 0].float())


def test_grad_clip_zero_means_no_clipping_not_a_zero_update(random_model_dir):
    cfg = load_config(None, ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4"])
    batch = _batch(random_model_dir)
    loss = make_policy_loss(cfg, float(batch["response_mask"].sum()), float(len(batch)))
    updated = {}
    for clip in (0.0, 1e9):
        actor = Actor(load_causal_lm(random_model_dir), OptimConfig(lr=1e-2, grad_clip=clip), torch.device("cpu"))
        norm = actor.train_mini_batch(batch, [[0, 1], [2, 3]], loss)["grad_norm"]
        updated[clip] = norm, {k: v.clone() for k, v in actor.model.state_dict().items()}
    assert updated[0.0][0] == updated[1e9][0] > 0
    assert all(torch.equal(v, updated[1e9][1][k]) for k, v in updated[0.0][1].items())
    before = load_causal_lm(random_model_dir).state_dict()
    assert any(not torch.equal(v, before[k]) for k, v in updated[0.0][1].items())


def test_an_update_s_gradients_are_freed_on_release(random_model_dir):
    cfg = load_config(None, ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4"])
    batch = _batch(random_model_dir)
    actor = Actor(load_causal_lm(random_model_dir), OptimConfig(lr=1e-2), torch.device("cpu"))
    actor.train_mini_batch(batch, [[0, 1], [2, 3]], make_policy_loss(cfg, float(batch["response_mask"].sum()), 4.0))
    assert all(p.grad is not None for p in actor.model.parameters())  # kept for the next micro-batch's sum
    actor.release_gradients()  # after the step's updates: not through the weight push and the rollout
    assert all(p.grad is None for p in actor.model.parameters())


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_trained_model_has_no_dropout_so_the_update_scores_the_policy_that_sampled(family):
    """GPT-2 drops out through nn.Dropout modules, Llama-style layers through a number
    they pass to attention: both are off, so two forwards in training mode agree."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from distflow.engines.common import without_dropout

    torch.manual_seed(0)
    if family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, resid_pdrop=0.5,
                                           embd_pdrop=0.5, attn_pdrop=0.5))
    else:
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                             num_key_value_heads=2, intermediate_size=64, vocab_size=64,
                                             attention_dropout=0.5, attn_implementation="eager"))
    ids = torch.randint(0, 64, (2, 12))
    model.train()
    assert not torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)  # dropout on
    without_dropout(model).train()
    assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)
