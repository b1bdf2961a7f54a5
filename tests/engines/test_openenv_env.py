"""An OpenEnv environment (the real `openenv` library's base classes, as a TRL user writes
one) runs unchanged through the adapter: its observations become observation tokens, its
rewards the sample's with reward.from_env, its `done` ends the episode, its seed is the
episode's, it is closed at the episode's end, it runs at once with others only where
its class allows; a class the adapter cannot drive is refused in one line; and a short training
run takes it end to end. Needs openenv (.ci/run installs it in the TRL environment)."""

from __future__ import annotations

import pytest

pytest.importorskip("openenv.core.env_server")
pytestmark = pytest.mark.openenv

from distflow.engines.agent import EpisodeRunner, EpisodeSettings  # noqa: E402
from distflow.engines.openenv_env import OpenEnvEnvironment, OpenEnvError, action_text_field  # noqa: E402
from distflow.engines.rollout import SamplingParams, sample_seed  # noqa: E402
from distflow.engines.tiny_model import build_tokenizer  # noqa: E402
from helpers import ScriptedEngine, distflow_sweep, run_metrics  # noqa: E402

GAME = '''
from openenv.core.env_server import Action, Environment, Observation, State


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    feedback: str = ""


CLOSED = []  # the secrets of the episodes whose environment was closed


class GuessDigit(Environment[GuessAction, GuessObservation, State]):
    """Guess a digit from the seed; each wrong guess is told higher or lower and costs 0.25."""

    def close(self) -> None:
        CLOSED.append(self.secret)

    def __init__(self):
        super().__init__()
        self._state, self.secret = State(), 0

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self._state, self.secret = State(episode_id=episode_id), (seed or 0) % 10
        return GuessObservation(feedback="Guess a digit.")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        digits = [int(c) for c in action.guess if c.isdigit()]
        if digits and digits[-1] == self.secret:
            return GuessObservation(feedback="right", done=True, reward=1.0)
        hint = "higher" if not digits or digits[-1] < self.secret else "lower"
        return GuessObservation(feedback=hint, reward=-0.25)

    @property
    def state(self) -> State:
        return self._state


class Steps(Environment[GuessAction, GuessObservation, State]):
    """Pays 0.5 for every turn and never ends an episode: a sample's reward is 0.5 x its turns."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # its instances share nothing

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        return GuessObservation()

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        return GuessObservation(feedback="go on", reward=0.5)

    @property
    def state(self) -> State:
        return State()


class OneThread(Steps):
    """Says its sessions share nothing, but each must run on OpenEnv's one thread."""

    REQUIRES_SINGLE_THREAD_EXECUTOR = True


class OneSession(Steps):
    """Unmarked (OpenEnv's default: one session at a time), and counts its live sessions."""

    SUPPORTS_CONCURRENT_SESSIONS = False
    live = {"now": 0, "most": 0}  # sessions alive at once, now and at most
    threads = set()  # the threads its sessions ran on

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        import threading

        self.threads.add(threading.get_ident())
        self.live["now"] += 1
        self.live["most"] = max(self.live["most"], self.live["now"])
        return GuessObservation()

    def close(self) -> None:
        self.live["now"] -= 1


class NumpySeeded(Steps):
    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        import numpy as np

        self.draw = np.random.RandomState(seed).randint(10)  # refuses a seed of 2**32 or more
        return GuessObservation()
'''


@pytest.fixture(scope="module")
def game(tmp_path_factory):
    import importlib.util

    path = tmp_path_factory.mktemp("openenv") / "guess_game.py"
    path.write_text(GAME)
    spec = importlib.util.spec_from_file_location("guess_game", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, path


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_an_openenv_game_runs_through_the_adapter(game):
    module, _ = game
    tok = build_tokenizer()
    a, b = _ids(tok, "A?"), _ids(tok, "B?")
    engine = ScriptedEngine(tok, {a[0]: ["5", "8", "7"], b[0]: ["3", "1", "0"]})
    runner = EpisodeRunner(engine, tok, OpenEnvEnvironment.episodes_of(module.GuessDigit),
                           EpisodeSettings(max_turns=3, max_total_tokens=200, step_last_turn=True))
    # seeds 7 and 13: secrets 7 and 3
    out = runner.generate([a, b], [7, 13], SamplingParams(max_new_tokens=8), [{}, {}])
    assert out["num_turns"].tolist() == [3.0, 1.0]  # a: 5 (higher), 8 (lower), 7; b: 3 at once
    assert out["env_scores"].tolist() == [-0.25 - 0.25 + 1.0, 1.0]  # the last turn is stepped for its reward
    shown = tok.decode(out["responses"][0][out["observation_mask"][0].bool()])
    assert shown == "higher\nA: lower\nA: "  # observations, rendered by the chat template; never trained
    assert sorted(module.CLOSED) == [3, 7]  # each episode's environment is closed once it has ended
    # the same episodes without step_last_turn: the third turn's reward is not asked for
    runner.settings = EpisodeSettings(max_turns=3, max_total_tokens=200)
    engine.calls.clear()
    assert runner.generate([a], [7], SamplingParams(max_new_tokens=8), [{}])["env_scores"].tolist() == [-0.5]


def test_episodes_run_at_once_only_where_the_class_says_its_sessions_may(game, tmp_path):
    from distflow.config import load_config
    from distflow.trainer.loop import make_episode_runner

    _, path = game
    tok = build_tokenizer()
    one_at_a_time = {}
    for name in ("GuessDigit", "Steps", "OneThread"):  # unmarked; sharing nothing; sharing nothing on one thread
        cfg = load_config(None, [f"rollout.env=openenv:{path}:{name}", "rollout.max_turns=2", "rollout.env_workers=4"])
        one_at_a_time[name] = make_episode_runner(cfg, ScriptedEngine(tok, {}), tok).settings.one_episode_at_a_time
    assert one_at_a_time == {"GuessDigit": True, "Steps": False, "OneThread": True}
    # one session alive at a time, from its reset to its close: each episode's turns alone, one generate each
    prompts = [_ids(tok, f"{c}?") for c in "ABCD"]
    engine = ScriptedEngine(tok, {p[0]: ["1", "2"] for p in prompts})
    cfg = load_config(None, [f"rollout.env=openenv:{path}:OneSession", "rollout.max_turns=2", "reward.from_env=true"])
    runner = make_episode_runner(cfg, engine, tok)
    loaded = type(runner.make_env().env)  # the class as the run loaded it
    out = runner.generate(prompts, [1, 2, 3, 4], SamplingParams(max_new_tokens=8), [{}] * 4)
    assert loaded.live == {"now": 0, "most": 1} and out["env_scores"].tolist() == [1.0] * 4
    assert len(loaded.threads) == 1  # one thread for all of them, as OpenEnv runs a single-thread class
    assert [len(call) for call in engine.calls] == [1] * 8


def test_an_episode_s_seed_is_one_numpy_takes(game):
    """Episode seeds are 63-bit; an environment seeding numpy's legacy generator with one
    failed every episode."""
    module, _ = game
    env = OpenEnvEnvironment.episodes_of(module.NumpySeeded)()
    draws = []
    for seed in (sample_seed(4558017691475869577, 1), None):
        env.reset({"seed": seed})
        draws.append(env.env.draw)
    assert all(0 <= d < 10 for d in draws)


def test_a_class_the_adapter_cannot_drive_is_refused_in_one_line():
    from openenv.core.env_server import Action, Environment, Observation, State

    class Move(Action):
        x: int
        y: int

    class Board(Environment[Move, Observation, State]):
        def reset(self, seed=None, episode_id=None, **kwargs):
            return Observation()

        def step(self, action: Move, timeout_s=None, **kwargs):
            return Observation()

        @property
        def state(self):
            return State()

    with pytest.raises(OpenEnvError, match="Board's action Move has fields x, y: the adapter passes the assistant"):
        action_text_field(Board)
    with pytest.raises(OpenEnvError, match="'dict' is not an openenv.core.env_server.Environment subclass"):
        action_text_field(dict)


def test_a_training_run_takes_its_rewards_from_the_openenv_environment(game, tmp_path):
    _, path = game
    runs = distflow_sweep({"openenv": [f"rollout.env=openenv:{path}:Steps", "reward.from_env=true",
                                       "rollout.max_turns=2", "rollout.max_new_tokens=16", "rollout.max_total_tokens=80",
                                       "trainer.total_steps=2",
                                       "data.train_batch_size=4", "algorithm.group_size=4", "actor.ppo_mini_batch_size=2",
                                       "data.val_max_samples=8", "trainer.progress=false", "trainer.save_final=false"]},
                          1, tmp_path)
    records = run_metrics(runs["openenv"])
    assert "val/accuracy" in records[0]  # the held-out evaluation runs the episodes too,
    assert records[0]["val/reward"] == 1.0  # and scores them with the environment's rewards, as training does
    for record in records[1:]:
        assert record["turns/mean"] == 2.0 and record["reward/mean"] == 1.0  # 0.5 for each of two turns
        assert record["env/failed"] == 0.0
