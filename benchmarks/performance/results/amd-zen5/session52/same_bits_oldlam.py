"""same_bits.py (../../amd-zen4/session49/same_bits.py) with DifferentialAttention.lambda_full put back to its float32 formula of
the start commit: shows that the float64 lambda is the only change of this session that moves bf16 training bits.

    python benchmarks/performance/results/amd-zen5/session52/same_bits_oldlam.py /tmp/now_oldlam.pt   (from the repo root)
"""
import sys, runpy, torch
from difftx.nn.attention import DifferentialAttention
def old(self):
    f = torch.float64 if self.lambda_q1.dtype == torch.float64 else torch.float32
    l1 = torch.exp(torch.sum(self.lambda_q1.to(f) * self.lambda_k1.to(f)))
    l2 = torch.exp(torch.sum(self.lambda_q2.to(f) * self.lambda_k2.to(f)))
    return l1 - l2 + self.lambda_init
DifferentialAttention.lambda_full = old
sys.argv = ["same_bits.py", sys.argv[1]]
runpy.run_path("benchmarks/performance/results/amd-zen4/session49/same_bits.py", run_name="__main__")
