"""Run under ``python -m torch.distributed.run --nproc-per-node 2``: resumes of a run that has reached its last step.

argv: DATA CACHE OUT.  Writes OUT/finished/ (a run stopped by --stop-at, finished by a resume with --steps at that
step, then resumed once more) and OUT/summary_RANK.json (each process's summary of that last resume).
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch.distributed as dist  # noqa: E402
from _helpers import finish, phase, tiny  # noqa: E402

from difftx.train import train  # noqa: E402

data, cache, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
dist.init_process_group("gloo")
RANK = dist.get_rank()


run = out / "finished"
phase("stop_at")  # no evaluation at step 2: the checkpoint's last evaluation is not of step 2
train(*tiny(data, cache, steps=4, stop_at=2, eval_every=0), run, announce=None)
phase("finish")  # no step runs: step 2's validation is evaluated after the loop and logged, with no new checkpoint
train(*tiny(data, cache, steps=2), run, resume="auto", explicit_train={"steps"}, announce=None)
phase("again")  # the metrics file holds step 2's val_loss, the checkpoint does not: every process must agree
summary = train(*tiny(data, cache, steps=2), run, resume="auto", explicit_train={"steps"}, announce=None)
(out / f"summary_{RANK}.json").write_text(json.dumps(summary))
phase("destroy_process_group")
dist.destroy_process_group()
finish()
