"""The errors that stop a run, each a message that names the culprit: before it trains
(`StartupError`, `ConfigError`) or after (`RunStopped` and the errors deriving from it, each
raised where it arises). The CLI catches each base once and prints the message, no traceback.

Kept apart from config/ so that every module can raise them without importing the config tree
(the config imports the registries it validates against: losses, tasks, engines, dtypes).
"""


class StartupError(Exception):
    """The run cannot start (a bad config, an unreadable model or dataset, an unwritable or full
    output folder): one message naming the culprit, raised before any training."""


class ConfigError(StartupError, ValueError):
    """A config problem, stated as the field that is wrong and how to fix it."""

    @classmethod
    def listing(cls, problems: list[str]) -> "ConfigError":
        """Every problem found at once, a line each."""
        return cls("invalid config:\n" + "\n".join(f"  - {p}" for p in problems))


class RunStopped(Exception):
    """A started run stopped for a reason its message states in full. The newest state the weights
    match is saved where it can be (training/checkpointing.py), so the message is followed by the
    command that resumes, unless `says_what_to_do`."""

    # Raised on the process that ran the user's code (a reward function, a tool, an environment),
    # so that process says it; otherwise raised alike on every process, and process 0 says it.
    in_users_code = False
    says_what_to_do = False  # its message says what to do instead of resuming
    signum: int | None = None  # a signal stopped it: the exit status is 128 + signum, the shell's convention
    checkpoint = None  # the folder (a Path) a signal's stop after a step saved, which a resumed run continues from
