"""The vision-language path on a Qwen2-VL built in code: images reach generation and the
scoring forward the same way, and sampling stays placement-invariant."""

import copy
import json
from pathlib import Path

import pytest
import torch

from distflow.data.images import ImagePrompter, decode_image, image_fields
from distflow.data.tasks import dots
from distflow.engines.common import forward_response, render_prompt
from distflow.engines.rollout import HFRolloutEngine, SamplingParams, left_pad, sample_seed
from distflow.engines.tiny_model import ASSET_DIR
from distflow.engines.tiny_vlm import VisionSpec, build_vlm, image_processor

AGENT = Path(__file__).resolve().parents[2] / "examples" / "agents" / "arith_agent.py"


@pytest.fixture(scope="module")
def vlm():
    tokenizer, model = build_vlm(ASSET_DIR, VisionSpec(), seed=0)
    return tokenizer, model.eval(), ImagePrompter(image_processor(), tokenizer, model.config)


def _prompts(tokenizer, prompter, problems):
    out = []
    for p in problems:
        row = dots.to_verl_row(p, 0, "test")
        out.append(prompter.encode(tokenizer, render_prompt(tokenizer, row["prompt"]),
                                   [decode_image(e, None) for e in row["images"]]))
    return out


def test_the_text_model_carries_over_and_images_become_merged_patch_tokens(vlm):
    tokenizer, model, prompter = vlm
    (prompt,) = _prompts(tokenizer, prompter, dots.generate("test", 1))
    assert prompt.image_grid_thw.tolist() == [[1, 4, 4]] and prompt.pixel_values.shape == (16, 1176)
    assert list(prompt).count(model.config.image_token_id) == 4  # 16 patches, 2x2 merged
    # on text alone, M-RoPE is the text model's rotation: the same next-token logits
    from transformers import LlamaForCausalLM

    text = LlamaForCausalLM.from_pretrained(ASSET_DIR).eval()
    ids = torch.tensor([tokenizer("Ann has 3 pens, gets 4 more. How many?\nA: ")["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits[..., :100], text(input_ids=ids).logits, atol=1e-4)


def test_generation_and_scoring_agree_on_image_prompts(vlm):
    tokenizer, model, prompter = vlm
    engine = HFRolloutEngine(model, tokenizer, shares_trainer_weights=True)
    prompts = _prompts(tokenizer, prompter, dots.generate("test", 3))
    text_only = tokenizer("Q\nA: ", add_special_tokens=False)["input_ids"]  # shorter: left padding in the batch
    prompts.append(text_only)
    seeds = [sample_seed(3, i) for i in range(len(prompts))]
    params = SamplingParams(temperature=1.0, max_new_tokens=10)
    out = engine.generate(prompts, seeds, params)
    # the scoring forward (actor, reference) on the same rows, images from the batch fields
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    with torch.no_grad():
        log_probs, _ = forward_response(model, ids, mask, out["responses"], out["response_mask"],
                                        images=image_fields(prompts))
    assert torch.allclose(log_probs * out["response_mask"], out["rollout_log_probs"], atol=1e-4)
    # the same (prompt, seed) alone gives the same response: placement-invariant
    for i in (0, 3):
        alone = engine.generate([prompts[i]], [seeds[i]], params)
        n = int(alone["response_mask"][0].sum())
        assert torch.equal(alone["responses"][0, :n], out["responses"][i, :n])
    # and the image matters: another picture, another distribution
    other = _prompts(tokenizer, prompter, dots.generate("test", 4)[3:])
    with torch.no_grad():
        swapped, _ = forward_response(model, ids[:1], mask[:1], out["responses"][:1], out["response_mask"][:1],
                                      images=image_fields(other))
    assert not torch.allclose(swapped, log_probs[:1], atol=1e-4)


def test_a_bf16_run_keeps_pixels_in_bf16_and_its_forwards_see_the_same_values(vlm):
    """model.dtype=bfloat16: the vision tower casts the pixels to bf16 before anything else,
    on bf16 weights (the rollout, FSDP2's gathered weights) and under autocast (DDP, one
    worker, the reference) alike, so keeping them in bf16 changes no logit."""
    from distflow.config import load_config
    from distflow.data.dataset import PromptRow
    from distflow.data.images import model_inputs
    from distflow.engines.common import computing_in
    from distflow.trainer.nodes import source_batch

    tokenizer, model, prompter = vlm
    half = ImagePrompter(prompter.processor, tokenizer, model.config, pixel_dtype=torch.bfloat16)
    problems = dots.generate("test", 2)
    full, kept = _prompts(tokenizer, prompter, problems), _prompts(tokenizer, half, problems)
    assert kept[0].pixel_values.dtype == torch.bfloat16 and [list(p) for p in kept] == [list(p) for p in full]
    ids, _ = left_pad(full, tokenizer.pad_token_id)

    def logits(m, prompts):
        with torch.no_grad():
            return m(input_ids=ids, **model_inputs(image_fields(prompts), ids, model.config.image_token_id)).logits

    with computing_in(torch.bfloat16, torch.device("cpu")):
        assert torch.equal(logits(model, full), logits(model, kept))
    weights_in_bf16 = copy.deepcopy(model).to(torch.bfloat16)
    assert torch.equal(logits(weights_in_bf16, full), logits(weights_in_bf16, kept))
    assert not torch.equal(logits(model, full), logits(model, kept))  # in fp32 the rounding would show
    # a batch whose rows have no image carries a blank one in the run's dtype
    text = tokenizer("How many dots?\nA: ", add_special_tokens=False)["input_ids"]
    row = PromptRow(0, [{"role": "user", "content": "How many dots?"}], "3", "text")
    batch = source_batch([(0, (0, 0), row, text)], load_config(None, ["algorithm.group_size=2"]), 0, images=half)
    assert batch["pixel_values"].dtype == torch.bfloat16


def test_a_chunked_output_head_scores_and_trains_on_image_prompts_like_the_whole_logits(vlm):
    """actor.output_head_chunk_tokens on Qwen2-VL: its final hidden states (images placed
    by the model) through the head a few tokens at a time, the log-probs and entropy of
    its whole logits, and the same gradients for every parameter, the vision tower's too."""
    from distflow.engines.common import check_head_chunking

    tokenizer, model, prompter = vlm
    check_head_chunking(model)
    prompts = _prompts(tokenizer, prompter, dots.generate("test", 2))
    out = HFRolloutEngine(model, tokenizer, shares_trainer_weights=True).generate(
        prompts, [sample_seed(5, i) for i in range(2)], SamplingParams(temperature=1.0, max_new_tokens=8))
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    advantages = torch.tensor([[1.5], [-0.5]]) * out["response_mask"]
    runs = {}
    for chunk in (0, 3):
        model.zero_grad()
        lp, ent = forward_response(model, ids, mask, out["responses"], out["response_mask"], with_entropy=True,
                                   images=image_fields(prompts), head_chunk_tokens=chunk)
        ((lp * advantages).sum() + 0.3 * (ent * out["response_mask"]).sum()).backward()
        runs[chunk] = (lp.detach(), ent.detach(), {n: q.grad.clone() for n, q in model.named_parameters()})
    model.zero_grad()
    (whole_lp, whole_ent, whole_grads), (lp, ent, grads) = runs[0], runs[3]
    assert whole_lp.abs().sum() > 0
    torch.testing.assert_close(lp, whole_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, whole_ent, rtol=0, atol=1e-5)
    assert any(g.abs().sum() > 0 for n, g in whole_grads.items() if n.startswith("model.visual."))
    for name, g in whole_grads.items():
        assert (grads[name] - g).abs().max() <= 1e-5 * max(g.abs().max(), 1e-12), name


def test_the_vlm_build_is_a_loadable_deterministic_hf_folder(tmp_path):
    from distflow.engines.common import load_causal_lm, load_image_prompter, load_tokenizer, takes_images
    import dataclasses

    from distflow.engines.tiny_vlm import VISION_SFT, build_tiny_vlm

    sft = dataclasses.replace(VISION_SFT, steps=2, batch_size=4, eval_every=2, eval_size=6, warmup=1)
    record = build_tiny_vlm(tmp_path / "a", sft=sft, log=lambda s: None)
    build_tiny_vlm(tmp_path / "b", sft=sft, log=lambda s: None)
    a, b = load_causal_lm(str(tmp_path / "a")), load_causal_lm(str(tmp_path / "b"))
    assert type(a).__name__ == "Qwen2VLForConditionalGeneration"
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name
    assert record["history"][-1]["step"] == 2 and record["base"] == "tiny-arith"
    assert takes_images(str(tmp_path / "a")) and not takes_images(str(ASSET_DIR))
    tok = load_tokenizer(str(tmp_path / "a"))
    assert load_image_prompter(str(ASSET_DIR), tok) is None
    assert load_image_prompter(str(tmp_path / "a"), tok).merge == 4


def test_the_shipped_vlm_counts_but_mostly_answers_in_the_unverifiable_style():
    """The recorded build's held-out strict accuracy is low, its counting is not: RL has
    the answer style and level 3's counts to learn."""
    import json

    from distflow.engines.common import load_causal_lm, load_image_prompter, load_tokenizer
    from distflow.engines.tiny_vlm import VLM_ASSET_DIR, greedy_accuracy

    record = json.loads((VLM_ASSET_DIR / "distflow_build.json").read_text())
    assert record["num_parameters"] < 5_000_000
    torch.set_num_threads(1)
    model, tok = load_causal_lm("builtin:tiny-dots-vl"), load_tokenizer("builtin:tiny-dots-vl")
    prompter = load_image_prompter("builtin:tiny-dots-vl", tok)
    accuracy = greedy_accuracy(model, tok, prompter, dots.generate("test", record["sft"]["eval_size"]))
    assert 0.10 <= accuracy <= 0.60
    assert abs(accuracy - record["history"][-1]["heldout_accuracy"]) <= 0.03


@pytest.mark.parametrize("overrides, named", [
    (["rollout.engine=vllm"], "rollout.engine=vllm"),
    ([f"rollout.agent={AGENT}:run"], "an agent (rollout.agent)"),
])
def test_what_a_vlm_run_does_not_take_is_one_line_before_anything_loads(overrides, named):
    from distflow.config import load_config
    from distflow.dag.graph import GraphError
    from distflow.trainer.recipes import build_graph

    cfg = load_config(None, ["model.path=builtin:tiny-dots-vl", *overrides])
    with pytest.raises(GraphError, match="is a vision-language model") as e:
        build_graph(cfg)
    assert named in str(e.value) and "\n" not in str(e.value)
    graph = build_graph(load_config(None, ["model.path=builtin:tiny-dots-vl", "algorithm.use_kl_loss=true",
                                           "actor.ppo_mini_batch_size=8"]))
    for node in ("rollout", "ref_log_prob", "old_log_prob", "actor_update"):  # every forward gets the pixels
        assert {"pixel_values", "image_grid_thw"} <= set(graph.by_name[node].inputs), node
    ppo = build_graph(load_config(None, ["model.path=builtin:tiny-dots-vl", "algorithm.name=ppo"]))
    for node in ("critic_values", "critic_update"):
        assert {"pixel_values", "image_grid_thw"} <= set(ppo.by_name[node].inputs), node


def test_evaluating_a_vlm_on_vllm_is_refused_in_one_line():
    """`distflow eval` builds no task graph: it sampled from vLLM without the images."""
    from distflow.cli import check_inputs
    from distflow.config import ConfigError, load_config

    cfg = load_config(None, ["model.path=builtin:tiny-dots-vl", "rollout.engine=vllm"], training=False)
    with pytest.raises(ConfigError, match="is a vision-language model, which generates with the HF engine"):
        check_inputs(cfg, training=False)


def test_a_vision_model_of_another_family_or_truncated_image_prompts_are_refused_before_launch(tmp_path):
    """A folder with an image processor but not the Qwen2-VL family's image tokens (a
    LLaVA's, say): its workers stopped on an AttributeError while building their prompts.
    Truncating prompts stopped a VLM run at the first long image prompt drawn."""
    import shutil

    from distflow.cli import check_inputs
    from distflow.config import ConfigError, load_config

    folder = tmp_path / "other-vl"
    shutil.copytree(ASSET_DIR.parent / "tiny-dots-vl", folder)
    config = json.loads((folder / "config.json").read_text())
    del config["vision_start_token_id"]
    (folder / "config.json").write_text(json.dumps(config))
    check_inputs(load_config(None, ["model.path=builtin:tiny-dots-vl"]))  # the shipped one passes
    with pytest.raises(ConfigError, match=r"^model.path=.*other-vl: a vision-language model \(qwen2_vl\) without "
                                          r"vision_start_token_id; images are fed to the Qwen2-VL family's"):
        check_inputs(load_config(None, [f"model.path={folder}"]))
    with pytest.raises(ConfigError, match="^data.on_long_prompt=truncate: .* whose image prompts cannot be truncated"):
        check_inputs(load_config(None, ["model.path=builtin:tiny-dots-vl", "data.on_long_prompt=truncate"]))


def test_images_for_a_text_only_model_are_a_bad_row():
    from distflow.data.dataset import DatasetError, load_rows
    from distflow.engines.common import load_tokenizer
    from distflow.trainer.nodes import encode_prompt

    (row,) = load_rows("builtin:dots:train:1")
    with pytest.raises(DatasetError, match="the row has images but model.path is a text-only model"):
        encode_prompt(load_tokenizer(str(ASSET_DIR)), row)


def test_image_placeholders_are_never_generated(vlm):
    """Even when the policy favours `<|image_pad|>` after the prompt, the engine does not
    sample it (a response holding one would not match its images in the scoring forward)."""
    import copy

    tokenizer, model, prompter = vlm
    model = copy.deepcopy(model)
    prompts = _prompts(tokenizer, prompter, dots.generate("test", 2))
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    from distflow.data.images import model_inputs

    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=mask, output_hidden_states=True,
                       **model_inputs(image_fields(prompts), ids, model.config.image_token_id)).hidden_states[-1][:, -1]
        # the (tied) row of the image token: a logit of about 100 after these prompts
        model.get_input_embeddings().weight[model.config.image_token_id] = 100 * hidden.mean(0) / hidden.mean(0).norm() ** 2
        forced = model(input_ids=ids, attention_mask=mask,
                       **model_inputs(image_fields(prompts), ids, model.config.image_token_id)).logits[:, -1]
    assert (forced.argmax(-1) == model.config.image_token_id).all()
    engine = HFRolloutEngine(model, tokenizer, shares_trainer_weights=True)
    for params, seeds in ((SamplingParams(max_new_tokens=6, greedy=True), None),
                          (SamplingParams(max_new_tokens=6), [1, 2])):
        out = engine.generate(prompts, seeds, params)
        assert not torch.isin(out["responses"], torch.tensor([model.config.image_token_id,
                                                              model.config.vision_start_token_id])).any()
        with torch.no_grad():
            forward_response(model, ids, mask, out["responses"], out["response_mask"], images=image_fields(prompts))


def test_placeholders_must_match_the_row_s_images(vlm):
    from distflow.data.dataset import DatasetError

    tokenizer, _, prompter = vlm
    image = decode_image(dots.to_verl_row(dots.problem("test", 0), 0, "test")["images"][0], None)
    with pytest.raises(DatasetError, match="the prompt has 2 <image> placeholders but the row has 1 images"):
        prompter.encode(tokenizer, "<image><image>How many?", [image])
    two = prompter.encode(tokenizer, "<image> and <image>: how many in all?", [image, image])
    assert two.image_grid_thw.tolist() == [[1, 4, 4], [1, 4, 4]] and two.pixel_values.shape == (32, 1176)
    assert list(two).count(tokenizer.convert_tokens_to_ids("<|image_pad|>")) == 8
    # the model's own image token written in the text would have no image behind it (the forward would fail)
    with pytest.raises(DatasetError, match=r"^the prompt's text holds the vision token <\|image_pad\|>; only <image> "
                                           r"placeholders stand for images$"):
        prompter.encode(tokenizer, "<image> is not <|image_pad|>", [image])


def test_a_tool_result_that_writes_an_image_token_is_not_an_image_in_the_episode(vlm, tmp_path):
    """An environment's observation holding the literal `<|image_pad|>`: the token would
    stand for an image that is not there (the forward fails on features and tokens that do
    not match); the episode drops it from the observation."""
    from distflow.config import load_config
    from distflow.trainer.loop import make_episode_runner

    tokenizer, model, prompter = vlm
    (tmp_path / "env.py").write_text(
        "from distflow.engines.agent import EnvStep\n"
        "class Echo:\n"
        "    def __init__(self, toolbox):\n        pass\n"
        "    def reset(self, task):\n        pass\n"
        "    def step(self, text):\n"
        "        return EnvStep([{'role': 'user', 'content': 'result: <|image_pad|> ok'}], False)\n")
    cfg = load_config(None, ["rollout.max_turns=2", f"rollout.env={tmp_path / 'env.py'}:Echo"])
    runner = make_episode_runner(cfg, HFRolloutEngine(model, tokenizer, shares_trainer_weights=True), tokenizer)
    prompts = _prompts(tokenizer, prompter, dots.generate("test", 2))
    out = runner.generate(prompts, [sample_seed(5, i) for i in range(2)], SamplingParams(max_new_tokens=6), [{}, {}])
    observed = out["responses"][out["observation_mask"].bool()].tolist()
    assert observed and model.config.image_token_id not in observed
    assert "result:  ok" in tokenizer.decode(out["responses"][0][out["observation_mask"][0].bool()])


def _one_rank_without_images(rank, world, strategy):
    """Two updates of the tiny VLM where rank 0's rows have images and rank 1's have none
    (a dataset mixing text-only prompts): the global gradient norm, the same on both."""
    from distflow.config import load_config
    from distflow.data.batch import Batch
    from distflow.engines.actor import Actor, OptimConfig
    from distflow.engines.common import load_causal_lm, load_image_prompter, load_tokenizer
    from distflow.trainer.nodes import make_policy_loss

    path = "builtin:tiny-dots-vl"
    tokenizer, model = load_tokenizer(path), load_causal_lm(path)
    if rank == 0:
        prompts = _prompts(tokenizer, load_image_prompter(path, tokenizer), dots.generate("test", 2))
    else:
        prompts = [tokenizer("How many dots?\nA: ", add_special_tokens=False)["input_ids"]] * 2
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    g = torch.Generator().manual_seed(rank)
    responses = torch.randint(3, 100, (2, 6), generator=g)
    batch = Batch({"prompts": ids, "prompt_mask": mask, "responses": responses,
                   "response_mask": torch.ones_like(responses), "advantages": torch.randn(2, 6, generator=g),
                   **image_fields(prompts)})
    cfg = load_config(None, ["algorithm.use_kl_loss=false"])
    actor = Actor(model, OptimConfig(lr=1e-3), torch.device("cpu"), strategy=strategy)
    norms = [actor.train_mini_batch(batch, [[0, 1]], make_policy_loss(cfg, 24.0, 4.0))["grad_norm"] for _ in range(2)]
    return norms, any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in actor.module.named_parameters()
                      if n.startswith("model.visual."))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_rank_whose_rows_have_no_image_trains_beside_one_whose_rows_do(strategy):
    """Its forward skipped the vision tower: DDP failed in the next step (a parameter with no
    gradient), FSDP2 in the first (a collective the other rank never joined). The tower now
    runs on a blank image times 0, as verl does; the gradient is the images' alone."""
    from helpers import run_gloo

    (norms0, visual0), (norms1, visual1) = run_gloo(_one_rank_without_images, 2, strategy, timeout=300)
    assert norms0 == norms1 and all(n > 0 for n in norms0)
    assert visual0 and visual1  # the images' gradient reaches the tower, on both ranks (reduced)


def test_text_only_rows_of_a_vlm_run_generate_after_image_rows_and_carry_image_fields(vlm):
    """A dataset mixing text-only prompts into a VLM run: a step whose rows on a worker have
    no image still carries the (all-padding) image fields its nodes read, and generating
    them after a batch with images works (rows sharing a prompt were handed a prefilled
    cache, and Qwen2-VL then placed them by the previous batch's M-RoPE offsets)."""
    from distflow.config import load_config
    from distflow.data.dataset import PromptRow
    from distflow.trainer.nodes import source_batch

    tokenizer, model, prompter = vlm
    engine = HFRolloutEngine(model, tokenizer, shares_trainer_weights=True)
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    engine.generate(_prompts(tokenizer, prompter, dots.generate("test", 4)), [1, 2, 3, 4], params)
    text = tokenizer("How many dots?\nA: ", add_special_tokens=False)["input_ids"]
    out = engine.generate([text, text], [5, 6], params)  # GRPO's two samples of one prompt
    assert out["responses"].shape == (2, 6)
    row = PromptRow(0, [{"role": "user", "content": "How many dots?"}], "3", "text")
    batch = source_batch([(0, (0, 0), row, text)], load_config(None, ["algorithm.group_size=2"]), 0,
                         images=prompter)
    assert batch["pixel_values"].shape == (2, 1, 1176) and not batch["image_grid_thw"].any()
