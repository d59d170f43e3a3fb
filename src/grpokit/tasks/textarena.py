"""TextArena's single-player games (`pip install 'grpokit[textarena]'`): `data.task=textarena:<env id>`
(e.g. `textarena:GuessTheNumber-v0`), with the game's arguments in `data.task_args`.

Each prompt is one game, seeded: train game `index` is game seed s + index (a pure function of the
run's seed and the position, so a run resumes anywhere), the held-out games seeds s + 10^9 on. The
prompt is the game's first observation as a user message.

The task brings its own agent (`rollout.agent` defaults to `grpokit.tasks.textarena:play`, rollouts/agents.py):
the observation is the user turn, the model's reply is the action (`env.step`), the game's next
observation (its new text) is the next user turn, until the game is done; the game's reward for
the player is the rollout's reward. A game the token budget (rollout.max_completion_length) ends
before it is done scores 0.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

from grpokit.runtime.errors import ConfigError
from grpokit.tasks.task import Example, stream_from

PREFIX = "textarena:"
AGENT = "grpokit.tasks.textarena:play"
EVAL_OFFSET = 10**9


def _make(env_id: str, arguments: dict):
    try:
        import textarena as ta
    except ImportError:
        raise ConfigError(f"data.task={PREFIX}{env_id} needs TextArena: pip install 'grpokit[textarena]'") from None
    try:
        return ta.make(env_id=env_id, **arguments)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"data.task={PREFIX}{env_id} (data.task_args={arguments!r}): TextArena says: {e}") from None


@contextlib.contextmanager
def _own_random():
    """TextArena's games draw from (and seed) Python's global random: the run's own state is kept."""
    state = random.getstate()
    try:
        yield
    finally:
        random.setstate(state)


def _start(env_id: str, arguments: dict, seed: int):
    """A game of `env_id`, reset for one player with `seed`, and its first observation."""
    env = _make(env_id, arguments)
    with _own_random():
        env.reset(num_players=1, seed=seed)
    _, observation = env.get_observation()
    return env, observation


class TextArenaTask:
    reward_functions = ()  # the game's reward, through the task's agent (`agent` reward)

    def __init__(self, env_id: str, arguments: dict, seed: int = 0, eval_size: int = 100):
        self.env_id, self.arguments, self.seed = env_id, dict(arguments), seed
        try:
            self.train_example(0)  # a wrong id, argument or a game that needs two players: named now
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - the library's own error, named
            raise ConfigError(f"data.task={PREFIX}{env_id}: cannot start a one-player game: {type(e).__name__}: {e} "
                              "(grpokit plays TextArena's single-player games)") from None
        self.eval_examples = [self._example(seed + EVAL_OFFSET + i) for i in range(eval_size)]

    def _example(self, game_seed: int) -> Example:
        _, observation = _start(self.env_id, self.arguments, game_seed)
        return Example([{"role": "user", "content": observation}],
                       {"game": self.env_id, "game_seed": game_seed, "game_args": self.arguments})

    def train_example(self, index: int) -> Example:
        return self._example(self.seed + index)

    def train_stream(self, start: int = 0) -> Iterator[Example]:
        return stream_from(self, start)


async def play(client, model, row) -> float:
    """Play one game of `row` (a TextArenaTask's): observation in, reply out, until it is done."""
    env, observation = _start(row["game"], row["game_args"], row["game_seed"])
    messages, seen, done = list(row["prompt"]), observation, False
    while True:
        reply = await client.chat.completions.create(model=model, messages=messages)
        action = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": action})
        if reply.choices[0].finish_reason == "length" and not action:  # the token budget is spent
            break
        with _own_random():
            done, _ = env.step(action=action)
        if done:
            break
        _, observation = env.get_observation()
        # The observation is the game's whole log: its new text is the next turn.
        messages.append({"role": "user", "content": observation[len(seen):] if observation.startswith(seen) else observation})
        seen = observation
    if not done:
        return 0.0
    closed = env.close()
    rewards = closed[0] if isinstance(closed, tuple) else closed
    return float(rewards[0])
