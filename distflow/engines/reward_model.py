"""A learned reward model (`reward.model_path`): a HuggingFace sequence-classification
model with one label, whose score of a prompt and its response is the sample's reward, as
verl's `reward_model` worker and TRL's `reward_funcs=<model>` use one.

Each sample's conversation (the prompt's messages, then the response as the assistant's
turn) is rendered by the reward model's own tokenizer and chat template, which need not
be the policy's; the score is the model's output at the conversation's last token, found
by the attention mask (a pad id that also ends every turn does not move it). A
conversation longer than `max_length` tokens (at most the model's positions) keeps its
end: the response and what the score is read at. Scored without gradients, in
micro-batches, on the worker's device.
"""

from __future__ import annotations

import json
import os
import threading

import torch

from distflow.engines.common import load_tokenizer, quiet_transformers, resolve_model_path


class RewardModelError(ValueError):
    """One line: why a folder is not a reward model this can load."""


def check_reward_model(path: str) -> None:
    """The folder's config names a sequence-classification model with one label and
    safetensors weights (read without loading it)."""
    folder = resolve_model_path(path)
    try:
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise RewardModelError(f"{path}: no readable config.json ({e})") from None
    architectures = config.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise RewardModelError(f"{path}: a {', '.join(architectures) or 'model without architectures'}, not a "
                               "sequence-classification model (AutoModelForSequenceClassification)")
    labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
    if labels != 1:
        raise RewardModelError(f"{path}: has {labels} labels; a reward model has one (its score)")
    if not any(name.endswith(".safetensors") for name in os.listdir(folder)):
        raise RewardModelError(f"{path}: no .safetensors weights (pickled .bin weights are never loaded)")


class RewardModel:
    def __init__(self, path: str, device: torch.device, micro_batch_size: int = 8, max_length: int = 4096):
        from transformers import AutoModelForSequenceClassification

        check_reward_model(path)
        quiet_transformers()
        self.tokenizer = load_tokenizer(path)
        self.tokenizer.padding_side, self.tokenizer.truncation_side = "right", "left"
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        self.model = AutoModelForSequenceClassification.from_pretrained(
            resolve_model_path(path), dtype=dtype, use_safetensors=True, trust_remote_code=False).to(device).eval()
        text_config = self.model.config.get_text_config()
        if text_config.pad_token_id is None:  # HF's own pooling finds the last token by it
            text_config.pad_token_id = self.model.config.pad_token_id = self.tokenizer.pad_token_id
        # the score head's output at every position, where the head is one per token: each thread's own (the
        # reward node scores several rollout chunks at once, on the scheduler's threads)
        self._head_output = threading.local()
        head = getattr(self.model, "score", None)  # decoder models' (Llama, Qwen, Mistral, Gemma ...)
        if isinstance(head, torch.nn.Linear):
            head.register_forward_hook(lambda module, inputs, output: setattr(self._head_output, "value", output))
        positions = getattr(text_config, "max_position_embeddings", None) or max_length
        self.device, self.micro_batch_size, self.max_length = device, micro_batch_size, min(max_length, positions)
        self.templated = bool(getattr(self.tokenizer, "chat_template", None))

    def conversation(self, messages: list[dict]) -> str:
        """`messages` as the reward model reads them: its own chat template's text (the
        messages' contents, a line each, without one)."""
        if not self.templated:
            return "\n".join(m["content"] for m in messages)
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        except Exception as e:  # e.g. a template without a role an environment answers in
            roles = sorted({m["role"] for m in messages})
            raise ValueError(f"reward.model_path: its chat template cannot render a conversation of the roles "
                             f"{roles}: {type(e).__name__}: {e}") from None

    @torch.no_grad()
    def score(self, conversations: list[list[dict]]) -> torch.Tensor:
        """Each conversation's score (its messages: the prompt's, then the response as the
        assistant's, or an episode's turns and observations), float32 on the CPU: the head's
        output at the conversation's last token by the attention mask (as verl reads it;
        HF's own pooling, by the pad id, where the head is not one per token)."""
        texts = [self.conversation(c) for c in conversations]
        scores = []
        for start in range(0, len(texts), self.micro_batch_size):
            # a template's text holds its special tokens; plain text gets the model's own (BOS, [CLS])
            enc = self.tokenizer(texts[start:start + self.micro_batch_size], return_tensors="pt", padding=True,
                                 truncation=True, max_length=self.max_length, add_special_tokens=not self.templated)
            mask = enc["attention_mask"].to(self.device)
            self._head_output.value = None
            logits = self.model(input_ids=enc["input_ids"].to(self.device), attention_mask=mask).logits
            per_token = self._head_output.value
            if per_token is not None and per_token.dim() == 3:  # (rows, tokens, 1), right-padded
                last = mask.sum(-1) - 1
                logits = per_token[torch.arange(len(last), device=self.device), last]
            scores.append(logits[:, 0].float().cpu())
        return torch.cat(scores) if scores else torch.zeros(0)

    def close(self) -> None:
        self.model = None
