"""The built-in algorithms as task graphs, chosen by `algorithm.name`.

Recipes name their callables as `module:function` strings, exactly as a user's YAML
graph does; the trainer layer provides them (`distflow.trainer.nodes`). Every recipe:

    rollout ─┬─ reward ─(dynamic_sampling)─(overlong)─ advantage ─┐
             ├─ ref_log_prob ───────────────────────────────────────┤
             └─ (critic_values, old_log_prob) ─────────────────────── actor_update (critic_update)

  grpo, dr_grpo, rloo,            group-relative advantages; differ in the estimator and
  reinforce_plus_plus(_baseline)  (dr_grpo) the loss aggregation
  gspo                            GRPO's graph with the sequence-level importance ratio
  ppo                             a critic (value head): values -> GAE -> clipped value loss
  dapo                            overlong shaping, dynamic sampling (drop all-equal groups,
                                  refill), clip-higher, token-level loss, no KL
"""

from __future__ import annotations

from distflow.config import ALGORITHMS, Config
from distflow.dag.graph import Graph, GraphError, Node, load_graph_file

# Fields the trainer puts in the store before the first node (one row per response).
SOURCES = ("prompts", "prompt_mask", "group", "mini_batch", "sample_id", "sample_k", "uid",
           "ground_truth", "data_source", "extra_info")
SCORING = ("prompts", "prompt_mask", "responses", "response_mask")
_IMPL = "distflow.trainer.nodes:"
# estimators that normalise over the whole batch: a collective (an all-reduce) in the node
_BATCH_WHITENED = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae")


def on_policy(cfg: Config) -> bool:
    """One optimizer step per rollout: the old log-probs equal the current ones (detached)."""
    return cfg.actor.ppo_epochs == 1 and cfg.actor.ppo_mini_batch_size == cfg.data.train_batch_size


def _node(name: str, role: str, inputs, outputs, **kw) -> Node:
    return Node(name=name, role=role, fn=_IMPL + kw.pop("impl", name), inputs=tuple(inputs),
                outputs=tuple(outputs), **kw)


def build_recipe(cfg: Config, name: str | None = None) -> Graph:
    name = name or cfg.algorithm.name
    if name not in ALGORITHMS:
        raise GraphError(f"unknown recipe {name!r} (recipes: {', '.join(ALGORITHMS)})")
    a = cfg.algorithm
    nodes = [
        _node("rollout", "rollout", ("prompts", "prompt_mask", "uid", "sample_k"), ("responses", "response_mask"),
              stream=True),
        _node("reward", "reward", ("responses", "response_mask", "ground_truth", "data_source", "extra_info"),
              ("scores", "accuracy", "reward_status")),
    ]
    reward_field = "scores"
    gate: tuple[str, ...] = ()  # DAPO: everything after the filter scores only the kept groups
    if name == "dapo":
        # on the task's score before shaping, as verl's filter_groups on "score"/"acc"
        nodes.append(_node("dynamic_sampling", "filter", ("scores", "group"), ("kept",), refill=True,
                           params={"reward_field": "scores"}))
        gate = ("dynamic_sampling",)
        if a.overlong_buffer_len:
            nodes.append(_node("overlong_penalty", "reward", ("scores", "response_mask"), ("shaped_scores",),
                               layout="groups", deps=gate))
            reward_field = "shaped_scores"
    if a.use_kl_loss:
        nodes.append(_node("ref_log_prob", "reference", SCORING, ("ref_log_probs",), deps=gate))
    if not on_policy(cfg):
        nodes.append(_node("old_log_prob", "actor_forward", SCORING, ("old_log_probs",), deps=gate))
    estimator = {"ppo": "gae", "dapo": "grpo", "gspo": "grpo"}.get(name, name)
    adv_inputs = [reward_field, "response_mask", "group"] + (["values"] if name == "ppo" else [])
    nodes.append(_node("advantage", "advantage", adv_inputs,
                       ("advantages", "returns") if name == "ppo" else ("advantages",),
                       params={"estimator": estimator, "reward_field": reward_field},
                       collective=estimator in _BATCH_WHITENED, layout="train" if name == "ppo" else None,
                       deps=gate))
    train_inputs = [*SCORING, "advantages", "mini_batch"]
    train_inputs += ["ref_log_probs"] if a.use_kl_loss else []
    train_inputs += [] if on_policy(cfg) else ["old_log_probs"]
    if name == "ppo":
        nodes.append(_node("critic_values", "critic_forward", SCORING, ("values",)))
        nodes.append(_node("critic_update", "critic_train", [*SCORING, "values", "returns", "mini_batch"], ()))
    nodes.append(_node("actor_update", "actor_train", train_inputs, (),
                       params={"policy_loss": "gspo" if name == "gspo" else "vanilla"}))
    return Graph(nodes, SOURCES)


def build_graph(cfg: Config) -> Graph:
    """The run's graph: the recipe, plus the user's YAML nodes (`algorithm.graph`)."""
    if cfg.algorithm.graph is None:
        return build_recipe(cfg)
    return load_graph_file(cfg.algorithm.graph, lambda name: build_recipe(cfg, name))
