"""The embedded vision-language policy: a tiny Qwen2-VL (`builtin:tiny-dots-vl`),
warm-started on the dot-counting task (`builtin:dots:...`).

It is an ordinary HF folder of `Qwen2VLForConditionalGeneration` (config.json,
model.safetensors, tokenizer.json, preprocessor_config.json for Qwen2-VL's image
processor), shipped in `distflow/assets/tiny-dots-vl` and rebuilt bit-for-bit by

    distflow build-tiny-model --vision --out distflow/assets/tiny-dots-vl

Its language model starts as the default text model (`tiny-arith`: Qwen2-VL's decoder
is Llama's with q/k/v biases, here zero, and M-RoPE, which on text tokens is the same
rotation); its vision tower (2 blocks, width 64) starts random. The fine-tune is short
and its answers mixed as the text model's are: half end with `#### 7`, half with
`The answer is 7.`, which the rule reward does not accept. So RL has two things to
learn: the verifiable style, and to count better.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from distflow.data.images import ImagePrompter, decode_image, image_fields, model_inputs
from distflow.data.tasks import dots
from distflow.engines.common import render_prompt
from distflow.engines.tiny_model import ASSET_DIR, ASSETS, SFTSpec, _sft_batch, sft_target

VLM_ASSET_DIR = ASSETS / "tiny-dots-vl"
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")


@dataclass(kw_only=True)
class VisionSpec:
    depth: int = 2
    embed_dim: int = 64
    num_heads: int = 4
    mlp_ratio: int = 2


# The fine-tune (SFTSpec's fields; the levels are the dot task's).
VISION_SFT = SFTSpec(steps=200, batch_size=32, lr=2e-3, warmup=20, eval_every=50, eval_size=192, levels=dots.LEVELS)


def image_processor():
    """Qwen2-VL's image processor (the Pillow backend: no torchvision), sized so that the
    task's 56x56 pictures stay as they are: 4x4 patches of 14 pixels."""
    from transformers import Qwen2VLImageProcessorPil

    side = dots.IMAGE_SIZE
    return Qwen2VLImageProcessorPil(size={"shortest_edge": side * side, "longest_edge": 4 * side * side})


def build_vlm(base: str | os.PathLike, vision: VisionSpec, seed: int):
    """(tokenizer, model): `base`'s tokenizer with Qwen2-VL's vision tokens added, and a
    Qwen2-VL whose language model holds `base`'s weights."""
    from transformers import AutoTokenizer, LlamaForCausalLM, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.padding_side = "left"
    text = LlamaForCausalLM.from_pretrained(base)
    t = text.config
    start, pad, end = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    head_dim = t.hidden_size // t.num_attention_heads
    quarter = head_dim // 8  # M-RoPE: (time, height, width) sections of the head's rotary half
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                         num_hidden_layers=t.num_hidden_layers, num_attention_heads=t.num_attention_heads,
                         num_key_value_heads=t.num_key_value_heads, max_position_embeddings=t.max_position_embeddings,
                         rms_norm_eps=t.rms_norm_eps, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": t.rope_parameters["rope_theta"],
                                          "mrope_section": [2 * quarter, quarter, quarter]},
                         pad_token_id=t.pad_token_id, bos_token_id=t.bos_token_id, eos_token_id=t.eos_token_id),
        vision_config=dict(depth=vision.depth, embed_dim=vision.embed_dim, hidden_size=t.hidden_size,
                           num_heads=vision.num_heads, mlp_ratio=vision.mlp_ratio),
        image_token_id=pad, video_token_id=pad, vision_start_token_id=start, vision_end_token_id=end,
        tie_word_embeddings=True, pad_token_id=t.pad_token_id, bos_token_id=t.bos_token_id,
        eos_token_id=t.eos_token_id)
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, weight in text.state_dict().items():
            if name == "lm_head.weight":  # tied to the embedding
                continue
            target = params[name.replace("model.", "model.language_model.", 1)]
            target[: weight.shape[0]].copy_(weight)  # the embedding gains rows for the vision tokens
        for name, p in params.items():
            if name.startswith("model.language_model.") and name.endswith("_proj.bias"):
                p.zero_()
    return tokenizer, model


def encode(prompter: ImagePrompter, tokenizer, p: dots.Problem):
    row = dots.to_verl_row(p, 0, "train")
    image = decode_image(row["images"][0], None)
    return prompter.encode(tokenizer, render_prompt(tokenizer, row["prompt"]), [image])


@torch.no_grad()
def greedy_accuracy(model, tokenizer, prompter: ImagePrompter, problems: list[dots.Problem],
                    max_new_tokens: int = 24) -> float:
    from distflow.engines.reward import gsm8k_score
    from distflow.engines.rollout import left_pad

    model.eval()
    correct = 0
    for start in range(0, len(problems), 64):
        chunk = problems[start: start + 64]
        prompts = [encode(prompter, tokenizer, p) for p in chunk]
        ids, mask = left_pad(prompts, tokenizer.pad_token_id)
        images = model_inputs(image_fields(prompts), ids, model.config.image_token_id)
        out = model.generate(input_ids=ids, attention_mask=mask, **images, do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
        texts = tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
        correct += sum(gsm8k_score(t, str(p.answer)) for t, p in zip(texts, chunk))
    model.train()
    return correct / len(problems)


def supervised_finetune(model, tokenizer, prompter: ImagePrompter, sft: SFTSpec, log=print) -> list[dict]:
    rng = random.Random(sft.seed)
    test = dots.generate("test", sft.eval_size, levels=sft.levels)
    opt = torch.optim.AdamW(model.parameters(), lr=sft.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / sft.warmup) * max(0.0, 1 - s / sft.steps))
    history = []
    model.train()
    for step in range(1, sft.steps + 1):
        problems = [dots.problem("train", rng.randrange(100_000), levels=sft.levels) for _ in range(sft.batch_size)]
        prompts = [encode(prompter, tokenizer, p) for p in problems]
        sequences = []
        for prompt, p in zip(prompts, problems):
            answer = tokenizer(sft_target(p, rng.random() < sft.unverifiable_style_fraction),
                               add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            sequences.append((list(prompt) + answer, [-100] * len(prompt) + answer))
        ids, mask, labels = _sft_batch(tokenizer, sequences)
        images = model_inputs(image_fields(prompts), ids, model.config.image_token_id)
        loss = model(input_ids=ids, attention_mask=mask.long(), labels=labels, **images).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % sft.eval_every == 0 or step == sft.steps:
            acc = greedy_accuracy(model, tokenizer, prompter, test)
            history.append({"step": step, "loss": round(loss.item(), 4), "heldout_accuracy": acc})
            log(f"sft step {step}: loss {loss.item():.4f} held-out accuracy {acc:.3f}")
    return history


def build_tiny_vlm(out_dir: str | os.PathLike, vision: VisionSpec | None = None, sft: SFTSpec = VISION_SFT,
                   log=print, base: str | os.PathLike = ASSET_DIR) -> dict:
    """Build, warm-start and save the tiny VLM; returns the build record (also saved)."""
    vision = vision or VisionSpec()
    torch.set_num_threads(1)  # single-threaded CPU math keeps the build reproducible
    start = time.time()
    tokenizer, model = build_vlm(base, vision, sft.seed)
    processor = image_processor()
    prompter = ImagePrompter(processor, tokenizer, model.config)
    history = supervised_finetune(model, tokenizer, prompter, sft, log=log)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    processor.save_pretrained(out)
    record = {"vision": vision.__dict__, "base": Path(base).name, "sft": sft.__dict__, "history": history,
              "num_parameters": sum(p.numel() for p in model.parameters()),
              "build_seconds": round(time.time() - start, 1)}
    (out / "distflow_build.json").write_text(json.dumps(record, indent=1))
    return record
