"""What MetricsLogger writes on a resume (metrics.jsonl and the TensorBoard log tell one history)."""

import json
import sys
import types


class _Writer:
    made: list = []

    def __init__(self, log_dir, purge_step=None, **kw):
        self.log_dir, self.purge_step = log_dir, purge_step
        _Writer.made.append(self)

    def add_scalar(self, tag, value, step):
        pass

    def close(self):
        pass


def test_a_resumed_tensorboard_log_purges_the_steps_after_the_checkpoint(tmp_path, monkeypatch):
    """metrics.jsonl drops the rows after the resumed step; the TensorBoard log kept its events of those steps (a run
    killed past its last checkpoint, or resumed from an earlier one), so TensorBoard drew both histories over each
    other.  The writer of a resumed run now purges the steps after it (purge_step), as metrics.jsonl does; a run that
    starts at step 0 (--resume auto of a run killed before its first checkpoint) empties metrics.jsonl and purges all."""
    from difftx.train.metrics import MetricsLogger

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = _Writer
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    _Writer.made.clear()
    logger = MetricsLogger(tmp_path, tensorboard=True)
    for step in range(1, 6):
        logger.log({"step": step, "loss": 1.0 / step})
    logger.close()
    assert _Writer.made[-1].purge_step == 1  # a run started afresh (--resume auto before any checkpoint): all

    logger = MetricsLogger(tmp_path, tensorboard=True, resume_step=3)
    logger.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert _Writer.made[-1].purge_step == 4  # the events of steps 4 and 5 are hidden, step 3's kept


def test_a_tensorboard_that_cannot_start_leaves_no_file_open(tmp_path, monkeypatch):
    """metrics.jsonl was opened before the TensorBoard writer was made: a missing tensorboard package (a clear
    ConfigError) or a writer that raises (a log dir that cannot be made) left the file open.  The error still comes
    out as it was, and the file is closed."""
    import pytest

    from difftx.errors import ConfigError
    from difftx.train import metrics

    opened = []

    def tracking_open(*args, **kwargs):
        f = open(*args, **kwargs)
        opened.append(f)
        return f

    monkeypatch.setattr(metrics, "open", tracking_open, raising=False)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # not installed: the import raises
    with pytest.raises(ConfigError, match="tensorboard package"):
        metrics.MetricsLogger(tmp_path, tensorboard=True)
    assert len(opened) == 1 and opened[0].closed

    class Refuses:
        def __init__(self, log_dir, **kw):
            raise NotADirectoryError(20, "Not a directory", log_dir)

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = Refuses
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    with pytest.raises(NotADirectoryError, match="Not a directory"):
        metrics.MetricsLogger(tmp_path, tensorboard=True)
    assert len(opened) == 2 and opened[1].closed
