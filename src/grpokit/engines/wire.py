"""What a trainer and a rollout server (engines/client.py, server.py) say to each other besides JSON:
the answers that refuse a request, and images as lossless PNG text.
"""

from __future__ import annotations

import base64
import io

# A rollout server's answers (HTTP 409) to a request that expects other weights than it holds,
# and to a trainer whose place another trainer took.
STALE_WEIGHTS = "stale weights"
TAKEN_OVER = "another trainer joined this server's weight group since: one server serves one trainer"
# A LoRA trainer's adapters pushed to a server whose base weights are not the trainer's.
BASE_DIFFERS = ("its base weights are not the trainer's (another checkpoint of the model, or whole weights pushed "
                "since it started): the adapters would sample from another model; restart it with the trainer's "
                "model.name")


def to_png(image) -> str:
    """A PIL image as a base64 PNG (lossless: the pixels arrive as they left)."""
    out = io.BytesIO()
    image.save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode("ascii")


def from_png(data: str):
    """to_png's image back; ValueError when `data` is not one."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(base64.b64decode(data, validate=True))) as image:
            return image.convert("RGB")
    except (ValueError, UnidentifiedImageError, OSError) as e:
        raise ValueError(f"an image is not a base64 PNG: {e}") from None
