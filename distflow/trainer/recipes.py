"""One builder turns any recipe into a task graph.

A recipe is data (distflow/recipes/NAME.yaml, or your own file): config values for
the estimator, the policy loss, the loss aggregation and the optional parts. By the time
the builder runs they are in the config, so the graph follows from the config alone:

    rollout ─┬─ reward ─(drop_failed_groups)─(dynamic_sampling)─(overlong_penalty)─(greedy_baseline)─┐
             ├─ ref_log_prob ─(kl_in_reward)─────────────────────────────────────────────────────────┤
             │                                                                          advantage ─┐
             └─ (critic_values) (old_log_prob) ───────────────────────────────── actor_update (critic_update)

  ref_log_prob        with KL in the loss or in the reward
  kl_in_reward        algorithm.use_kl_in_reward: the penalty (from the rollout's own
                        log-probs and the reference's) goes into the token rewards
  drop_failed_groups  multi-turn or an agent, rollout.on_failed_episode=drop_group: a filter
                        of the groups with an episode whose environment or agent raised
  dynamic_sampling    algorithm.dynamic_sampling: a refilling filter; later nodes wait for it
  overlong_penalty    algorithm.overlong_buffer_len or _fraction > 0
  greedy_baseline     an estimator that needs a "baseline" (ReMax)
  critic_values,      an estimator that needs "values" (GAE): PPO's critic
  critic_update
  old_log_prob        off-policy updates (ppo_epochs > 1, several mini-batches, or samples
                        of older weights), unless algorithm.old_log_probs_from=rollout
  (actor_update reads rollout_log_probs with algorithm.rollout_correction on)
  With rollout.max_turns > 1 the rollout runs multi-turn episodes (engines/agent.py), with
  rollout.agent a user's OpenAI-client agent (engines/openai_endpoint.py, its reward in
  agent_scores); every scoring forward also reads observation_mask (the tokens the
  environment or the agent supplied).

The node implementations are the library in nodes.py; a user's YAML graph
(`algorithm.graph`) adds to or replaces them (dag/graph.py's load_graph_file).
"""

from __future__ import annotations

from distflow.algos.core import get_policy_loss
from distflow.config import ALGORITHMS, Config, Recipe, load_recipe, overlong_buffer_tokens
from distflow.dag.graph import Graph, GraphError, Node, load_graph_file
from distflow.data.images import IMAGE_FIELDS
from distflow.engines.agent import COUNTS as EPISODE_COUNTS
from distflow.engines.common import takes_images
from distflow.engines.openai_endpoint import AGENT_FIELDS
from distflow.trainer import nodes

# Fields the trainer puts in the store before the first node (one row per response).
SOURCES = ("prompts", "prompt_mask", "group", "mini_batch", "sample_id", "sample_k", "uid", "draw",
           "ground_truth", "data_source", "extra_info", "prompt_messages")
SCORING = ("prompts", "prompt_mask", "responses", "response_mask")
# Under runtime.placement=disaggregated the rollout workers run these roles' nodes (as far
# as their inputs allow: Graph.split), the train workers the rest.
ROLLOUT_ROLES = ("rollout", "reward", "filter")


def on_policy(cfg: Config) -> bool:
    """One optimizer step per rollout, on samples of the current weights: the old
    log-probs equal the current ones (detached)."""
    return (cfg.actor.ppo_epochs == 1 and cfg.actor.ppo_mini_batch_size == cfg.data.train_batch_size
            and cfg.algorithm.max_staleness == 0)


def recomputes_old_log_probs(cfg: Config) -> bool:
    return not on_policy(cfg) and cfg.algorithm.old_log_probs_from == "recompute"


def _node(name: str, role: str, inputs, outputs, **kw) -> Node:
    return Node(name=name, role=role, fn=getattr(nodes, name), inputs=tuple(inputs), outputs=tuple(outputs), **kw)


def _checked(cfg: Config):
    """The estimator (and what it needs), the policy loss and the KL estimators, or one
    line naming the key."""
    a = cfg.algorithm
    try:
        _, info = nodes.resolve_estimator(a.estimator)
    except ValueError as e:
        raise GraphError(f"algorithm.estimator={a.estimator!r}: {e}") from None
    try:
        get_policy_loss(a.policy_loss)
    except ValueError as e:
        raise GraphError(f"algorithm.policy_loss={a.policy_loss!r}: {e}") from None
    for key in ("kl_type", "reward_kl_type"):
        try:
            nodes.resolve_kl(getattr(a, key))
        except ValueError as e:  # PluginError too
            raise GraphError(f"algorithm.{key}={getattr(a, key)!r}: {e}") from None
    if a.group_size < info.min_group_size:
        raise GraphError(f"algorithm.group_size={a.group_size}: the {a.estimator!r} estimator needs at least "
                         f"{info.min_group_size} responses per prompt; with fewer every advantage is 0")
    return info


def recipe_graph(cfg: Config) -> Graph:
    a, info = cfg.algorithm, _checked(cfg)
    agent = cfg.rollout.agent is not None  # an OpenAI-client agent's calls are the sample
    episodes = cfg.rollout.max_turns > 1 or agent  # the environment's / agent's tokens are attended to, not trained
    if episodes and "values" in info.needs:
        raise GraphError(f"rollout.max_turns={cfg.rollout.max_turns}: multi-turn episodes train critic-free "
                         f"recipes (grpo, dapo, rloo, reinforce_plus_plus, ...); {a.estimator!r} needs a critic")
    if episodes and "baseline" in info.needs:  # its greedy baseline is one turn, scored by the text reward
        raise GraphError(f"algorithm.estimator={a.estimator!r}: its greedy baseline is a single-turn response scored "
                         "by the reward function, not an episode of the environment, tools or agent the samples "
                         "run; use grpo, rloo or reinforce_plus_plus_baseline for multi-turn episodes")
    images = IMAGE_FIELDS if takes_images(cfg.model.path) else ()  # a VLM: every forward sees the pixels
    untested_with_images = {"an agent (rollout.agent)": agent, "rollout.engine=vllm": cfg.rollout.engine == "vllm"}
    if images and any(untested_with_images.values()):
        raise GraphError(f"model.path={cfg.model.path} is a vision-language model: it trains with the HF engine "
                         f"and the episode runner's turns, not with "
                         + ", ".join(k for k, v in untested_with_images.items() if v))
    scoring = SCORING + images + (("observation_mask",) if episodes else ())
    rollout_out = ("responses", "response_mask", "rollout_log_probs")
    rollout_out += ("rollout_weight_version",) if cfg.rollout.partial else ()  # each token's weight version
    # a reward model reads the prompt's messages too, and an episode's own (its turns and observations)
    episode_messages = ("episode_messages",) if episodes and cfg.reward.model_path else ()
    rollout_out += (("observation_mask", "num_turns", *AGENT_FIELDS) if agent else
                    ("observation_mask", "num_turns", *EPISODE_COUNTS, "env_scores", *episode_messages) if episodes
                    else ())
    # what scoring a response reads besides it
    reward_inputs = (("ground_truth", "data_source", "extra_info")
                     + (("prompt_messages",) if cfg.reward.model_path else ()) + episode_messages
                     # an episode's text holds its observations, and its extra_info verl's num_turns and the
                     # rollout's own scores (nodes.reward_extra_info), which with reward.from_env or an agent are
                     # the reward (nodes.rollout_reward_field)
                     + (("observation_mask", "num_turns", "agent_scores" if agent else "env_scores")
                        if episodes else ()))
    rollout_in = ("prompts", "prompt_mask", "uid", "draw", "sample_k", *images)
    rollout_in += ("ground_truth", "data_source", "extra_info", "prompt_messages") if episodes else ()
    built = [
        _node("rollout", "rollout", rollout_in, rollout_out, stream=True),
        _node("reward", "reward", ("responses", "response_mask", *reward_inputs), ("scores", "accuracy", "reward_status")),
    ]
    reward_field = "scores"
    gate: tuple[str, ...] = ()  # after a filter, everything sees only the kept groups
    gated = {}  # ... and runs in the filter's (groups) layout or later
    if episodes and cfg.rollout.on_failed_episode == "drop_group":
        failed_field = "agent_failed" if agent else "env_failed"
        built.append(_node("drop_failed_groups", "filter", (failed_field, "group"), ("no_failed_episode",),
                           params={"failed_field": failed_field}))
        gate, gated = ("drop_failed_groups",), {"layout": "groups"}
    if a.dynamic_sampling:
        # on the task's score before shaping, as verl's filter_groups on "score"/"acc"
        built.append(_node("dynamic_sampling", "filter", ("scores", "group"), ("kept",), refill=True,
                           params={"reward_field": "scores"}, deps=gate))
        gate, gated = ("dynamic_sampling",), {"layout": "groups"}
    if overlong_buffer_tokens(cfg):
        built.append(_node("overlong_penalty", "reward", ("scores", "response_mask")
                           + (("observation_mask",) if episodes else ()), ("shaped_scores",),
                           layout="groups", deps=gate))
        reward_field = "shaped_scores"
    if "baseline" in info.needs:
        built.append(_node("greedy_baseline", "rollout", ("prompts", "prompt_mask", "group", *reward_inputs, *images),
                           ("baseline_scores",),
                           deps=gate, **gated))
    if a.use_kl_loss or a.use_kl_in_reward:
        built.append(_node("ref_log_prob", "reference", scoring, ("ref_log_probs",), deps=gate, **gated))
    if a.use_kl_in_reward:
        # from the engine's own log-probs (verl takes the recomputed old ones): those come from a forward in the train
        # layout, after this node's groups layout (layouts only move on towards train's), and a forward in the groups
        # layout would run a replica's rows on each of its members. A collective (the controller sees the KL of the
        # whole batch), after any group-layout shaping
        built.append(_node("kl_in_reward", "reward", (reward_field, "response_mask", "ref_log_probs",
                                                      "rollout_log_probs"), ("token_rewards",), layout="groups",
                           collective=True, chunked=False, params={"reward_field": reward_field}))
        reward_field = "token_rewards"
    if recomputes_old_log_probs(cfg):
        built.append(_node("old_log_prob", "actor_forward", scoring, ("old_log_probs",), deps=gate))
    critic = "values" in info.needs
    adv_inputs = [reward_field, "response_mask", "group"] + (["values"] if critic else []) \
        + (["baseline_scores"] if "baseline" in info.needs else [])
    built.append(_node("advantage", "advantage", adv_inputs, ("advantages", "returns") if critic else ("advantages",),
                       params={"estimator": a.estimator, "reward_field": reward_field},
                       collective=info.batch_whitened, layout="train" if critic else None, deps=gate))
    train_inputs = [*scoring, "advantages", "mini_batch"]
    train_inputs += ["ref_log_probs"] if a.use_kl_loss else []
    train_inputs += ["old_log_probs"] if recomputes_old_log_probs(cfg) else []
    train_inputs += ["rollout_log_probs"] if a.rollout_correction != "off" or a.old_log_probs_from == "rollout" else []
    if critic:
        built.append(_node("critic_values", "critic_forward", scoring, ("values",)))
        built.append(_node("critic_update", "critic_train", [*scoring, "values", "returns", "mini_batch"], ()))
    built.append(_node("actor_update", "actor_train", train_inputs, (), params={"policy_loss": a.policy_loss}))
    return Graph(built, SOURCES + images)


def build_graph(cfg: Config) -> Graph:
    """The run's graph: the recipe's, plus the user's YAML nodes (`algorithm.graph`). A
    graph file's `base:` must be the run's recipe, whose settings the nodes read."""
    if cfg.algorithm.graph is None:
        return recipe_graph(cfg)

    def run_recipe(name: str | None) -> Graph:
        if name not in (None, cfg.algorithm.name):
            raise GraphError(f"algorithm.graph={cfg.algorithm.graph}: its base recipe {name!r} is not "
                             f"algorithm.name={cfg.algorithm.name!r}, whose settings the run has; set "
                             f"algorithm.name={name}")
        return recipe_graph(cfg)

    return load_graph_file(cfg.algorithm.graph, run_recipe)


# ---------------------------------------------------------------------------- documentation

_SHOWN = ("algorithm.estimator", "algorithm.policy_loss", "algorithm.loss_agg_mode", "algorithm.use_kl_loss",
          "algorithm.use_kl_in_reward", "algorithm.dynamic_sampling", "algorithm.overlong_buffer_len",
          "algorithm.overlong_buffer_fraction")


def _kl_where(recipe: Recipe) -> str:
    where = [f"loss ({recipe.setting('algorithm.kl_type')})" if recipe.setting("algorithm.use_kl_loss") else "",
             f"reward ({recipe.setting('algorithm.reward_kl_type')})"
             if recipe.setting("algorithm.use_kl_in_reward") else ""]
    return " + ".join(w for w in where if w) or "-"


def recipe_row(recipe: Recipe) -> list[str]:
    estimator = recipe.setting("algorithm.estimator")
    needs = nodes.resolve_estimator(estimator)[1].needs
    extra = ", ".join(f"`{k.split('.', 1)[1]}={v}`" for k, v in recipe.settings if k not in _SHOWN)
    buffer, fraction = recipe.setting("algorithm.overlong_buffer_len"), recipe.setting("algorithm.overlong_buffer_fraction")
    shaping = f"{buffer} tokens" if buffer else f"the last {fraction:.0%} of the budget" if fraction else "-"
    return [f"`{recipe.name}`", f"`{estimator}`", f"`{recipe.setting('algorithm.policy_loss')}`",
            f"`{recipe.setting('algorithm.loss_agg_mode')}`", "yes" if "values" in needs else "-",
            _kl_where(recipe), "yes" if recipe.setting("algorithm.dynamic_sampling") else "-",
            shaping, extra or "-", recipe.description]


def recipe_table() -> str:
    """The built-in recipes as a markdown table, made from their files (README and docs
    carry this text; a test keeps them equal)."""
    head = ["recipe", "estimator", "policy loss", "loss aggregation", "critic", "KL in", "dynamic sampling",
            "overlong shaping", "other settings", "what it is"]
    rows = [head, ["---"] * len(head)] + [recipe_row(load_recipe(name)) for name in ALGORITHMS]
    return "\n".join("| " + " | ".join(r) + " |" for r in rows) + "\n"


def describe_recipe(cfg: Config) -> str:
    """What `distflow dag show NAME` prints above the graph: the recipe and its settings as
    the run has them (a setting the command line or config file changed says so)."""
    recipe = load_recipe(cfg.algorithm.name)
    lines = [f"{recipe.name}: {recipe.description}"] + ([f"  paper: {recipe.paper}"] if recipe.paper else [])
    for key, value in recipe.settings:
        section, name = key.split(".", 1)
        effective = getattr(getattr(cfg, section), name)
        lines.append(f"  {key} = {effective}" + (f"  (the recipe's: {value})" if effective != value else ""))
    return "\n".join(lines)
