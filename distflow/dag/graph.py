"""An RL algorithm as a graph of nodes over the step's per-sample fields.

A node reads declared input fields of the worker's local store and produces declared
output fields (every field has exactly one producer). Edges follow from the fields, plus
optional explicit `deps` for pure ordering. The graph is validated before any model
loads; every problem is a `GraphError` whose message is one line naming the node.

    Node("reward", "reward", my_nodes.reward,
         inputs=["responses", "response_mask", "ground_truth"], outputs=["rewards"])

A node's callable is `fn(ctx, batch) -> Batch`: `batch` holds exactly its inputs for the
samples on this worker, the result exactly its outputs for the same samples. A
streaming node (`stream=True`) returns an iterator of `(rows, Batch)` chunks instead, and
chunk-capable consumers (`chunked=True`) run on each chunk as it arrives. A node
without outputs (an update) returns None. A `filter` node returns one boolean field; the scheduler keeps only the rows where it is true.

Where a node runs, as its `layout`:
  local   on whatever samples this worker holds (rule rewards, a replicated reference)
  groups  needs every response of a prompt on one worker (group advantages, group filters)
  train   the balanced data-parallel training layout (FSDP forwards and updates)
Layouts only move forward (local -> groups -> train), so a `groups` node may not depend
on a `train` node. `collective=True` nodes use process-group collectives: every worker
runs them in the same order on its main thread; all others may run concurrently.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import yaml

from distflow.coordinator.layout import LAYOUT_ORDER, LAYOUTS
from distflow.plugins import PluginError, load_callable

ROLES = ("rollout", "reward", "reference", "actor_forward", "critic_forward", "advantage",
         "actor_train", "critic_train", "filter", "custom")
# defaults by role: (layout, collective, chunked)
_ROLE_DEFAULTS = {
    "rollout": ("local", False, False),
    "reward": ("local", False, True),
    "reference": ("local", False, True),
    "actor_forward": ("train", True, False),
    "critic_forward": ("train", True, False),
    "advantage": ("groups", False, False),
    "actor_train": ("train", True, False),
    "critic_train": ("train", True, False),
    "filter": ("groups", False, False),
    "custom": ("local", False, False),
}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


_DOT_SOURCE = '"source:prompts"'  # the prompts' pseudo-node: a colon, so no node's name


def _dot_id(name: str | None) -> str:
    """A node's id in DOT, quoted; None: the prompts' pseudo-node."""
    return _DOT_SOURCE if name is None else f'"{name}"'


class GraphError(ValueError):
    """An invalid graph; the message is one line naming the node and the problem."""


@dataclass(kw_only=True)
class Node:
    name: str
    role: str
    fn: Callable | str
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    deps: tuple[str, ...] = ()  # extra ordering: run after these nodes
    layout: str | None = None  # None -> the role's default
    collective: bool | None = None
    chunked: bool | None = None  # may consume a streaming producer's chunks
    stream: bool = False  # fn yields (rows, Batch) chunks
    refill: bool = False  # a filter that re-runs its ancestors on new prompts until the batch is full
    params: dict[str, Any] = field(default_factory=dict)  # passed to fn as ctx.params

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise GraphError(f"node name {self.name!r} must be an identifier")
        if self.role not in ROLES:
            raise GraphError(f"node '{self.name}': unknown role {self.role!r} (roles: {', '.join(ROLES)})")
        layout, collective, chunked = _ROLE_DEFAULTS[self.role]
        self.layout = layout if self.layout is None else self.layout
        self.collective = collective if self.collective is None else bool(self.collective)
        self.chunked = chunked if self.chunked is None else bool(self.chunked)
        if self.layout not in LAYOUTS:
            raise GraphError(f"node '{self.name}': unknown layout {self.layout!r} (layouts: {', '.join(LAYOUTS)})")
        for key in ("inputs", "outputs", "deps"):
            value = getattr(self, key)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise GraphError(f"node '{self.name}': {key} must be a list of names, got {value!r}")
            setattr(self, key, tuple(value))
        if self.role == "filter" and len(self.outputs) != 1:
            raise GraphError(f"node '{self.name}': a filter produces exactly one boolean field")
        if self.role == "filter" and (self.stream or self.chunked):  # it drops rows of the whole batch
            raise GraphError(f"node '{self.name}': a filter cannot be {'stream' if self.stream else 'chunked'} "
                             "(it drops rows from the whole batch)")
        if self.refill:  # it counts kept groups over all workers
            self.collective = True
        if self.stream and self.collective:
            raise GraphError(f"node '{self.name}': a streaming node cannot use collectives")

    def resolve(self) -> Callable:
        if callable(self.fn):
            return self.fn
        try:
            return load_callable(self.fn, f"node '{self.name}' fn")
        except PluginError as e:
            raise GraphError(str(e)) from None


class Graph:
    """Validated nodes in a deterministic execution order (the same on every worker)."""

    def __init__(self, nodes: Iterable[Node], sources: Iterable[str] = ()):
        self.nodes = list(nodes)
        self.sources = tuple(sources)  # fields present before the first node (the prompts)
        self.by_name: dict[str, Node] = {}
        for node in self.nodes:
            if node.name in self.by_name:
                raise GraphError(f"node '{node.name}': defined twice")
            self.by_name[node.name] = node
        self.producer: dict[str, str] = {}
        for node in self.nodes:
            for out in node.outputs:
                if out in self.sources:
                    raise GraphError(f"node '{node.name}': output '{out}' is an input field of the step")
                if out in self.producer:
                    raise GraphError(f"node '{node.name}': output '{out}' is already produced by "
                                     f"node '{self.producer[out]}'")
                self.producer[out] = node.name
        for node in self.nodes:
            for name in node.inputs:
                if name not in self.producer and name not in self.sources:
                    raise GraphError(f"node '{node.name}': input '{name}' is produced by no node")
            for dep in node.deps:
                if dep not in self.by_name:
                    raise GraphError(f"node '{node.name}': depends on unknown node '{dep}'")
        self.parents = {n.name: sorted({self.producer[i] for i in n.inputs if i in self.producer} | set(n.deps))
                        for n in self.nodes}
        self.order = self._order()
        for node in self.nodes:
            for parent in self.ancestors(node.name):
                if LAYOUT_ORDER[self.by_name[parent].layout] > LAYOUT_ORDER[node.layout]:
                    raise GraphError(f"node '{node.name}': layout '{node.layout}' cannot follow node "
                                     f"'{parent}' in layout '{self.by_name[parent].layout}' "
                                     "(layouts only move local -> groups -> train)")
            if node.refill and node.role != "filter":
                raise GraphError(f"node '{node.name}': only a filter can refill")
            if node.refill:  # a refill re-runs exactly the nodes before it on new prompts
                ancestors = self.ancestors(node.name)
                stray = [n for n in self.order[:self.order.index(node.name)] if n not in ancestors]
                if stray:
                    raise GraphError(f"node '{stray[0]}': runs before the refilling filter '{node.name}' "
                                     f"without feeding it; add deps: [{node.name}] to it")

    def _order(self) -> list[str]:
        """Topological order; among ready nodes the earliest layout first, then the
        order of definition, so that reshards happen once and every worker agrees."""
        position = {n.name: i for i, n in enumerate(self.nodes)}
        done: list[str] = []
        remaining = dict(self.parents)
        while remaining:
            ready = [n for n, ps in remaining.items() if all(p in done for p in ps)]
            if not ready:
                cycle = self._cycle_path(remaining)
                raise GraphError(f"node '{cycle[0]}': is part of a cycle ({' -> '.join(cycle)})")
            best = min(ready, key=lambda n: (LAYOUT_ORDER[self.by_name[n].layout], position[n]))
            done.append(best)
            del remaining[best]
        return done

    def _cycle_path(self, remaining: dict[str, list[str]]) -> list[str]:
        node, seen = next(iter(remaining)), []
        while node not in seen:  # walk parents inside the unresolved part until a repeat
            seen.append(node)
            node = next(p for p in remaining[node] if p in remaining)
        return seen[seen.index(node):] + [node]

    def ancestors(self, name: str) -> list[str]:
        out, stack = set(), list(self.parents[name])
        while stack:
            n = stack.pop()
            if n not in out:
                out.add(n)
                stack.extend(self.parents[n])
        return [n for n in self.order if n in out]

    def resolve(self) -> dict[str, Callable]:
        """Import every callable now (before models load), so a bad name fails early."""
        return {n.name: n.resolve() for n in self.nodes}

    # ------------------------------------------------------------------ editing

    def edited(self, add: Iterable[Node] = (), remove: Iterable[str] = ()) -> "Graph":
        """A new graph without the `remove` nodes, where an added node with a known name
        replaces that node and the others are added."""
        merged = {n.name: n for n in self.nodes if n.name not in set(remove)}
        for node in add:
            merged[node.name] = node
        return Graph(merged.values(), self.sources)

    def split(self, first_roles: Iterable[str]) -> tuple["Graph", "Graph"]:
        """The graph cut in two for two sets of workers that run one after the other on
        the same samples (a disaggregated run's rollout and train workers). The first
        half: the nodes of `first_roles` whose inputs come only from the sources and other
        first-half nodes, in order. The second: every other node, with the sources and all
        the first half produces as its sources. Ordering deps across the cut are dropped:
        the first half has finished before the second starts."""
        roles, first = set(first_roles), []
        for name in self.order:
            node = self.by_name[name]
            if node.role in roles and all(p in first for p in self.parents[name]):
                first.append(name)
        second = [n for n in self.order if n not in first]

        def nodes(names: list[str]) -> list[Node]:
            keep = set(names)
            return [dataclasses.replace(self.by_name[n], deps=tuple(d for d in self.by_name[n].deps if d in keep))
                    for n in names]

        made = [out for n in first for out in self.by_name[n].outputs]
        return Graph(nodes(first), self.sources), Graph(nodes(second), (*self.sources, *made))

    # ------------------------------------------------------------------ pictures

    def to_dot(self, title: str = "") -> str:
        colours = {"local": "#dbeafe", "groups": "#fef3c7", "train": "#dcfce7"}
        # ids quoted (a node may be named `node` or `graph`); the source's id no node name can be
        lines = ["digraph distflow {", "  rankdir=LR;", f'  label="{title}";',
                 '  node [shape=box, style="rounded,filled", fontname="Helvetica"];',
                 f'  {_dot_id(None)} [label="prompts", shape=ellipse, fillcolor="#eeeeee"];']
        for name in self.order:
            n = self.by_name[name]
            extra = " stream" if n.stream else (" collective" if n.collective else "")
            lines.append(f'  "{name}" [label="{name}\\n{n.role} · {n.layout}{extra}", '
                         f'fillcolor="{colours[n.layout]}"];')
        for name in self.order:
            for parent in self.parents[name] or [None]:
                fields = [f for f in self.by_name[name].inputs if self.producer.get(f) == parent]
                label = f' [label="{", ".join(fields)}"]' if fields else ""
                lines.append(f'  {_dot_id(parent)} -> "{name}"{label};')
        return "\n".join(lines + ["}"]) + "\n"

    def to_mermaid(self) -> str:
        # every node's id prefixed (a node may be named `end`), the source's not: no name can take it
        lines = ["flowchart LR", "  source([prompts])"]
        for name in self.order:
            n = self.by_name[name]
            lines.append(f'  n_{name}["{name}<br/>{n.role} · {n.layout}"]')
        for name in self.order:
            for parent in self.parents[name] or [None]:
                lines.append(f"  {'source' if parent is None else 'n_' + parent} --> n_{name}")
        return "\n".join(lines) + "\n"

    def describe(self) -> str:
        rows = []
        for i, name in enumerate(self.order, 1):
            n = self.by_name[name]
            flags = ", ".join(f for f, on in (("stream", n.stream), ("chunked", n.chunked),
                                              ("collective", n.collective), ("refill", n.refill)) if on)
            rows.append(f"{i:2d}. {name:<22} {n.role:<14} {n.layout:<7} "
                        f"{', '.join(n.inputs) or '-'} -> {', '.join(n.outputs) or '(update)'}" + (f"  [{flags}]" if flags else ""))
        return "\n".join(rows)


# ---------------------------------------------------------------------------- YAML

_NODE_KEYS = {f for f in Node.__dataclass_fields__}


def node_from_dict(spec: dict, where: str) -> Node:
    if not isinstance(spec, dict):
        raise GraphError(f"{where}: a node must be a mapping, got {spec!r}")
    name = spec.get("name", "?")
    unknown = sorted(set(spec) - _NODE_KEYS)
    if unknown:
        raise GraphError(f"node '{name}' in {where}: unknown key(s) {unknown} (keys: {', '.join(sorted(_NODE_KEYS))})")
    for key in ("name", "role", "fn"):
        if key not in spec:
            raise GraphError(f"node '{name}' in {where}: missing '{key}'")
    return Node(**spec)


def _relative_to(spec: Any, folder: Path) -> Any:
    """`fn: nodes.py:f` in a graph file means the nodes.py beside that file."""
    if isinstance(spec, dict) and isinstance(spec.get("fn"), str):
        target, _, name = spec["fn"].rpartition(":")
        if target.endswith(".py") and not Path(target).expanduser().is_absolute():
            spec = {**spec, "fn": f"{(folder / target).resolve()}:{name}"}
    return spec


def load_graph_file(path: str | Path, base: Callable[[str | None], Graph]) -> Graph:
    """A YAML graph: `nodes:` (a list of node mappings with `deps`), optionally on top of
    a recipe (`base: grpo`), where a node with a recipe node's name replaces it and
    `remove:` drops recipe nodes. `base` builds a recipe by name (None: the run's own,
    whose sources a graph of only its own nodes reads)."""
    path = Path(path)
    try:
        spec = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise GraphError(f"graph file {path}: {type(e).__name__}: {e}".replace("\n", " ")) from None
    if not isinstance(spec, dict) or not isinstance(spec.get("nodes", []), list):
        raise GraphError(f"graph file {path}: expected a mapping with a 'nodes' list")
    unknown = sorted(set(spec) - {"base", "nodes", "remove"})
    if unknown:
        raise GraphError(f"graph file {path}: unknown key(s) {unknown} (keys: base, nodes, remove)")
    nodes = [node_from_dict(_relative_to(n, path.parent), str(path)) for n in spec.get("nodes", [])]
    if spec.get("base"):
        graph = base(spec["base"])
        missing = [n for n in spec.get("remove", []) if n not in graph.by_name]
        if missing:
            raise GraphError(f"graph file {path}: remove names unknown node(s) {missing}")
        return graph.edited(add=nodes, remove=spec.get("remove", []))
    if spec.get("remove"):
        raise GraphError(f"graph file {path}: 'remove' needs a 'base' recipe")
    return Graph(nodes, base(None).sources)
