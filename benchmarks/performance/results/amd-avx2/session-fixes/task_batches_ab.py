# A/B: LMDomain.train_batches with the mqar task (batch 8 x 256, 50 steps, median of 5), 1 process; argv[1]: a checkout.
# Run alternately: python task_batches_ab.py OLD_CHECKOUT; python task_batches_ab.py NEW_CHECKOUT
import sys, time
sys.path.insert(0, sys.argv[1] + "/src")
import difftx
assert difftx.__file__.startswith(sys.argv[1])
from difftx.train.config import TrainConfig
from difftx.train.distributed import World
from difftx.train.domain import LMDomain
from difftx.data.tasks import get_task
from difftx.data.tokenizers import ByteTokenizer
res = []
for n_micro in (1, 4):
    dom = LMDomain(TrainConfig(batch_size=8), World())
    dom.task = get_task("mqar")(ByteTokenizer(), 256, 0)
    ts = []
    for rep in range(5):
        t = time.process_time()
        for step in range(50):
            dom.train_batches(step, n_micro)
        ts.append((time.process_time() - t) / 50)
    ts.sort(); res.append(f"accum {n_micro}: {1e3 * ts[2]:.2f} ms/step")
print(sys.argv[1], "; ".join(res))
