"""The user's code named in configs (reward functions, tools, environments): found by
`package.module:name` or `path/to/file.py:name`; async functions run on one event loop; and
sys.exit() or KeyboardInterrupt inside it stop the run as a named error (`exits_caught`), never
as a silent exit of the whole process."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import os
import signal
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path

from grpokit.runtime import signals
from grpokit.runtime.errors import ConfigError, RunStopped


# Objects a program hands grpokit (grpokit.train's tools and environment), by the name its config
# records for them: found by that name in this process.
OBJECTS: dict[str, object] = {}


def find(what: str, name: str, noun: str = "function"):
    """The object `name` ('package.module:attr' or 'path/to/file.py:attr', or a name in OBJECTS)
    names; a ConfigError that starts with `what` (e.g. "reward function 'x'") when it cannot be
    found, or when `noun` is "function" and it is not callable."""
    if name in OBJECTS:
        return OBJECTS[name]
    where, sep, attr = name.rpartition(":")
    if not sep or not where or not attr:
        raise ConfigError(f"{what}: name it 'package.module:name' or 'path/to/file.py:name' (or, from Python, pass "
                          "the object itself to grpokit.train)")
    module = _load_file(what, Path(where)) if where.endswith(".py") else _import(what, where)
    found = getattr(module, attr, None)
    if found is None or (noun == "function" and not callable(found)):
        raise ConfigError(f"{what}: {where} has no {noun} named {attr!r}")
    return found


def _import(what: str, module_name: str):
    # `python -m grpokit` puts the working directory on sys.path, the `grpokit` script does not;
    # a module next to the user should be found either way.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(
            f"{what}: cannot import module {module_name!r} ({e}); "
            f"a file can be named by its path instead, e.g. 'path/to/{module_name.split('.')[-1]}.py:name'"
        ) from None


_loaded_files: dict[Path, types.ModuleType] = {}


def _load_file(what: str, path: Path):
    """Run a user's file once (however many objects are taken from it)."""
    path = path.resolve()
    if path in _loaded_files:
        return _loaded_files[path]
    if not path.is_file():
        raise ConfigError(f"{what}: file {path} does not exist")
    # A unique module name per file: two files with the same name in different folders both load.
    module_name = f"grpokit_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and typing look a class's module up here
    try:
        spec.loader.exec_module(module)
    except ImportError as e:  # a library the file needs and this machine lacks: named, no traceback
        del sys.modules[module_name]
        raise ConfigError(f"{what}: {path} cannot import what it needs: {e} (install the package that provides "
                          "it; the file's docstring may say which)") from None
    except BaseException:
        del sys.modules[module_name]
        raise
    _loaded_files[path] = module
    return module


_loop: asyncio.AbstractEventLoop | None = None


def is_async(fn) -> bool:
    """Whether calling `fn` gives a coroutine: an `async def` function, or an object whose
    `__call__` is one (asyncio.iscoroutinefunction looks at the object itself only)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def submit(coroutine, what: str) -> concurrent.futures.Future:
    """Schedule `coroutine`, a call into the user's code (`what`, for messages), on one event loop
    that lives as long as the process (in its own thread), as TRL does: async clients and semaphores
    made on the first step still work on the next, and a caller's own running loop (Jupyter) is
    left alone. sys.exit() inside it is the future's UserCodeExit (asyncio would let it end the
    loop's thread, and the wait for the future would never end)."""
    global _loop
    if _loop is None:
        _loop = asyncio.new_event_loop()
        threading.Thread(target=_run_loop, args=(_loop,), name="grpokit-user-code", daemon=True).start()
    return asyncio.run_coroutine_threadsafe(exits_caught_async(coroutine, what), _loop)


def in_thread(fn: Callable[[], object], what: str) -> concurrent.futures.Future:
    """fn(), a call into the user's code (`what`), in a daemon thread of its own: a wait on it can
    give up (its timeout) where no signal can end it, off the main thread. One that never returns
    keeps its thread, which never holds the process's exit."""
    future = concurrent.futures.Future()
    future.set_running_or_notify_cancel()  # running: a cancel() no longer applies, the result is set

    def run():
        try:
            with exits_caught(what):
                future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on it
            future.set_exception(e)

    threading.Thread(target=run, name="grpokit-user-call", daemon=True).start()
    return future


def wait(future: concurrent.futures.Future, timeout: float | None, what: str):
    """The result of `future`, a call into the user's code (`what`), waited for up to `timeout`
    seconds (None: for ever): signals.WaitTimedOut after that; its own TimeoutError passes as any error."""
    try:
        return future.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        if future.done():  # it ended meanwhile, or raised a TimeoutError of its own
            return future.result()
        raise signals.WaitTimedOut(f"{what} did not return within {timeout:g} s") from None


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    """The loop's thread. A task the user's code starts itself (its own gather) that calls
    sys.exit() lets SystemExit out of run_forever; the loop runs on, and the code that awaited
    that task gets the exit there, inside exits_caught_async."""
    while True:
        try:
            loop.run_forever()
            return
        except BaseException:  # noqa: BLE001 - SystemExit / KeyboardInterrupt of a task: its awaiter has it too
            continue


async def exits_caught_async(coroutine, what: str):
    """`coroutine`'s result, with exits_caught around it. Each coroutine that asyncio.gather runs as
    a task of its own needs it: a task lets sys.exit() through to the loop."""
    with exits_caught(what):
        return await coroutine


class UserCodeExit(RunStopped, RuntimeError):
    """The user's code called sys.exit() or raised KeyboardInterrupt. Unhandled, either would end
    the process at once: nothing saved, and sys.exit(0) with exit status 0, as if the run had
    finished. As this error the run stops like one whose reward function raised: the last completed
    step saved, a non-zero exit status, and the command that resumes."""

    in_users_code = True


@contextlib.contextmanager
def exits_caught(what: str):
    """Run the body, a call into the user's code (`what`, e.g. "tool 'search'"), with sys.exit()
    and KeyboardInterrupt inside it turned into UserCodeExit."""
    try:
        yield
    except SystemExit as e:
        raise UserCodeExit(f"{what} called sys.exit({e.code!r}), which would have ended the process with nothing "
                           "saved") from None
    except KeyboardInterrupt:
        # Ctrl-C itself passes: pressed twice while the run's stop signals are in place (the second
        # stops at once), or under Python's own handler (no run's signals in place). Raised by the
        # code while they are, it is the code's.
        if signals.requested() or signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            raise
        raise UserCodeExit(f"KeyboardInterrupt, raised by it, stopped {what}") from None
