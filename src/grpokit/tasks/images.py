"""A dataset row's images: read from files, PIL images or `datasets`' {"bytes", "path"}, and where a
prompt's messages place them ({"type": "image"} parts, TRL's convention).
"""

from __future__ import annotations

import io
from pathlib import Path

from grpokit.tasks.task import DataError


def open_image(value, base: Path | None, where: str):
    """An image of a dataset row as an RGB PIL image: a PIL image, a file path (relative to `base`,
    the data file's folder), or `datasets`' {"bytes", "path"}; DataError naming `where` otherwise."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict) and (value.get("bytes") or value.get("path")):
        value = io.BytesIO(value["bytes"]) if value.get("bytes") else value["path"]
    if isinstance(value, (str, Path)):
        path = Path(value)
        if not path.is_absolute() and base is not None:
            path = base / path
        if not path.is_file():
            raise DataError(f"{where}: image file {path} does not exist")
        value = path
    elif not isinstance(value, io.BytesIO):
        raise DataError(f"{where}: an image must be a file path, a PIL image or {{'bytes': ...}}, got "
                        f"{type(value).__name__}")
    try:
        with Image.open(value) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        raise DataError(f"{where}: cannot read image {value if isinstance(value, Path) else '(bytes)'}: {e}") from None


def image_parts(prompt) -> int:
    """How many {"type": "image"} parts the messages of `prompt` hold."""
    if isinstance(prompt, str):
        return 0
    return sum(1 for m in prompt if isinstance(m.get("content"), list)
               for part in m["content"] if isinstance(part, dict) and part.get("type") == "image")


def with_image_parts(prompt: list[dict], count: int) -> list[dict]:
    """The messages with `count` image parts before the text of the first user message (how TRL
    places the images of a prompt that does not say where they go)."""
    out, placed = [], False
    for m in prompt:
        if not placed and m["role"] == "user":
            text = m["content"] if isinstance(m["content"], str) else None
            parts = [{"type": "image"} for _ in range(count)]
            content = [*parts, {"type": "text", "text": text}] if text is not None else [*parts, *m["content"]]
            m, placed = {**m, "content": content}, True
        out.append(m)
    return out
