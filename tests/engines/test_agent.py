"""Multi-turn episodes, token in, token out: the trained tokens are exactly the sampled
ones plus the observation tokens as the engine was shown them, observation tokens carry
loss mask 0 and log-prob 0, episodes advance independently, and the bounds hold. Driven
by a scripted RolloutEngine (the tiny model calls no tools); the real engine runs them
in test_multi_turn_run.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from distflow.data.batch import Batch
from distflow.engines.agent import (EnvStep, EpisodeRunner, EpisodeSettings, ToolEnvironment, ToolResultForm,
                                   observation_ids, tool_result_form)
from distflow.engines.rollout import SamplingParams
from distflow.engines.tiny_model import build_tokenizer
from distflow.engines.tools import Toolbox
from helpers import ScriptedEngine

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'


def _runner(tok, engine, max_turns=4, max_total=400):
    box = Toolbox(["calculator"])
    return EpisodeRunner(engine, tok, lambda: ToolEnvironment(box),
                         EpisodeSettings(max_turns=max_turns, max_total_tokens=max_total))


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_trained_tokens_are_the_sampled_ones_plus_the_observation_as_shown():
    tok = build_tokenizer()
    a, b = _ids(tok, "A?"), _ids(tok, "B?")
    engine = ScriptedEngine(tok, {a[0]: [CALL % "12*7", "#### 84"], b[0]: ["#### 5"]})
    out = _runner(tok, engine).generate([a, b], [1, 2], SamplingParams(max_new_tokens=128), [{}, {}])
    eos = [tok.eos_token_id]
    turn1, turn2 = _ids(tok, CALL % "12*7") + eos, _ids(tok, "#### 84") + eos
    observed = observation_ids(tok, [{"role": "tool", "content": "<tool_response>\n84\n</tool_response>"}], turn1)
    assert tok.decode(observed) == "<tool_response>\n84\n</tool_response>\nA: "  # the tiny model's template
    want = turn1 + observed + turn2
    row = out["responses"][0, :len(want)].tolist()
    assert row == want and set(out["responses"][0, len(want):].tolist()) == {tok.pad_token_id}
    # the second turn was generated from exactly these tokens: nothing decoded and re-encoded
    assert engine.calls[1] == [a + turn1 + observed]  # and only the episode still running took part
    loss = [1] * len(turn1) + [0] * len(observed) + [1] * len(turn2)
    assert out["response_mask"][0, :len(want)].tolist() == loss
    assert out["observation_mask"][0].tolist() == [1 - m for m in loss] + [0] * (400 - len(want))
    assert out["rollout_log_probs"][0, :len(want)].tolist() == [-0.5 * m for m in loss]
    assert out["num_turns"].tolist() == [2.0, 1.0]
    assert (out["tool_calls"].tolist(), out["tool_errors"].tolist()) == ([1.0, 0.0], [0.0, 0.0])
    # episode b: one turn, no observation
    assert out["response_mask"][1].sum() == len(_ids(tok, "#### 5")) + 1 and out["observation_mask"][1].sum() == 0


def test_errors_are_observed_and_counted_and_the_bounds_hold():
    tok = build_tokenizer()
    a = _ids(tok, "A?")
    calls = ['<tool_call>{"name": "nope"}</tool_call>', CALL % "1/0", CALL % "2+2", "#### 4"]
    out = _runner(tok, ScriptedEngine(tok, {a[0]: calls}), max_turns=3).generate(
        [a], [1], SamplingParams(max_new_tokens=128), [{}])
    text = tok.decode(out["responses"][0][out["observation_mask"][0].bool()])
    assert "error: unknown tool 'nope'; available: calculator" in text and "ZeroDivisionError" in text
    # max_turns=3: the third turn's call is not answered, the fourth never generated
    assert out["num_turns"].tolist() == [3.0] and out["tool_calls"].tolist() == [2.0]
    assert out["tool_errors"].tolist() == [2.0]
    # max_total_tokens cuts the episode inside a turn
    short = _runner(tok, ScriptedEngine(tok, {a[0]: calls}), max_total=30).generate(
        [a], [1], SamplingParams(max_new_tokens=128), [{}])
    assert short["responses"].shape == (1, 30) and int(short["response_mask"][0].sum()) == 30
    assert short["num_turns"].tolist() == [1.0]


def test_a_custom_environment_and_a_template_with_a_system_prompt():
    tok = build_tokenizer()
    tok.chat_template = ("{% if messages[0]['role'] != 'system' %}SYS\n{% endif %}"
                         "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}[assistant] {% endif %}")
    # the system prompt the template adds at the start is not repeated mid-episode
    assert tok.decode(observation_ids(tok, [{"role": "user", "content": "retry"}], [tok.eos_token_id])) == \
        "[user] retry\n[assistant] "

    class Retry:
        def reset(self, task):
            self.left = task["retries"]

        def step(self, text):
            self.left -= 1
            return EnvStep([{"role": "user", "content": "retry"}], self.left < 0, {})

    a = _ids(tok, "A?")
    runner = EpisodeRunner(ScriptedEngine(tok, {a[0]: ["x", "y", "z"]}), tok, Retry,
                           EpisodeSettings(max_turns=5, max_total_tokens=100))
    out = runner.generate([a, a], None, SamplingParams(max_new_tokens=8), [{"retries": 0}, {"retries": 1}])
    assert out["num_turns"].tolist() == [1.0, 2.0]  # retries 0: the first answer ends it; 1: one retry


def test_an_environment_that_raises_ends_its_episode_and_the_others_go_on(capsys):
    """reset raising (task 0), step raising on the second turn (task 1), close raising
    (task 2), an environment that works (task 3), and one whose episode ends at its first
    turn (task 4): a reset or step failure ends its own episode there, counts in env_failed
    and zeroes its reward from the environment; a close failure is reported, its episode
    stands; the rollout, and every other episode, goes on; every environment is closed
    (a failed one too), each once its own episode has ended."""
    tok = build_tokenizer()
    closed = {}  # task -> the engine calls made when its environment was closed

    class Fragile:
        def reset(self, task):
            self.task, self.turn = task["fail"], 0
            if self.task == "reset":
                raise RuntimeError("no such level")

        def step(self, text):
            self.turn += 1
            if self.task == "step" and self.turn == 2:
                raise ValueError("the board is gone")
            return EnvStep([{"role": "user", "content": "again"}], self.task == "short", {}, reward=1.0)

        def close(self):
            if self.task == "close":
                raise OSError("socket already closed")
            closed[self.task] = len(engine.calls)

    prompts = [_ids(tok, f"{c}?") for c in "ABCDE"]
    engine = ScriptedEngine(tok, {p[0]: ["x", "y", "z"] for p in prompts})
    runner = EpisodeRunner(engine, tok, Fragile,
                           EpisodeSettings(max_turns=3, max_total_tokens=100, step_last_turn=True))
    tasks = [{"fail": f} for f in ("reset", "step", "close", None, "short")]
    out = runner.generate(prompts, [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=8), tasks)
    assert out["env_failed"].tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert out["num_turns"].tolist() == [0.0, 2.0, 3.0, 3.0, 1.0]  # reset failed: no turn; step: at the second
    assert out["env_scores"].tolist() == [0.0, 0.0, 3.0, 3.0, 1.0]
    assert out["response_mask"][0].sum() == 0 and out["observation_mask"][1].sum() > 0  # its first observation kept
    assert closed == {"reset": 0, "step": 2, None: 3, "short": 1}  # at its episode's end, not the batch's
    printed = capsys.readouterr().out
    assert printed.count("distflow: rollout.env failed") == 1 and "RuntimeError: no such level" in printed


def test_episodes_environments_are_stepped_at_once_and_give_the_same_episodes():
    """env_workers=4: the four episodes' steps run at once (each waits at a barrier that
    only four at once pass); env_workers=1: one at a time. The episodes are the same, and
    each environment is called only on the thread that made it."""
    import threading

    tok = build_tokenizer()
    state = {"in_flight": 0, "most": 0}
    lock = threading.Lock()

    def make(barrier):
        class Waits:
            def __init__(self):
                self.thread = threading.get_ident()  # an environment stays on the thread that made it

            def reset(self, task):
                self.task = task
                assert threading.get_ident() == self.thread

            def step(self, text):
                assert threading.get_ident() == self.thread
                with lock:
                    state["in_flight"] += 1
                    state["most"] = max(state["most"], state["in_flight"])
                if barrier is not None:
                    barrier.wait()
                with lock:
                    state["in_flight"] -= 1
                return EnvStep([{"role": "user", "content": f"seen {self.task['n']}"}], len(text) > 1, {})
        return Waits

    prompts = [_ids(tok, f"{c}?") for c in "ABCD"]
    out = {}
    for workers, barrier in ((4, threading.Barrier(4, timeout=30)), (1, None)):
        state["most"] = 0
        runner = EpisodeRunner(ScriptedEngine(tok, {p[0]: ["x", "yy"] for p in prompts}), tok, make(barrier),
                               EpisodeSettings(max_turns=3, max_total_tokens=100, env_workers=workers))
        out[workers] = runner.generate(prompts, [1, 2, 3, 4], SamplingParams(max_new_tokens=8),
                                       [{"n": n} for n in range(4)])
        assert state["most"] == workers and out[workers]["env_failed"].sum() == 0
    assert out[4]["num_turns"].tolist() == [2.0] * 4
    for name in ("responses", "response_mask", "observation_mask"):
        assert torch.equal(out[4][name], out[1][name])
    assert "seen 3" in tok.decode(out[4]["responses"][3][out[4]["observation_mask"][3].bool()])


def test_the_trainer_attends_to_observation_tokens_it_does_not_train(random_model_dir):
    from distflow.engines.actor import policy_forward
    from distflow.engines.common import load_causal_lm

    model = load_causal_lm(random_model_dir).eval()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, 90, (2, 5), generator=g)
    responses = torch.randint(4, 90, (2, 9), generator=g)
    loss = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 0, 0, 0]])
    observed = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 0, 0], [0] * 9])
    base = {"prompts": prompts, "prompt_mask": torch.ones_like(prompts), "responses": responses}
    with torch.no_grad():
        episode, _ = policy_forward(model, Batch({**base, "response_mask": loss, "observation_mask": observed}), False)
        # the same tokens all attended as one response: the generated ones' log-probs agree
        whole, _ = policy_forward(model, Batch({**base, "response_mask": loss + observed}), False)
        blind, _ = policy_forward(model, Batch({**base, "response_mask": loss}), False)
    torch.testing.assert_close(episode * loss, whole * loss, rtol=0, atol=1e-6)
    # without the observation in the attention, the second turn's log-probs change
    assert ((episode - blind).abs() * loss)[0, 5:].max() > 1e-4


HERMES_TEMPLATE = (  # the shape of Qwen2.5's and Qwen3's: a tool message is framed by the template itself
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_tool_result_is_framed_once_whether_or_not_the_template_frames_it():
    from distflow.config import load_config
    from distflow.trainer.loop import make_episode_runner

    cfg = load_config(None, ["rollout.max_turns=2", "rollout.tools=calculator"])
    for template, content in ((None, "<tool_response>\n84\n</tool_response>"), (HERMES_TEMPLATE, "84")):
        tok = build_tokenizer()
        if template is not None:
            tok.chat_template = template
        step = make_episode_runner(cfg, ScriptedEngine(tok, {}), tok).make_env().step(CALL % "12*7")
        assert step.observation == [{"role": "tool", "content": content}]
        assert tok.decode(observation_ids(tok, step.observation, [tok.eos_token_id])).count("<tool_response>") == 1


QWEN3_LIKE = ("{%- for m in messages -%}"
              "{%- if m.role == 'assistant' -%}<|im_start|>assistant\n{% if loop.last %}<think>\n\n</think>\n\n"
              "{% endif %}{{ m.content }}<|im_end|>\n"
              "{%- elif m.role == 'tool' -%}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response>"
              "<|im_end|>\n"
              "{%- else -%}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif -%}{%- endfor -%}"
              "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}")


@pytest.mark.parametrize("template", [None, QWEN3_LIKE], ids=["qwen2", "qwen3-like"])
def test_an_episode_s_tokens_are_the_whole_conversation_as_the_template_renders_it(qwen2_model_dir, template):
    """Qwen's template closes an assistant message with <|im_end|> and a newline; the turn
    ends at <|im_end|> (the engine's EOS), so the observation starts with that newline, and
    prompt + turn + observation are the whole conversation's tokens (the newline was lost
    at every turn: a context no served model sees, verl's #6501). A turn cut before its
    EOS gets it from the observation. Qwen3's template renders the last assistant message
    with an empty think block and an earlier one without, so the conversation before an
    observation is no prefix of the whole: there the newline was still lost."""
    from distflow.engines.common import load_tokenizer

    tok = load_tokenizer(qwen2_model_dir)
    if template is not None:
        tok.chat_template = template
    question = [{"role": "user", "content": "What is 2+2?"}]
    reply, tool = "<tool_call>x</tool_call>", [{"role": "tool", "content": "4"}]
    prompt = tok(tok.apply_chat_template(question, add_generation_prompt=True, tokenize=False),
                 add_special_tokens=False)["input_ids"]
    turn = tok(reply, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    observed = observation_ids(tok, tool, turn)
    whole = tok.apply_chat_template(question + [{"role": "assistant", "content": reply}] + tool,
                                    add_generation_prompt=True, tokenize=False)
    assert prompt + turn + observed == tok(whole, add_special_tokens=False)["input_ids"]
    assert observation_ids(tok, tool, turn[:-1]) == [tok.eos_token_id] + observed


GEMMA_LIKE = ("{%- for m in messages -%}<|im_start|>{{ 'model' if m.role == 'assistant' else m.role }}\n"
              "{{ m.content }}{{ '<|endoftext|>\\n' }}{%- endfor -%}"
              "{%- if add_generation_prompt %}<|im_start|>model\n{% endif -%}")


def test_a_turn_that_ends_at_an_end_of_turn_token_other_than_eos_gets_the_template_s_newline(qwen2_model_dir):
    """Gemma's template closes a turn with <end_of_turn> and a newline, and its EOS is another
    token (<eos>): the engine stops at <end_of_turn> (the model's generation config lists
    it), so the newline after it must come from the observation, and a turn cut short gets
    the token too, as with an EOS that closes turns (Qwen's). Here <|endoftext|> stands for
    <end_of_turn> beside the tokenizer's EOS <|im_end|>."""
    from transformers import GenerationConfig

    from distflow.engines.common import load_tokenizer
    from distflow.engines.rollout import stop_token_ids

    tok = load_tokenizer(qwen2_model_dir)
    tok.chat_template = GEMMA_LIKE
    end_of_turn = tok.convert_tokens_to_ids("<|endoftext|>")
    stops = stop_token_ids(tok, GenerationConfig(eos_token_id=[tok.eos_token_id, end_of_turn]))
    question = [{"role": "user", "content": "What is 2+2?"}]
    reply, answer = "<tool_call>x</tool_call>", [{"role": "user", "content": "4"}]
    prompt = tok(tok.apply_chat_template(question, add_generation_prompt=True, tokenize=False),
                 add_special_tokens=False)["input_ids"]
    turn = tok(reply, add_special_tokens=False)["input_ids"] + [end_of_turn]
    observed = observation_ids(tok, answer, turn, stops)
    whole = tok.apply_chat_template(question + [{"role": "assistant", "content": reply}] + answer,
                                    add_generation_prompt=True, tokenize=False)
    assert prompt + turn + observed == tok(whole, add_special_tokens=False)["input_ids"]
    assert observation_ids(tok, answer, turn[:-1], stops) == [end_of_turn] + observed


class _PaysPerTurn:
    """Rewards every turn it is shown with 1 and asks for more."""

    def reset(self, task):
        pass

    def step(self, text):
        return EnvStep([{"role": "user", "content": "more"}], False, reward=1.0)


def test_with_rewards_from_the_environment_a_turn_that_uses_up_the_tokens_is_scored():
    tok = build_tokenizer()
    a = _ids(tok, "A?")
    answer = "#### 84"
    budget = len(_ids(tok, answer)) + 1  # the first turn and its eos fill it exactly
    settings = EpisodeSettings(max_turns=3, max_total_tokens=budget, step_last_turn=True)
    out = EpisodeRunner(ScriptedEngine(tok, {a[0]: [answer]}), tok, _PaysPerTurn, settings).generate(
        [a], [1], SamplingParams(max_new_tokens=128), [{}])
    assert out["num_turns"].tolist() == [1.0] and out["env_scores"].tolist() == [1.0]


ALTERNATING = ("{%- for m in messages -%}"
               "{%- if m.role not in ('user', 'assistant') -%}{{ raise_exception('no role ' + m.role) }}{%- endif -%}"
               "{%- if loop.index0 > 0 and m.role == messages[loop.index0 - 1].role -%}"
               "{{ raise_exception('roles must alternate') }}{%- endif -%}"
               "<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n{%- endfor -%}"
               "{%- if add_generation_prompt %}<start_of_turn>assistant\n{% endif -%}")


def test_a_template_that_refuses_the_tool_role_gets_the_results_in_one_user_message():
    """A Gemma-like template (user and assistant only, alternating): the calculator's two
    results of one turn come back framed in one user message, and the episode goes on;
    they came as tool messages, and the template's error stopped the whole step."""
    tok = build_tokenizer()
    tok.chat_template = ALTERNATING
    assert tool_result_form(tok) == ToolResultForm(role="user", framed=True)
    a = _ids(tok, "A?")
    engine = ScriptedEngine(tok, {a[0]: [CALL % "2+2" + CALL % "3*3", "#### 4"]})
    box = Toolbox(["calculator"])
    runner = EpisodeRunner(engine, tok, lambda: ToolEnvironment(box, tool_result_form(tok)),
                           EpisodeSettings(max_turns=3, max_total_tokens=1000))
    out = runner.generate([a], [1], SamplingParams(max_new_tokens=400), [{}])
    assert out["num_turns"].tolist() == [2.0] and out["env_failed"].tolist() == [0.0]
    shown = tok.decode(engine.calls[1][0][len(a):])
    assert "<start_of_turn>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\n9\n</tool_response>" in shown


SKIPS_UNKNOWN_ROLES = ("{%- for m in messages -%}{%- if m.role in ('system', 'user', 'assistant') -%}"
                      "<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{%- endif -%}{%- endfor -%}"
                      "{%- if add_generation_prompt %}<|assistant|>\n{% endif -%}")  # Phi-3's shape


def test_a_template_that_skips_the_tool_role_gets_the_results_in_a_user_message():
    """Phi-3's and Phi-4's templates render nothing of a tool message, without an error:
    the model was shown no tool result at all. The results go in a user message; an
    environment's message the template drops fails its episode in one line."""
    tok = build_tokenizer()
    tok.chat_template = SKIPS_UNKNOWN_ROLES
    assert tool_result_form(tok) == ToolResultForm(role="user", framed=True)
    a = _ids(tok, "A?")
    engine = ScriptedEngine(tok, {a[0]: [CALL % "2+2", "#### 4"]})
    runner = EpisodeRunner(engine, tok, lambda: ToolEnvironment(Toolbox(["calculator"]), tool_result_form(tok)),
                           EpisodeSettings(max_turns=3, max_total_tokens=1000))
    out = runner.generate([a], [1], SamplingParams(max_new_tokens=400), [{}])
    assert out["num_turns"].tolist() == [2.0] and out["env_failed"].tolist() == [0.0]
    assert "<|user|>\n<tool_response>\n4\n</tool_response>" in tok.decode(engine.calls[1][0][len(a):])
    with pytest.raises(ValueError, match="the chat template renders nothing of a 'tool' message's text"):
        observation_ids(tok, [{"role": "tool", "content": "4"}], [5])


def test_an_answer_the_template_cannot_render_or_a_reward_that_is_no_number_fails_only_its_episode():
    """An environment answering in a role the template refuses, and one whose reward is NaN
    or infinite: each fails its own episode (env/failed, reward 0); the others go on."""
    tok = build_tokenizer()
    tok.chat_template = ALTERNATING

    class Odd:
        def reset(self, task):
            self.kind = task["kind"]

        def step(self, text):
            if self.kind == "narrator":
                return EnvStep([{"role": "narrator", "content": "meanwhile"}], False)
            return EnvStep([{"role": "user", "content": "again"}], False,
                           reward={"nan": float("nan"), "inf": float("inf")}.get(self.kind, 1.0))

    prompts = [_ids(tok, f"{c}?") for c in "ABCD"]
    engine = ScriptedEngine(tok, {p[0]: ["x", "y"] for p in prompts})
    runner = EpisodeRunner(engine, tok, Odd, EpisodeSettings(max_turns=2, max_total_tokens=100,
                                                             step_last_turn=True))
    out = runner.generate(prompts, [1, 2, 3, 4], SamplingParams(max_new_tokens=8),
                          [{"kind": k} for k in ("narrator", "nan", "inf", "fine")])
    assert out["env_failed"].tolist() == [1.0, 1.0, 1.0, 0.0]
    assert out["env_scores"].tolist() == [0.0, 0.0, 0.0, 2.0] and out["num_turns"].tolist() == [1.0, 1.0, 1.0, 2.0]


@pytest.mark.parametrize("hang_in", ["step", "reset"])
def test_an_environment_that_does_not_answer_fails_its_episode_and_the_rollout_goes_on(hang_in):
    """env_timeout_s: a call that hangs (here until the test lets it go) fails its episode;
    the episode behind it on the same thread fails without being run, and the episodes on
    the other thread finish. The rollout used to wait for the hung call forever. Once the
    hung call returns, its thread closes the environments it held (they were left open:
    the one a late reset had made too)."""
    tok = build_tokenizer()
    release, ran, closed = threading.Event(), [], []

    class Hangs:
        def reset(self, task):
            self.kind = task["kind"]
            self._call("reset")

        def step(self, text):
            ran.append(self.kind)
            self._call("step")
            return EnvStep([], True)

        def _call(self, name):
            if self.kind == "hangs" and name == hang_in:
                release.wait(60)

        def close(self):
            closed.append(self.kind)

    prompts = [_ids(tok, f"{c}?") for c in "ABCD"]
    engine = ScriptedEngine(tok, {p[0]: ["x"] for p in prompts})
    runner = EpisodeRunner(engine, tok, Hangs, EpisodeSettings(max_turns=2, max_total_tokens=100, env_workers=2,
                                                               env_timeout_s=1.0))
    try:  # episodes 0 and 2 on one thread, 1 and 3 on the other
        out = runner.generate(prompts, [1, 2, 3, 4], SamplingParams(max_new_tokens=8),
                              [{"kind": k} for k in ("hangs", "fine", "behind", "fine")])
    finally:
        release.set()
    assert out["env_failed"].tolist() == [1.0, 0.0, 1.0, 0.0] and "behind" not in ran
    assert runner.first_error == "TimeoutError: no answer"
    # the episode behind a hung reset is never made; behind a hung step it was, and is closed too
    held = ["behind", "hangs"] if hang_in == "step" else ["hangs"]
    for _ in range(100):  # the thread left to the hung call ends once it returns
        if not any(t.name.startswith("environment-") for t in threading.enumerate()):
            break
        time.sleep(0.1)
    assert not any(t.name.startswith("environment-") for t in threading.enumerate()) and "behind" not in ran
    assert sorted(closed) == sorted(["fine", "fine", *held])


def test_env_timeout_s_limits_each_call_not_a_thread_s_queue_of_calls():
    """Six resets of 0.4 s on one thread against a 1 s limit: every call is in time.
    The limit counted from the batch's submission failed the episodes queued third and
    later (and then every episode on the thread, and closed none)."""
    tok = build_tokenizer()
    closed = []

    class Slow:
        def reset(self, task):
            time.sleep(0.4)

        def step(self, text):
            return EnvStep([], True)

        def close(self):
            closed.append(1)

    prompts = [_ids(tok, f"{c}?") for c in "ABCDEF"]
    engine = ScriptedEngine(tok, {p[0]: ["x", "y"] for p in prompts})
    runner = EpisodeRunner(engine, tok, Slow, EpisodeSettings(max_turns=2, max_total_tokens=100, env_workers=1,
                                                              env_timeout_s=1.0))
    out = runner.generate(prompts, list(range(6)), SamplingParams(max_new_tokens=8), [{}] * 6)
    assert out["env_failed"].tolist() == [0.0] * 6 and len(closed) == 6 and runner.first_error is None
