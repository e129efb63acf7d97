"""The study's progress display: which jobs run, at which step, and the ETA of the whole study.

On a terminal one status line is redrawn in place (finished jobs are printed
above it); otherwise a status line every ``every_s`` seconds and a line per
finished job, so logs stay readable.  The ETA weighs every job by its cost
(:func:`difftx.compare.jobs.step_cost` x steps) and learns seconds per unit of
cost from the steps already done, so it holds across arms of different speed;
it divides the remaining work by the number of parallel workers.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

MEASURE_GUESS_S = 4.0  # measurements after training, until one has been timed


def fmt_duration(s: Optional[float]) -> str:
    if s is None:
        return "?"
    s = max(0, int(round(s)))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class StudyProgress:
    def __init__(self, jobs: list, costs: dict, workers: int, stream: Optional[TextIO] = None,
                 tty: Optional[bool] = None, every_s: float = 15.0, enabled: bool = True):
        self.jobs = {j.key: j for j in jobs}
        self.cost = dict(costs)                      # key -> cost of one step
        self.workers = max(1, workers)
        self.stream = sys.stderr if stream is None else stream  # looked up now: sys.stderr can be replaced
        self.enabled = enabled
        self.tty = self.stream.isatty() if tty is None else tty
        self.every_s = every_s
        self.state: dict[str, dict] = {}             # key -> {"phase", "step", "t0", "t_train"}
        self.done: set[str] = set()
        self.train_s = 0.0                           # seconds and cost units of finished training
        self.train_units = 0.0
        self.measure_s: list[float] = []
        self.t0 = time.monotonic()
        self._last_line = 0.0
        self._width = 0

    # ------------------------------------------------------------------ events
    def handle(self, e: dict) -> None:
        key, now = e.get("job"), time.monotonic()
        if key not in self.jobs:
            return
        st = self.state.setdefault(key, {"phase": "train", "step": 0, "t0": now})
        kind = e["event"]
        if kind == "start":
            st.update(phase="train", step=0, t0=now)
        elif kind == "step":
            st["step"] = e["step"]
            st["loss"] = e.get("loss")
        elif kind == "measure":
            j = self.jobs[key]
            steps = max(st["step"], 1)
            self.train_s += now - st["t0"]
            self.train_units += steps * self.cost[key]
            st.update(phase="measure", tm=now, step=j.steps)
        elif kind == "done":
            if st.get("phase") == "measure":
                self.measure_s.append(now - st["tm"])
            self.finish(key, e.get("note"))
            return
        self.render()

    def finish(self, key: str, note: Optional[str] = None) -> None:
        """A job is complete (also: found complete on resume)."""
        self.done.add(key)
        self.state.pop(key, None)
        if note:
            self.line(f"done {self.jobs[key].describe()}: {note}")
        self.render(force=True)

    # ------------------------------------------------------------------ estimates
    def eta(self) -> Optional[float]:
        running_units = sum(st["step"] * self.cost[k] for k, st in self.state.items() if st["phase"] == "train")
        running_s = sum(time.monotonic() - st["t0"] for st in self.state.values() if st["phase"] == "train")
        units, secs = self.train_units + running_units, self.train_s + running_s
        if units <= 0 or secs <= 0 or (not self.train_units and running_units < 20 * min(self.cost.values())):
            return None
        rate = secs / units
        measure = sum(self.measure_s) / len(self.measure_s) if self.measure_s else MEASURE_GUESS_S
        left = 0.0
        for key, j in self.jobs.items():
            if key in self.done:
                continue
            st = self.state.get(key)
            step = st["step"] if st and st["phase"] == "train" else 0
            if st and st["phase"] == "measure":
                left += max(0.0, measure - (time.monotonic() - st["tm"]))
                continue
            left += (j.steps - step) * self.cost[key] * rate + measure
        return left / self.workers

    # ------------------------------------------------------------------ output
    def status(self) -> str:
        parts = [f"compare {len(self.done)}/{len(self.jobs)} jobs", f"{fmt_duration(time.monotonic() - self.t0)} "
                 f"elapsed", f"ETA {fmt_duration(self.eta()) if self.eta() is not None else 'estimating'}"]
        for key, st in sorted(self.state.items()):
            j = self.jobs[key]
            what = f"{st['step']}/{j.steps}" if st["phase"] == "train" else "measuring"
            parts.append(f"{j.describe()} {what}")
        return " | ".join(parts)

    def render(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if self.tty:
            if not force and now - self._last_line < 0.2:
                return
            text = self.status()
            self.stream.write("\r" + text + " " * max(0, self._width - len(text)))
            self._width = len(text)
            self.stream.flush()
        elif force or now - self._last_line >= self.every_s:
            self.stream.write(self.status() + "\n")
            self.stream.flush()
        else:
            return
        self._last_line = now

    def line(self, text: str) -> None:
        """A message above the status line."""
        if not self.enabled:
            return
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0
