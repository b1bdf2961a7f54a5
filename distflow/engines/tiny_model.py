"""The embedded default policy: a tiny Llama with a character-level tokenizer,
warm-started by a short supervised fine-tune on the built-in arithmetic task.

It is an ordinary HuggingFace folder (config.json, model.safetensors, tokenizer.json),
shipped in `distflow/assets/tiny-arith` and rebuilt bit-for-bit by

    distflow build-tiny-model --out distflow/assets/tiny-arith

The SFT is deliberately short and its data deliberately mixed: half of the worked
solutions end with GSM8K's `#### 42`, the other half with `The answer is 42.`, which
the rule reward does not accept (as verl's strict GSM8K score would not). The model
learns both styles and part of the arithmetic, so it starts in the 10-60% band of
held-out accuracy, and RL has two real things to learn: prefer the verifiable answer
style, and get more sums right.

The tool-using model (`builtin:tiny-arith-tools`, in `distflow/assets/tiny-arith-tools`)
continues from it on the tool task, whose level 4 multiplies two two-digit numbers:

    distflow build-tiny-model --tools --out distflow/assets/tiny-arith-tools

30% of its traces work the problem out with the calculator, in the token layout a
multi-turn rollout produces: the assistant's Hermes `<tool_call>`, the tool's result as
the observation (not trained), then the answer. The rest answer directly, which a model
this small cannot do for level 4, so RL with the tool has one more thing to learn: call
it where it helps. (Greedy, the model starts by answering directly.)
"""

from __future__ import annotations

import json
import os
import random
import string
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from distflow.data.tasks import arith
from distflow.engines.agent import EpisodeRunner, EpisodeSettings, ToolEnvironment, observation_ids, tool_messages
from distflow.engines.common import render_prompt
from distflow.engines.rollout import HFRolloutEngine, SamplingParams
from distflow.engines.tools import Toolbox, calculator, tool_call_text

ASSETS = Path(__file__).resolve().parent.parent / "assets"
ASSET_DIR = ASSETS / "tiny-arith"
SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
CHARS = tuple(string.ascii_letters + string.digits + string.punctuation + " \n")
# The chat template renders one user turn and opens the answer; verl-format prompts
# (lists of chat messages) go through it like through any HF tokenizer's template.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}A: {% endif %}"
)


@dataclass(kw_only=True)
class TinyModelSpec:
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 384
    max_positions: int = 256


@dataclass(kw_only=True)
class SFTSpec:
    steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3
    warmup: int = 50
    seed: int = 0
    eval_every: int = 100
    eval_size: int = 256
    unverifiable_style_fraction: float = 0.5
    levels: tuple[int, ...] = arith.LEVELS
    tool_levels: tuple[int, ...] = ()  # levels some of whose traces call the calculator
    tool_fraction: float = 0.0  # of those levels' traces


# The tool model's fine-tune, from the default model's weights.
TOOL_SFT = SFTSpec(steps=300, lr=2e-3, warmup=30, levels=arith.TOOL_TASK_LEVELS,
                   tool_levels=arith.TOOL_TASK_LEVELS, tool_fraction=0.3)
# Its episodes: a call, the result, the answer (rollout.max_turns / max_new_tokens / max_total_tokens).
TOOL_EPISODE = EpisodeSettings(max_turns=2, max_total_tokens=160)
TOOL_TURN_TOKENS = 96


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    # BPE without merges is exactly character-level; Fuse joins characters back on decode.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(SPECIALS))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>", unk_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE
    tok.padding_side = "left"
    return tok


def build_model(tokenizer, spec: TinyModelSpec, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads, max_position_embeddings=spec.max_positions,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def sft_target(p: arith.Problem, unverifiable: bool) -> str:
    if not unverifiable:
        return p.solution
    steps = p.solution.rsplit("\n####", 1)[0]
    return f"{steps}\nThe answer is {p.answer}."


def _prompt(tokenizer, p: arith.Problem) -> str:
    return render_prompt(tokenizer, [{"role": "user", "content": p.question}])


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def sft_sequence(tokenizer, p: arith.Problem, unverifiable: bool, calls_tool: bool) -> tuple[list[int], list[int]]:
    """(token ids, labels) of one trace: the prompt, then the answer, or with
    `calls_tool` the calculator call, its result (label -100: the environment's tokens)
    and the answer. Each assistant turn ends with EOS, as the engine ends it."""
    ids = _ids(tokenizer, _prompt(tokenizer, p))
    labels = [-100] * len(ids)
    if calls_tool:
        call = _ids(tokenizer, tool_call_text("calculator", {"expression": p.expression})) + [tokenizer.eos_token_id]
        result = observation_ids(tokenizer, tool_messages([calculator(p.expression)]), call)
        ids, labels = ids + call + result, labels + call + [-100] * len(result)
    answer = _ids(tokenizer, sft_target(p, unverifiable)) + [tokenizer.eos_token_id]
    return ids + answer, labels + answer


def _sft_batch(tokenizer, sequences: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels), right-padded; loss only on the assistant's tokens."""
    width = max(len(ids) for ids, _ in sequences)
    ids = torch.full((len(sequences), width), tokenizer.pad_token_id)  # (B, T)
    labels = torch.full((len(sequences), width), -100)
    for i, (s, lab) in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
        labels[i, : len(lab)] = torch.tensor(lab)
    return ids, ids != tokenizer.pad_token_id, labels


@torch.no_grad()
def greedy_accuracy(model, tokenizer, problems: list[arith.Problem], max_new_tokens: int = 32) -> float:
    from distflow.engines.reward import gsm8k_score

    model.eval()
    correct = 0
    for start in range(0, len(problems), 128):
        chunk = problems[start: start + 128]
        prompts = [_prompt(tokenizer, p) for p in chunk]
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        correct += sum(gsm8k_score(t, str(p.answer)) for t, p in zip(texts, chunk))
    model.train()
    return correct / len(problems)


@torch.no_grad()
def tool_accuracy_by_level(model, tokenizer, problems: list[arith.Problem]) -> dict[int, float]:
    """Greedy held-out accuracy per level of episodes with the calculator, as a
    multi-turn rollout runs them (what the engine generated is scored)."""
    from distflow.engines.reward import gsm8k_score

    model.eval()
    runner = EpisodeRunner(HFRolloutEngine(model, tokenizer, shares_trainer_weights=True), tokenizer,
                           lambda: ToolEnvironment(Toolbox(["calculator"])), TOOL_EPISODE)
    prompts = [_ids(tokenizer, _prompt(tokenizer, p)) for p in problems]
    out = runner.generate(prompts, None, SamplingParams(max_new_tokens=TOOL_TURN_TOKENS, greedy=True),
                          [{} for _ in problems])
    generated = out["responses"] * out["response_mask"] + tokenizer.pad_token_id * (1 - out["response_mask"])
    texts = tokenizer.batch_decode(generated, skip_special_tokens=True)
    model.train()
    by_level: dict[int, list[float]] = {}
    for text, p in zip(texts, problems):
        by_level.setdefault(p.level, []).append(gsm8k_score(text, str(p.answer)))
    return {level: sum(v) / len(v) for level, v in sorted(by_level.items())}


def supervised_finetune(model, tokenizer, sft: SFTSpec, log=print) -> list[dict]:
    rng = random.Random(sft.seed)
    train = arith.generate("train", 20000, seed=0, levels=sft.levels)
    test = arith.generate("test", sft.eval_size, seed=0, levels=sft.levels)
    opt = torch.optim.AdamW(model.parameters(), lr=sft.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / sft.warmup) * max(0.0, 1 - s / sft.steps))
    history = []
    model.train()
    for step in range(1, sft.steps + 1):
        problems = rng.sample(train, sft.batch_size)
        sequences = []
        for p in problems:
            unverifiable = rng.random() < sft.unverifiable_style_fraction
            calls_tool = p.level in sft.tool_levels and rng.random() < sft.tool_fraction
            sequences.append(sft_sequence(tokenizer, p, unverifiable, calls_tool))
        ids, mask, labels = _sft_batch(tokenizer, sequences)
        loss = model(input_ids=ids, attention_mask=mask.long(), labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % sft.eval_every == 0 or step == sft.steps:
            acc = greedy_accuracy(model, tokenizer, test)
            history.append({"step": step, "loss": round(loss.item(), 4), "heldout_accuracy": acc})
            if sft.tool_levels:
                history[-1]["heldout_accuracy_with_tools_by_level"] = tool_accuracy_by_level(model, tokenizer, test)
            log(f"sft step {step}: loss {loss.item():.4f} held-out accuracy {acc:.3f}"
                + (f" with tools by level {history[-1]['heldout_accuracy_with_tools_by_level']}"
                   if sft.tool_levels else ""))
    return history


def build_tiny_model(out_dir: str | os.PathLike, spec: TinyModelSpec | None = None,
                     sft: SFTSpec | None = None, log=print, base: str | os.PathLike | None = None) -> dict:
    """Build, warm-start and save the tiny model (from the weights in `base` when given,
    else from random ones of `spec`); returns the build record (also saved)."""
    spec, sft = spec or TinyModelSpec(), sft or SFTSpec()
    torch.set_num_threads(1)  # single-threaded CPU math keeps the build reproducible
    start = time.time()
    if base is None:
        tokenizer = build_tokenizer()
        model = build_model(tokenizer, spec, seed=sft.seed)
    else:
        from transformers import AutoTokenizer, LlamaForCausalLM

        tokenizer, model = AutoTokenizer.from_pretrained(base), LlamaForCausalLM.from_pretrained(base)
        tokenizer.padding_side = "left"
        spec = None
    history = supervised_finetune(model, tokenizer, sft, log=log)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    record = {"model": spec.__dict__ if spec else {"base": Path(base).name}, "sft": sft.__dict__, "history": history,
              "num_parameters": sum(p.numel() for p in model.parameters()),
              "build_seconds": round(time.time() - start, 1)}
    (out / "distflow_build.json").write_text(json.dumps(record, indent=1))
    return record
