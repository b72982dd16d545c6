"""User-facing errors.

Anything the user can fix (a config key, a path, a dataset column, a reward plugin) is raised as
`UserError`; the CLI prints its one-line message and exits with code 2, with no traceback unless
`--debug` is given. Everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input: printed as one line by the CLI, exit code 2."""


class ConfigError(UserError):
    """A config key is unknown, mistyped or holds an impossible value."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"config key '{key}': {message}" if key else message)


class TrainingAborted(Exception):
    """The run cannot go on (e.g. too many non-finite steps): one line, exit code 1."""
