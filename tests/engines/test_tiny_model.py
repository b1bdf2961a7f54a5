import json

import torch

from distflow.data.tasks import arith
from distflow.engines.common import load_causal_lm, load_tokenizer
from distflow.engines.tiny_model import ASSET_DIR, SFTSpec, TinyModelSpec, build_tiny_model, greedy_accuracy, sft_target

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
