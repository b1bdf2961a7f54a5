"""A learned reward model (reward.model_path): its score of each conversation is the HF
model's own output at the conversation's last token, whatever the micro-batching and
padding; it is the reward of a training run's samples and of its held-out evaluation
(accuracy stays the rule's); a folder that is not one is refused before launch."""

from __future__ import annotations

import json
from shutil import copytree

import pytest
import torch

from distflow.cli import check_inputs
from distflow.config import ConfigError, load_config
from distflow.engines.reward_model import RewardModel
from helpers import CHECK_ONCE_ENV, distflow_sweep, run_metrics

PROMPTS = [[{"role": "user", "content": "Q: 3 + 4?"}], [{"role": "user", "content": "Q: 12 * 7, and show it?"}],
           [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q: 1 + 1?"}]]
RESPONSES = ["#### 7", "12 * 7 = 84, so the answer is #### 84", ""]


def _single_turn(prompts, responses):
    return [[*p, {"role": "assistant", "content": r}] for p, r in zip(prompts, responses)]


def test_scores_are_the_model_s_own_at_the_last_token_in_any_batching(qwen2_reward_model_dir):
    from transformers import AutoModelForSequenceClassification

    rm = RewardModel(qwen2_reward_model_dir, torch.device("cpu"), micro_batch_size=2)
    scores = rm.score(_single_turn(PROMPTS, RESPONSES))
    reference = AutoModelForSequenceClassification.from_pretrained(qwen2_reward_model_dir).eval()
    for prompt, response, score in zip(PROMPTS, RESPONSES, scores.tolist()):
        text = rm.tokenizer.apply_chat_template([*prompt, {"role": "assistant", "content": response}], tokenize=False)
        ids = rm.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]  # alone: no padding
        with torch.no_grad():
            assert score == pytest.approx(float(reference(input_ids=ids).logits[0, 0]), abs=1e-5)
    one_by_one = RewardModel(qwen2_reward_model_dir, torch.device("cpu"), micro_batch_size=1)
    assert torch.allclose(one_by_one.score(_single_turn(PROMPTS, RESPONSES)), scores, atol=1e-5)
    assert len(set(scores.tolist())) == 3  # it reads the conversation: different ones score differently
    short = RewardModel(qwen2_reward_model_dir, torch.device("cpu"), max_length=8)  # a long one keeps its end
    assert short.score(_single_turn(PROMPTS[1:2], RESPONSES[1:2])).shape == (1,)


def test_the_score_is_read_at_the_last_token_when_the_config_s_pad_id_ends_every_turn(qwen2_reward_model_dir,
                                                                                       tmp_path):
    """A config whose pad id is the token that ends every templated conversation (the
    newline after <|im_end|> here) and a tokenizer that pads with another: HF's pooling by
    the pad id would read each score one token early, and padded rows at a pad position;
    the score is the head's output at the last real token, alone or in a padded batch."""
    from transformers import AutoModelForSequenceClassification

    folder = tmp_path / "rm"
    copytree(qwen2_reward_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    rm = RewardModel(qwen2_reward_model_dir, torch.device("cpu"))
    ending = rm.tokenizer(rm.conversation(_single_turn(PROMPTS, RESPONSES)[0]),
                          add_special_tokens=False)["input_ids"][-1]
    assert ending != rm.tokenizer.pad_token_id
    config["pad_token_id"] = ending
    (folder / "config.json").write_text(json.dumps(config))
    scores = RewardModel(str(folder), torch.device("cpu"), micro_batch_size=3).score(_single_turn(PROMPTS, RESPONSES))
    reference = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    for conversation, score in zip(_single_turn(PROMPTS, RESPONSES), scores.tolist()):
        text = rm.conversation(conversation)
        ids = rm.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        assert ids[0, -1] == ending  # every conversation ends with the config's pad id
        with torch.no_grad():
            last = reference.score(reference.model(input_ids=ids).last_hidden_state)[0, -1, 0]
        assert score == pytest.approx(float(last), abs=1e-5)


def test_two_threads_scoring_at_once_each_get_their_own_conversations_scores(qwen2_reward_model_dir):
    """The reward node runs on the scheduler's threads, one per rollout chunk: two chunks'
    calls at once. The first call's forward is held until the second's has run; each
    still gets its own scores (the head's output was kept in one attribute for all
    threads, and the first read the second's)."""
    import threading

    rm = RewardModel(qwen2_reward_model_dir, torch.device("cpu"))
    first, second = _single_turn(PROMPTS[:2], RESPONSES[:2]), _single_turn(PROMPTS[2:], RESPONSES[2:])
    alone = rm.score(first), rm.score(second)
    forward, first_ran, second_ran = rm.model.forward, threading.Event(), threading.Event()

    def held(*args, **kwargs):  # the first's forward, then the second's, then the first's call goes on
        if threading.current_thread().name == "first":
            out = forward(*args, **kwargs)
            first_ran.set()
            assert second_ran.wait(30)
        else:
            assert first_ran.wait(30)
            out = forward(*args, **kwargs)
            second_ran.set()
        return out

    rm.model.forward = held
    results = {}
    threads = [threading.Thread(target=lambda name=name, c=c: results.__setitem__(name, rm.score(c)), name=name)
               for name, c in (("first", first), ("second", second))]
    threads[0].start()
    threads[1].start()
    for t in threads:
        t.join(60)
    assert torch.equal(results["first"], alone[0]) and torch.equal(results["second"], alone[1])


def test_the_reward_is_the_model_s_score_and_accuracy_the_rule_s(qwen2_reward_model_dir, qwen2_model_dir):
    from distflow.data.batch import Batch
    from distflow.engines.common import load_tokenizer
    from distflow.engines.reward import FAILED, RewardRunner
    from distflow.engines.rollout import left_pad
    from distflow.trainer.nodes import score_responses

    policy_tok = load_tokenizer(qwen2_model_dir)
    rm = RewardModel(qwen2_reward_model_dir, torch.device("cpu"))
    ids = [policy_tok(r, add_special_tokens=False)["input_ids"] + [policy_tok.eos_token_id] for r in RESPONSES[:2]]
    responses, _ = left_pad([list(reversed(i)) for i in ids], policy_tok.pad_token_id)  # right-padded:
    responses = responses.flip(-1)
    batch = Batch({"responses": responses, "response_mask": (responses != policy_tok.pad_token_id).long()},
                  {"ground_truth": ["7", "85"], "data_source": ["gsm8k"] * 2, "extra_info": [{}] * 2,
                   "prompt_messages": PROMPTS[:2]})
    scores, accuracy, status, _ = score_responses(policy_tok, batch, rm, RewardRunner(None, 0))
    assert torch.allclose(scores, rm.score(_single_turn(PROMPTS[:2], RESPONSES[:2])), atol=1e-5)
    assert accuracy.tolist() == [1.0, 0.0] and status.tolist() == [0, 0]  # '#### 7' right, '#### 84' not 85
    rm.model.score.weight.data.fill_(float("inf"))  # an overflow: the scores are not finite
    scores, _, status, _ = score_responses(policy_tok, batch, rm, RewardRunner(None, 0))
    assert scores.tolist() == [0.0, 0.0] and status.tolist() == [FAILED, FAILED]  # counted in reward/failed


def test_an_episode_is_scored_as_its_whole_conversation(qwen2_reward_model_dir, qwen2_model_dir):
    """Multi-turn: the reward model reads the prompt, then each of the episode's turns as
    the assistant's and what the environment answered between them, in its own template
    (it was refused); a template that cannot render a role is named in one line."""
    from distflow.data.batch import Batch
    from distflow.engines.agent import EpisodeRunner, EpisodeSettings
    from distflow.engines.common import load_tokenizer, render_prompt
    from distflow.engines.reward import RewardRunner
    from distflow.engines.rollout import SamplingParams
    from distflow.engines.tools import Toolbox
    from distflow.trainer.nodes import score_responses
    from helpers import ScriptedEngine

    env = {}
    exec(CHECK_ONCE_ENV, env)  # asks each episode to check its answer once
    tok = load_tokenizer(qwen2_model_dir)
    rm = RewardModel(qwen2_reward_model_dir, torch.device("cpu"))
    prompt = tok(render_prompt(tok, PROMPTS[0]), add_special_tokens=False)["input_ids"]
    engine = ScriptedEngine(tok, {prompt[0]: ["It is 8.", "No: #### 7"]})
    runner = EpisodeRunner(engine, tok, lambda: env["CheckOnce"](Toolbox([])),
                           EpisodeSettings(max_turns=2, max_total_tokens=64, keep_messages=True))
    out = runner.generate([prompt], [3], SamplingParams(max_new_tokens=16), [{"prompt": PROMPTS[0]}])
    turns = [{"role": "assistant", "content": "It is 8."}, {"role": "user", "content": "Check it. Answer with ####."},
             {"role": "assistant", "content": "No: #### 7"}]
    assert out["episode_messages"] == [turns]
    out.meta.update({"ground_truth": ["7"], "data_source": ["gsm8k"], "extra_info": [{}],
                     "prompt_messages": PROMPTS[:1]})
    scores, accuracy, _, _ = score_responses(tok, out, rm, RewardRunner(None, 0))
    assert torch.allclose(scores, rm.score([[*PROMPTS[0], *turns]]), atol=1e-5) and accuracy.tolist() == [1.0]
    last_turn_alone = rm.score(_single_turn(PROMPTS[:1], ["No: #### 7"]))
    assert abs(float(scores[0] - last_turn_alone[0])) > 1e-4
    with pytest.raises(ValueError, match=r"^reward.model_path: its chat template cannot render a conversation of "
                                         r"the roles \['narrator', 'user'\]"):
        rm.tokenizer.chat_template = "{% for m in messages %}{% if m.role != 'user' %}" \
                                     "{{ raise_exception('no ' + m.role) }}{% endif %}{% endfor %}"
        rm.score([[*PROMPTS[0], {"role": "narrator", "content": "x"}]])
    assert Batch.concat([out, out])["episode_messages"] == [turns, turns]


def test_what_is_not_a_reward_model_is_refused_before_launch(qwen2_model_dir, qwen2_reward_model_dir, tmp_path):
    cfg = load_config(None, [f"reward.model_path={qwen2_model_dir}"])
    with pytest.raises(ConfigError, match=r"reward.model_path: .*a Qwen2ForCausalLM, not a sequence-classification"):
        check_inputs(cfg)
    two = tmp_path / "two_labels"
    two.mkdir()
    copytree(qwen2_reward_model_dir, two, dirs_exist_ok=True)
    data = json.loads((two / "config.json").read_text())
    data["id2label"] = {"0": "bad", "1": "good"}
    (two / "config.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="has 2 labels; a reward model has one"):
        check_inputs(load_config(None, [f"reward.model_path={two}"]))
    with pytest.raises(ConfigError, match="the reward model gives the reward; leave reward.custom_fn unset"):
        load_config(None, [f"reward.model_path={qwen2_reward_model_dir}", "reward.custom_fn=x.py:score"])


@pytest.mark.slow
def test_a_run_takes_its_rewards_from_the_reward_model(qwen2_model_dir, qwen2_reward_model_dir, tmp_path):
    common = [f"model.path={qwen2_model_dir}", "trainer.total_steps=2", "data.train_batch_size=4",
              "actor.ppo_mini_batch_size=4", "algorithm.group_size=4", "data.val_max_samples=8",
              "rollout.max_new_tokens=16", "trainer.progress=false", "trainer.save_final=false",
              "trainer.eval_every=0"]
    reward_model = f"reward.model_path={qwen2_reward_model_dir}"
    (tmp_path / "env.py").write_text(CHECK_ONCE_ENV)
    episodes = [reward_model, "rollout.max_turns=2", "rollout.max_total_tokens=96", "rollout.tools=calculator",
                f"rollout.env={tmp_path / 'env.py'}:CheckOnce"]
    runs = distflow_sweep({"rm": [reward_model], "rule": [], "remax": [reward_model, "algorithm.name=remax"],
                           "episodes": episodes}, 2, tmp_path, common)
    rm, rule = run_metrics(runs["rm"]), run_metrics(runs["rule"])
    assert all(r["actor/grad_norm"] > 0 for r in run_metrics(runs["remax"])[1:])  # its greedy baseline scored too
    for record in rm[1:]:
        assert record["reward/failed"] == 0.0 and record["actor/grad_norm"] > 0
        assert record["reward/mean"] != 0.0 and record["reward/mean"] != record["reward/accuracy"]
    assert rm[0]["val/reward"] != rule[0]["val/reward"]  # the held-out reward is the model's too
    assert rm[0]["val/accuracy"] == rule[0]["val/accuracy"]
    for record in run_metrics(runs["episodes"])[1:]:  # episodes scored as conversations, in training and held out
        assert record["reward/failed"] == 0.0 and record["turns/mean"] == 2.0 and record["actor/grad_norm"] > 0
    assert run_metrics(runs["episodes"])[0]["val/reward"] not in (0.0, rm[0]["val/reward"])
