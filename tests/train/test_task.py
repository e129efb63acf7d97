"""`difftx train --task NAME` draws batches from the task registry (a tiny task registered here)."""

import json

import pytest
import torch

from difftx.data.tasks import TASKS, register_task
from difftx.train.domain import VAL_STEP_BASE


class RepeatTask:
    """x = a random prefix followed by itself; only the second half is scored (a copy task)."""

    def __init__(self, tokenizer, seq_len, seed, alphabet=8):
        self.seq_len, self.seed, self.alphabet = seq_len, seed, int(alphabet)
        self.calls = []

    def batch(self, batch_size, step, rank=0):
        self.calls.append((batch_size, step, rank))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 101 + rank)
        half = self.seq_len // 2
        a = torch.randint(0, self.alphabet, (batch_size, half), generator=g) + 97
        x = torch.cat([a, a], 1)
        y = torch.full_like(x, -100)
        y[:, half - 1:-1] = x[:, half:]
        return x, y


def test_task_training_learns_the_copy(tmp_path, capsys):
    from difftx.cli import main

    made = []

    @register_task("test-repeat")
    def factory(tokenizer, seq_len, seed, **opts):
        made.append(RepeatTask(tokenizer, seq_len, seed, **opts))
        return made[-1]

    try:
        out = tmp_path / "run"
        code = main(["train", "--task", "test-repeat", "--task-opt", "alphabet=4", "--d-model", "32", "--n-layers",
                     "2", "--n-heads", "2", "--seq-len", "16", "--batch-size", "8", "--steps", "60", "--lr", "3e-3",
                     "--warmup", "5", "--dtype", "fp32", "--eval-every", "0", "--eval-batches", "2", "--no-progress",
                     "--out", str(out), "--grad-accum", "2"])
        assert code == 0, capsys.readouterr().err
    finally:
        TASKS.pop("test-repeat", None)
    task = made[0]
    assert task.alphabet == 4
    train_calls = [c for c in task.calls if c[1] < VAL_STEP_BASE]
    assert train_calls[:3] == [(16, 0, 0), (16, 1, 0), (16, 2, 0)]  # a step's global batch (8 x accum 2)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["train"]["task"] == "test-repeat" and cfg["data"]["task_options"] == {"alphabet": 4}
    first, val = rows[0]["loss"], rows[-1]["val_loss"]
    assert val < 0.5 * first  # the second half is predictable: the loss falls well below chance (ln 256 = 5.5)


@pytest.mark.parametrize("world_size, n_micro", [(2, 1), (2, 2), (1, 4), (4, 1)])
def test_task_data_does_not_depend_on_processes_or_micro_batches(world_size, n_micro):
    """A step's rows over all processes and micro-batches are the same global batch whatever the split, so a run
    resumed on another process count (same global batch) neither replays nor skips task data."""
    from difftx.train.config import TrainConfig
    from difftx.train.distributed import World
    from difftx.train.domain import LMDomain

    def rows(world, n_micro, batch_size):
        out = []
        for rank in range(world):
            dom = LMDomain(TrainConfig(batch_size=batch_size), World(rank=rank, world_size=world))
            dom.task = RepeatTask(None, 8, 3)
            out += [b["input_ids"] for b in dom.train_batches(5, n_micro)]
        return torch.cat(out)

    ref = rows(1, 1, 8)
    assert torch.equal(rows(world_size, n_micro, 8 // (world_size * n_micro)), ref)


@pytest.mark.parametrize("name", ["mqar", "niah"])
def test_validation_batches_are_not_training_batches(name):
    """Validation draws steps VAL_STEP_BASE + i; the task samplers seed from 32-bit words, so the base must
    survive that (2^40 + i used to be training step i)."""
    from difftx.data import ByteTokenizer
    from difftx.data.tasks import get_task

    task = get_task(name)(ByteTokenizer(), 512 if name == "niah" else 64, 0)
    for i in range(3):
        val = task.batch(2, VAL_STEP_BASE + i, 0)[0]
        assert all(not torch.equal(val, task.batch(2, step, 0)[0]) for step in range(4))


@pytest.mark.parametrize("args,flag", [
    (["--task", "mqar", "--val-fraction", "0.2"], "--val-fraction"),
    (["--task", "mqar", "--text-field", "body"], "--text-field"),
    (["--task-opt", "pairs=4"], "--task-opt"),  # no --task: the built-in corpus, which takes no task options
    (["--task", "mqar", "--bpe-vocab-size", "300"], "--bpe-vocab-size"),  # the task's tokenizer is byte
    (["--task", "mqar", "--cache-dir", "unread-cache"], "--cache-dir"),  # a task caches no token shards
])
def test_options_the_data_source_does_not_read_are_refused(tmp_path, capsys, args, flag):
    """A synthetic --task generates its data (no corpus to split or read fields of); --task-opt needs a --task.
    Both were accepted and ignored."""
    from difftx.cli import main

    out = tmp_path / "run"
    code = main(["train", *args, "--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--seq-len", "64",
                 "--batch-size", "2", "--steps", "1", "--dtype", "fp32", "--eval-every", "0", "--eval-batches", "1",
                 "--no-progress", "--threads", "1", "--out", str(out)])
    lines = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and flag in lines[0] and "drop" in lines[0], lines
    assert not out.exists()
