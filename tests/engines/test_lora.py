"""LoRA through peft: only the adapter trains, the reference is the base (adapter off),
the weights pushed to a rollout engine are the merge, and a LoRA run learns, checkpoints
its adapter, resumes exactly, evaluates and exports."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distflow.data.batch import Batch
from distflow.engines.actor import Actor, OptimConfig
from distflow.engines.common import load_causal_lm
from distflow.engines.lora import AdapterDisabledReference, LoraSettings, merged_weights, with_lora
from helpers import distflow_sweep

SETTINGS = LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules="all-linear")


def _adapted(random_model_dir):
    torch.manual_seed(3)  # peft draws A at random
    model = with_lora(load_causal_lm(random_model_dir), SETTINGS)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at 0 (the adapter a no-op): make it count
            p.data.normal_(0, 0.5)
    return model


def _batch(vocab: int) -> Batch:
    g = torch.Generator().manual_seed(0)
    return Batch({"prompts": torch.randint(3, vocab, (3, 5), generator=g), "prompt_mask": torch.ones(3, 5, dtype=torch.long),
                  "responses": torch.randint(3, vocab, (3, 6), generator=g),
                  "response_mask": torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4])})


def test_merged_weights_are_peft_merge_under_hf_names(random_model_dir):
    model = _adapted(random_model_dir)
    ours = dict(merged_weights(model))
    reference = load_causal_lm(random_model_dir)
    expected = {k: v for k, v in _adapted(random_model_dir).merge_and_unload().state_dict().items()}
    # every HF name of the plain model, once (the tied output head under its first name only)
    assert set(ours) <= set(reference.state_dict()) and set(ours) == set(expected) - {"lm_head.weight"}
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6)
    changed = [n for n in ours if not torch.equal(ours[n], reference.state_dict()[n])]
    assert changed and all(n.endswith("proj.weight") for n in changed)  # only the adapted linear layers
    # computed, not merged in place: the base weights are untouched
    base = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    assert torch.equal(base, reference.model.layers[0].self_attn.q_proj.weight)


def test_export_merges_an_adapter_in_fp32_and_then_casts_it(random_model_dir, tmp_path):
    """`distflow export --merge --dtype bfloat16`: the adapter merged into the fp32 base, then
    cast; it merged into a base loaded in bf16, rounding the base before adding the delta."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from distflow.trainer import checkpoint

    adapter = tmp_path / "adapter"
    _adapted(random_model_dir).save_pretrained(adapter)
    AutoTokenizer.from_pretrained(random_model_dir).save_pretrained(adapter)
    checkpoint.export(adapter, tmp_path / "fp32", merge=True)
    checkpoint.export(adapter, tmp_path / "bf16", merge=True, dtype="bfloat16")
    full, cast = (load_file(tmp_path / name / "model.safetensors") for name in ("fp32", "bf16"))
    assert set(full) == set(cast) and all(v.dtype == torch.float32 for v in full.values())
    for name, tensor in full.items():
        assert torch.equal(cast[name], tensor.to(torch.bfloat16)), name
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16


def test_an_export_that_fails_leaves_no_folder_and_a_moved_base_is_one_line(random_model_dir, tmp_path,
                                                                            monkeypatch):
    import shutil

    from transformers import AutoTokenizer

    from distflow.trainer import checkpoint

    base = tmp_path / "base"
    shutil.copytree(random_model_dir, base)
    adapter = tmp_path / "adapter"
    _adapted(str(base)).save_pretrained(adapter)
    AutoTokenizer.from_pretrained(base).save_pretrained(adapter)

    def disk_full(folder, dtype):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "_cast_weights", disk_full)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.export(adapter, tmp_path / "out", merge=True, dtype="bfloat16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "base"]  # nothing that looks like a model
    (tmp_path / "here").mkdir()  # `--out .` in an empty folder: written in place, emptied again on a failure
    monkeypatch.chdir(tmp_path / "here")
    with pytest.raises(OSError, match="No space left"):
        checkpoint.export(adapter, Path("."), merge=True, dtype="bfloat16")
    assert not any((tmp_path / "here").iterdir()) and not (tmp_path / "here.partial").exists()
    monkeypatch.undo()
    shutil.rmtree(base)  # the base was on the training machine
    with pytest.raises(checkpoint.CheckpointError, match=f"checkpoint {adapter}: its adapter's base model {base} is "
                                                         "not a folder here; export the adapter without --merge"):
        checkpoint.export(adapter, tmp_path / "out", merge=True)
    assert checkpoint.export(adapter, tmp_path / "out", merge=False)  # the adapter alone needs no base
    with pytest.raises(checkpoint.CheckpointError, match="a checkpoint still being written"):
        checkpoint.export(tmp_path / "step_3.tmp", tmp_path / "again", merge=False)


def test_resuming_across_lora_settings_is_one_line(random_model_dir, tmp_path):
    """A LoRA checkpoint resumed without LoRA failed on torch's "missing optimizer state
    ... use strict=False", the reverse on PEFT's missing adapter_config.json, and an
    adapter of another rank loaded as saved, the run's rank ignored."""
    from distflow.trainer import checkpoint

    adapter = tmp_path / "adapter"
    _adapted(random_model_dir).save_pretrained(adapter)
    checkpoint.check_resumable(adapter, SETTINGS)  # the same settings: resumable
    checkpoint.check_resumable(Path(random_model_dir), None)
    other = functools.partial(dataclasses.replace, SETTINGS)
    cases = {(adapter, None): f"a LoRA adapter of rank {SETTINGS.rank}, but this run has actor.lora_rank=0",
             (adapter, other(rank=2 * SETTINGS.rank)): f"resume with actor.lora_rank={SETTINGS.rank}",
             # PEFT loaded these as saved, while the run's config said otherwise
             (adapter, other(alpha=4 * SETTINGS.alpha, dropout=0.1)): f"resume with actor.lora_alpha={SETTINGS.alpha}, "
                                                                     f"actor.lora_dropout={SETTINGS.dropout}",
             (adapter, other(target_modules="q_proj")): "resume with actor.lora_target_modules=",
             (Path(random_model_dir), SETTINGS): "the whole model's weights, but this run trains a LoRA adapter"}
    for (path, settings), message in cases.items():
        with pytest.raises(checkpoint.CheckpointError, match=message.replace("(", r"\(")):
            checkpoint.check_resumable(path, settings)
    # all-linear is checked where the model is: an adapter on two of its layers is not one on all of them
    narrow = tmp_path / "narrow"
    with_lora(load_causal_lm(random_model_dir), other(target_modules="q_proj,v_proj")).save_pretrained(narrow)
    assert SETTINGS.target_modules == "all-linear"
    checkpoint.check_resumable(narrow, SETTINGS)
    with pytest.raises(ValueError, match=r"resume with actor.lora_target_modules=q_proj,v_proj$"):
        with_lora(load_causal_lm(random_model_dir), SETTINGS, adapter_path=narrow)
    with_lora(load_causal_lm(random_model_dir), SETTINGS, adapter_path=adapter)
    # GPT-2's linear layers are Conv1D, which PEFT's all-linear counts too: its unchanged adapter resumes
    from transformers import GPT2Config, GPT2LMHeadModel

    def gpt2():
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32))

    conv = tmp_path / "gpt2-adapter"
    with_lora(gpt2(), SETTINGS).save_pretrained(conv)
    with_lora(gpt2(), SETTINGS, adapter_path=conv)


def test_only_the_adapter_trains_and_the_reference_is_the_base(random_model_dir):
    model = _adapted(random_model_dir)
    actor = Actor(model, OptimConfig(lr=1e-2), torch.device("cpu"))
    trainable = {n for n, p in actor.module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    counts = actor.parameter_counts()
    assert counts["optimizer_state_bytes"] == 8 * counts["trainable_parameters"] < counts["total_parameters"]
    batch = _batch(actor.module.config.vocab_size)
    base = load_causal_lm(random_model_dir)
    from distflow.engines.actor import ReferenceModel

    want = ReferenceModel(base, torch.device("cpu")).compute_log_probs(batch, [[0, 1, 2]])
    ref = AdapterDisabledReference(actor)
    torch.testing.assert_close(ref.compute_log_probs(batch, [[0, 1, 2]]), want, rtol=0, atol=1e-6)
    adapted = actor.compute_log_probs(batch, [[0, 1, 2]])
    assert (adapted - want).abs().max() > 1e-3  # the adapter is back on after the reference forward

    frozen_before = {n: p.detach().clone() for n, p in actor.module.named_parameters() if not p.requires_grad}

    def loss_fn(log_probs, _, micro):
        return -(log_probs * micro["response_mask"]).sum(), {}

    actor.train_mini_batch(batch, [[0, 1, 2]], loss_fn)
    assert all(torch.equal(p, frozen_before[n]) for n, p in actor.module.named_parameters() if not p.requires_grad)
    assert {len(s) for s in actor.optimizer.state.values()} == {3}  # step, exp_avg, exp_avg_sq
    assert sum(p.numel() for group in actor.optimizer.param_groups for p in group["params"]) == \
        counts["trainable_parameters"]


def test_gradient_checkpointing_under_the_adapter_gives_the_adapters_gradients(random_model_dir):
    """The checkpointed layers are the base model's, under peft's wrapper: the adapter's
    gradients are those of the run that keeps the activations."""
    from distflow.engines.common import checkpoints_activations

    grads = {}
    for checkpointing in (False, True):
        actor = Actor(_adapted(random_model_dir), OptimConfig(lr=1e-2), torch.device("cpu"),
                      gradient_checkpointing=checkpointing)
        assert checkpoints_activations(actor.model) is checkpointing
        batch = _batch(actor.module.config.vocab_size)
        actor.model.train()
        log_probs, _ = actor.forward(actor.model, batch, True)
        (log_probs * batch["response_mask"]).sum().backward()
        grads[checkpointing] = {n: p.grad for n, p in actor.module.named_parameters() if p.requires_grad}
    assert grads[False] and grads[False].keys() == grads[True].keys()
    for name, g in grads[False].items():
        assert g.abs().sum() > 0 and torch.allclose(grads[True][name], g, atol=1e-6, rtol=1e-5), name


def test_a_chunked_output_head_under_the_adapter_gives_the_whole_logits_results(random_model_dir):
    """actor.output_head_chunk_tokens with LoRA (all-linear leaves the output head out):
    the adapter's gradients, the actor's log-probs and the adapter-off reference's are
    those of the whole logits."""
    runs = {}
    for chunk in (0, 4):
        actor = Actor(_adapted(random_model_dir), OptimConfig(lr=1e-2), torch.device("cpu"), head_chunk_tokens=chunk)
        batch = _batch(actor.module.config.vocab_size)
        actor.model.train()
        log_probs, _ = actor.forward(actor.model, batch, True)
        (log_probs * batch["response_mask"]).sum().backward()
        runs[chunk] = ({n: p.grad for n, p in actor.module.named_parameters() if p.requires_grad},
                       actor.compute_log_probs(batch, [[0, 1, 2]]),
                       AdapterDisabledReference(actor).compute_log_probs(batch, [[0, 1, 2]]))
    (grads, scored, ref), (grads1, scored1, ref1) = runs[0], runs[4]
    assert grads and grads.keys() == grads1.keys()
    for name, g in grads.items():
        assert g.abs().sum() > 0 and torch.allclose(grads1[name], g, atol=1e-6, rtol=1e-5), name
    torch.testing.assert_close(scored1, scored, rtol=0, atol=1e-5)
    torch.testing.assert_close(ref1, ref, rtol=0, atol=1e-5)
    assert (scored - ref).abs().max() > 1e-3


def _cli(args, cwd):
    return subprocess.run([sys.executable, "-m", "distflow.cli", *args], cwd=cwd, capture_output=True, text=True,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"), timeout=400)


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


LORA = ["actor.lora_rank=8", "actor.lr=1e-3", "actor.lr_scheduler=constant", "actor.lr_warmup_steps=0",
        "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "data.val_max_samples=64",
        "rollout.max_new_tokens=24", "trainer.progress=false", "runtime.launcher=torchrun", "trainer.eval_every=0"]


@pytest.mark.slow
def test_a_lora_run_learns_resumes_exactly_evaluates_and_exports(tmp_path):
    # one 2-worker launch: the run, then trainer.resume=PATH from its step 2 into a new folder
    resume = f"trainer.resume={tmp_path / 'straight' / 'checkpoints' / 'step_2'}"
    runs = distflow_sweep({"straight": ["trainer.save_every=2"], "resumed": [resume]}, 2, tmp_path,
                          [*LORA, "trainer.total_steps=4"])
    straight, resumed = runs["straight"], runs["resumed"]
    summary = json.loads((straight / "summary.json").read_text())
    # measured: 0.156 -> 0.375 in 4 steps (64 held-out prompts, greedy)
    assert summary["heldout_accuracy_final"] >= summary["heldout_accuracy_initial"] + 0.10, summary
    assert summary["trainable_parameters"] < summary["total_parameters"] / 10
    ckpt = straight / "checkpoints" / "step_2"
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    # resumed from step 2: steps 3-4 as the uninterrupted run's
    want, got = _metrics(straight), _metrics(resumed)
    assert [r["step"] for r in got] == list(range(5))
    for a, b in zip(want[3:], got[3:], strict=True):
        for key in ("reward/mean", "response/length_mean", "tokens/total"):
            assert a[key] == b[key], (key, a["step"])
        for key in [k for k in a if k.startswith("actor/")]:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (key, a["step"], a[key], b[key])
    # the final adapter merges into a plain HF folder that evaluates as the run's own held-out number
    final, merged = straight / "checkpoints" / "final", tmp_path / "merged"
    assert _cli(["export", str(final), "--out", str(merged), "--merge"], tmp_path).returncode == 0
    assert (merged / "model.safetensors").is_file() and not (merged / "adapter_config.json").exists()
    out = tmp_path / "eval"
    proc = _cli(["eval", f"model.path={merged}", "data.val_max_samples=64", "rollout.max_new_tokens=24",
                 "runtime.launcher=torchrun", "runtime.num_workers=1", f"trainer.output_dir={out}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "eval.json").read_text())["metrics"]["accuracy"] == summary["heldout_accuracy_final"]


def test_lora_refuses_fsdp2_and_forced_overlap_in_one_line():
    from distflow.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"^actor.lora_rank=8: LoRA trains DDP replicas .*use actor.strategy=auto or ddp$"):
        load_config(None, ["actor.lora_rank=8", "actor.strategy=fsdp2"])
    with pytest.raises(ConfigError, match=r"^actor.lora_rank=8: the reference is the actor with its adapter switched "
                                          r"off, which must not run beside the rollout; use scheduler.overlap=auto or false$"):
        load_config(None, ["actor.lora_rank=8", "scheduler.overlap=true"])


def test_a_target_module_the_model_lacks_is_named_with_the_config_key(random_model_dir):
    model = load_causal_lm(random_model_dir)
    some = LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules="q_proj, v_proj")
    adapted = {n.removesuffix(".lora_A").rsplit(".", 1)[-1] for n, _ in with_lora(model, some).named_modules()
               if n.endswith(".lora_A")}
    assert adapted == {"q_proj", "v_proj"}
    wrong = LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules="q_proj,nonsense_proj")
    with pytest.raises(ValueError, match=r"actor.lora_target_modules='q_proj,nonsense_proj': the model has no "
                                         r"module named nonsense_proj; its linear layers are named .*q_proj"):
        with_lora(load_causal_lm(random_model_dir), wrong)


def test_a_tied_output_head_is_refused_as_a_target(random_model_dir):
    """The tiny Llama ties lm_head to the embedding: an adapter's delta on it would be merged
    into the shared weight (the pushed weights and `export --merge` would change both)."""
    tied = LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules="q_proj,lm_head")
    with pytest.raises(ValueError, match=r"^actor.lora_target_modules='q_proj,lm_head': lm_head shares its weight "
                                         r"with another layer \(tied embeddings\); leave it out$"):
        with_lora(load_causal_lm(random_model_dir), tied)


def test_a_lora_checkpoint_as_model_path_has_its_bases_skeleton_and_a_new_adapter_on_it_is_refused(
        tmp_path, random_model_dir):
    from distflow.cli import check_inputs
    from distflow.config import ConfigError, load_config
    from distflow.engines.common import causal_lm_skeleton

    adapter = tmp_path / "adapter"
    settings = LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules="q_proj")
    with_lora(load_causal_lm(random_model_dir), settings).save_pretrained(adapter)
    assert type(causal_lm_skeleton(str(adapter))) is type(load_causal_lm(random_model_dir))
    check_inputs(load_config(None, [f"model.path={adapter}"]))  # trained whole: its merge
    with pytest.raises(ConfigError, match=r"^model.path='.*adapter': a LoRA checkpoint; a new adapter on it would be "
                                          r"saved against its base without it: merge it first"):
        check_inputs(load_config(None, [f"model.path={adapter}", "actor.lora_rank=4"]))


def test_an_adapter_records_its_base_by_an_absolute_path(tmp_path, monkeypatch, random_model_dir):
    """A run started with a relative model.path: its LoRA checkpoints still merge from any
    folder (export, eval, a cluster's nodes)."""
    import json
    import os
    import shutil

    from distflow.engines.lora import adapter_base

    shutil.copytree(random_model_dir, tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    settings = LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules="q_proj")
    with_lora(load_causal_lm("base"), settings).save_pretrained(tmp_path / "adapter")
    assert adapter_base(tmp_path / "adapter") == str(tmp_path / "base")
    monkeypatch.chdir(os.path.dirname(tmp_path))
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] \
        == str(tmp_path / "base")
    load_causal_lm(str(tmp_path / "adapter"))  # merges from elsewhere


def _auto_strategy_on_a_small_host(rank, world, model_dir):
    """actor.strategy=auto where the model's training state (16 bytes a parameter) does not
    fit a quarter of a worker's share of memory (the host's pages stood in as few)."""
    from distflow.engines.actor import resolve_strategy

    real = os.sysconf
    os.sysconf = lambda name: 64 if name == "SC_PHYS_PAGES" else real(name)
    try:
        whole = resolve_strategy("auto", load_causal_lm(model_dir), torch.device("cpu"))
        adapted = resolve_strategy("auto", with_lora(load_causal_lm(model_dir), SETTINGS), torch.device("cpu"))
    finally:
        os.sysconf = real
    return whole, adapted


def _auto_strategy_where_one_host_is_small(rank, world, model_dir):
    from distflow.engines.actor import resolve_strategy

    real = os.sysconf
    if rank == 1:  # rank 1's host has few pages
        os.sysconf = lambda name: 64 if name == "SC_PHYS_PAGES" else real(name)
    try:
        return resolve_strategy("auto", load_causal_lm(model_dir), torch.device("cpu"))
    finally:
        os.sysconf = real


def test_auto_takes_one_strategy_for_every_rank_by_the_smallest_memory(random_model_dir):
    """Each rank chose by its own memory: ranks on hosts of different sizes wrapped DDP and
    FSDP2, whose collectives do not match (a hang until the collective timeout)."""
    from helpers import run_gloo

    assert run_gloo(_auto_strategy_where_one_host_is_small, 2, random_model_dir) == ["fsdp2", "fsdp2"]


def test_lora_under_auto_is_ddp_where_a_whole_model_would_be_sharded(random_model_dir):
    """auto chose FSDP2 by the frozen base's size too, and LoRA under FSDP2 failed at the
    first weight push (sharded base tensors merged and copied as if whole)."""
    from helpers import run_gloo

    assert run_gloo(_auto_strategy_on_a_small_host, 2, random_model_dir) == [("fsdp2", "ddp")] * 2
