"""OpenEnv environments in a multi-turn rollout, as they are: `rollout.env=openenv:module:Class`.

OpenEnv (the `openenv` package, the environment library TRL trains with) defines an environment
as a subclass of `openenv.core.env_server.Environment[Action, Observation, State]` with
pydantic actions and observations. Each episode makes its own instance and runs it in
the rollout worker's process (no server, no container):

- `reset(seed=...)` with the episode's seed, so an episode is the same on any worker.
  The episode's first messages are the dataset row's prompt, as in TRL's OpenEnv
  rollouts; what reset returns is not shown.
- Each assistant turn becomes the action: the action model's one string field gets the
  turn's text (a class whose action has other required fields is refused when the
  rollout worker starts, naming them).
- The observation's own fields (all but done, reward and metadata) become the next user
  message: its one string field as it is, several as JSON. Its `reward` is the step's
  reward (the sample's, summed, with `reward.from_env`); `done` ends the episode.
- `close()` once the episode has ended.
- Episodes run one after another unless the class sets OpenEnv's
  `SUPPORTS_CONCURRENT_SESSIONS = True` (then on `rollout.env_workers` threads).
"""

from __future__ import annotations

import json
import typing
from functools import partial
from typing import Any, Callable

from distflow.engines.agent import EnvStep

_BASE_FIELDS = {"done", "reward", "metadata"}  # what every OpenEnv Observation / Action has


class OpenEnvError(ValueError):
    """An environment class the adapter cannot drive; one line naming what is wrong."""


def action_text_field(env_class: type) -> tuple[type, str]:
    """(the environment's action class, the name of its one string field)."""
    from openenv.core.env_server import Action, Environment

    if not (isinstance(env_class, type) and issubclass(env_class, Environment)):
        raise OpenEnvError(f"{getattr(env_class, '__name__', env_class)!r} is not an "
                           f"openenv.core.env_server.Environment subclass")
    action = _action_class(env_class, Environment)
    if not (isinstance(action, type) and issubclass(action, Action)):
        raise OpenEnvError(f"{env_class.__name__}: no Action subclass in Environment[Action, ...] or in step's "
                           "annotation")
    fields = {name: f for name, f in action.model_fields.items() if name not in _BASE_FIELDS}
    text = [name for name, f in fields.items() if f.annotation is str]
    required_others = [name for name, f in fields.items() if f.is_required() and name not in text[:1]]
    if len(text) != 1 or required_others:
        raise OpenEnvError(f"{env_class.__name__}'s action {action.__name__} has fields {', '.join(fields) or 'none'}: "
                           "the adapter passes the assistant's turn to an action with one string field")
    return action, text[0]


def _action_class(env_class: type, environment: type) -> Any:
    """The Action of `Environment[Action, Observation, State]` among the class's bases,
    else the annotation of step's `action`."""
    for klass in env_class.__mro__:
        for base in klass.__dict__.get("__orig_bases__", ()):
            if typing.get_origin(base) is environment and typing.get_args(base):
                return typing.get_args(base)[0]
    try:
        return typing.get_type_hints(env_class.step).get("action")
    except NameError:  # an annotation that names a class out of the module's scope
        return None


def observation_text(observation: Any) -> str:
    fields = {name: getattr(observation, name) for name in type(observation).model_fields if name not in _BASE_FIELDS}
    if len(fields) == 1 and isinstance(value := next(iter(fields.values())), str):
        return value
    return json.dumps(fields, default=str)


class OpenEnvEnvironment:
    """One episode of an OpenEnv environment as a DistFlow `Environment`."""

    def __init__(self, env_class: type, action_class: type, text_field: str):
        self.action_class, self.text_field = action_class, text_field
        self.env = env_class()

    @classmethod
    def episodes_of(cls, env_class: type) -> Callable[[], "OpenEnvEnvironment"]:
        """A maker of one episode's environment; a class the adapter cannot drive is
        refused here, before any episode."""
        return partial(cls, env_class, *action_text_field(env_class))

    @staticmethod
    def concurrent(env_class: type) -> bool:
        """Whether the class says its instances may run at once (OpenEnv's
        SUPPORTS_CONCURRENT_SESSIONS, False unless set, and not REQUIRES_SINGLE_THREAD_EXECUTOR,
        which OpenEnv's server honours with one thread for every session); if not, one
        episode runs at a time, from its reset to its close (EpisodeSettings)."""
        return (bool(getattr(env_class, "SUPPORTS_CONCURRENT_SESSIONS", False))
                and not getattr(env_class, "REQUIRES_SINGLE_THREAD_EXECUTOR", False))

    def reset(self, task: dict) -> None:
        seed = task.get("seed")  # the episode's 63-bit seed, in the 32 bits np.random.seed takes
        self.env.reset(seed=None if seed is None else seed % 2 ** 32)

    def close(self) -> None:
        self.env.close()

    def step(self, assistant_text: str) -> EnvStep:
        observation = self.env.step(self.action_class(**{self.text_field: assistant_text}))
        reward = 0.0 if observation.reward is None else float(observation.reward)
        if observation.done:
            return EnvStep([], True, reward=reward)
        return EnvStep([{"role": "user", "content": observation_text(observation)}], False, reward=reward)
