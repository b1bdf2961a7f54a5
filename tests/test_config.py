import importlib.util
import json
import subprocess
import sys

import pytest

from distflow.config import ConfigError, load_config, traced_steps


def test_defaults_are_valid():
    cfg = load_config()
    assert cfg.algorithm.name == "grpo" and cfg.runtime.num_workers == 2


def test_dotted_overrides_are_typed(tmp_path):
    cfg = load_config(None, ["algorithm.group_size=4", "actor.lr=1e-5", "trainer.save_final=false",
                             "trainer.output_dir=/tmp/x", "rollout.temperature=1"])
    assert cfg.algorithm.group_size == 4
    assert cfg.actor.lr == 1e-5
    assert cfg.trainer.save_final is False
    assert cfg.rollout.temperature == 1.0 and isinstance(cfg.rollout.temperature, float)
    # a text key takes the text as typed: YAML 1.1 read these as an octal, a base-60 number and a float
    text = load_config(None, ["trainer.output_dir=0755", "trainer.experiment_name=12:30", "trainer.project_name=1.10",
                              "reward.custom_fn=null"])
    assert (text.trainer.output_dir, text.trainer.experiment_name, text.trainer.project_name) == ("0755", "12:30", "1.10")
    assert text.reward.custom_fn is None
    # `key=` clears an optional key as null does (it was the text "", refused as a malformed value), and empties a
    # text one (rollout.tools=: no tools)
    (tmp_path / "agent.yaml").write_text("rollout:\n  agent: my_pkg.agents:run\n  tools: calculator\n")
    cleared = load_config(str(tmp_path / "agent.yaml"), ["rollout.agent=", "rollout.tools=", "reward.custom_fn=",
                                                         "algorithm.graph=", "rollout.kv_cache_memory_gb="])
    assert (cleared.rollout.agent, cleared.reward.custom_fn, cleared.algorithm.graph,
            cleared.rollout.kv_cache_memory_gb, cleared.rollout.tools) == (None, None, None, None, "")
    # verl's list syntax for the comma-separated keys
    listed = load_config(None, ["trainer.logger=[jsonl,tensorboard]", "data.val_files=['builtin:arith:test']"])
    assert (listed.trainer.logger, listed.data.val_files) == ("jsonl,tensorboard", "builtin:arith:test")
    # " #" is no comment in a text key's value: YAML cut `runs/exp #2` to `runs/exp`, another run's folder
    hashed = load_config(None, ["trainer.output_dir=runs/exp #2", "trainer.experiment_name=run #1",
                                "trainer.project_name='quoted #3'"])
    assert (hashed.trainer.output_dir, hashed.trainer.experiment_name, hashed.trainer.project_name) == \
        ("runs/exp #2", "run #1", "quoted #3")


def test_yaml_file_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  group_size: 4\ntrainer:\n  total_steps: 7\n")
    cfg = load_config(str(path), ["trainer.total_steps=9"])
    assert cfg.algorithm.group_size == 4 and cfg.trainer.total_steps == 9
    # a text key in a file takes its text as written too, as an override does
    path.write_text("trainer:\n  output_dir: 0755\n  experiment_name: 12:30\n  total_steps: '7'\n"
                    "  logger: [jsonl, tensorboard]\nrollout:\n  temperature: 1\n")
    typed = load_config(str(path))
    assert (typed.trainer.output_dir, typed.trainer.experiment_name, typed.trainer.total_steps) == ("0755", "12:30", 7)
    assert typed.trainer.logger == "jsonl,tensorboard" and typed.rollout.temperature == 1.0
    path.write_text('trainer:\n  output_dir: "runs/exp #2"  # a comment\n')
    assert load_config(str(path)).trainer.output_dir == "runs/exp #2"
    # a section whose keys are all commented out is empty; a file that is not YAML says where, or that it is not text
    path.write_text("algorithm:\n  # name: dapo\ntrainer:\n  total_steps: 7\n")
    assert load_config(str(path)).trainer.total_steps == 7
    path.write_text("trainer:\n  total_steps: 7\n\tseed: 3\n")
    with pytest.raises(ConfigError, match=r"c.yaml: not valid YAML \(.*line 3, column 1\)$"):
        load_config(str(path))
    path.write_bytes(b"\xc2\x00\xff")
    with pytest.raises(ConfigError, match=r"c.yaml: not UTF-8 text"):
        load_config(str(path))


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
    ("runtime.placement=disaggregated runtime.train_workers=3 runtime.rollout_workers=1 data.train_batch_size=8 "
     "actor.ppo_mini_batch_size=8", "data.train_batch_size=8: must be divisible by runtime.train_workers=3"),
    ("actor.lr=nan", "actor.lr=nan: must be a finite number"),
    ("critic.grad_clip=inf", "critic.grad_clip=inf: must be a finite number"),
    ("trainer.trace_steps=2,abc", "trainer.trace_steps='2,abc': 'abc' is not a step"),
    ("trainer.trace_steps=0", "trainer.trace_steps='0': '0' is not a step"),
    ("algorithm.clip_ratio_low=1.0", "algorithm.clip_ratio_low=1.0: must be < 1"),
    ("actor_rollout_ref.rollout.n=8", "'actor_rollout_ref.rollout.n': verl's name; here it is algorithm.group_size"),
    ("data.max_response_length=512", "'data.max_response_length': verl's name; here it is rollout.max_new_tokens"),
    ("reward_model.enable=true", "'reward_model.enable': verl's name; here it is reward.model_path=FOLDER"),
    ("runtime.network=loopback trainer.logger=jsonl,wandb trainer.wandb_mode=online",
     "trainer.wandb_mode=online: W&B sends to its server, which a loopback-only run (runtime.network=loopback) cannot"),
    ("algorithm.kl_ctrl.kl_coef=0.1", "'algorithm.kl_ctrl.kl_coef': verl's name; here it is algorithm.reward_kl_coef"),
    ("algorithm.filter_groups.enable=true", "verl's name; here it is algorithm.dynamic_sampling"),
    ("reward_model.overlong_buffer.len=512", "verl's name; here it is algorithm.overlong_buffer_len"),
    ("rollout.engine=vllm rollout.top_p=0.9 rollout.temperature=0.7", "rollout.top_p=0.9 with rollout.temperature=0.7 "
                                                                      "on vLLM: its log-probs after temperature"),
    # vLLM sampled at 0.01 while the trainer divided by 0.001
    ("rollout.engine=vllm rollout.temperature=0.001", "rollout.temperature=0.001 on vLLM: it samples at 0.01 at least"),
    ("+trainer.total_steps=5", "'+trainer.total_steps': drop the '+'"),
    ("runtime.num_workers=8 rollout.replica_size=4 data.train_batch_size=2 actor.ppo_mini_batch_size=2 "
     "algorithm.group_size=1", "rollout.replica_size=4: a replica's 1 sequences a step"),
    ("data.val_max_samples=0", "data.val_max_samples=0: no held-out rows"),
    ("actor.use_dynamic_bsz=true actor.max_tokens_per_micro_batch=100 data.max_prompt_length=150 "
     "rollout.max_new_tokens=50", "actor.max_tokens_per_micro_batch=100: smaller than the longest sequence a step "
                                  "may hold, 200 tokens"),
])
def test_bad_values_name_key_and_value(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, override.split())
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_a_verl_config_file_s_nested_keys_are_named_as_on_the_command_line(tmp_path):
    """Nested under actor_rollout_ref: as verl's YAML writes them, the key was one unknown
    'actor_rollout_ref' without the hint its dotted form gets."""
    (tmp_path / "verl.yaml").write_text("actor_rollout_ref:\n  rollout:\n    n: 4\n")
    with pytest.raises(ConfigError, match=r"^unknown config key 'actor_rollout_ref.rollout.n': verl's name; here it "
                                          r"is algorithm.group_size$"):
        load_config(str(tmp_path / "verl.yaml"))


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
    ("algorithm.name=dapo runtime.mode=centralized", "filters run in distributed mode only (without them: "
                                                      "algorithm.dynamic_sampling=false)"),
    # the multi-turn run's filter is the failed episodes' (it was called dynamic sampling)
    ("rollout.max_turns=2 rollout.tools=calculator rollout.max_total_tokens=256 runtime.mode=centralized",
     "has the filter node(s) drop_failed_groups; filters run in distributed mode only (without them: "
     "rollout.on_failed_episode=score_zero)"),
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


def test_trace_steps_are_read_as_a_set_of_steps():
    assert traced_steps(load_config(None, ["trainer.trace_steps= 3, 1,3"])) == {1, 3}
    assert traced_steps(load_config(None, [])) == set()


def _parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema([("prompt", pa.string())])), path)
    return path


@pytest.mark.parametrize("override, fragment", [
    ("data.train_files={tmp}/rows.csv", "data.train_files='{tmp}/rows.csv': unknown file type; expected .parquet, .jsonl or .json"),
    ("data.val_files={tmp}/empty.parquet", "data.val_files='{tmp}/empty.parquet': no rows in the dataset"),
    ("data.train_files={tmp}/empty.parquet,{tmp}/empty.parquet", "no rows in the dataset"),
    ("trainer.output_dir={tmp}/rows.csv", "trainer.output_dir='{tmp}/rows.csv': exists and is not a folder"),
    ("reward.custom_fn=no_such_module_here:score", "reward.custom_fn='no_such_module_here:score': cannot import "
                                                   "no_such_module_here (no such module)"),
    ("reward.custom_fn=no_such_package.sub:score", "cannot import no_such_package.sub (no such module)"),
    ("reward.custom_fn={tmp}/missing.py:score", "reward.custom_fn='{tmp}/missing.py:score': no such file"),
    ("trainer.resume={tmp}", "trainer.resume='{tmp}': no complete checkpoint there"),
    ("data.train_files=builtin:arith:tain", "data.train_files: builtin:arith:tain: unknown built-in dataset"),
    ("data.val_files=builtin:arith:test:ten", "data.val_files: builtin:arith:test:ten: unknown built-in dataset"),
    ("data.train_files=", "data.train_files: empty; name the training data"),
    ("data.train_files={tmp}/unreadable.jsonl", "data.train_files='{tmp}/unreadable.jsonl': cannot be read "
                                                "(Input/output error)"),
])
def test_inputs_the_launcher_can_check_fail_before_anything_starts(override, fragment, tmp_path):
    """What `check_inputs` finds from the files' names, footers and folders alone."""
    from distflow.cli import check_inputs

    (tmp_path / "rows.csv").write_text("prompt\nhello\n")
    _parquet(tmp_path / "empty.parquet", [])
    (tmp_path / "unreadable.jsonl").symlink_to("/proc/self/mem")  # a file whose read fails, even for root
    cfg = load_config(None, [override.format(tmp=tmp_path)])
    with pytest.raises(ValueError) as err:
        check_inputs(cfg)
    assert fragment.format(tmp=tmp_path) in str(err.value) and "\n" not in str(err.value)


def test_what_the_launcher_checks_passes_where_the_inputs_are_there(tmp_path):
    from distflow.cli import check_inputs

    (tmp_path / "score.py").write_text("raise SystemExit('imported by the launcher')\n")  # found, never run
    one = _parquet(tmp_path / "one.parquet", [{"prompt": "hi"}])
    check_inputs(load_config(None, [f"data.train_files={_parquet(tmp_path / 'empty.parquet', [])},{one}",
                                    f"data.val_files={one}",
                                    f"reward.custom_fn={tmp_path}/score.py:score",
                                    f"trainer.output_dir={tmp_path}/new", "trainer.resume=off"]))
    check_inputs(load_config(None, ["reward.custom_fn=json:loads"]))


def test_episodes_and_agents_need_a_tokenizer_with_a_chat_template(tmp_path):
    """Each turn's observation is rendered by the chat template: without one every episode
    that called a tool failed (a base model's tokenizer), so it is refused before the start."""
    import shutil

    from distflow.cli import check_inputs
    from distflow.engines.common import resolve_model_path

    plain = tmp_path / "plain"
    shutil.copytree(resolve_model_path("builtin:tiny-arith-tools"), plain)
    (plain / "chat_template.jinja").unlink()
    check_inputs(load_config(None, [f"model.path={plain}"]))  # one turn: its prompt is the messages joined
    for overrides in (["rollout.max_turns=2", "rollout.tools=calculator"], ["rollout.agent=json:loads"]):
        with pytest.raises(ConfigError, match=r"^model.path='.*plain': its tokenizer has no chat template, which "
                                              r"multi-turn episodes"):
            check_inputs(load_config(None, [f"model.path={plain}", *overrides]))
    check_inputs(load_config(None, ["model.path=builtin:tiny-arith-tools", "rollout.max_turns=2", "rollout.tools=calculator"]))


def test_held_out_files_default_to_the_builtin_tasks_test_split_and_own_data_needs_its_own(tmp_path):
    """An empty data.val_files is the test split of the built-in task being trained on;
    with your own training files it is one line before anything starts (the held-out
    accuracy was measured on the built-in arithmetic test set, whatever the run trained on).
    A JSON-lines file of no rows is one line too, as an empty parquet file is."""
    from distflow.cli import check_inputs

    assert load_config(None, []).data.val_files == "builtin:arith:test"
    assert load_config(None, ["data.train_files=builtin:dots:train"]).data.val_files == "builtin:dots:test"
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"prompt": "hi", "reward_model": {"ground_truth": "1"}}) + "\n")
    with pytest.raises(ConfigError, match=r"^data.val_files: not set, and data.train_files='.*one.jsonl' is not a "
                                          r"built-in task: name held-out files"):
        check_inputs(load_config(None, [f"data.train_files={one}"]))
    check_inputs(load_config(None, [f"data.train_files={one}", f"data.val_files={one}"]))
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    (tmp_path / "empty.json").write_text(" [ ]\n")
    for name in ("blank.jsonl", "empty.json"):
        with pytest.raises(ConfigError, match=rf"data.val_files='.*{name}': no rows in the dataset"):
            check_inputs(load_config(None, [f"data.val_files={tmp_path / name}"]))


def test_an_agent_s_prompts_are_not_truncated():
    """The agent's endpoint renders each row's messages whole and asks the first request to
    match the row's prompt tokens: a truncated prompt failed every such episode (and cut the
    template's head, the tools' schemas with it)."""
    pytest.importorskip("openai")  # rollout.agent needs it, and says so first
    with pytest.raises(ConfigError, match=r"^data.on_long_prompt=truncate: rollout.agent='json:loads' .* use skip or "
                                          r"error$"):
        load_config(None, ["rollout.agent=json:loads", "data.on_long_prompt=truncate"])
    load_config(None, ["rollout.agent=json:loads", "data.on_long_prompt=skip"])


def test_a_relaunch_with_other_settings_keeps_the_earlier_config_and_names_what_changed(tmp_path, capsys):
    from distflow.cli import changed_settings, record_config

    first = load_config(None, ["trainer.total_steps=5", "algorithm.group_size=8"])
    second = load_config(None, ["trainer.total_steps=9", "algorithm.group_size=4", "actor.lr=3e-6"])
    record_config(tmp_path, first)
    record_config(tmp_path, first)  # the same settings again (a resume): nothing to keep
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"] and capsys.readouterr().err == ""
    record_config(tmp_path, second)
    assert capsys.readouterr().err == (
        "distflow: this folder's earlier launch had other settings (kept as config-1.json): "
        f"actor.lr {first.actor.lr} -> 3e-06; algorithm.group_size 8 -> 4; trainer.total_steps 5 -> 9\n")
    record_config(tmp_path, first)
    assert changed_settings({"a": {str(k): k for k in range(10)}}, {"a": {}}, shown=2) == ["a.0 0 -> -", "a.1 1 -> -",
                                                                                         "and 8 more"]
    steps = {p.name: json.loads(p.read_text())["trainer"]["total_steps"] for p in tmp_path.iterdir()}
    assert steps == {"config-1.json": 5, "config-2.json": 9, "config.json": 5}


def test_a_recorded_config_reused_for_another_algorithm_takes_that_algorithm_s_settings(tmp_path):
    """A run's config.json holds every value, its recipe's among them: reused with
    algorithm.name=dapo it trained GRPO's settings (KL loss on, no dynamic sampling, no
    clip-higher) under DAPO's name. The file's own choices stay. Its run folder (the launch
    records it) and resume setting are that run's: the DAPO run went on in the GRPO run's
    folder, resuming its final checkpoint."""
    from distflow.cli import record_config

    recorded = load_config(None, ["trainer.total_steps=7", "actor.lr=3e-6", "algorithm.kl_coef=0.01",
                                  "trainer.resume=auto"])
    recorded.trainer.output_dir = str(tmp_path)  # as `distflow train` records it in its run folder
    record_config(tmp_path, recorded)
    reused = load_config(str(tmp_path / "config.json"), ["algorithm.name=dapo", "algorithm.clip_ratio_high=0.3"])
    fresh = load_config(None, ["algorithm.name=dapo", "algorithm.clip_ratio_high=0.3", "trainer.total_steps=7",
                               "actor.lr=3e-6", "algorithm.kl_coef=0.01"])
    assert reused.to_dict() == fresh.to_dict()
    assert reused.algorithm.dynamic_sampling and not reused.algorithm.use_kl_loss
    assert reused.trainer.output_dir is None
    # a hand-written file's folder is the user's choice, whatever the algorithm
    (tmp_path / "exp.yaml").write_text("algorithm:\n  name: grpo\ntrainer:\n  output_dir: /shared/exp1\n")
    assert load_config(str(tmp_path / "exp.yaml"), ["algorithm.name=dapo"]).trainer.output_dir == "/shared/exp1"
    # the same algorithm again: the file as it is (the same run, relaunched); and a choice that is another recipe's value stays a choice
    assert load_config(str(tmp_path / "config.json")).to_dict() == json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "mine.yaml").write_text("algorithm:\n  name: grpo\n  use_kl_loss: false\n")
    assert not load_config(str(tmp_path / "mine.yaml"), ["algorithm.name=ppo"]).algorithm.use_kl_loss
    # a file that names no algorithm holds the user's choices, whatever algorithm.name says
    (tmp_path / "kl.yaml").write_text("algorithm:\n  use_kl_loss: true\n")
    assert load_config(str(tmp_path / "kl.yaml"), ["algorithm.name=dapo"]).algorithm.use_kl_loss


def test_make_data_refuses_a_count_below_one_and_makes_the_output_folder(tmp_path):
    bad = subprocess.run([sys.executable, "-m", "distflow.cli", "make-data", "--num", "0", "--out", "x.parquet"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert bad.returncode == 2 and "argument --num: '0': must be an integer >= 1" in bad.stderr
    assert not (tmp_path / "x.parquet").exists()
    good = subprocess.run([sys.executable, "-m", "distflow.cli", "make-data", "--num", "3", "--out", "a/b/x.parquet"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert good.returncode == 0, good.stderr
    from distflow.data.dataset import load_rows

    assert len(load_rows(str(tmp_path / "a/b/x.parquet"))) == 3


def test_several_reward_functions_take_one_weight_each():
    from distflow.config import reward_fn_specs, reward_fn_weights

    two = load_config(None, ["reward.custom_fn=r.py:fmt, my_pkg.rewards:acc", "reward.custom_fn_weights=0.5,2"])
    assert reward_fn_specs(two) == ["r.py:fmt", "my_pkg.rewards:acc"] and reward_fn_weights(two) == [0.5, 2.0]
    assert reward_fn_weights(load_config(None, ["reward.custom_fn=r.py:fmt,r.py:acc"])) == [1.0, 1.0]
    assert reward_fn_specs(load_config()) == [] and reward_fn_weights(load_config()) == []
    for weights in ("1", "1,x", "1,inf"):
        with pytest.raises(ConfigError, match=rf"^reward.custom_fn_weights='{weights}': expected 2 finite number"):
            load_config(None, ["reward.custom_fn=r.py:fmt,r.py:acc", f"reward.custom_fn_weights={weights}"])
    with pytest.raises(ConfigError, match=r"^reward.custom_fn='r.py:fmt,acc': expected module:function or "
                                          r"path.py:function, comma-separated \('acc' is neither\)"):
        load_config(None, ["reward.custom_fn=r.py:fmt,acc"])


def test_reward_fn_kwargs_are_a_mapping_for_the_custom_function_alone(tmp_path):
    from distflow.config import from_dict, reward_fn_kwargs

    one = load_config(None, ["reward.custom_fn=r.py:score", "reward.custom_fn_kwargs.strict=true",
                             "reward.custom_fn_kwargs.bonus=0.5"])
    path = tmp_path / "c.yaml"
    path.write_text("reward:\n  custom_fn: r.py:score\n  custom_fn_kwargs:\n    strict: true\n    bonus: 0.5\n")
    assert reward_fn_kwargs(from_dict(one.to_dict())) == reward_fn_kwargs(load_config(str(path))) == \
        {"strict": True, "bonus": 0.5}
    # a nested value stays nested (a judge's settings), read as YAML reads it; a date as its text, as JSON holds it
    path.write_text("reward:\n  custom_fn: r.py:score\n  custom_fn_kwargs:\n    judge: {model: gpt, temperature: 0}\n"
                    "    since: 2024-01-01\n")
    nested = {"judge": {"model": "gpt", "temperature": 0}, "since": "2024-01-01"}
    assert reward_fn_kwargs(load_config(str(path))) == nested
    assert reward_fn_kwargs(load_config(None, ["reward.custom_fn=r.py:score",
                                               "reward.custom_fn_kwargs={judge: {model: gpt, temperature: 0}, "
                                               "since: 2024-01-01}"])) == nested
    with pytest.raises(ConfigError, match="^reward.custom_fn_kwargs: arguments to reward.custom_fn, which is not set"):
        load_config(None, ["reward.custom_fn_kwargs.strict=true"])
    with pytest.raises(ConfigError, match="^reward.custom_fn_kwargs: ground_truth is set by DistFlow"):
        load_config(None, ["reward.custom_fn=r.py:score", "reward.custom_fn_kwargs={ground_truth: 7}"])
    with pytest.raises(ConfigError, match="verl's name; here it is reward.custom_fn_kwargs$"):
        load_config(None, ["custom_reward_function.reward_kwargs.strict=true"])


def test_chat_template_kwargs_are_a_mapping_set_whole_or_one_name_at_a_time(tmp_path):
    from distflow.config import chat_template_kwargs, from_dict

    assert chat_template_kwargs(load_config()) == {}
    whole = load_config(None, ["data.chat_template_kwargs={enable_thinking: false}"])
    one = load_config(None, ["data.chat_template_kwargs.enable_thinking=false", "data.chat_template_kwargs.n=3"])
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  chat_template_kwargs:\n    enable_thinking: false\n")  # a YAML file's nested mapping
    assert chat_template_kwargs(whole) == chat_template_kwargs(load_config(str(path))) == {"enable_thinking": False}
    assert chat_template_kwargs(from_dict(one.to_dict())) == {"enable_thinking": False, "n": 3}  # the workers'
    with pytest.raises(ConfigError, match=r"^data.chat_template_kwargs='\[1\]': expected a mapping"):
        load_config(None, ["data.chat_template_kwargs=[1]"])
    with pytest.raises(ConfigError, match="add_generation_prompt is set by DistFlow"):
        load_config(None, ["data.chat_template_kwargs.add_generation_prompt=false"])
    # verl's names say what DistFlow's are
    with pytest.raises(ConfigError, match="verl's name; here it is data.chat_template_kwargs$"):
        load_config(None, ["data.apply_chat_template_kwargs.enable_thinking=False"])
    with pytest.raises(ConfigError, match="verl's name; here it is data.on_long_prompt=skip"):
        load_config(None, ["data.filter_overlong_prompts=true"])
