"""Graph validation and ordering: the generic engine, on graphs made here."""

from __future__ import annotations

import pytest

from distflow.dag.graph import Graph, GraphError, Node


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
    # chunk by chunk a filter's flags were stored as a field and no row was dropped
    ({"role": "filter", "chunked": True}, r"node 'n': a filter cannot be chunked \(it drops rows"),
    ({"role": "filter", "stream": True}, "node 'n': a filter cannot be stream"),
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
