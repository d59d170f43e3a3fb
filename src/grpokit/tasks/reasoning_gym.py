"""reasoning-gym's procedural tasks (`pip install 'grpokit[reasoning-gym]'`):
`data.task=reasoning_gym:<dataset name>`, with the generator's arguments in `data.task_args`.

A stream is cut into blocks of BLOCK entries, block k being reasoning-gym's dataset of size BLOCK
and seed s + k * BLOCK: entry `index` of the train stream is a pure function of (seed, index), so a
run resumes anywhere, and no dataset is ever larger than a block (some datasets generate all their
entries up front). Most datasets draw entry i from Random(seed + i): for them the stream is the one
dataset of seed s, whatever the block size. The held-out prompts come from seed s + 10^9, so they
never repeat the first 10^9 train entries.

Each prompt is reasoning-gym's "direct" system prompt (answer between <answer> tags, no reasoning),
one worked example (another entry's question, answered `<answer>...</answer>`, from a third seed)
and the entry's question: a small model shown no example never uses the tags. Completions are scored by the `reasoning_gym` reward (rewards/
reasoning_gym.py), which hands the answer to the dataset's own `score_answer`.
"""

from __future__ import annotations

from collections.abc import Iterator

from grpokit.runtime.errors import ConfigError
from grpokit.tasks.task import Example, stream_from

PREFIX = "reasoning_gym:"
BLOCK = 1000
# Seeds from the run's seed s: s for the train prompts, s + EVAL_OFFSET for the held-out ones, and
# two more streams for their worked examples.
EVAL_OFFSET = 10**9
SHOTS_OFFSET = 2 * 10**9
EVAL_SHOTS_OFFSET = 3 * 10**9


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


class _Stream:
    """Entries 0, 1, ... of reasoning-gym's dataset `name` from `seed` on, a block at a time."""

    def __init__(self, name: str, seed: int, arguments: dict):
        self.name, self.seed, self.arguments = name, seed, arguments
        self.block, self.dataset = 0, create(name, seed, BLOCK, arguments)

    def __getitem__(self, index: int) -> dict:
        block = index // BLOCK
        if block != self.block:
            self.block, self.dataset = block, create(self.name, self.seed + block * BLOCK, BLOCK, self.arguments)
        return self.dataset[index % BLOCK]


class ReasoningGymTask:
    reward_functions = (("reasoning_gym", 1.0),)

    def __init__(self, name: str, arguments: dict, seed: int = 0, eval_size: int = 100):
        self.name, self.arguments = name, arguments
        self.train = _Stream(name, seed, arguments)  # first: names a missing library or a bad name or argument
        from reasoning_gym.utils import SYSTEM_PROMPTS

        self.system_prompt = SYSTEM_PROMPTS["direct"]
        self.shots = _Stream(name, seed + SHOTS_OFFSET, arguments)
        held_out, held_out_shots = _Stream(name, seed + EVAL_OFFSET, arguments), _Stream(name, seed + EVAL_SHOTS_OFFSET, arguments)
        self.eval_examples = [self._example(held_out[i], held_out_shots[i]) for i in range(eval_size)]

    def _example(self, entry: dict, shot: dict) -> Example:
        prompt = [{"role": "system", "content": self.system_prompt},
                  {"role": "user", "content": shot["question"]},
                  {"role": "assistant", "content": f"<answer>{shot['answer']}</answer>"},
                  {"role": "user", "content": entry["question"]}]
        # `entry` is what score_answer reads, `task_args` the generator's arguments (some datasets'
        # score_answer reads them); `answer` is there for exact_answer and the report.
        return Example(prompt=prompt, columns={"answer": entry["answer"], "entry": entry, "task_args": self.arguments})

    def train_example(self, index: int) -> Example:
        """Example `index` of the train stream (a pure function of seed and index)."""
        return self._example(self.train[index], self.shots[index])

    def train_stream(self, start: int = 0) -> Iterator[Example]:
        return stream_from(self, start)
