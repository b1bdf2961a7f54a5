"""Vision-language RL end to end: GRPO on the dot-counting task with the tiny Qwen2-VL.
The pixels go with their samples through rollout, reference and update; 1 and 2 workers
give the same run, a checkpoint resumes exactly, a bad image is a counted, replaced row
under data.on_bad_row=skip, the single-controller baseline relays the pixels, PPO's
critic sees them too, every turn of an episode sees them, LoRA trains the VLM and exports
it merged, and rollout and training apart pass the pixels with each trajectory."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from distflow.data.tasks import dots
from helpers import CHECK_ONCE_ENV, distflow_sweep, distflow_train, run_metrics

pytestmark = pytest.mark.slow

COMMON = ["model.path=builtin:tiny-dots-vl", "data.train_files=builtin:dots:train", "data.val_files=builtin:dots:test",
          "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "algorithm.group_size=4", "algorithm.use_kl_loss=true",
          "algorithm.rollout_correction=token_tis", "data.val_max_samples=12", "trainer.progress=false",
          "trainer.save_final=false",
          "actor.lr_scheduler=constant", "actor.lr_warmup_steps=0", "trainer.total_steps=2"]
LORA = ["actor.lora_rank=8", "actor.lr=1e-3"]  # adapters on every linear layer, the vision tower's too
PPO = ["algorithm.name=ppo"]  # a critic of the VLM's whole body: it sees the pixels too


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("vlm")
    (base / "env.py").write_text(CHECK_ONCE_ENV)
    # room for both answers and the check between them (the tokenizer is char-level)
    turns = ["rollout.max_turns=2", "rollout.max_total_tokens=192",
             "rollout.tools=calculator", f"rollout.env={base / 'env.py'}:CheckOnce",
             f"reward.custom_fn={base / 'env.py'}:by_length"]  # rewards that differ within groups
    rows = [dots.to_verl_row(p, i, "train") for i, p in enumerate(dots.generate("train", 16))]
    rows[5]["images"] = [{"bytes": b"not a picture", "path": None}]
    pq.write_table(pa.Table.from_pylist(rows), base / "with_a_bad_image.parquet")
    bad = [f"data.train_files={base / 'with_a_bad_image.parquet'}", "data.on_bad_row=skip", "trainer.total_steps=1",
           "data.train_batch_size=16", "actor.ppo_mini_batch_size=16", "algorithm.group_size=2", "trainer.eval_every=0"]
    folders = distflow_sweep({"w1": [], "half": ["trainer.total_steps=1", "trainer.save_final=true"], "bad": bad,
                              "lora1": [*LORA, "trainer.save_final=true"], "ppo1": PPO, "turns1": turns},
                             1, base, COMMON)
    resume = f"trainer.resume={folders['half'] / 'checkpoints' / 'final'}"
    return folders | distflow_sweep({"w2": [], "resumed": [resume], "lora2": LORA, "ppo2": PPO, "turns2": turns,
                                     "bf16": ["model.dtype=bfloat16"]}, 2, base, COMMON)


def _same_run(one: list[dict], two: list[dict]) -> None:
    assert one[0]["val/accuracy"] == two[0]["val/accuracy"]  # greedy held-out evaluation on the images
    for a, b in zip(one[1:], two[1:], strict=True):
        for key in ("reward/mean", "response/length_mean", "tokens/total"):
            assert a[key] == b[key], (key, a["step"])
        for key in [k for k in a if k.startswith(("actor/", "critic/"))]:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (key, a["step"], a[key], b[key])
        assert a["actor/grad_norm"] > 0 and a["actor/kl"] >= 0 and a["time/ref_log_prob"] > 0
        # the update scored the responses with the images the rollout generated them from
        assert a["rollout_correction/mismatch_kl"] < 1e-6, a["rollout_correction/mismatch_kl"]


def test_images_train_alike_on_one_and_two_workers(runs):
    _same_run(run_metrics(runs["w1"]), run_metrics(runs["w2"]))


def test_a_bf16_vlm_run_carries_its_pixels_in_half_the_bytes(runs):
    fp32, bf16 = run_metrics(runs["w2"]), run_metrics(runs["bf16"])
    assert [r["step"] for r in bf16] == [0, 1, 2] and all(r["actor/grad_norm"] > 0 for r in bf16[1:])
    for a, b in zip(fp32[1:], bf16[1:]):  # the same images each step; the grids' few bytes stay int64
        assert b["images/batch_bytes"] == pytest.approx(a["images/batch_bytes"] / 2, rel=0.01)


def test_a_vlm_checkpoint_resumes_like_an_uninterrupted_run(runs):
    """Step 1 on 1 worker, checkpointed (weights, tokenizer and image processor), step 2
    resumed from it on 2 workers: equal to the 2-worker run straight."""
    checkpoint = runs["half"] / "checkpoints" / "final"
    assert (checkpoint / "preprocessor_config.json").is_file()
    want, got = run_metrics(runs["w2"]), run_metrics(runs["resumed"])
    assert [r["step"] for r in got] == [0, 1, 2]
    for key in ("reward/mean", "response/length_mean", "tokens/total"):
        assert want[2][key] == got[2][key], key
    for key in [k for k in want[2] if k.startswith("actor/")]:
        assert want[2][key] == pytest.approx(got[2][key], rel=1e-4, abs=1e-6), key


def test_a_bad_image_is_skipped_counted_and_replaced(runs):
    """The step reads all 16 rows of the file, one of them with an undecodable image."""
    step = run_metrics(runs["bad"])[-1]
    assert step["step"] == 1 and step["data/skipped_rows"] == 1
    assert step["tokens/total"] > 0 and step["actor/grad_norm"] > 0  # 16 prompts, one a replacement


def test_the_single_controller_relays_the_pixels_and_gives_the_same_run(runs, tmp_path):
    """runtime.mode=centralized on 2 workers (the baseline of `distflow bench e2e
    --settings vlm`): every stage's data, pixels included, goes through the driver, and
    the run is the 2-worker run's bit for bit."""
    central = tmp_path / "centralized"
    distflow_train([*COMMON, "runtime.mode=centralized", "runtime.num_workers=2", "trainer.save_final=false",
                    f"trainer.output_dir={central}"], tmp_path)
    skip = ("time/", "perf/", "coordinator/")  # timings, and the peer-to-peer transfer counters
    got = run_metrics(central)
    for a, b in zip(run_metrics(runs["w2"]), got, strict=True):
        assert {k: v for k, v in a.items() if not k.startswith(skip)} == \
            {k: v for k, v in b.items() if not k.startswith(skip)}
    pixels = sum(r["images/batch_bytes"] for r in got[1:])  # 16 samples a step, 16 patches each
    assert pixels == 2 * 16 * (16 * 1176 * 4 + 3 * 8)
    driver = json.loads((central / "launcher.json").read_text())
    assert driver["payload_bytes_received"] == 0  # the launcher's own counter: the relay is the driver's
    # the pixels went out to rollout, reference, old log-probs and update: more than 3 passes
    assert driver["driver_payload_bytes_sent"] > 3 * pixels


def test_ppo_trains_a_vlm_and_its_critic_alike_on_one_and_two_workers(runs):
    """The 2-worker critic is a DDP replica: a vision tower that got no gradient (no
    pixels in its forward) would fail the run's first update."""
    one, two = run_metrics(runs["ppo1"]), run_metrics(runs["ppo2"])
    _same_run(one, two)
    assert all(r["critic/grad_norm"] > 0 and r["critic/vf_loss"] > 0 for r in two[1:])


def test_every_turn_of_an_episode_is_generated_with_the_picture(runs):
    """Multi-turn episodes (an environment that asks for a second count): the second turn
    is generated from the picture too, so the update's forward over the whole trajectory,
    pixels and all, gives the rollout's log-probs (`_same_run`: mismatch KL < 1e-6)."""
    one, two = run_metrics(runs["turns1"]), run_metrics(runs["turns2"])
    _same_run(one, two)
    assert all(r["turns/mean"] == 2.0 for r in one[1:])


def test_lora_trains_a_vlm_alike_on_one_and_two_workers_and_exports_it_merged(runs, tmp_path):
    """The reference is the actor with its adapter off, images and all; the checkpoint is
    the adapter with the image processor, and `distflow export --merge` makes a plain
    Qwen2-VL folder that evaluates as the run's own final held-out number."""
    from distflow.trainer.checkpoint import export

    _same_run(run_metrics(runs["lora1"]), run_metrics(runs["lora2"]))
    summary = json.loads((runs["lora1"] / "summary.json").read_text())
    assert summary["trainable_parameters"] < summary["total_parameters"] / 10
    final, merged = runs["lora1"] / "checkpoints" / "final", tmp_path / "merged"
    assert (final / "adapter_model.safetensors").is_file() and (final / "preprocessor_config.json").is_file()
    export(final, merged, merge=True)
    assert {"model.safetensors", "config.json", "preprocessor_config.json"} <= {f.name for f in merged.iterdir()}
    out = tmp_path / "eval"
    distflow_eval = [sys.executable, "-m", "distflow.cli", "eval", f"model.path={merged}",
                     "data.val_files=builtin:dots:test", "data.val_max_samples=12", "runtime.launcher=torchrun",
                     "runtime.num_workers=1", f"trainer.output_dir={out}"]
    proc = subprocess.run(distflow_eval, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "eval.json").read_text())["metrics"]["accuracy"] == summary["heldout_accuracy_final"]


def test_rollout_and_training_apart_carry_the_pixels_with_each_trajectory(tmp_path):
    """runtime.placement=disaggregated: the rollout worker streams each trajectory, its
    pixels included, to the training worker, which scores it with the same images: at
    version lag 0 the rollout-vs-update mismatch is float noise; later steps sample from
    weights one version old."""
    out = tmp_path / "apart"
    distflow_train([*COMMON, "runtime.placement=disaggregated", "runtime.rollout_workers=1",
                    "runtime.train_workers=1", "algorithm.max_staleness=1", "trainer.total_steps=3",
                    "trainer.eval_every=0", f"trainer.output_dir={out}"], tmp_path)
    steps = run_metrics(out)[1:]
    assert [r["async/version_lag_max"] for r in steps] == [0.0, 1.0, 1.0]
    assert steps[0]["rollout_correction/mismatch_kl"] < 1e-6, steps[0]["rollout_correction/mismatch_kl"]
    assert all(r["images/batch_bytes"] == 16 * (16 * 1176 * 4 + 3 * 8) and r["actor/grad_norm"] > 0 for r in steps)
    assert json.loads((out / "launcher.json").read_text())["payload_bytes_received"] == 0
