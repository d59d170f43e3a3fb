"""SIGTERM and Ctrl-C: a request to stop that the training loop honours after the step in flight,
and that a wait on the user's code (a reward function) honours at once.

Launchers send SIGTERM and then, after a grace period (torchrun, SLURM's KillWait, Kubernetes: 30 s
by default), SIGKILL. A step that is running stops after its update and saves a checkpoint. A
step stuck waiting for a reward function that never returns cannot get there: the wait gives up at
the request (`waiting_on`: StoppedWhileWaiting, naming what it waited for), and the failure path
saves the state after the last completed step before the process exits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

from grpokit.runtime.errors import RunStopped

# The signal of the stop request in force (0: none); set by StopSignals' handler.
_requested = 0


def requested() -> int:
    """The signal number of this process's stop request, 0 for none."""
    return _requested


class StoppedWhileWaiting(RunStopped):
    """A stop request arrived while the step waited for the user's code, which had not returned."""

    def __init__(self, signum: int, what: str, waited: float):
        self.signum = signum
        super().__init__(f"{signal.Signals(signum).name} arrived while the step waited for {what}, which had not "
                         f"returned after {waited:.0f} s")


class WaitTimedOut(Exception):
    """The user's code did not return within its time limit."""


class _Interrupt(BaseException):
    """Raised inside the user's code to end a wait: a BaseException, so that the code's own
    `except Exception` does not swallow it. `waiting_on` turns it into `error`."""

    def __init__(self, error: Exception):
        self.error = error


@contextlib.contextmanager
def waiting_on(what: str, timeout: float | None = None):
    """Run the body, a call into the user's code (`what`, for messages), so that a stop request
    (StoppedWhileWaiting) or `timeout` seconds (WaitTimedOut) end it even if it never returns.

    The code runs in the main thread, where some libraries need to be (math-verify's own timeouts
    use SIGALRM). A watcher thread notices the stop request or the time limit and interrupts the
    main thread with SIGUSR1, whose handler raises inside the code. Off the main thread (where no
    signal can be handled) the body runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    start, done, reason = time.monotonic(), threading.Event(), []

    def watch():
        while not done.wait(0.1):
            waited = time.monotonic() - start
            if _requested:
                reason.append(StoppedWhileWaiting(_requested, what, waited))
            elif timeout is not None and waited > timeout:
                reason.append(WaitTimedOut(f"{what} did not return within {timeout:g} s"))
            if reason:
                signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
                return

    def interrupt(signum, frame):
        if reason and not done.is_set():
            raise _Interrupt(reason[0])

    previous = signal.signal(signal.SIGUSR1, interrupt)
    watcher = threading.Thread(target=watch, name="grpokit-watch", daemon=True)
    watcher.start()
    try:
        yield
    except _Interrupt as stop:
        raise stop.error from None
    finally:
        done.set()
        watcher.join()
        signal.signal(signal.SIGUSR1, previous)


class StopSignals:
    """SIGTERM and SIGINT (Ctrl-C) ask the loop to stop after the step in flight and save a
    checkpoint. A second Ctrl-C stops at once; a second SIGTERM is ignored, because launchers
    deliver one per layer (SLURM to every task, torchrun forwarding its own) and it must not kill
    the save that the first one asked for."""

    def __init__(self, is_main: bool):
        self.is_main = is_main
        self.previous = {}

    def __enter__(self):
        global _requested
        _requested = 0
        if threading.current_thread() is threading.main_thread():  # Python only allows it there
            self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def handle(self, signum, frame) -> None:
        global _requested
        if _requested:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        _requested = signum
        if self.is_main:  # os.write: safe inside a signal handler, unlike the progress bar
            os.write(2, f"\ngrpokit: {signal.Signals(signum).name} received: stopping after this step and saving "
                        "a checkpoint (Ctrl-C again to stop at once)\n".encode())

    def __exit__(self, *exc) -> None:
        global _requested
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        _requested = 0
