"""The task registry."""

import pytest

from difftx.data.tasks import TASKS, get_task, register_task
from difftx.errors import DataError


def test_register_and_get():
    @register_task("unit-test-task")
    def factory(tokenizer, seq_len, seed):
        return "sampler"

    try:
        assert get_task("unit-test-task") is factory
    finally:
        TASKS.pop("unit-test-task")


def test_unknown_task_when_builtin_task_modules_are_absent():
    """Regression: a missing difftx.evals package must not crash the lookup (it named the parent package)."""
    with pytest.raises(DataError, match="unknown task 'no-such-task'"):
        get_task("no-such-task")
