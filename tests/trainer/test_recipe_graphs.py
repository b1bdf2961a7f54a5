"""Every built-in recipe as a graph, YAML graphs on top of a recipe, pictures, and
the CLI's checks before anything starts."""

from __future__ import annotations

import pytest

from distflow.config import ALGORITHMS, load_config
from distflow.dag.graph import GraphError
from distflow.trainer.recipes import SOURCES, build_graph, recipe_graph


@pytest.mark.parametrize("name", ALGORITHMS)
def test_every_recipe_is_valid_and_resolves(name):
    cfg = load_config(None, [f"algorithm.name={name}"])
    g = recipe_graph(cfg)
    g.resolve()
    assert g.order[0] == "rollout" and "actor_update" in g.order
    assert set(g.sources) == set(SOURCES)
    roles = {n.role for n in g.nodes}
    assert ("critic_train" in roles) == (name == "ppo")
    assert any(n.refill for n in g.nodes) == (name == "dapo")
    assert ("reference" in roles) == (cfg.algorithm.use_kl_loss or cfg.algorithm.use_kl_in_reward)


def test_episodes_drop_groups_with_a_failed_episode_before_anything_else_uses_them():
    """rollout.on_failed_episode=drop_group (the default with episodes): a filter on the
    environment's (or an agent's) failures that DAPO's refilling filter follows, so its
    refill rounds drop failed groups too; later nodes wait for it. score_zero: no filter."""
    tools = ["rollout.max_turns=2", "rollout.tools=calculator"]
    dapo = recipe_graph(load_config(None, [*tools, "algorithm.name=dapo"]))
    node = dapo.by_name["drop_failed_groups"]
    assert node.role == "filter" and node.inputs == ("env_failed", "group") and not node.refill
    assert "drop_failed_groups" in dapo.ancestors("dynamic_sampling")
    grpo = recipe_graph(load_config(None, tools))
    assert all("drop_failed_groups" in grpo.ancestors(n) for n in ("ref_log_prob", "advantage", "actor_update"))
    agent = recipe_graph(load_config(None, ["rollout.agent=examples/agents/arith_agent.py:run"]))
    assert agent.by_name["drop_failed_groups"].inputs == ("agent_failed", "group")
    scored = recipe_graph(load_config(None, [*tools, "rollout.on_failed_episode=score_zero"]))
    assert "drop_failed_groups" not in scored.by_name
    assert "drop_failed_groups" not in recipe_graph(load_config(None, [])).by_name


def test_recipe_defaults_apply_unless_the_user_sets_the_key():
    dapo = load_config(None, ["algorithm.name=dapo"])
    assert dapo.algorithm.clip_ratio_high == 0.28 and not dapo.algorithm.use_kl_loss
    assert load_config(None, ["algorithm.name=dapo", "algorithm.clip_ratio_high=0.3"]).algorithm.clip_ratio_high == 0.3
    assert load_config(None, ["algorithm.name=dr_grpo"]).algorithm.loss_agg_mode == "seq-mean-token-sum-norm"
    assert load_config(None, []).algorithm.loss_agg_mode == "token-mean"


def test_off_policy_adds_old_log_prob():
    cfg = load_config(None, ["actor.ppo_mini_batch_size=8"])
    assert "old_log_prob" in recipe_graph(cfg).by_name
    assert "old_log_prob" not in recipe_graph(load_config(None, [])).by_name


def test_yaml_graph_adds_replaces_and_removes(tmp_path):
    path = tmp_path / "graph.yaml"
    path.write_text("""
base: grpo
remove: [ref_log_prob]
nodes:
  - name: short_only
    role: filter
    fn: distflow.plugins:load_callable
    inputs: [response_mask]
    outputs: [short]
""")
    with pytest.raises(GraphError, match="node 'actor_update': input 'ref_log_probs' is produced by no node"):
        build_graph(load_config(None, [f"algorithm.graph={path}"]))
    path.write_text(path.read_text().replace("remove: [ref_log_prob]", "remove: [advantage]") + """
  - name: advantage
    role: advantage
    fn: distflow.trainer.nodes:advantage
    inputs: [scores, response_mask, group]
    outputs: [advantages]
    params: {estimator: rloo, reward_field: scores}
""")
    g = build_graph(load_config(None, [f"algorithm.graph={path}"]))
    assert "short_only" in g.by_name and g.by_name["advantage"].params["estimator"] == "rloo"
    assert g.order.index("short_only") < g.order.index("actor_update")


@pytest.mark.parametrize("text, message", [
    ("nodes: [{name: a, role: custom, fn: 'x:y', outputs: [o], colour: red}]", r"node 'a' in .*unknown key\(s\) \['colour'\]"),
    ("nodes: [{name: a, role: custom, outputs: [o]}]", "node 'a' in .*: missing 'fn'"),
    ("base: grpo\nremove: [nope]", r"remove names unknown node\(s\) \['nope'\]"),
    ("nodes: {a: 1}", "expected a mapping with a 'nodes' list"),
    ("stages: []", r"unknown key\(s\) \['stages'\]"),
    ("nodes: [\n", "graph file .*ScannerError|graph file .*ParserError"),
])
def test_bad_yaml_graphs(tmp_path, text, message):
    path = tmp_path / "g.yaml"
    path.write_text(text)
    with pytest.raises(GraphError, match=message) as info:
        build_graph(load_config(None, [f"algorithm.graph={path}"]))
    assert "\n" not in str(info.value)


def test_a_graph_on_another_recipe_than_the_run_s_is_refused(tmp_path):
    """`base: dapo` under algorithm.name=grpo made dapo's nodes read grpo's settings (an
    overlong node with no buffer, a KL loss with no reference): it failed in the first step."""
    path = tmp_path / "g.yaml"
    path.write_text("base: dapo\nnodes: []\n")
    with pytest.raises(GraphError, match=r"its base recipe 'dapo' is not algorithm.name='grpo', whose settings the "
                                         r"run has; set algorithm.name=dapo"):
        build_graph(load_config(None, [f"algorithm.graph={path}"]))
    assert "dynamic_sampling" in build_graph(load_config(None, [f"algorithm.graph={path}", "algorithm.name=dapo"])).by_name


def test_pictures_name_every_node():
    g = recipe_graph(load_config(None, ["algorithm.name=ppo"]))
    dot, mermaid = g.to_dot("ppo"), g.to_mermaid()
    for name in g.order:
        assert f'  "{name}" [' in dot and f"  n_{name}[" in mermaid
    assert '"critic_values" -> "advantage"' in dot and "n_rollout --> n_reward" in mermaid
    assert '"source:prompts" -> "rollout"' in dot and "source --> n_rollout" in mermaid
    assert "critic_update" in g.describe()


def test_pictures_take_nodes_named_as_the_languages_keywords_or_as_the_source():
    """`node`, `graph` are DOT's keywords, `end` Mermaid's, `prompts` the source's label:
    written bare they broke the pictures (dot failed) or merged with the source."""
    from distflow.dag.graph import Graph, Node

    def f(ctx, batch):
        return batch

    g = Graph([Node(name="node", role="custom", fn=f, inputs=("x",), outputs=("a",)),
               Node(name="end", role="custom", fn=f, inputs=("a",), outputs=("b",)),
               Node(name="prompts", role="custom", fn=f, inputs=("b",), outputs=("c",))], sources=("x",))
    dot, mermaid = g.to_dot(), g.to_mermaid()
    assert '"source:prompts" -> "node"' in dot and '"node" -> "end"' in dot and '"end" -> "prompts"' in dot
    assert "source --> n_node" in mermaid and "n_node --> n_end" in mermaid and "n_end --> n_prompts" in mermaid


@pytest.mark.parametrize("graph_text, fragment", [
    ("base: grpo\nnodes:\n  - {name: x, role: custom, fn: 'nodes.py:f', inputs: [nothing], outputs: [y]}",
     "node 'x': input 'nothing' is produced by no node"),
    ("base: grpo\nnodes:\n  - {name: x, role: custom, fn: 'missing.py:f', outputs: [y]}",
     "node 'x' fn="),
])
def test_cli_rejects_a_bad_graph_before_anything_starts(tmp_path, graph_text, fragment):
    import subprocess
    import sys

    (tmp_path / "g.yaml").write_text(graph_text)
    proc = subprocess.run([sys.executable, "-m", "distflow.cli", "train", f"algorithm.graph={tmp_path / 'g.yaml'}"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and lines[0].startswith("distflow: error:"), lines
    assert not (tmp_path / "runs").exists(), "no run folder, no worker, no model"


def test_dag_show_writes_pictures_and_the_settings_the_run_would_have(tmp_path, capsys):
    from distflow.cli import main

    assert main(["dag", "show", "dapo", "algorithm.clip_ratio_high=0.3", "--out", str(tmp_path / "d")]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert "  algorithm.clip_ratio_high = 0.3  (the recipe's: 0.28)" in printed  # it printed the recipe's 0.28
    assert "  algorithm.dynamic_sampling = True" in printed
    assert "dynamic_sampling" in (tmp_path / "d.dot").read_text()
    assert (tmp_path / "d.mmd").read_text().startswith("flowchart LR")
    assert (tmp_path / "d.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["dag", "show", "nope", "--out", str(tmp_path / "e")]) == 2
    (tmp_path / "file").write_text("")
    capsys.readouterr()
    assert main(["dag", "show", "grpo", "--out", str(tmp_path / "file" / "g")]) == 2  # a traceback before
    assert capsys.readouterr().err.startswith(f"distflow: error: --out {tmp_path / 'file' / 'g'}: ")


def test_a_new_recipe_is_data_alone(tmp_path):
    path = tmp_path / "rloo_sum.yaml"
    path.write_text("description: RLOO with a summed loss and a straight-through KL\n"
                    "algorithm: {estimator: rloo, loss_agg_mode: token-sum, kl_type: k3+, clip_ratio_high: 0.3}\n")
    cfg = load_config(None, [f"algorithm.name={path}", "algorithm.clip_ratio_high=0.25"])
    assert (cfg.algorithm.estimator, cfg.algorithm.loss_agg_mode, cfg.algorithm.kl_type) == ("rloo", "token-sum", "k3+")
    assert cfg.algorithm.clip_ratio_high == 0.25  # the user's value wins over the recipe's
    g = build_graph(cfg)
    assert g.by_name["advantage"].params["estimator"] == "rloo" and "ref_log_prob" in g.by_name


def test_the_worked_example_recipe_names_an_estimator_file_beside_it():
    cfg = load_config(None, ["algorithm.name=examples/new_estimator/recipe.yaml"])
    assert cfg.algorithm.estimator.endswith("examples/new_estimator/estimator.py:sign_baseline")
    g = build_graph(cfg)
    g.resolve()
    from distflow.algos.estimators import estimator_info

    assert estimator_info("sign_baseline").needs == ()  # registered when the file was loaded, once
    build_graph(cfg)  # loading it again does not register it twice


@pytest.mark.parametrize("text, fragment", [
    ("algorithm: {estimator: grpo, colour: red}", "rec.yaml: unknown config key 'algorithm.colour'"),
    ("algorithm: {loss_agg_mode: token-max}", "rec.yaml: algorithm.loss_agg_mode='token-max': allowed values"),
    ("trainer: {total_steps: many}", "rec.yaml: trainer.total_steps='many': expected int"),
    ("algorithm: {name: grpo}", "rec.yaml: a recipe cannot set algorithm.name"),
    ("stages: []", r"rec.yaml: unknown key(s) ['stages']"),
])
def test_a_bad_recipe_file_is_one_line_naming_the_file(tmp_path, text, fragment):
    from distflow.config import ConfigError

    (tmp_path / "rec.yaml").write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"algorithm.name={tmp_path / 'rec.yaml'}"])
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_an_unknown_estimator_or_policy_loss_is_one_line():
    with pytest.raises(GraphError, match=r"^algorithm.estimator='nope': Unknown advantage estimator 'nope'; allowed"):
        build_graph(load_config(None, ["algorithm.estimator=nope"]))
    with pytest.raises(GraphError, match=r"^algorithm.policy_loss='cispo': Unknown policy loss"):
        build_graph(load_config(None, ["algorithm.policy_loss=cispo"]))
    with pytest.raises(GraphError, match=r"^algorithm.reward_kl_type='k4': unknown KL estimator 'k4'; registered: "
                                         r"k1, k2, abs, k3, low_var_kl \(each also as name\+"):
        build_graph(load_config(None, ["algorithm.reward_kl_type=k4"]))


def test_a_kl_estimator_of_one_s_own_is_chosen_by_its_file_or_module(tmp_path):
    """docs/ALGORITHMS.md names the KL estimators a registry chosen by algorithm.kl_type:
    the config allowed only the eight built-in names, and `+` only for three of them."""
    import torch

    from distflow.trainer.nodes import resolve_kl

    (tmp_path / "my_kl.py").write_text("def quartic(log_probs, ref_log_probs):\n"
                                       "    return (log_probs - ref_log_probs) ** 4\n")
    spec = f"{tmp_path / 'my_kl.py'}:quartic"
    build_graph(load_config(None, [f"algorithm.kl_type={spec}+", f"algorithm.reward_kl_type={spec}"]))
    logp, ref = torch.tensor([[0.5, -1.0]], requires_grad=True), torch.tensor([[0.0, 0.0]])
    torch.testing.assert_close(resolve_kl(spec)(logp, ref), torch.tensor([[0.0625, 1.0]]), check_dtype=False)
    value = resolve_kl(spec + "+")(logp, ref)
    value.sum().backward()
    torch.testing.assert_close(value.detach(), torch.tensor([[0.0625, 1.0]]))
    torch.testing.assert_close(logp.grad, logp.detach() - ref)  # k2's gradient
    with pytest.raises(GraphError, match=r"^algorithm.kl_type='.*my_kl.py:nothing': "):
        build_graph(load_config(None, [f"algorithm.kl_type={tmp_path / 'my_kl.py'}:nothing"]))


def test_a_group_of_one_is_refused_only_where_it_gives_no_signal():
    # RLOO's baseline is the mean of the prompt's other responses: with none, every advantage is 0
    with pytest.raises(GraphError, match=r"^algorithm.group_size=1: the 'rloo' estimator needs at least 2 "):
        build_graph(load_config(None, ["algorithm.name=rloo", "algorithm.group_size=1"]))
    # GRPO's group of one standardises with mean 0 and std 1 (verl's rule): the raw reward, a signal
    for name in ("grpo", "reinforce_plus_plus", "ppo", "remax"):
        build_graph(load_config(None, [f"algorithm.name={name}", "algorithm.group_size=1"]))
    build_graph(load_config(None, ["algorithm.name=rloo", "algorithm.group_size=2"]))


def test_tensor_parallelism_is_vllm_only_and_makes_the_replica():
    from distflow.config import ConfigError

    with pytest.raises(ConfigError, match=r"^rollout.tensor_parallel_size=2: the HF engine splits no tensors"):
        load_config(None, ["rollout.tensor_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"^rollout.replica_size=4: a vLLM engine of rollout.tensor_parallel_size=2"):
        load_config(None, ["rollout.engine=vllm", "rollout.tensor_parallel_size=2", "rollout.replica_size=4",
                           "runtime.num_workers=4"])
    cfg = load_config(None, ["rollout.engine=vllm", "rollout.tensor_parallel_size=2"])
    assert cfg.rollout.replica_size == 2 and cfg.algorithm.rollout_correction == "token_tis"
    assert load_config(None, []).algorithm.rollout_correction == "off"  # the HF engine samples the trainer's forward
    assert load_config(None, ["rollout.engine=vllm", "algorithm.rollout_correction=off"]
                       ).algorithm.rollout_correction == "off"
    # the update's old policy being the engine's own (old_log_probs_from=rollout), auto has nothing to correct
    assert load_config(None, ["rollout.engine=vllm", "algorithm.old_log_probs_from=rollout"]
                       ).algorithm.rollout_correction == "off"


def test_kl_in_reward_and_remax_add_their_nodes():
    g = build_graph(load_config(None, ["algorithm.name=remax"]))
    for episodes in (["rollout.max_turns=3", "rollout.tools=calculator"], ["rollout.agent=json:loads"]):
        with pytest.raises(GraphError, match="its greedy baseline is a single-turn response"):
            build_graph(load_config(None, ["algorithm.name=remax", *episodes]))
    assert g.order.index("greedy_baseline") < g.order.index("advantage")
    assert g.by_name["advantage"].inputs == ("token_rewards", "response_mask", "group", "baseline_scores")
    assert g.by_name["kl_in_reward"].collective and "ref_log_probs" not in g.by_name["actor_update"].inputs
    grpo = build_graph(load_config(None, ["algorithm.use_kl_in_reward=true", "algorithm.use_kl_loss=false"]))
    assert {"kl_in_reward", "ref_log_prob"} <= set(grpo.by_name)
    # the penalty uses the rollout engine's own log-probs, returned while it generated (the recomputed old ones come
    # from a forward in the train layout, after the penalty's groups layout)
    assert grpo.parents["kl_in_reward"] == ["ref_log_prob", "reward", "rollout"]
    ppo = build_graph(load_config(None, ["algorithm.name=ppo", "algorithm.use_kl_in_reward=true", "actor.ppo_epochs=2"]))
    assert "rollout_log_probs" in ppo.by_name["kl_in_reward"].inputs and ppo.by_name["old_log_prob"].layout == "train"


def test_readme_and_docs_carry_the_generated_recipe_table():
    from pathlib import Path

    from distflow.trainer.recipes import recipe_table

    root = Path(__file__).resolve().parents[2]
    table = recipe_table()
    for doc in ("README.md", "docs/ALGORITHMS.md"):
        assert table in (root / doc).read_text(), f"{doc}: regenerate with `distflow dag recipes`"


def test_rollout_correction_feeds_the_engines_log_probs_to_the_update():
    assert "rollout_log_probs" not in build_graph(load_config(None, [])).by_name["actor_update"].inputs
    g = build_graph(load_config(None, ["algorithm.rollout_correction=token_tis"]))
    assert "rollout_log_probs" in g.by_name["actor_update"].inputs and g.producer["rollout_log_probs"] == "rollout"
