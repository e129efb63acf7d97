"""User-facing errors.

Anything raised as a :class:`DifftxError` is a problem with the user's input (a
config, a data path, a checkpoint, a CLI argument).  The CLI prints its message
as one line and exits with code 2; library users get an ordinary exception that
also derives from ``ValueError`` so existing ``except ValueError`` code works.
"""

from __future__ import annotations


class DifftxError(ValueError):
    """A problem with the user's input; the message names it and the fix."""


def option_flag(name: str) -> str:
    """The command-line flag of config field ``name``: ``seq_len`` -> ``--seq-len``; a ``*_options`` dict is given
    as repeated ``KEY=VALUE`` flags, ``task_options`` -> ``--task-opt``."""
    if name.endswith("_options"):
        name = name[: -len("_options")] + "_opt"
    return "--" + name.replace("_", "-")


class ConfigError(DifftxError):
    """An invalid model, training or evaluation configuration.

    ``field`` is the name of the offending field (``None`` when not one field).
    """

    def __init__(self, field: str | None, message: str):
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)


class CheckpointError(DifftxError):
    """A checkpoint that is missing, truncated, corrupt or does not match the model."""


class DataError(DifftxError):
    """A data path that is missing, empty, binary or otherwise unusable."""


class InsufficientMemory(DifftxError):
    """A run that cannot fit in the free memory of its device (see ``difftx.train.memory_check``)."""
