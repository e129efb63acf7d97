"""The session's changes leave bf16 training's bits as they were: 3 bf16 training steps of the bench's
Transformer and DIFF arms (small preset, 4 x 512 tokens, the same seeds), every weight compared bit for bit
between the start commit and now.

    PYTHONPATH=<worktree of the start commit>/src python same_bits.py /tmp/start.pt
    python same_bits.py /tmp/now.pt
    python same_bits.py --compare /tmp/start.pt /tmp/now.pt
"""

import sys

import torch

from difftx.benchmarking.speed import BenchConfig, _train_step, build_arms


def run(out: str) -> None:
    torch.set_num_threads(2)
    res = {}
    for name in ("transformer", "diff", "diff2"):
        arm = build_arms(BenchConfig(arms=[name], peers=False), torch.device("cpu"), log=lambda s: None)[0]
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randint(0, 256, (4, 512), generator=g)
            y = torch.randint(0, 256, (4, 512), generator=g)
            _train_step(arm, x, y, "bf16", torch.device("cpu"))
        res[name] = {k: v.detach().clone() for k, v in arm.model.state_dict().items()}
    torch.save(res, out)


def compare(a_path: str, b_path: str) -> None:
    a, b = torch.load(a_path, weights_only=True), torch.load(b_path, weights_only=True)
    for arm in a:
        diff = [k for k in a[arm] if not torch.equal(a[arm][k], b[arm][k])]
        print(f"{arm}: {len(diff)} of {len(a[arm])} tensors differ {diff[:5]}")


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        run(sys.argv[1])
