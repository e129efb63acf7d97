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


def test_a_task_drawing_ids_past_the_tokenizer_sizes_the_model_for_them():
    """--task mqar --task-opt vocab=1000 draws ids up to 999, and the model was given the byte tokenizer's 256
    rows: an IndexError traceback at the first step, after the run directory was written."""
    from difftx.config import ModelConfig
    from difftx.errors import ConfigError
    from difftx.train.config import TrainConfig
    from difftx.train.distributed import World
    from difftx.train.domain import LMDomain

    domain = LMDomain(TrainConfig(task="mqar", task_options={"vocab": 1000}, seq_len=64), World())
    domain.prepare()
    mcfg = ModelConfig.from_preset("nano")
    vocab = domain.model_overrides(mcfg)["vocab_size"]
    x, y = domain.train_batches(0, 1)[0].values()
    assert vocab >= 1000 and int(x.max()) < vocab and int(y.max()) < vocab
    with pytest.raises(ConfigError, match="vocab_size"):
        domain.model_overrides(mcfg.replace(vocab_size=256), frozenset({"vocab_size"}))
