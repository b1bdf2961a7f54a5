import importlib.util
import subprocess
import sys

import pytest

from distflow.config import ConfigError, load_config


def test_defaults_are_valid():
    cfg = load_config()
    assert cfg.algorithm.name == "grpo" and cfg.runtime.num_workers == 2


def test_dotted_overrides_are_typed():
    cfg = load_config(None, ["algorithm.group_size=4", "actor.lr=1e-5", "trainer.save_final=false",
                             "trainer.output_dir=/tmp/x", "rollout.temperature=1"])
    assert cfg.algorithm.group_size == 4
    assert cfg.actor.lr == 1e-5
    assert cfg.trainer.save_final is False
    assert cfg.rollout.temperature == 1.0 and isinstance(cfg.rollout.temperature, float)


def test_yaml_file_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  group_size: 4\ntrainer:\n  total_steps: 7\n")
    cfg = load_config(str(path), ["trainer.total_steps=9"])
    assert cfg.algorithm.group_size == 4 and cfg.trainer.total_steps == 9


@pytest.mark.parametrize("override, fragment", [
    ("algorithm.nope=1", "unknown config key 'algorithm.nope'"),
    ("nope=1", "unknown config key 'nope'"),
    ("trainer.total_steps=-3", "trainer.total_steps=-3: must be >= 1"),
    ("trainer.total_steps=abc", "trainer.total_steps='abc': expected int"),
    ("algorithm.name=sac", "algorithm.name='sac': allowed values are"),
    ("rollout.top_p=1.5", "rollout.top_p=1.5: must be <= 1.0"),
    ("trainer.save_final=3", "trainer.save_final=3: expected bool"),
    ("model.path=/does/not/exist", "model.path='/does/not/exist': not a local HuggingFace model folder"),
    ("data.train_batch_size=15", "data.train_batch_size=15: must be divisible by the number of rollout replicas"),
    ("rollout.replica_size=3", "rollout.replica_size=3: must divide runtime.num_workers=2"),
    ("actor.ppo_mini_batch_size=5", "actor.ppo_mini_batch_size=5: must divide"),
    ("runtime.mode=central", "runtime.mode='central': allowed values are"),
    ("runtime.ray_address=1.2.3.4:6379 runtime.launcher=torchrun", "needs runtime.launcher=ray"),
    ("algorithm.name=dapo algorithm.group_size=1", "algorithm.group_size=1: dynamic sampling keeps only groups "
                                                   "whose rewards differ"),
])
def test_bad_values_name_key_and_value(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, override.split())
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_a_model_folder_with_only_pickled_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ConfigError, match="no .safetensors weights there"):
        load_config(None, [f"model.path={tmp_path}"])


def test_a_data_file_that_is_not_parquet_is_one_line_before_anything_starts(tmp_path):
    bad = tmp_path / "train.parquet"
    bad.write_text("this is not parquet")
    proc = subprocess.run([sys.executable, "-m", "distflow.cli", "train", f"data.train_files={bad}"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"data.train_files: {bad}: not a readable parquet file" in lines[0]
    assert not (tmp_path / "runs").exists()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="checks the answer without vLLM")
def test_the_vllm_engine_without_vllm_is_one_line_before_anything_starts(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "distflow.cli", "train", "rollout.engine=vllm"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("distflow: error: rollout.engine=vllm: vLLM is not importable in this Python")
    assert not (tmp_path / "runs").exists()


def test_yaml_unknown_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  total_stepz: 3\n")
    with pytest.raises(ConfigError, match="unknown config key 'trainer.total_stepz'"):
        load_config(str(path))


@pytest.mark.parametrize("override, fragment", [
    ("algorithm.nope=1", "algorithm.nope"),
    ("trainer.total_steps=-3", "trainer.total_steps=-3"),
    ("model.path=/does/not/exist", "/does/not/exist"),
    ("data.train_files=/no/such.parquet", "/no/such.parquet"),
    ("algorithm.name=dapo runtime.mode=centralized", "filters run in distributed mode only"),
    ("algorithm.name=rloo algorithm.group_size=1", "the 'rloo' estimator needs at least 2 responses per prompt"),
])
def test_cli_bad_input_is_one_line_and_exit_2(override, fragment, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "distflow.cli", "train", *override.split()],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and lines[0].startswith("distflow: error:")
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists(), "a rejected config must not create a run folder"


def test_example_config_loads_and_matches_defaults():
    from pathlib import Path

    path = Path(__file__).parent.parent / "examples" / "grpo_tiny.yaml"
    assert load_config(str(path)).to_dict() == load_config().to_dict()


def test_off_is_a_word_for_a_text_key():
    """YAML 1.1 reads `off` as false; a text key (rollout_correction=off) gets the word back."""
    assert load_config(None, ["algorithm.rollout_correction=off"]).algorithm.rollout_correction == "off"
    with pytest.raises(ConfigError, match=r"^algorithm.rollout_correction='on': allowed values are auto, off"):
        load_config(None, ["algorithm.rollout_correction=on"])
