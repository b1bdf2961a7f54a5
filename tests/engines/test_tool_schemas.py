"""The tools' JSON schemas reach the model: with rollout.tools (and rollout.tool_schemas
for an environment's or agent's own tools) every prompt, in training and in held-out
evaluation, is rendered by the chat template with them, as verl and TRL render it; a
bad schemas file is refused before launch in one line; an agent's first request that
sends the same schemas as `tools=` matches its sample's prompt."""

from __future__ import annotations

import json
import re
import shutil

import openai
import pytest

from distflow.cli import check_inputs
from distflow.config import TOOLS, ConfigError, load_config
from distflow.coordinator.layout import Layout
from distflow.engines.common import load_tokenizer, render_prompt
from distflow.engines.openai_endpoint import ChatEndpoint
from distflow.engines.rollout import SamplingParams
from distflow.engines.tools import SCHEMAS
from distflow.trainer.loop import PromptSource, heldout_rows
from helpers import ScriptedEngine

# Qwen2.5's way with tools, shortened: a system turn listing each schema as JSON
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ENV = "rollout.env=env.py:Searches"  # an environment that runs the search tool (its file is not read here)
SEARCH = {"type": "function", "function": {"name": "search", "description": "Look a word up.",
                                           "parameters": {"type": "object", "properties": {
                                               "word": {"type": "string"}}, "required": ["word"]}}}


@pytest.fixture(scope="module")
def tools_model(qwen2_model_dir, tmp_path_factory) -> str:
    """The Qwen2 folder with a chat template that renders tools."""
    path = tmp_path_factory.mktemp("qwen2_tools")
    shutil.copytree(qwen2_model_dir, path, dirs_exist_ok=True)
    tok = load_tokenizer(qwen2_model_dir)
    tok.chat_template = TOOLS_TEMPLATE
    tok.save_pretrained(path)
    return str(path)


def _schemas_file(tmp_path, content) -> str:
    path = tmp_path / "tools.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def test_every_built_in_tool_has_a_schema_of_its_arguments():
    assert tuple(SCHEMAS) == TOOLS
    assert SCHEMAS["calculator"]["function"]["parameters"]["required"] == ["expression"]  # tools.calculator(expression)
    assert SCHEMAS["python"]["function"]["parameters"]["required"] == ["code"]  # python(code)


def test_prompts_show_the_tools_in_training_and_evaluation(tools_model, tmp_path):
    schemas_file = _schemas_file(tmp_path, [SEARCH])
    tok = load_tokenizer(tools_model)
    for extra, shown in (([], []), (["rollout.max_turns=2", "rollout.tools=calculator"], ["calculator"]),
                         (["rollout.max_turns=2", "rollout.tools=calculator", ENV,
                           f"rollout.tool_schemas={schemas_file}"],
                          ["calculator", "search"])):
        cfg = load_config(None, [f"model.path={tools_model}", "data.train_batch_size=4",
                                 "actor.ppo_mini_batch_size=4", "data.max_prompt_length=1024", *extra])
        train = PromptSource(cfg, Layout(1), 0, pad_id=0).prepare(1)
        (row, held_out), _ = heldout_rows(cfg, tok, None, 0, 1)[0][0], None
        for ids in (train["prompts"][0][train["prompt_mask"][0].bool()].tolist(), held_out):
            text = tok.decode(ids)
            assert re.findall(r'\{"type": "function", "function": \{"name": "(\w+)"', text) == shown
            assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("content, error", [
    ("[", "not JSON"),
    ({"type": "function"}, "expected a JSON list of tool schemas, got dict"),
    ([{"type": "function", "function": {"description": "no name"}}], 'entry 0 is not {"type": "function"'),
    ([SCHEMAS["calculator"]], "tool 'calculator' is named twice"),
])
def test_a_bad_schemas_file_is_refused_before_launch_in_one_line(tmp_path, content, error):
    cfg = load_config(None, ["rollout.max_turns=2", "rollout.tools=calculator", ENV,
                             f"rollout.tool_schemas={_schemas_file(tmp_path, content)}"])
    with pytest.raises(ConfigError, match="rollout.tool_schemas: ") as e:
        check_inputs(cfg)
    assert error in str(e.value) and "\n" not in str(e.value)


def test_schemas_without_turns_or_anything_running_the_tools_and_a_missing_file_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="the built-in tool environment runs rollout.tools alone"):
        load_config(None, ["rollout.max_turns=2", "rollout.tools=calculator", "rollout.tool_schemas=t.json"])
    with pytest.raises(ConfigError, match="an OpenEnv environment runs as it is, without the built-in tools"):
        load_config(None, ["rollout.max_turns=2", "rollout.tools=calculator", "rollout.env=openenv:game.py:Game"])
    with pytest.raises(ConfigError, match="tools and environments answer between turns; set rollout.max_turns > 1"):
        load_config(None, ["rollout.tool_schemas=t.json", ENV])
    cfg = load_config(None, ["rollout.max_turns=2", "rollout.tools=calculator", ENV,
                             f"rollout.tool_schemas={tmp_path / 'missing.json'}"])
    with pytest.raises(ConfigError, match="missing.json: No such file or directory"):
        check_inputs(cfg)


def test_an_agent_that_sends_the_schemas_as_tools_matches_its_prompt(tools_model):
    tok = load_tokenizer(tools_model)
    question = [{"role": "user", "content": "Q: 3 + 4?"}]
    prompt = tok(render_prompt(tok, question, [SEARCH]), add_special_tokens=False)["input_ids"]
    engine = ScriptedEngine(tok, {prompt[0]: ["#### 7"]})
    endpoint = ChatEndpoint(engine, tok, SamplingParams(max_new_tokens=16), max_total_tokens=64, max_calls=2)
    try:
        keys = endpoint.open([prompt, prompt], [1, 2])
        clients = [openai.OpenAI(base_url=endpoint.base_url(k), api_key=endpoint.token, max_retries=0, timeout=60)
                   for k in keys]
        with pytest.raises(openai.BadRequestError) as e:  # without the tools the row's prompt is not what it sent
            clients[0].chat.completions.create(model="policy", messages=question)
        assert e.value.code == "prompt_mismatch" and "rollout.tool_schemas" in str(e.value)
        reply = clients[1].chat.completions.create(model="policy", messages=question, tools=[SEARCH])
        assert reply.choices[0].message.content == "#### 7"
        assert engine.calls[-1] == [prompt]
    finally:
        endpoint.close()
