"""Graph validation, ordering, YAML graphs, pictures, and every built-in recipe."""

from __future__ import annotations

import pytest

from distflow.config import ALGORITHMS, load_config
from distflow.dag.graph import Graph, GraphError, Node, load_graph_file
from distflow.dag.recipes import SOURCES, build_graph, build_recipe


def fn(ctx, batch):  # a node callable for graphs that are only validated
    return None


def node(name, role="custom", inputs=(), outputs=(), **kw):
    return Node(name=name, role=role, fn=fn, inputs=inputs, outputs=outputs, **kw)


def test_order_follows_fields_and_layouts():
    g = Graph([node("train", "actor_train", ["adv"]), node("adv", "advantage", ["r"], ["adv"]),
               node("gen", "rollout", ["prompts"], ["resp"]), node("score", "reward", ["resp"], ["r"]),
               node("side", "custom", ["resp"], ["x"])], ["prompts"])
    assert g.order == ["gen", "score", "side", "adv", "train"]  # local first, then groups, then train
    assert g.parents["train"] == ["adv"]
    assert g.ancestors("train") == ["gen", "score", "adv"]


@pytest.mark.parametrize("nodes, message", [
    ([node("a", inputs=["b_out"], outputs=["a_out"]), node("b", inputs=["a_out"], outputs=["b_out"])],
     r"node '(a|b)': is part of a cycle \((a -> b -> a|b -> a -> b)\)"),
    ([node("a", inputs=["nowhere"], outputs=["x"])], "node 'a': input 'nowhere' is produced by no node"),
    ([node("a", outputs=["x"]), node("b", outputs=["x"])], "node 'b': output 'x' is already produced by node 'a'"),
    ([node("a", outputs=["x"]), node("a", outputs=["y"])], "node 'a': defined twice"),
    ([node("a", outputs=["prompts"])], "node 'a': output 'prompts' is an input field of the step"),
    ([node("a", outputs=["x"], deps=["ghost"])], "node 'a': depends on unknown node 'ghost'"),
    ([node("t", "actor_forward", outputs=["lp"]), node("g", "advantage", ["lp"], ["adv"])],
     "node 'g': layout 'groups' cannot follow node 't' in layout 'train'"),
    ([node("gen", "rollout", outputs=["r"]), node("side", inputs=["r"], outputs=["s"]),
      node("f", "filter", ["r"], ["keep"], refill=True)],
     r"node 'side': runs before the refilling filter 'f' without feeding it"),
])
def test_invalid_graphs_name_the_node_and_the_problem(nodes, message):
    with pytest.raises(GraphError, match=message) as info:
        Graph(nodes, ["prompts"])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"role": "magic"}, "node 'n': unknown role 'magic'"),
    ({"layout": "sideways"}, "node 'n': unknown layout 'sideways'"),
    ({"role": "filter", "outputs": ["a", "b"]}, "node 'n': a filter produces exactly one boolean field"),
    ({"role": "actor_train", "stream": True}, "node 'n': a streaming node cannot use collectives"),
    ({"inputs": "prompts"}, "node 'n': inputs must be a list of names"),
    ({"role": "custom", "refill": True}, "node 'n': only a filter can refill"),
])
def test_bad_nodes(kwargs, message):
    with pytest.raises(GraphError, match=message):
        Graph([node("n", **{"outputs": ["x"], **kwargs})], ["prompts"])


def test_unknown_callable_fails_on_resolve_naming_the_node(tmp_path):
    g = Graph([Node(name="n", role="custom", fn="distflow.no_such_module:f", outputs=("x",))], [])
    with pytest.raises(GraphError, match=r"node 'n' fn='distflow.no_such_module:f': cannot import"):
        g.resolve()
    g = Graph([Node(name="n", role="custom", fn="distflow.plugins:missing", outputs=("x",))], [])
    with pytest.raises(GraphError, match="has no function missing"):
        g.resolve()


@pytest.mark.parametrize("name", ALGORITHMS)
def test_every_recipe_is_valid_and_resolves(name):
    cfg = load_config(None, [f"algorithm.name={name}"])
    g = build_recipe(cfg)
    g.resolve()
    assert g.order[0] == "rollout" and "actor_update" in g.order
    assert set(g.sources) == set(SOURCES)
    roles = {n.role for n in g.nodes}
    assert ("critic_train" in roles) == (name == "ppo")
    assert any(n.refill for n in g.nodes) == (name == "dapo")
    assert ("reference" in roles) == cfg.algorithm.use_kl_loss


def test_recipe_defaults_apply_unless_the_user_sets_the_key():
    dapo = load_config(None, ["algorithm.name=dapo"])
    assert dapo.algorithm.clip_ratio_high == 0.28 and not dapo.algorithm.use_kl_loss
    assert load_config(None, ["algorithm.name=dapo", "algorithm.clip_ratio_high=0.3"]).algorithm.clip_ratio_high == 0.3
    assert load_config(None, ["algorithm.name=dr_grpo"]).algorithm.loss_agg_mode == "seq-mean-token-sum-norm"
    assert load_config(None, []).algorithm.loss_agg_mode == "token-mean"


def test_off_policy_adds_old_log_prob():
    cfg = load_config(None, ["actor.ppo_mini_batch_size=8"])
    assert "old_log_prob" in build_recipe(cfg).by_name
    assert "old_log_prob" not in build_recipe(load_config(None, [])).by_name


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
    cfg = load_config(None, [])
    with pytest.raises(GraphError, match=message) as info:
        load_graph_file(path, lambda name: build_recipe(cfg, name))
    assert "\n" not in str(info.value)


def test_pictures_name_every_node():
    g = build_recipe(load_config(None, ["algorithm.name=ppo"]))
    dot, mermaid = g.to_dot("ppo"), g.to_mermaid()
    for name in g.order:
        assert f"  {name} [" in dot and f"  {name}[" in mermaid
    assert "critic_values -> advantage" in dot and "rollout --> reward" in mermaid
    assert "critic_update" in g.describe()


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


def test_dag_show_writes_pictures(tmp_path):
    from distflow.cli import main

    assert main(["dag", "show", "dapo", "--out", str(tmp_path / "d")]) == 0
    assert "dynamic_sampling" in (tmp_path / "d.dot").read_text()
    assert (tmp_path / "d.mmd").read_text().startswith("flowchart LR")
    assert (tmp_path / "d.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["dag", "show", "nope", "--out", str(tmp_path / "e")]) == 2
