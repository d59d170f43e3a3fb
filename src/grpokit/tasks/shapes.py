"""The picture task (data.task=shapes), for vision-language models: synthetic images drawn with
PIL, each with a question whose one-word answer is checkable.

    colour  one shape; "What colour is the shape?"           red, green, blue or yellow
    shape   one shape; "What shape is it?"                    circle, square or triangle
    count   1 to 4 shapes; "How many shapes are there?"      1, 2, 3 or 4

Every image is 64x64, a white background, shapes of random size and place. A reply scores 1 when
it names the answer and none of the other options (rewards/word_answer.py). `data.task_args`
chooses the questions ({questions: [colour]}; all three by default). Example i of the train stream
is a pure function of (seed, i); the held-out split is drawn from its own seed.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from grpokit.runtime.errors import ConfigError
from grpokit.tasks.task import Example, stream_from

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 70), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
SHAPES = ("circle", "square", "triangle")
OPTIONS = {"colour": list(COLOURS), "shape": list(SHAPES), "count": ["1", "2", "3", "4"]}
QUESTIONS = {
    "colour": "What colour is the shape? Answer with one word: red, green, blue or yellow.",
    "shape": "What shape is it? Answer with one word: circle, square or triangle.",
    "count": "How many shapes are there? Answer with just the number.",
}
SIZE = 64


def draw(shapes: list[tuple[str, str, tuple[int, int, int]]]):
    """A SIZE x SIZE picture of `shapes`: (shape, colour, (x, y, r)) each, centred at (x, y), radius r."""
    from PIL import Image, ImageDraw

    picture = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    pen = ImageDraw.Draw(picture)
    for shape, colour, (x, y, r) in shapes:
        fill = COLOURS[colour]
        if shape == "circle":
            pen.ellipse((x - r, y - r, x + r, y + r), fill=fill)
        elif shape == "square":
            pen.rectangle((x - r, y - r, x + r, y + r), fill=fill)
        else:
            pen.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=fill)
    return picture


def _one(rng: random.Random) -> tuple[str, str, tuple[int, int, int]]:
    r = rng.randint(10, 20)
    return rng.choice(SHAPES), rng.choice(list(COLOURS)), (rng.randint(r + 2, SIZE - r - 3), rng.randint(r + 2, SIZE - r - 3), r)


def _several(rng: random.Random, count: int) -> list[tuple[str, str, tuple[int, int, int]]]:
    """`count` small shapes, one in each of `count` quadrants (they never overlap)."""
    quadrants = rng.sample([(0, 0), (1, 0), (0, 1), (1, 1)], count)
    shapes = []
    for qx, qy in quadrants:
        r = rng.randint(5, 9)
        x = qx * SIZE // 2 + rng.randint(r + 2, SIZE // 2 - r - 2)
        y = qy * SIZE // 2 + rng.randint(r + 2, SIZE // 2 - r - 2)
        shapes.append((rng.choice(SHAPES), rng.choice(list(COLOURS)), (x, y, r)))
    return shapes


def example(rng: random.Random, question: str) -> Example:
    """One picture and its question, drawn from `rng`."""
    if question == "count":
        count = rng.randint(1, 4)
        shapes, answer = _several(rng, count), str(count)
    else:
        shapes = [_one(rng)]
        answer = shapes[0][1] if question == "colour" else shapes[0][0]
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTIONS[question]}]}]
    columns = {"answer": answer, "options": OPTIONS[question], "question": question}
    return Example(prompt=prompt, columns=columns, images=(draw(shapes),))


class ShapesTask:
    name = "shapes"
    reward_functions = (("named_answer", 1.0),)

    def __init__(self, seed: int = 0, eval_size: int = 100, questions: list[str] | tuple[str, ...] = tuple(QUESTIONS)):
        unknown = [q for q in questions if q not in QUESTIONS]
        if unknown or not questions:
            raise ConfigError(f"data.task_args questions={list(questions)!r}: each one of {', '.join(QUESTIONS)}")
        self.seed, self.questions = seed, tuple(questions)
        rng = random.Random(f"shapes-eval-{seed}")
        self.eval_examples = [example(rng, self.questions[i % len(self.questions)]) for i in range(eval_size)]

    def train_example(self, index: int) -> Example:
        """Example `index` of the train stream (a pure function of seed and index)."""
        rng = random.Random(f"shapes-train-{self.seed}-{index}")
        return example(rng, rng.choice(self.questions))

    def train_stream(self, start: int = 0) -> Iterator[Example]:
        return stream_from(self, start)
