"""Where a run reports: ``metrics.jsonl`` (always), TensorBoard (optional) and a progress bar.

``metrics.jsonl`` holds one JSON object per line: training rows (``step``,
``loss``, ``lr``, ``grad_norm``, ``tokens``, ``tokens_per_s``, ``elapsed``, and at
the diagnostics interval ``lambdas`` and ``grad_norms``), evaluation rows
(``step``, ``val_loss``, ...).  On resume the rows after the resumed step are
dropped (they belong to the steps about to be recomputed), so the file always
describes one consistent history.  Only rank 0 writes.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Optional

from ..errors import ConfigError

METRICS_FILE = "metrics.jsonl"


class MetricsLogger:
    def __init__(self, run_dir: Path, enabled: bool = True, tensorboard: bool = False,
                 resume_step: Optional[int] = None, history: Optional[Path] = None):
        """``resume_step``: keep the rows up to it; ``history``: the run dir they come from (a fork)."""
        self.enabled = enabled
        self.path = Path(run_dir) / METRICS_FILE
        self.tb = None
        if not enabled:
            return
        if resume_step is None:
            self.path.write_text("")
        else:
            self._truncate_after(resume_step, Path(history or run_dir) / METRICS_FILE)
        self._f = open(self.path, "a", encoding="utf-8")
        if tensorboard:
            try:
                self.tb = _writer(run_dir, resume_step)
            except BaseException:  # no tensorboard, or its log dir cannot be made: the error as it is, no file open
                self._f.close()
                raise

    def _truncate_after(self, step: int, source: Path) -> None:
        from ..io import atomic_write_text

        if not source.is_file():
            self.path.write_text("")
            return
        keep = []
        for line in source.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a crash
            if row.get("step", 0) <= step:
                keep.append(line)
        atomic_write_text(self.path, "".join(line + "\n" for line in keep))

    def has(self, step: int, key: str) -> bool:
        """Whether the file already holds a row of ``step`` with ``key`` (a resumed finished run's final evals)."""
        if not self.enabled or not self.path.is_file():
            return False
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if row.get("step") == step and key in row:
                return True
        return False

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        self._f.write(json.dumps(row, allow_nan=True) + "\n")
        self._f.flush()
        if self.tb is not None:
            step = row["step"]
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
                elif k == "lambdas" and v:
                    for i, lam in enumerate(v, 1):
                        if lam is not None:
                            self.tb.add_scalar(f"lambda/layer_{i}", lam, step)
                elif k == "grad_norms":
                    for name, g in v.items():
                        self.tb.add_scalar(f"grad_norm/{name}", g, step)

    def close(self) -> None:
        if self.enabled:
            self._f.close()
            if self.tb is not None:
                self.tb.close()


def _writer(run_dir: Path, resume_step: Optional[int]):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError("tensorboard", "needs the tensorboard package: pip install 'difftx[tensorboard]'") from None
    # the events after the resumed step (a run started afresh: all of them) are hidden, as MetricsLogger drops their
    # rows
    return SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=(resume_step or 0) + 1)


class Progress:
    """A tqdm bar (loss, lr, grad norm, throughput; tqdm adds the ETA), or plain lines when not a terminal."""

    def __init__(self, total: int, initial: int, enabled: Optional[bool], unit: str = "tok", is_main: bool = True):
        from tqdm.auto import tqdm

        if enabled is None:
            enabled = sys.stderr.isatty()
        self.unit = unit
        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                        disable=not (enabled and is_main), desc="train")
        self.is_main = is_main

    def update(self, loss: float, lr: float, grad_norm: float, rate: float) -> None:
        if self.bar.disable:
            return
        self.bar.set_postfix_str(f"loss {loss:.4f} lr {lr:.2e} gnorm {grad_norm:.3f} {rate:,.0f} {self.unit}/s",
                                 refresh=False)
        self.bar.update(1)

    def write(self, msg: str) -> None:
        if not self.is_main:
            return
        if self.bar.disable:
            print(msg, flush=True)
        else:
            self.bar.write(msg)

    def close(self) -> None:
        self.bar.close()
