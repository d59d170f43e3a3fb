"""A request whose client has gone (a trainer's or a judge's timeout, an agent that gave up): its
work is abandoned, so that a server does not go on generating what nobody will read.

- `unless_disconnected(request, work)`: an async handler's work, cancelled once the client
  disconnects (an agent's request waiting for its round leaves the round, rollouts/endpoint.py).
- `in_thread(request, fn, ...)`: blocking work in a worker thread, given an `abandoned` event that
  is set then. The work looks at it while it waits for the engine (`holding`) and between two
  decoded tokens (TransformersEngine.generate), and stops there.

Uvicorn learns that a client has gone when its connection closes; the handler learns it by looking
(Starlette's `Request.is_disconnected`), every POLL_S.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from contextlib import contextmanager

POLL_S = 0.2  # how often a request's connection, or a lock it waits for, is looked at


class Abandoned(Exception):
    """The client of a request went away: its work stopped, and nobody reads the answer."""


async def _disconnected(request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(POLL_S)


async def unless_disconnected(request, work):
    """The result of coroutine `work` (its body already read from `request`); once the client
    disconnects first, `work` is cancelled and Abandoned raised."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and _gone(watch):
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise Abandoned
        return await task
    finally:
        watch.cancel()
        task.cancel()  # (done: nothing; the handler itself cancelled: its work too)


async def in_thread(request, fn, *args):
    """fn(*args, abandoned=<event>) in a worker thread (the pool FastAPI runs plain `def` routes
    in); the event is set once `request`'s client disconnects, and fn stops at its next look."""
    import anyio.to_thread

    abandoned = threading.Event()
    task = asyncio.ensure_future(anyio.to_thread.run_sync(functools.partial(fn, *args, abandoned=abandoned)))
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and _gone(watch):
            abandoned.set()
        return await task  # a thread is not cancelled: it ends at its next look
    finally:
        watch.cancel()
        if not task.done():  # the handler itself cancelled (the server stopping): its work too
            abandoned.set()


def _gone(watch: asyncio.Task) -> bool:
    """Whether the connection `watch` looked at has closed (not a failure to look, which leaves the
    request to finish)."""
    return watch.done() and not watch.cancelled() and watch.exception() is None


@contextmanager
def holding(lock: threading.Lock, abandoned: threading.Event | None):
    """`lock`, held; Abandoned instead when the request is abandoned before it gets it (a queue of
    requests whose clients timed out is dropped, not generated one after another)."""
    while not lock.acquire(timeout=POLL_S):
        if abandoned is not None and abandoned.is_set():
            raise Abandoned
    try:
        if abandoned is not None and abandoned.is_set():
            raise Abandoned
        yield
    finally:
        lock.release()
