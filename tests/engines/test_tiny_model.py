import dataclasses
import json

import torch

from distflow.data.tasks import arith
from distflow.engines.common import load_causal_lm, load_tokenizer
from distflow.engines.tiny_model import (ASSET_DIR, TOOL_SFT, SFTSpec, TinyModelSpec, build_tiny_model, greedy_accuracy,
                                         sft_target)

SMALL = TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)


def test_build_is_a_loadable_hf_folder_and_deterministic(tmp_path):
    sft = SFTSpec(steps=3, batch_size=4, eval_every=3, eval_size=4, warmup=1)
    rec_a = build_tiny_model(tmp_path / "a", SMALL, sft, log=lambda s: None)
    build_tiny_model(tmp_path / "b", SMALL, sft, log=lambda s: None)
    a, b = load_causal_lm(str(tmp_path / "a")), load_causal_lm(str(tmp_path / "b"))
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name
    assert rec_a["history"][-1]["step"] == 3
    tok = load_tokenizer(str(tmp_path / "a"))
    text = "Ann has 3 pens, gets 4 more.\nA: 3+4=7\n#### 7"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_sft_targets_mix_a_verifiable_and_an_unverifiable_style():
    from distflow.engines.reward import gsm8k_score

    p = arith.generate("train", 2)[1]
    assert gsm8k_score(sft_target(p, False), str(p.answer)) == 1.0
    unverifiable = sft_target(p, True)
    assert unverifiable.endswith(f"The answer is {p.answer}.") and gsm8k_score(unverifiable, str(p.answer)) == 0.0


def test_shipped_model_starts_inside_the_10_to_60_percent_band():
    record = json.loads((ASSET_DIR / "distflow_build.json").read_text())
    assert record["num_parameters"] < 5_000_000
    torch.set_num_threads(1)
    model, tok = load_causal_lm("builtin:tiny-arith"), load_tokenizer("builtin:tiny-arith")
    accuracy = greedy_accuracy(model, tok, arith.generate("test", 256))
    assert 0.10 <= accuracy <= 0.60
    # the shipped file is the recorded build (float kernels may differ slightly across CPUs)
    assert abs(accuracy - record["history"][-1]["heldout_accuracy"]) <= 0.03


def test_a_tool_trace_is_laid_out_as_a_multi_turn_rollout_lays_it_out():
    """The SFT trace of a calculator call is token for token the episode the rollout
    makes of the same turns: the call and the answer trained, the result not."""
    from distflow.engines.agent import EpisodeRunner, ToolEnvironment
    from distflow.engines.rollout import SamplingParams
    from distflow.engines.tiny_model import TOOL_EPISODE, TOOL_TURN_TOKENS, build_tokenizer, sft_sequence
    from distflow.engines.tools import Toolbox, tool_call_text
    from helpers import ScriptedEngine

    tok = build_tokenizer()
    p = next(q for q in arith.generate("train", 8, levels=arith.TOOL_TASK_LEVELS) if q.level == 4)
    ids, labels = sft_sequence(tok, p, unverifiable=False, calls_tool=True)
    prompt = tok(tok.apply_chat_template([{"role": "user", "content": p.question}], add_generation_prompt=True,
                                         tokenize=False), add_special_tokens=False)["input_ids"]
    assert ids[:len(prompt)] == prompt and set(labels[:len(prompt)]) == {-100}
    engine = ScriptedEngine(tok, {prompt[0]: [tool_call_text("calculator", {"expression": p.expression}),
                                              sft_target(p, False)]})
    out = EpisodeRunner(engine, tok, lambda: ToolEnvironment(Toolbox(["calculator"])), TOOL_EPISODE).generate(
        [prompt], [1], SamplingParams(max_new_tokens=TOOL_TURN_TOKENS), [{}])
    k = len(ids) - len(prompt)
    assert k <= TOOL_EPISODE.max_total_tokens and out["tool_calls"].tolist() == [1.0]
    assert out["responses"][0, :k].tolist() == ids[len(prompt):]
    assert out["response_mask"][0, :k].tolist() == [int(label != -100) for label in labels[len(prompt):]]
    assert f"\n{p.answer}\n" in tok.decode([t for t, label in zip(ids, labels) if label == -100])  # the result, observed


def test_the_tool_model_continues_from_its_base(tmp_path):
    sft = SFTSpec(steps=2, batch_size=4, eval_every=2, eval_size=8, warmup=1)
    build_tiny_model(tmp_path / "base", SMALL, sft, log=lambda s: None)
    tools = dataclasses.replace(TOOL_SFT, steps=2, batch_size=4, eval_every=2, eval_size=8, warmup=1)
    record = build_tiny_model(tmp_path / "tools", sft=tools, log=lambda s: None, base=tmp_path / "base")
    assert record["model"] == {"base": "base"} and record["sft"]["tool_levels"] == arith.TOOL_TASK_LEVELS
    assert set(record["history"][-1]["heldout_accuracy_with_tools_by_level"]) == {1, 2, 3, 4}
    base, tuned = load_causal_lm(str(tmp_path / "base")), load_causal_lm(str(tmp_path / "tools"))
    assert base.config.hidden_size == tuned.config.hidden_size == SMALL.hidden_size
    assert not torch.equal(base.model.layers[0].mlp.up_proj.weight, tuned.model.layers[0].mlp.up_proj.weight)


def test_a_prompt_without_a_chat_template_starts_with_the_bos_its_tokenizer_puts_first():
    """A base model's tokenizer (no chat template) that puts BOS first, as Llama-2's and
    Mistral's do: its prompts start with it, as TRL tokenises a plain prompt (they had none:
    the text is tokenised without special tokens, right after a template, which writes its
    own). A tokenizer that puts none first gets none."""
    from tokenizers.processors import TemplateProcessing

    from distflow.data.dataset import PromptRow
    from distflow.trainer.nodes import encode_prompt

    tok = load_tokenizer(str(ASSET_DIR))
    tok.chat_template = None
    row = PromptRow(index=0, messages=[{"role": "user", "content": "1+2"}], ground_truth=3, data_source="x")
    assert tok("x")["input_ids"][:1] != [tok.bos_token_id] and tok.decode(encode_prompt(tok, row)) == "1+2\n"
    tok.backend_tokenizer.post_processor = TemplateProcessing(single=f"{tok.bos_token} $A",
                                                              special_tokens=[(tok.bos_token, tok.bos_token_id)])
    ids = encode_prompt(tok, row)
    assert ids[0] == tok.bos_token_id and ids[1:] == tok("1+2\n", add_special_tokens=False)["input_ids"]


def test_chat_template_kwargs_reach_the_template_of_every_rendering():
    """data.chat_template_kwargs (Qwen3's enable_thinking, as TRL's chat_template_kwargs and
    verl's data.apply_chat_template_kwargs): a prompt's and an agent's renderings see them."""
    from distflow.config import chat_template_kwargs, load_config
    from distflow.data.dataset import PromptRow
    from distflow.engines.common import render_prompt
    from distflow.trainer.nodes import encode_prompt

    thinking = ("{% if enable_thinking is defined and not enable_thinking %}NOTHINK {% endif %}"
                "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    row = PromptRow(index=0, messages=[{"role": "user", "content": "1+2"}], ground_truth=3, data_source="x")
    for overrides, text in ([], "1+2"), (["data.chat_template_kwargs.enable_thinking=false"], "NOTHINK 1+2"), \
            (["data.chat_template_kwargs={enable_thinking: true}"], "1+2"):
        tok = load_tokenizer(str(ASSET_DIR), chat_template_kwargs(load_config(None, overrides)))
        tok.chat_template = thinking
        assert tok.decode(encode_prompt(tok, row)) == text
        assert render_prompt(tok, row.messages, tools=[]) == text
