"""Shared fixtures. CPU only; multi-process tests use gloo on loopback."""

from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

# Tests import helpers from the tests folder itself (tests/helpers.py).
sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(items) -> None:
    """Files with multi-process runs (a test marked slow) first, each file's tests kept
    together and in order: under the README's `-n 2 --dist loadfile` the two workers
    start on the long files, and the short ones fill in at the end."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory) -> str:
    """An untrained tiny Llama + char tokenizer saved as a HF folder (fast to build)."""
    from distflow.engines.tiny_model import TinyModelSpec, build_model, build_tokenizer

    path = tmp_path_factory.mktemp("random_model")
    tok = build_tokenizer()
    model = build_model(tok, TinyModelSpec(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128), seed=0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


QWEN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def qwen2_model_dir(tmp_path_factory) -> str:
    """An ordinary HF folder of a real architecture, as a user brings one: a Qwen2 causal LM
    (random weights of a shrunk config, saved in bf16), its own byte-level BPE tokenizer
    trained here on the built-in task's text, Qwen's chat template and special tokens
    (eos <|im_end|>, pad <|endoftext|>). Nothing is downloaded."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from distflow.data.tasks import arith

    path = tmp_path_factory.mktemp("qwen2")
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    texts = [p.question + " " + p.solution for p in arith.generate("train", 2000, seed=0)]
    core.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = QWEN_CHAT_TEMPLATE
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, use_sliding_window=False)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def qwen2_reward_model_dir(qwen2_model_dir, tmp_path_factory) -> str:
    """A reward model as a user brings one: a Qwen2 sequence-classification model with one
    label (random weights of the shrunk config), with the Qwen2 folder's tokenizer and
    chat template."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    path = tmp_path_factory.mktemp("qwen2_rm")
    tok = AutoTokenizer.from_pretrained(qwen2_model_dir)
    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, num_labels=1,
                         bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         use_sliding_window=False)
    Qwen2ForSequenceClassification(config).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return str(path)
