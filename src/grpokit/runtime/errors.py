"""The errors that stop a run before it trains, each a message that names the culprit.

Kept apart from config/ so that every module can raise them without importing the config tree
(the config imports the registries it validates against: losses, tasks, engines, dtypes).
"""


class StartupError(Exception):
    """The run cannot start (a bad config, an unreadable model or dataset, an unwritable or full
    output folder): one message naming the culprit, raised before any training."""


class ConfigError(StartupError, ValueError):
    """A config problem, stated as the field that is wrong and how to fix it."""
