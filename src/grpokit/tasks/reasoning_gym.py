"""reasoning-gym's procedural tasks (`pip install 'grpokit[reasoning-gym]'`):
`data.task=reasoning_gym:<dataset name>`, with the generator's arguments in `data.task_args`.

reasoning-gym entry i of a dataset with seed s is drawn from Random(s + i), so entry `index` of the
train stream is a pure function of (seed, index) and a run resumes anywhere. The held-out split is
a dataset of its own seed, 10^9 further on, so its entries never repeat the first 10^9 train ones.

Each prompt is reasoning-gym's "direct" system prompt (answer between <answer> tags, no reasoning),
one worked example (another entry's question, answered `<answer>...</answer>`, from a third seed)
and the entry's question: a small model shown no example never uses the tags. Completions are scored by the `reasoning_gym` reward (rewards/
reasoning_gym.py), which hands the answer to the dataset's own `score_answer`.
"""

from __future__ import annotations

from collections.abc import Iterator

from grpokit.errors import ConfigError
from grpokit.tasks import Example

PREFIX = "reasoning_gym:"
# Train entries are indices 0 .. TRAIN_SIZE - 1 of the train dataset, in order, then again.
TRAIN_SIZE = 10**9
EVAL_OFFSET = 10**9
SHOTS_OFFSET = 2 * 10**9  # the worked examples' dataset; the held-out prompts' come from its second half


def _library():
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError("data.task=reasoning_gym:... needs reasoning-gym: pip install 'grpokit[reasoning-gym]'") from None
    return reasoning_gym


def dataset_names() -> list[str]:
    """The dataset names reasoning-gym registers (empty when it is not installed)."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        return []
    return sorted(DATASETS)


def create(name: str, seed: int, size: int, arguments: dict):
    """reasoning-gym's dataset `name` with its generator `arguments` (data.task_args); a
    ConfigError naming the culprit for an unknown name or argument."""
    rg = _library()
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        import difflib

        hint = difflib.get_close_matches(name, DATASETS, n=3)
        raise ConfigError(f"data.task={PREFIX}{name}: reasoning-gym has no dataset {name!r}"
                          + (f" (did you mean {', '.join(hint)}?)" if hint else f"; it has {len(DATASETS)}, e.g. "
                             "basic_arithmetic, chain_sum, letter_counting, spell_backward"))
    try:
        return rg.create_dataset(name, seed=seed, size=size, **arguments)
    except (TypeError, ValueError, AssertionError) as e:
        raise ConfigError(f"data.task_args={arguments!r} for reasoning-gym's {name!r}: {type(e).__name__}: {e}") from None


class ReasoningGymTask:
    reward_functions = (("reasoning_gym", 1.0),)

    def __init__(self, name: str, arguments: dict, seed: int = 0, eval_size: int = 100):
        from reasoning_gym.utils import SYSTEM_PROMPTS

        self.name = name
        self.system_prompt = SYSTEM_PROMPTS["direct"]
        self.train = create(name, seed, TRAIN_SIZE, arguments)
        self.shots = create(name, seed + SHOTS_OFFSET, 2 * TRAIN_SIZE, arguments)
        held_out = create(name, seed + EVAL_OFFSET, max(eval_size, 1), arguments)
        self.eval_examples = [self._example(held_out[i], self.shots[TRAIN_SIZE + i]) for i in range(eval_size)]

    def _example(self, entry: dict, shot: dict) -> Example:
        prompt = [{"role": "system", "content": self.system_prompt},
                  {"role": "user", "content": shot["question"]},
                  {"role": "assistant", "content": f"<answer>{shot['answer']}</answer>"},
                  {"role": "user", "content": entry["question"]}]
        # `entry` is what score_answer reads; `answer` is there for exact_answer and the report.
        return Example(prompt=prompt, columns={"answer": entry["answer"], "entry": entry})

    def train_example(self, index: int) -> Example:
        """Example `index` of the train stream (a pure function of seed and index)."""
        return self._example(self.train[index % TRAIN_SIZE], self.shots[index % TRAIN_SIZE])

    def train_stream(self, start: int = 0) -> Iterator[Example]:
        index = start
        while True:
            yield self.train_example(index)
            index += 1
