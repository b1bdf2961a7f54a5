"""Evaluation: mean@k / pass@k and the slices against hand-computed values, and `distflow eval`
on 1 and 2 workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from distflow.data.batch import Batch
from distflow.data.dataset import PromptRow
from distflow.engines.reward import RewardRunner
from distflow.engines.rollout import left_pad, response_mask_from
from distflow.engines.tiny_model import build_tokenizer
from distflow.trainer.evaluation import EvalSettings, evaluate, table


class ScriptedEngine:
    """A RolloutEngine whose answers are fixed per (prompt, call): greedy answers first,
    then the k sampled answers of each prompt in order."""

    weight_version, tensor_parallel_size = 0, 1

    def __init__(self, tokenizer, greedy: list[str], sampled: list[list[str]]):
        self.tok, self.greedy, self.sampled = tokenizer, greedy, sampled
        self.stop_token_ids = (tokenizer.eos_token_id,)

    def generate(self, prompts, seeds, params):
        texts = self.greedy if params.greedy else [t for row in self.sampled for t in row]
        assert len(texts) == len(prompts) and (seeds is None) == params.greedy
        ids = [self.tok(t, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id] for t in texts]
        width = params.max_new_tokens
        resp = torch.full((len(ids), width), self.tok.pad_token_id, dtype=torch.long)
        for i, r in enumerate(ids):
            resp[i, :min(len(r), width)] = torch.tensor(r[:width])
        p, m = left_pad(prompts, self.tok.pad_token_id)
        return Batch({"prompts": p, "prompt_mask": m, "responses": resp,
                      "response_mask": response_mask_from(resp, [self.tok.eos_token_id])})

    def close(self):
        pass


def _row(i: int, answer: int, level: int, source: str) -> PromptRow:
    return PromptRow(index=i, messages=[{"role": "user", "content": "q"}], ground_truth=str(answer),
                     data_source=source, extra_info={"level": level})


def test_mean_and_pass_at_k_and_slices_by_hand():
    tok = build_tokenizer()
    rows = [_row(0, 4, 1, "a"), _row(1, 45, 1, "a"), _row(2, 450, 2, "b")]
    greedy = ["#### 4", "#### 44", "a long wrong answer that is cut"]  # right, wrong, cut at 16 tokens
    sampled = [["#### 4", "#### 4", "#### 9"],     # 2 of 3 right
               ["#### 1", "#### 2", "#### 3"],     # none
               ["#### 450", "no", "no"]]           # 1 of 3
    runner = RewardRunner(None, 0)
    report = evaluate(ScriptedEngine(tok, greedy, sampled), tok, rows, [[5, 6]] * 3, runner, runner,
                      EvalSettings(max_new_tokens=16, k=3), by_source=True)
    expected = {
        "accuracy": 1 / 3, "accuracy/level_1": 1 / 2, "accuracy/level_2": 0.0,
        "accuracy/data_source/a": 1 / 2, "accuracy/data_source/b": 0.0,
        "mean@3": (2 / 3 + 0 + 1 / 3) / 3, "mean@3/level_1": (2 / 3 + 0) / 2, "mean@3/level_2": 1 / 3,
        "mean@3/data_source/a": 1 / 3, "mean@3/data_source/b": 1 / 3,
        "pass@3": 2 / 3, "pass@3/level_1": 1 / 2, "pass@3/level_2": 1.0,
        "pass@3/data_source/a": 1 / 2, "pass@3/data_source/b": 1.0,
        "response_length/mean": (7 + 8 + 16) / 3, "response_length/max": 16.0,
        "response_length/clip_ratio": 1 / 3, "rows": 3.0,
        # the reward function here is the accuracy's (the default, strict): the same numbers
        "reward": 1 / 3, "reward/level_1": 1 / 2, "reward/level_2": 0.0, "reward/data_source/a": 1 / 2,
        "reward/data_source/b": 0.0,
    }
    assert report == pytest.approx(expected, rel=1e-12)
    lines = table(report, 3).splitlines()
    assert lines[0].split() == ["slice", "greedy", "reward", "mean@3", "pass@3"]
    assert lines[1].split() == ["all", "33.3%", "0.333", "33.3%", "66.7%"]
    assert lines[-1] == "3 prompts; greedy responses: 10.3 tokens on average, at most 16, 33.3% cut at the token limit"


def test_pass_at_k_of_a_structured_ground_truth_is_the_custom_reward_s(tmp_path):
    """A ground truth the default rule reads no answer from (verl's search data keeps
    `{"target": [...]}`): the samples' accuracy is the custom function's full marks, as the
    greedy accuracy is (the default rule failed on every sample: pass@k was 0)."""
    tok = build_tokenizer()
    rows = [PromptRow(index=0, messages=[{"role": "user", "content": "q"}], ground_truth={"target": ["4"]},
                      data_source="search", extra_info={})]
    (tmp_path / "target.py").write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(solution_str.endswith(tuple(ground_truth['target'])))\n")
    report = evaluate(ScriptedEngine(tok, ["#### 4"], [["#### 4", "#### 5"]]), tok, rows, [[5, 6]],
                      RewardRunner(f"{tmp_path / 'target.py'}:score", 0), RewardRunner(None, 0),
                      EvalSettings(max_new_tokens=16, k=2))
    assert (report["accuracy"], report["mean@2"], report["pass@2"]) == (1.0, 0.5, 1.0)


def test_a_reward_functions_acc_is_the_greedy_and_sampled_accuracy_and_its_numbers_are_reported(tmp_path):
    """A function returning verl's DAPO dict: its "acc" is the accuracy of the greedy and the
    sampled responses alike (the rule read these as right: `#### 4` against 4), its other
    numbers are reported (reward_extra/<name>)."""
    tok = build_tokenizer()
    rows = [PromptRow(index=0, messages=[{"role": "user", "content": "q"}], ground_truth="4", data_source="x")]
    (tmp_path / "strict.py").write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    right = solution_str == 'The answer is 4.'\n"
        "    return {'score': float(right), 'acc': right, 'chars': len(solution_str)}\n")
    report = evaluate(ScriptedEngine(tok, ["#### 4"], [["#### 4", "The answer is 4."]]), tok, rows, [[5, 6]],
                      RewardRunner(f"{tmp_path / 'strict.py'}:score", 0), RewardRunner(None, 0),
                      EvalSettings(max_new_tokens=24, k=2))
    assert (report["accuracy"], report["mean@2"], report["pass@2"]) == (0.0, 0.5, 1.0)
    assert (report["reward_extra/acc"], report["reward_extra/chars"]) == (0.0, 6.0)


class EpisodeEngine:
    """Two episodes of a turn, a tool's reply (observation) and a second turn: the first ends its
    last turn with EOS, the second's last turn is cut at the budget."""

    weight_version, tensor_parallel_size = 0, 1

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.stop_token_ids = (tokenizer.eos_token_id,)

    def generate(self, prompts, seeds, params):
        eos, word = self.tok.eos_token_id, self.tok("#### 4", add_special_tokens=False)["input_ids"]
        rows = [word + [eos] + [7, 7] + word + [eos], word + [eos] + [7, 7] + word + word]
        width = max(map(len, rows))
        resp = torch.tensor([r + [self.tok.pad_token_id] * (width - len(r)) for r in rows])
        mask = torch.zeros_like(resp)
        for i, r in enumerate(rows):
            mask[i, :len(r)] = 1
            mask[i, len(word) + 1: len(word) + 3] = 0  # the tool's tokens
        p, m = left_pad(prompts, self.tok.pad_token_id)
        return Batch({"prompts": p, "prompt_mask": m, "responses": resp, "response_mask": mask})


def test_a_multi_turn_episode_is_cut_where_its_last_turn_is():
    """An earlier turn's EOS made every episode count as ended: the clip ratio of a
    multi-turn evaluation read 0 whatever the budget cut."""
    tok = build_tokenizer()
    runner = RewardRunner(None, 0)
    report = evaluate(EpisodeEngine(tok), tok, [_row(0, 4, 1, "a"), _row(1, 4, 1, "a")], [[5, 6]] * 2, runner, runner,
                      EvalSettings(max_new_tokens=32))
    assert report["response_length/clip_ratio"] == 0.5


def test_the_configured_reward_is_reported_beside_accuracy_which_takes_full_marks(tmp_path):
    """A custom reward (a letter answer the rule-based scorer cannot read) is the report's
    `reward`; a code answer passing 1 of 2 tests is not accurate (its reward is 0.5)."""
    tok = build_tokenizer()
    (tmp_path / "letters.py").write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 1.0 if solution_str.strip().endswith(ground_truth) else 0.0\n")
    letters = RewardRunner(f"{tmp_path / 'letters.py'}:score", 0)
    rows = [PromptRow(index=0, messages=[{"role": "user", "content": "q"}], ground_truth="B", data_source="mcq")]
    report = evaluate(ScriptedEngine(tok, ["the answer is B"], []), tok, rows, [[5, 6]], letters,
                      RewardRunner(None, 0), EvalSettings(max_new_tokens=24))
    assert (report["reward"], report["accuracy"]) == (1.0, 0.0)
    cases = json.dumps({"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "11\n"]})
    code = [PromptRow(index=0, messages=[{"role": "user", "content": "q"}], ground_truth=cases,
                      data_source="codecontests")]
    default = RewardRunner(None, 0)
    program = "print(sum(map(int, input().split())))"
    report = evaluate(ScriptedEngine(tok, [program], []), tok, code, [[5, 6]], default, default,
                      EvalSettings(max_new_tokens=64))
    assert (report["reward"], report["accuracy"]) == (0.5, 0.0)


def test_with_rewards_from_the_environment_the_report_s_reward_is_theirs_as_in_training():
    """reward.from_env: the reward of a held-out episode is the sum of its environment's
    rewards, as in training (it was the text reward's); accuracy stays the scorer's."""
    from distflow.engines.agent import EnvStep, EpisodeRunner, EpisodeSettings

    class Pays:
        def reset(self, task):
            self.pay = float(task["extra_info"]["level"])

        def step(self, text):
            return EnvStep([], True, reward=self.pay / 4)

    from helpers import ScriptedEngine as EpisodeScripts

    tok = build_tokenizer()
    rows = [_row(0, 4, 1, "a"), _row(1, 45, 2, "a")]
    engine = EpisodeScripts(tok, {5: ["#### 4"] * 2, 7: ["#### 44"] * 2})  # one answer per evaluation
    episodes = EpisodeRunner(engine, tok, Pays, EpisodeSettings(max_turns=2, max_total_tokens=16,
                                                                step_last_turn=True))
    runner = RewardRunner(None, 0)
    for field, reward in ((None, 0.5), ("env_scores", (0.25 + 0.5) / 2)):
        report = evaluate(engine, tok, rows, [[5, 6], [7, 6]], runner, runner,
                          EvalSettings(max_new_tokens=16, reward_field=field), episodes=episodes)
        assert (report["reward"], report["accuracy"]) == (reward, 0.5)


def test_held_out_episodes_whose_environment_raised_are_reported_and_count_as_wrong():
    """An environment that raises ends its episode: the episode scores as wrong, and the
    report (and its table) says what share failed, so accuracy is not read as the policy's."""
    from distflow.engines.agent import EnvStep, EpisodeRunner, EpisodeSettings
    from helpers import ScriptedEngine as EpisodeScripts

    class DownOnLevel2:
        def reset(self, task):
            if task["extra_info"]["level"] == 2:
                raise ConnectionError("the checker is down")

        def step(self, text):
            return EnvStep([], True)

    tok = build_tokenizer()
    rows = [_row(0, 4, 1, "a"), _row(1, 45, 2, "a")]
    engine = EpisodeScripts(tok, {5: ["#### 4"], 7: ["#### 45"]})
    episodes = EpisodeRunner(engine, tok, DownOnLevel2, EpisodeSettings(max_turns=2, max_total_tokens=16))
    runner = RewardRunner(None, 0)
    report = evaluate(engine, tok, rows, [[5, 6], [7, 6]], runner, runner, EvalSettings(max_new_tokens=16),
                      episodes=episodes)
    assert (report["failed_episodes"], report["accuracy"]) == (0.5, 0.5)
    assert table(report, 0).splitlines()[-1] == ("50.0% of the greedy episodes failed (their environment or agent "
                                                 "raised) and count as wrong")
    plain = evaluate(EpisodeEngine(tok), tok, rows, [[5, 6]] * 2, runner, runner, EvalSettings(max_new_tokens=32))
    assert "failed_episodes" not in plain and "failed" not in table(plain, 0)


def test_an_eval_worker_that_fails_to_build_its_reward_closes_its_engine(tmp_path, monkeypatch):
    """The engine was built before the reward runners, outside the try that closes it: a
    reward that failed to build left it open (vLLM's GPU memory and process)."""
    from distflow.config import load_config
    from distflow.trainer import loop

    closed, make_engine = [], loop.make_rollout_engine

    def engine_that_says_when_closed(*args, **kwargs):
        engine = make_engine(*args, **kwargs)
        close = engine.close
        engine.close = lambda: (closed.append(True), close())
        return engine

    monkeypatch.setattr(loop, "make_rollout_engine", engine_that_says_when_closed)
    monkeypatch.setattr(loop, "make_reward_runners", lambda cfg, device: (_ for _ in ()).throw(MemoryError("judge")))
    cfg = load_config(None, ["data.val_max_samples=2", "runtime.device=cpu"], training=False)
    with pytest.raises(MemoryError, match="judge"):
        loop.run_eval_worker(cfg.to_dict(), str(tmp_path / "eval.json"), 0)
    assert closed == [True]


def test_a_report_of_no_prompts_is_said_and_written_as_valid_json(tmp_path):
    from distflow.trainer.evaluation import write_report

    report = {"accuracy": float("nan"), "rows": 0.0}
    assert table(report, 2) == "no prompts were scored (every held-out row was dropped as bad or too long)"
    write_report(tmp_path / "eval.json", report, {"k": 2})
    assert json.loads((tmp_path / "eval.json").read_text())["metrics"] == {"accuracy": None, "rows": 0.0}


def test_held_out_rows_are_a_fixed_sample_of_every_file_and_minus_one_takes_all(tmp_path):
    """data.val_max_samples rows are a sample of all of data.val_files' rows, drawn with a
    fixed seed (the first 256 of a test set sorted by source, or of the first of two files,
    were all a report saw; an even stride missed 3 of 4 levels of a test set that cycles
    through them); -1 takes every row, as verl's default; 0 is refused in one line."""
    from distflow.config import ConfigError, load_config
    from distflow.data.tasks import arith
    from distflow.trainer.loop import heldout_rows

    files = []
    for name, n in (("gsm.jsonl", 30), ("math.jsonl", 10)):
        rows = [r | {"data_source": name} for r in arith.verl_rows("test", n)]
        (tmp_path / name).write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        files.append(str(tmp_path / name))
    tok = build_tokenizer()
    for limit, chosen in ((8, 8), (-1, 40)):
        cfg = load_config(None, [f"data.val_files={','.join(files)}", f"data.val_max_samples={limit}"])
        halves = [heldout_rows(cfg, tok, None, rank, 2) for rank in range(2)]
        assert [h[1] for h in halves] == [{"rows_chosen": chosen, "rows_in_files": 40, "skipped_rows": 0.0,
                                           "truncated_prompts": 0.0}] * 2
        sources = [row.data_source for half in halves for row, _ in half[0]]
        assert len(sources) == chosen and 0 < sources.count("math.jsonl") < chosen  # rows of both files
    # prompts cut to data.max_prompt_length are counted and the report's table says so (they were silently scored)
    cut = load_config(None, [f"data.val_files={files[0]}", "data.max_prompt_length=8", "data.on_long_prompt=truncate"])
    taken, held = heldout_rows(cut, tok, None, 0, 1)
    assert held["truncated_prompts"] == len(taken) == 30 and held["skipped_rows"] == 0
    report = {"accuracy": 0.5, "reward": 0.5, "rows": 30.0, "response_length/mean": 3.0, "response_length/max": 4.0,
              "response_length/clip_ratio": 0.0, **held}
    assert "30 prompts, 30 prompts truncated to data.max_prompt_length;" in table(report, 0)
    with pytest.raises(ConfigError, match="data.val_max_samples=0: no held-out rows"):
        load_config(None, ["data.val_max_samples=0"])
    cfg = load_config(None, ["data.val_files=builtin:arith-tools:test", "data.val_max_samples=16"])  # levels 1-4 in turn
    assert {row.extra_info["level"] for row, _ in heldout_rows(cfg, tok, None, 0, 1)[0]} == {1, 2, 3, 4}


def _cli(args, cwd, timeout=300):
    return subprocess.run([sys.executable, "-m", "distflow.cli", *args], cwd=cwd, capture_output=True, text=True,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"), timeout=timeout)


def test_eval_refuses_a_negative_k_in_one_line(tmp_path):
    proc = _cli(["eval", "--k", "-1"], tmp_path)
    assert proc.returncode == 2 and proc.stderr == "distflow: error: --k=-1: must be >= 0 (0 = greedy only)\n"


def test_the_torchrun_entry_s_eval_without_an_output_dir_makes_an_eval_folder(tmp_path):
    """`python -m distflow.train --eval-k K` (a documented entry) with no trainer.output_dir
    failed on every rank with Path(None)'s TypeError."""
    from distflow.runtime.process_group import free_port

    proc = subprocess.run([sys.executable, "-m", "distflow.train", "--eval-k", "0", "data.val_max_samples=4",
                           "rollout.max_new_tokens=8"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, HF_HUB_OFFLINE="1", MASTER_PORT=str(free_port())))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (report,) = (tmp_path / "runs").glob("*-eval/eval.json")
    assert json.loads(report.read_text())["metrics"]["rows"] == 4 and f"report: {report.resolve()}" in proc.stdout
    assert json.loads((report.parent / "eval-config.json").read_text())["rollout"]["max_new_tokens"] == 8


@pytest.mark.slow
def test_eval_on_one_and_three_workers_agrees(tmp_path):
    """3 workers do not divide the training batch (16 prompts), which evaluation does not split."""
    common = ["data.val_max_samples=48", "rollout.max_new_tokens=24", "runtime.launcher=torchrun"]
    reports = {}
    for workers in (1, 3):
        out = tmp_path / f"eval{workers}"
        proc = _cli(["eval", "--k", "2", *common, f"runtime.num_workers={workers}", f"trainer.output_dir={out}"],
                    tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.splitlines()[0].split() == ["slice", "greedy", "reward", "mean@2", "pass@2"]
        assert "48 prompts (data.val_max_samples=48 of the 256 rows of data.val_files; -1: all)" in proc.stdout
        reports[workers] = json.loads((out / "eval.json").read_text())
        # the settings the numbers depend on are kept beside them (eval.json names only some)
        assert json.loads((out / "eval-config.json").read_text())["data"]["val_max_samples"] == 48
    assert reports[1]["metrics"] == reports[3]["metrics"]
    metrics = reports[3]["metrics"]
    assert metrics["rows"] == 48 and 0 < metrics["mean@2"] <= metrics["pass@2"]  # mean <= any, per prompt
    # that the training loop's held-out evaluation is this code: test_real_model.py and test_lora.py
    # evaluate a run's final checkpoint to the run's own final held-out number
