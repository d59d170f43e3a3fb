"""Whether something answers at a URL a run depends on (a judge, a teacher, a rollout server):
asked at start-up, so that a run does not find out at its first step, in a message about scores."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

from grpokit.runtime.errors import StartupError


def unreachable(url: str, timeout: float, proxies: bool = True) -> str | None:
    """Why nothing answers a GET of `url` within `timeout` seconds, or None when something does
    (whatever it answers: an HTTP error is an answer). `proxies`: through the environment's proxies
    (HTTPS_PROXY, NO_PROXY), as the judge's client goes; else directly, as a rollout server's and a
    teacher's clients go."""
    opener = urllib.request.build_opener(*(() if proxies else (urllib.request.ProxyHandler({}),)))
    try:
        with opener.open(url, timeout=timeout):
            return None
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError, ValueError) as e:  # refused, no such host, a timeout, a bad URL
        return str(getattr(e, "reason", None) or e)


def reach(url: str, setting: str, wait_s: float, probe: str = "", proxies: bool = True) -> None:
    """Something answers at `url` + `probe` (`unreachable`), tried for `wait_s` seconds (a server
    starting beside the run has that long): StartupError naming `setting` and the URL otherwise."""
    deadline, delay = time.monotonic() + wait_s, 0.5
    while (why := unreachable(url.rstrip("/") + probe, min(10.0, max(1.0, wait_s)), proxies)) is not None:
        if time.monotonic() + delay > deadline:
            raise StartupError(f"{setting}={url}: nothing answers there ({why}; tried for {wait_s:g} s). Start it "
                               f"first, or correct {setting}")
        time.sleep(delay)
        delay = min(2 * delay, 8.0)
