"""`grpokit config --check`: what `grpokit train` finds at start-up before it loads a weight, found
without starting a run. On a loaded config (its settings checked against each other, the launch
and the model's config: config/checks.py), in the order a run meets them:

    the data, tools, environment and reward functions      setup.prepare: the first row read, each
                                                            reward function's arguments, every
                                                            prompt against the model's positions
    the agent (rollout.agent)                              found, taking (client, model, row), and
                                                            the openai client installed
    a teacher (distill.teacher)                            its folder exists, or its Hub id is known
    the URLs a run reaches                                  reward.judge_url, distill.teacher,
                                                            rollout.server_url: a warning where
                                                            nothing answers now (a run waits for
                                                            them a while, and they may start beside
                                                            it)

The first problem raises what the run would raise (ConfigError, StartupError), so the command
exits as `grpokit train` does (2). What needs the model's tokenizer is checked where the model is on
this machine; a Hub id not fetched yet is checked by the run once it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from grpokit.config.checks import model_facts
from grpokit.models.loading import check_source, model_config, naming
from grpokit.rollouts.agents import find_agent, import_openai
from grpokit.runtime.reach import unreachable
from grpokit.settings.schema import Config
from grpokit.training.setup import judge_urls, prepare

# Seconds a URL's check waits for an answer: a warning, not the run's wait.
URL_TIMEOUT_S = 3.0


@dataclass
class Preflight:
    """What the checks saw: whether the model was on this machine (its data checked), and a
    warning for each URL where nothing answers."""

    model_known: bool
    warnings: list[str] = field(default_factory=list)


def preflight(config: Config) -> Preflight:
    """Every start-up check of `config` that needs no weight (module docstring): the first problem
    raised; the URLs' warnings returned."""
    check_source(config.model.name)  # a missing folder, which model_facts takes for a Hub id not fetched yet
    found = model_facts(config.model.name, local_only=True)
    urls = []  # (URL, the setting, the path asked, through the environment's proxies: as the run's clients go)
    if found is not None:
        prepared = prepare(config, model_facts=found)
        urls += [(url, setting, "/models", True) for url, _, setting in judge_urls(config, prepared)]
    if config.rollout.agent is not None:
        find_agent(config.rollout.agent)
        import_openai()
    teacher = config.distill.teacher
    if teacher is not None and not teacher.startswith(("http://", "https://")):
        with naming("distill.teacher"):
            check_source(teacher)
            model_config(teacher, local_only=True)  # (a Hub id not fetched: the run reads it)
    elif teacher is not None:
        urls.append((teacher, "distill.teacher", "/health", False))
    if config.rollout.engine == "server":
        servers = config.rollout.server_url
        urls += [(url, "rollout.server_url", "/health", False)
                 for url in ([servers] if isinstance(servers, str) else servers)]
    return Preflight(found is not None, [f"{setting}={url}: nothing answers there now ({why}); a run waits for it at "
                                         "start-up, then stops" for url, setting, probe, proxies in urls
                                         if (why := unreachable(url.rstrip("/") + probe, URL_TIMEOUT_S, proxies))])
