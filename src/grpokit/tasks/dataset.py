"""Datasets from files: JSONL, JSON, CSV, Parquet, a `datasets.save_to_disk` folder, or a Hub id.

A dataset becomes a task shaped like the built-in ones: a train stream that is a pure function of
(seed, position) (epoch e visits the rows in an order seeded by (seed, e), so a run can resume
anywhere), a held-out split, and the columns that reward functions receive. Every row is checked
before training starts; a bad one is an error naming the file, the row and the problem.

Prompts follow TRL's two shapes: a list of chat messages ({"role", "content"}), rendered with the
model's chat template, or a string. A string is sent as one user message through the chat
template (`data.chat_template=true`, the default) or as plain text (false, TRL's behaviour).

Images, for vision-language models, as TRL takes them: an `image` column (one) or an `images`
column (a list), each a file path (relative to the data file's folder), a PIL image or `datasets`'
{"bytes", "path"}. A message's content may then be a list of parts, {"type": "image"} and
{"type": "text", "text": ...}, one image part per image in order; a prompt without image parts gets
its images before the text of its first user message (a plain-text prompt with images becomes a
user message, whatever data.chat_template says: plain text has no place for an image).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path

from grpokit.runtime.errors import ConfigError
from grpokit.settings.schema import DataConfig
from grpokit.tasks.task import RESERVED, DataError, Example, stream_from


# The roles a chat message may have (what chat templates render).
ROLES = ("system", "user", "assistant", "tool")
# What data.long_prompts may say.
LONG_PROMPTS = ("drop", "truncate")


def read_rows(path: str) -> list[tuple[str, dict]]:
    """Rows of a dataset, each with where it came from ("file.jsonl:line 3") for error messages."""
    p = Path(path)
    suffix = p.suffix.lower()
    if p.is_dir():
        return _rows_from_datasets(path, lambda: _datasets().load_from_disk(path))
    if p.is_file():
        if suffix == ".jsonl":
            return _jsonl(p)
        if suffix == ".json":
            return _json(p)
        if suffix == ".csv":
            with p.open(newline="") as f:
                rows = []
                for i, row in enumerate(csv.DictReader(f), start=1):  # row 1: the first after the header
                    if None in row:
                        raise DataError(f"{p}:row {i}: more fields than the header has columns")
                    rows.append((f"{p}:row {i}", dict(row)))
                return rows
        if suffix == ".parquet":
            return _rows_from_datasets(path, lambda: _datasets().Dataset.from_parquet(path))
        raise DataError(f"{p}: unsupported file type {suffix!r}; use .jsonl, .json, .csv, .parquet or a folder")
    if suffix in (".jsonl", ".json", ".csv", ".parquet") or path.startswith((".", "/")):
        raise DataError(f"data file {p} does not exist")
    # Not a local path: a Hub dataset id (needs internet).
    return _rows_from_datasets(path, lambda: _datasets().load_dataset(path, split="train"))


def _datasets():
    try:
        import datasets
    except ImportError:
        raise DataError("reading Parquet, dataset folders and Hub datasets needs `pip install datasets`") from None
    return datasets


def _rows_from_datasets(path: str, load: Callable) -> list[tuple[str, dict]]:
    try:
        dataset = load()
    except Exception as e:  # noqa: BLE001 - any loader failure is reported with the path
        raise DataError(f"cannot load dataset {path!r}: {type(e).__name__}: {e}") from None
    if isinstance(dataset, _datasets().DatasetDict):  # a folder or Hub id with several splits
        if "train" not in dataset:
            raise DataError(f"dataset {path!r} has splits {list(dataset)} but no 'train' split")
        dataset = dataset["train"]
    return [(f"{path}:row {i}", dict(row)) for i, row in enumerate(dataset, start=1)]


def _jsonl(p: Path) -> list[tuple[str, dict]]:
    rows = []
    with p.open(encoding="utf-8-sig") as f:  # -sig: a byte-order mark some editors write is not data
        for i, line in enumerate(f, start=1):
            # Without its line break: json would place an error at the end of the line on "line 2".
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                where = "at the end of the line" if e.pos >= len(line.rstrip()) else f"at column {e.colno}"
                hint = "; JSONL holds one object per line" if line.strip() in ("{", "[") else ""
                raise DataError(f"{p}:line {i}: not valid JSON ({e.msg} {where}){hint}") from None
            if not isinstance(row, dict):
                raise DataError(f"{p}:line {i}: expected a JSON object, got {type(row).__name__}")
            rows.append((f"{p}:line {i}", row))
    return rows


def _json(p: Path) -> list[tuple[str, dict]]:
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{p}:line {e.lineno}: not valid JSON ({e.msg})") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise DataError(f"{p}: expected a list of objects (or {{\"data\": [...]}})")
    for i, row in enumerate(data, start=1):
        if not isinstance(row, dict):
            raise DataError(f"{p}:row {i}: expected a JSON object, got {type(row).__name__}")
    return [(f"{p}:row {i}", row) for i, row in enumerate(data, start=1)]


def _is_content(content) -> bool:
    """A message's content: a string, or a list of text and image parts."""
    return isinstance(content, str) or (isinstance(content, list) and all(
        isinstance(p, dict) and (p.get("type") == "image" or (p.get("type") == "text" and isinstance(p.get("text"), str)))
        for p in content))


def _text(content) -> str:
    return content if isinstance(content, str) else "".join(p["text"] for p in content if p["type"] == "text")


# The columns that hold a row's images (TRL's names).
IMAGE_COLUMNS = ("image", "images")


def row_images(row: dict, where: str, base: Path | None) -> tuple:
    """The images of a row (its `image` or `images` column) as RGB PIL images."""
    from grpokit.tasks.images import open_image

    present = [c for c in IMAGE_COLUMNS if row.get(c) is not None]
    if not present:
        return ()
    if len(present) == 2:
        raise DataError(f"{where}: both an 'image' and an 'images' column; give the images in one")
    value = row[present[0]]
    if present[0] == "image" and isinstance(value, (list, tuple)):
        raise DataError(f"{where}: the 'image' column holds one image, and this row's holds a list of "
                        f"{len(value)}: name the column 'images' for several (TRL's name)")
    values = list(value) if present[0] == "images" and isinstance(value, (list, tuple)) else [value]
    return tuple(open_image(v, base, where) for v in values)


def to_example(row: dict, where: str, cfg: DataConfig, base: Path | None = None) -> Example:
    """One dataset row as an Example; DataError naming `where` when the row cannot be used.
    base: the folder that image paths are relative to (the data file's)."""
    if row.get(cfg.prompt_column) is None:
        present = sorted(k for k, v in row.items() if v is not None)
        raise DataError(f"{where}: no column {cfg.prompt_column!r} (data.prompt_column); columns: {present}")
    prompt = row[cfg.prompt_column]
    if isinstance(prompt, str):
        if cfg.prompt_template:
            try:
                prompt = cfg.prompt_template.format(**row)
            except (KeyError, IndexError, ValueError) as e:
                raise DataError(f"{where}: data.prompt_template {cfg.prompt_template!r} cannot be filled: {e!r}") from None
        if not prompt.strip():
            raise DataError(f"{where}: the prompt (column {cfg.prompt_column!r}) is empty")
        if cfg.chat_template:
            prompt = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and _is_content(m.get("content")) for m in prompt
    ):
        # Role and content, and a few-shot conversation's tool calls and tool names.
        prompt = [{k: m[k] for k in ("role", "content", "tool_calls", "name") if k in m} for m in prompt]
        for i, m in enumerate(prompt):
            if m["role"] not in ROLES:
                raise DataError(f"{where}: message {i} of the prompt (column {cfg.prompt_column!r}) has role "
                                f"{m['role']!r}; a chat template knows {', '.join(ROLES)}")
        if not any(_text(m["content"]).strip() or isinstance(m["content"], list) for m in prompt):
            raise DataError(f"{where}: the prompt (column {cfg.prompt_column!r}) has only empty messages")
    else:
        raise DataError(
            f"{where}: the prompt (column {cfg.prompt_column!r}) must be a string or a non-empty list of "
            f"{{role, content}} messages (content: a string, or a list of text and image parts), got {str(prompt)[:80]!r}"
        )
    images = row_images(row, where, base)
    prompt = _place_images(prompt, len(images), where, cfg)
    if cfg.system_prompt:
        if isinstance(prompt, str):
            prompt = cfg.system_prompt + "\n\n" + prompt
        elif prompt[0]["role"] != "system":
            prompt = [{"role": "system", "content": cfg.system_prompt}, *prompt]
    columns = {k: v for k, v in row.items() if k != cfg.prompt_column}
    if cfg.answer_column is not None:
        if row.get(cfg.answer_column) in (None, ""):
            raise DataError(f"{where}: no value in column {cfg.answer_column!r} (data.answer_column; null if none)")
        columns["answer"] = row[cfg.answer_column]  # what the built-in rewards read
    return Example(prompt=prompt, columns=columns, images=images, where=where)


def _place_images(prompt, count: int, where: str, cfg: DataConfig):
    """The prompt with one image part per image: as it has them, or added before the first user
    message's text; DataError when it has image parts that do not match the images."""
    from grpokit.tasks.images import image_parts, with_image_parts

    parts = image_parts(prompt)
    if parts == count:
        return prompt
    if parts:
        raise DataError(f"{where}: the prompt has {parts} image part(s) ({{'type': 'image'}}) but the row has {count} "
                        f"image(s) (column 'image' / 'images'): one part per image, in order")
    if isinstance(prompt, str):  # plain text has no place for an image: a user message holds both
        prompt = [{"role": "user", "content": prompt}]
    if not any(m["role"] == "user" for m in prompt):
        raise DataError(f"{where}: the prompt has no user message to put its {count} image(s) in")
    return with_image_parts(prompt, count)


class DatasetTask:
    """A dataset (data.path) as a task; `prompt_length(example)` counts a prompt's tokens, and
    `image_tokens(example)` how many of them its images take (said when every prompt is too long)."""

    reward_functions = ()  # a dataset brings no rewards of its own: reward.functions names them

    def __init__(self, cfg: DataConfig, seed: int, prompt_length: Callable[[Example], int],
                 image_tokens: Callable[[Example], int] = lambda example: 0):
        self.seed, self._image_tokens = seed, image_tokens
        self.notes: list[str] = []  # what loading did that the user should know (shown at start)
        examples = self._load(cfg.path, cfg, prompt_length)
        if cfg.eval_path:
            held_out = self._load(cfg.eval_path, cfg, prompt_length)
            self.eval_examples, self.train_examples = held_out[: cfg.eval_size], examples
            if "answer" in examples[0].columns and "answer" not in held_out[0].columns:
                raise DataError(f"{cfg.eval_path}: no column {cfg.answer_column!r} (data.answer_column), which "
                                f"{cfg.path} has: the reward functions would get no answer to score held-out prompts by")
        else:
            order = list(range(len(examples)))
            random.Random(f"data-split-{seed}").shuffle(order)
            held_out = set(order[: cfg.eval_size])
            self.eval_examples = [examples[i] for i in sorted(held_out)]
            self.train_examples = [e for i, e in enumerate(examples) if i not in held_out]
        self._empty_reason = (
            f"{cfg.path}: no training prompts left ({len(examples)} usable, data.eval_size={cfg.eval_size} held out)"
        )
        self._orders: dict[int, list[int]] = {}

    def _load(self, path: str, cfg: DataConfig, prompt_length) -> list[Example]:
        rows = read_rows(path)
        # Every row gets every column (None where a row lacks it), as `datasets` does: reward
        # functions receive one list per column, whatever rows a batch holds.
        columns = list(dict.fromkeys(k for _, row in rows for k in row))
        for name in columns:
            if name in RESERVED:
                raise DataError(f"{path}: column {name!r} clashes with an argument every reward function receives; rename it")
        if cfg.answer_column not in (None, "answer") and "answer" in columns:
            raise DataError(f"{path}: has its own 'answer' column, which data.answer_column={cfg.answer_column!r} "
                            "would overwrite; rename one, or set data.answer_column=answer")
        if cfg.answer_column == "answer" and "answer" not in columns:
            # The default name, and no row has it (TRL's datasets name their columns freely): no
            # `answer` argument; a reward function that needs one says so at start-up.
            cfg = dataclasses.replace(cfg, answer_column=None)
        base = Path(path).parent if Path(path).is_file() else None  # image paths are relative to a data file
        examples = [to_example({k: row.get(k) for k in columns}, where, cfg, base) for where, row in rows]
        if not examples:
            raise DataError(f"{path}: no rows")
        if cfg.max_prompt_length is None:
            return examples
        kept, dropped, truncated, shortest = [], 0, 0, (float("inf"), "", None)
        for (where, _), e in zip(rows, examples):
            try:
                length = prompt_length(e)
            except ConfigError as error:  # the prompt's own message, with the row named
                raise DataError(str(error) if str(error).startswith(f"{where}: ") else f"{where}: {error}") from None
            shortest = min(shortest, (length, where, e), key=lambda s: s[0])
            if length <= cfg.max_prompt_length:
                kept.append(e)
            elif cfg.long_prompts == "drop":
                dropped += 1
            elif e.images:
                raise DataError(f"{where}: the prompt is {length} tokens with its {len(e.images)} image(s), over "
                                f"data.max_prompt_length={cfg.max_prompt_length}, and an image's tokens are never cut: "
                                "raise data.max_prompt_length, or set data.long_prompts=drop to leave such rows out")
            else:  # the last max_prompt_length tokens are kept when it is encoded (rollouts.prompt_ids)
                kept.append(e)
                truncated += 1
        if dropped:
            self.notes.append(f"{path}: dropped {dropped} of {len(examples)} prompts longer than "
                              f"data.max_prompt_length={cfg.max_prompt_length} tokens")
        if truncated:
            self.notes.append(f"{path}: truncated {truncated} of {len(examples)} prompts to their last "
                              f"{cfg.max_prompt_length} tokens (data.long_prompts=truncate)")
        if not kept:
            length, where, example = shortest
            images = f", {self._image_tokens(example)} of them for its {len(example.images)} image(s)" if example.images \
                else ""
            raise DataError(f"{path}: every prompt is longer than data.max_prompt_length={cfg.max_prompt_length}: the "
                            f"shortest is {length} tokens{images} ({where})")
        return kept

    def train_example(self, index: int) -> Example:
        """Example `index` of the train stream: a pure function of (seed, index)."""
        epoch, position = divmod(index, len(self.train_examples))
        if epoch not in self._orders:
            order = list(range(len(self.train_examples)))
            random.Random(f"data-order-{self.seed}-{epoch}").shuffle(order)
            self._orders = {epoch: order}  # one epoch at a time is all a stream needs
        return self.train_examples[self._orders[epoch][position]]

    def train_stream(self, start: int = 0) -> Iterator[Example]:
        if not self.train_examples:  # fine for `grpokit eval`, not for training
            raise DataError(self._empty_reason)
        return stream_from(self, start)

