"""A dataset row's images: read from files, PIL images or `datasets`' {"bytes", "path"}, and where a
prompt's messages place them ({"type": "image"} parts, TRL's convention).
"""

from __future__ import annotations

import io
from pathlib import Path

from grpokit.tasks.task import DataError


def open_image(value, base: Path | None, where: str):
    """An image of a dataset row as an RGB PIL image (as_rgb): a PIL image, a file path (relative to
    `base`, the data file's folder), or `datasets`' {"bytes", "path"}; DataError naming `where`,
    and the file, otherwise: a URL, a folder, an animated image."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return as_rgb(value, where, "the image")
    if isinstance(value, dict) and (value.get("bytes") or value.get("path")):
        value = io.BytesIO(value["bytes"]) if value.get("bytes") else value["path"]
    if isinstance(value, str) and value.split("://", 1)[0].lower() in ("http", "https", "s3", "gs", "ftp"):
        raise DataError(f"{where}: image {value} is a URL, which grpokit does not fetch: download it and give the "
                        "file's path (relative to the data file's folder, or absolute)")
    if isinstance(value, (str, Path)):
        path = Path(value)
        if not path.is_absolute() and base is not None:
            path = base / path
        if path.is_dir():
            raise DataError(f"{where}: image {path} is a folder, not an image file: name one file per image")
        if not path.is_file():
            raise DataError(f"{where}: image file {path} does not exist")
        value = path
    elif not isinstance(value, io.BytesIO):
        raise DataError(f"{where}: an image must be a file path, a PIL image or {{'bytes': ...}}, got "
                        f"{type(value).__name__}")
    name = value if isinstance(value, Path) else "(bytes)"
    try:
        with Image.open(value) as image:
            return as_rgb(image, where, name)
    except (UnidentifiedImageError, OSError) as e:
        raise DataError(f"{where}: cannot read image {name}: {e}") from None


def as_rgb(image, where: str, name) -> object:
    """`image` as RGB, its values as they are meant: 8-bit modes as PIL converts them; 16-bit and
    32-bit integer and float greyscale scaled to 8 bits by their type's range (65535 -> 255; a
    float image in [0, 1] -> [0, 255]; integers that stay under 256, or floats under 256 above 1,
    as they are), where PIL's own conversion clips at 255 (a 16-bit picture would turn white).
    An animated image (several frames) is refused: which frame is meant is not for grpokit to guess."""
    import numpy as np
    from PIL import Image

    if getattr(image, "n_frames", 1) > 1:
        raise DataError(f"{where}: image {name} is animated ({image.n_frames} frames), and a prompt's image is one "
                        "picture: save the frame you mean as an image file of its own")
    if image.mode.startswith("I") or image.mode == "F":
        values = np.asarray(image, dtype=np.float64)
        high = float(values.max()) if values.size else 0.0
        if image.mode == "F" and 0 <= float(values.min(initial=0)) and high <= 1:
            values = values * 255
        elif high > 255:
            if high > 65535 or float(values.min(initial=0)) < 0:
                raise DataError(f"{where}: image {name} has values from {values.min():g} to {high:g} (mode "
                                f"{image.mode}), outside a 16-bit picture's range: save it as 8 or 16 bits")
            values = values * (255 / 65535)
        image = Image.fromarray(np.clip(np.rint(values), 0, 255).astype(np.uint8), mode="L")
    return image.convert("RGB")


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
