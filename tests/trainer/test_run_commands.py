"""`distflow runs` and `distflow plot` on run folders as a run leaves them."""

from __future__ import annotations

import json
import os
import time

import pytest

from distflow.cli import main
from distflow.trainer.metrics import progress_postfix


def _run(folder, rewards, vals, finished=True, algorithm="grpo"):
    folder.mkdir(parents=True)
    records = [{"step": 0, "val/accuracy": vals[0]}]
    records += [{"step": i + 1, "reward/mean": r} for i, r in enumerate(rewards)]
    records[-1]["val/accuracy"] = vals[-1]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "config.json").write_text(json.dumps({"algorithm": {"name": algorithm}}))
    if finished:
        (folder / "summary.json").write_text(json.dumps(
            {"algorithm": algorithm, "steps": len(rewards), "heldout_accuracy_initial": vals[0],
             "heldout_accuracy_final": vals[-1], "reward_last": rewards[-1], "wall_seconds": 83.8}))


def test_runs_lists_finished_and_unfinished_runs_newest_first(tmp_path, capsys):
    _run(tmp_path / "a-grpo", [0.25, 0.45], [0.238, 0.52])
    time.sleep(0.01)
    _run(tmp_path / "b-ppo", [0.125], [0.1, 0.3], finished=False, algorithm="ppo")
    now = time.time()
    os.utime(tmp_path / "a-grpo" / "metrics.jsonl", (now - 100, now - 100))
    assert main(["runs", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["run", "algorithm", "steps", "status", "held-out", "reward", "wall"]
    assert lines[1].split() == ["b-ppo", "ppo", "1", "unfinished", "10.0%", "->", "30.0%", "0.125", "-"]
    assert lines[2].split() == ["a-grpo", "grpo", "2", "done", "23.8%", "->", "52.0%", "0.450", "84", "s"]


def test_runs_and_plot_refuse_what_is_not_a_run_in_one_line(tmp_path, capsys):
    assert main(["runs", str(tmp_path)]) == 2
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"distflow: error: {tmp_path}: no run folders (folders with a metrics.jsonl)",
                   f"distflow: error: {tmp_path}: not a run folder (no metrics.jsonl)"]
    assert not (tmp_path / "x.png").exists()


def test_plot_overlays_runs_in_one_png(tmp_path):
    _run(tmp_path / "one", [0.2, 0.3, 0.4], [0.2, 0.5])
    _run(tmp_path / "two", [0.1, 0.1, 0.2], [0.2, 0.3])
    out = tmp_path / "both.png"
    assert main(["plot", str(tmp_path / "one"), str(tmp_path / "two"), "--out", str(out)]) == 0
    from PIL import Image

    with Image.open(out) as image:
        assert image.size == (700, 700)
        colours = {image.getpixel((x, y))[:3] for x in range(0, 700, 3) for y in range(0, 700, 3)}
    # matplotlib's first two cycle colours: one line per run
    assert (31, 119, 180) in colours and (255, 127, 14) in colours


def test_plot_to_a_format_or_folder_it_cannot_write_is_one_line(tmp_path, capsys):
    _run(tmp_path / "one", [0.2, 0.3], [0.2])
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["plot", str(tmp_path / "one"), "--out", str(tmp_path / "x.xyz")]) == 2  # a traceback before
    assert main(["plot", str(tmp_path / "one"), "--out", str(blocker / "x.png")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith(f"distflow: error: --out {tmp_path / 'x.xyz'}: Format 'xyz' is not")
    assert err[1].startswith(f"distflow: error: --out {blocker / 'x.png'}: ")


def test_progress_shows_reward_heldout_and_tokens_per_second():
    assert progress_postfix({"reward/mean": 0.4219, "perf/tokens_per_second": 6298.9}, 0.52) == \
        {"reward": "0.422", "heldout": "0.520", "tok_s": "6,299"}
    assert progress_postfix({"reward/mean": 0.1, "perf/tokens_per_second": 10.0}, None)["heldout"] == "-"
    assert progress_postfix({"reward/mean": 0.1}, 0.5) == {"reward": "0.100", "heldout": "0.500"}


def test_a_sweep_of_runs_sharing_a_folder_or_continuing_after_a_disaggregated_run_is_refused(tmp_path, capsys):
    from distflow import train

    def sweep(runs):
        (tmp_path / "runs.json").write_text(json.dumps(runs))
        assert train.main(["--runs", str(tmp_path / "runs.json")]) == 2
        return capsys.readouterr().err.strip()

    shared = f"trainer.output_dir={tmp_path / 'x'}"
    assert sweep([[shared], ["algorithm.name=rloo", shared]]) == (
        f"distflow: error: --runs: 2 runs have trainer.output_dir={tmp_path / 'x'}; give each its own (or none: "
        "each then gets a new folder)")
    disaggregated = ["runtime.placement=disaggregated", "runtime.train_workers=1", "runtime.rollout_workers=1"]
    assert sweep([disaggregated, []]) == ("distflow: error: --runs: runtime.placement=disaggregated leaves the "
                                          "workers in its role groups; put that run last or give it a launch of its own")


def test_runs_started_in_the_same_second_get_their_own_folders_and_a_relaunch_forgets_old_stages(
        tmp_path, monkeypatch):
    from distflow.cli import new_run_dir
    from distflow.config import load_config

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "strftime", lambda fmt: "20261206-223000")  # the same second for all three
    cfg = load_config(None, [])
    folders = [new_run_dir(cfg) for _ in range(3)]
    assert [f.name for f in folders] == ["20261206-223000-grpo", "20261206-223000-grpo-2", "20261206-223000-grpo-3"]
    # `distflow eval`'s too (two started at once shared one folder; now held, the second would be refused)
    assert [new_run_dir(cfg, kind="eval").name for _ in range(2)] == ["20261206-223000-eval", "20261206-223000-eval-2"]
    (folders[0] / "status").mkdir()
    (folders[0] / "status" / "rank-0.json").write_text('{"rank": 0, "step": 37, "stage": "actor_update"}')
    assert new_run_dir(load_config(None, [f"trainer.output_dir={folders[0]}"])) == folders[0]
    assert not (folders[0] / "status").exists()  # a failure of this launch names its own stages


def test_a_second_launch_into_a_run_folder_that_one_holds_is_refused_in_one_line(tmp_path, capsys):
    """A scheduler's retry while the first launch still runs would write the same
    checkpoints and metrics: the folder is held (flock) by the launch that runs in it."""
    import subprocess
    import sys

    from distflow import cli

    folder = tmp_path / "run"
    folder.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom pathlib import Path\n"
                               "from distflow.cli import hold_run_folder\nhold_run_folder(Path(sys.argv[1]))\n"
                               "print('held', flush=True)\ntime.sleep(60)", str(folder)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        refusal = (f"distflow: error: trainer.output_dir={folder}: another launch (pid {holder.pid}) is running "
                   "in this folder; wait for it to end, or choose another folder")
        assert cli.main(["train", "runtime.network=host", f"trainer.output_dir={folder}"]) == 2
        assert capsys.readouterr().err.strip() == refusal
        from distflow.runtime.process_group import free_port

        worker = subprocess.run([sys.executable, "-m", "distflow.train", f"trainer.output_dir={folder}"],
                                capture_output=True, text=True, timeout=120,
                                env=dict(os.environ, MASTER_PORT=str(free_port())))
        assert worker.returncode == 2 and worker.stderr.strip() == refusal  # torchrun's workers (one here) alike
        assert not (folder / "config.json").exists()
    finally:
        holder.kill()
        holder.wait(10)
    cli.hold_run_folder(folder)  # free once its launch ended; held again by the same process: nothing to do
    cli.hold_run_folder(folder)
    assert (folder / ".lock").read_text().strip() == str(os.getpid())


def test_an_error_of_ray_itself_is_one_line_with_its_traceback_kept(tmp_path, monkeypatch, capsys):
    """A cluster of another Ray version, a head node lost mid-run: Ray's exception came out
    as a traceback of the launcher's."""
    from distflow import cli
    from distflow.config import load_config
    from distflow.runtime import ray_launcher

    def lost_head(*args, **kwargs):
        raise ConnectionError("Could not read 'session_name' from GCS\n(more of Ray's text)")

    monkeypatch.setattr(ray_launcher, "launch_ray", lost_head)
    assert cli._launch(load_config(None, []), tmp_path, cli.WORKER_ENTRY, (), None, None) == 1
    assert capsys.readouterr().err.strip() == (
        "distflow: error: the launch failed: ConnectionError: Could not read 'session_name' from GCS (traceback: "
        f"{tmp_path / 'launcher-traceback.txt'})")
    assert "lost_head" in (tmp_path / "launcher-traceback.txt").read_text()


def test_launch_settings_that_need_the_host_are_not_refused_or_isolated(monkeypatch):
    from distflow import cli
    from distflow.config import load_config

    # launched from a head node without a GPU: the cluster's nodes have them
    cli.check_inputs(load_config(None, ["runtime.device=cuda", "runtime.ray_address=198.18.0.1:6379"]))

    def isolate(argv):
        raise AssertionError("the run would have no network to reach W&B's server")

    monkeypatch.setattr(cli.netns, "run_in_loopback_namespace", isolate)
    monkeypatch.delenv(cli.netns.ENV, raising=False)
    online = load_config(None, ["trainer.logger=jsonl,wandb", "trainer.wandb_mode=online"])
    assert cli._loopback_rerun(online, ["train"]) is None


def test_a_cluster_launch_names_local_files_by_absolute_paths(tmp_path, monkeypatch):
    """The workers on a cluster's nodes do not run in the launcher's folder."""
    from distflow.cli import with_absolute_paths
    from distflow.config import load_config

    monkeypatch.chdir(tmp_path)
    for name in ("train.jsonl", "reward.py", "env.py", "graph.yaml", "est.py", "kl.py"):
        (tmp_path / name).write_text("")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "model" / "model.safetensors").write_text("")
    cfg = load_config(None, ["data.train_files=train.jsonl,builtin:arith:train", "data.val_files=builtin:arith:test",
                             "model.path=model",
                             "reward.custom_fn=reward.py:score,my_pkg.rewards:fmt", "rollout.env=env.py:Game",
                             "rollout.max_turns=2", "algorithm.graph=graph.yaml", "algorithm.estimator=est.py:fn",
                             "algorithm.kl_type=kl.py:mine+", "algorithm.reward_kl_type=kl.py:mine"])
    with_absolute_paths(cfg)
    assert cfg.data.train_files == f"{tmp_path / 'train.jsonl'},builtin:arith:train"
    assert cfg.data.val_files == "builtin:arith:test" and cfg.model.path == str(tmp_path / "model")
    assert cfg.reward.custom_fn == f"{tmp_path / 'reward.py'}:score,my_pkg.rewards:fmt"  # each of several
    assert cfg.rollout.env == f"{tmp_path / 'env.py'}:Game" and cfg.algorithm.graph == str(tmp_path / "graph.yaml")
    assert cfg.algorithm.estimator == f"{tmp_path / 'est.py'}:fn"
    assert (cfg.algorithm.kl_type, cfg.algorithm.reward_kl_type) == (f"{tmp_path / 'kl.py'}:mine+",
                                                                     f"{tmp_path / 'kl.py'}:mine")
    agent = load_config(None, ["rollout.agent=my_pkg.agents:run"])  # a module: no path to make absolute
    with_absolute_paths(agent)
    assert agent.rollout.agent == "my_pkg.agents:run" and agent.algorithm.estimator == "grpo"
    # a recipe file's graph is beside the recipe, as its file.py:function values are
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "mine.yaml").write_text("algorithm:\n  graph: g.yaml\n")
    (tmp_path / "recipes" / "g.yaml").write_text("nodes: []\n")
    mine = load_config(None, ["algorithm.name=recipes/mine.yaml"])
    assert mine.algorithm.graph == str(tmp_path / "recipes" / "g.yaml")
    # an OpenEnv environment's file too (the prefix was taken into the path)
    (tmp_path / "recipes" / "env.yaml").write_text("rollout:\n  env: openenv:my_env.py:MyEnv\n  max_turns: 2\n")
    (tmp_path / "recipes" / "my_env.py").write_text("")
    from distflow.config import load_recipe

    assert dict(load_recipe("recipes/env.yaml").settings)["rollout.env"] == \
        f"openenv:{tmp_path / 'recipes' / 'my_env.py'}:MyEnv"


def test_the_commands_around_a_run_take_what_users_give_them(tmp_path, monkeypatch, capsys):
    """A metrics file cut mid-line, two runs of the same name plotted together, a plot into
    a new folder, make-data to a file that is not parquet, export of a run folder or onto
    a file, and eval with a training file that is not there (eval does not read it)."""
    from distflow import cli
    from distflow.config import load_config

    monkeypatch.chdir(tmp_path)
    for sweep in ("a", "b"):
        run = tmp_path / "sweep" / sweep / "seed0"
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text('{"step": 0, "val/accuracy": 0.2}\n{"step": 1, "reward/mean": 0.5}\n'
                                           '{"step": 2, "rew')  # killed mid-write
    assert main(["runs", str(tmp_path / "sweep" / "a")]) == 0
    assert "seed0" in capsys.readouterr().out
    from distflow.trainer import report

    drawn, overlay = [], report.write_overlay
    monkeypatch.setattr(report, "write_overlay", lambda runs, path: (drawn.append(list(runs)), overlay(runs, path)))
    assert main(["plot", "sweep/a/seed0", "sweep/b/seed0", "--out", "plots/both.png"]) == 0
    assert drawn == [["sweep/a/seed0", "sweep/b/seed0"]]  # both runs, by their paths (the same last name)
    assert (tmp_path / "plots" / "both.png").stat().st_size > 0
    assert main(["make-data", "--num", "2", "--out", "d.jsonl"]) == 2
    assert "--out='d.jsonl': name the .parquet file to write" in capsys.readouterr().err
    (tmp_path / "sweep" / "a" / "seed0" / "checkpoints").mkdir()
    (tmp_path / "file").write_text("")
    assert main(["export", "sweep/a/seed0", "--out", "x"]) == 2
    assert "a run folder; export one of its checkpoints, e.g. sweep/a/seed0/checkpoints/final" in capsys.readouterr().err
    assert main(["export", "sweep/a/seed0/checkpoints", "--out", "x"]) == 2  # no config.json and weights
    cli.check_inputs(load_config(None, ["data.train_files=/nowhere/train.parquet", "data.val_files=builtin:arith:test"]),
                     training=False)


def test_the_plots_show_every_series_and_a_reward_outside_0_to_1(tmp_path, monkeypatch):
    """reward.png pinned its axis to [0, 1] (a DAPO-shaped, reward-model or custom reward
    left it, cut off), drew the first five held-out levels and `distflow plot` the first 40
    runs."""
    import matplotlib.pyplot as plt

    from distflow.trainer import report

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (figures.append(fig), close(fig)))
    history = [{"step": s, "reward/mean": -0.8 + 0.1 * s, **{f"val/accuracy/level_{k}": 0.1 * k for k in range(7)}}
               for s in range(1, 6)]
    report.write_plot(history, tmp_path / "reward.png")
    top = figures[-1].axes[0]
    assert top.get_ylim()[0] <= -0.7 and top.get_ylim()[1] >= 1.0
    assert sum("held-out, level_" in (line.get_label() or "") for line in top.get_lines()) == 7
    report.write_overlay({f"run{i}": history for i in range(45)}, tmp_path / "runs.png")
    assert len(figures[-1].axes[0].get_lines()) == 45


def test_overrides_may_come_after_the_options(monkeypatch, capsys):
    """`distflow train trainer.seed=3 --config c.yaml trainer.total_steps=7` (Hydra's and
    verl's users put overrides anywhere): argparse refused the ones after an option."""
    from distflow import cli

    seen = []
    monkeypatch.setattr(cli, "cmd_train", lambda args: seen.append((args.config, args.overrides)) or 0)
    monkeypatch.setattr(cli, "cmd_eval", lambda args: seen.append((args.k, args.overrides)) or 0)
    assert cli.main(["train", "trainer.seed=3", "--config", "c.yaml", "trainer.total_steps=7"]) == 0
    assert cli.main(["eval", "model.path=m", "--k", "4", "data.val_files=v.parquet"]) == 0
    assert seen == [("c.yaml", ["trainer.seed=3", "trainer.total_steps=7"]), (4, ["model.path=m", "data.val_files=v.parquet"])]
    with pytest.raises(SystemExit):
        cli.main(["train", "--config", "c.yaml", "--colour"])
    assert "unrecognized arguments: --colour" in capsys.readouterr().err


def test_the_torchrun_entry_checks_what_distflow_train_checks(tmp_path):
    """`torchrun -m distflow.train` (the README's equivalent launch) skipped the launcher's
    checks: a misspelled dataset failed inside the workers."""
    import subprocess
    import sys

    from helpers import free_port

    env = dict(os.environ, HF_HUB_OFFLINE="1", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, "-m", "distflow.train", "data.train_files=builtin:arith:tain"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == ("distflow: error: data.train_files: builtin:arith:tain: unknown "
                                                    "built-in dataset; use builtin:TASK:train or builtin:TASK:test "
                                                    "(optionally :ROWS) with TASK one of arith, arith-tools, dots")
    # its runs were on the host network whatever runtime.network said (only `distflow train` makes the namespace)
    env["MASTER_PORT"] = str(free_port())
    proc = subprocess.run([sys.executable, "-m", "distflow.train", "runtime.network=loopback"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(
        "distflow: error: runtime.network=loopback: torchrun's own entry runs on the host network")
