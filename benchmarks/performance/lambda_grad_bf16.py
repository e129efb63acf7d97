"""Relative L2 error of bf16 autocast gradients against float64 for DIFF's lambda_q1 and the q / o projections'
weights, layer by layer: the native kernels and the torch block path (``native.ENABLED = False``), at a DIFF
twin of a preset at random init (docs/performance.md, "Numerics").

    python3 benchmarks/performance/lambda_grad_bf16.py [preset] [attn_backend]   # default: small auto
"""
import copy
import sys

import torch

from difftx.config import ModelConfig
from difftx.models import build_model
from difftx.nn import native


def grads(model, x, autocast: bool, use_native: bool) -> dict:
    was, native.ENABLED = native.ENABLED, use_native
    try:
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x[:, :-1], targets=x[:, 1:])
        out.loss.backward()
    finally:
        native.ENABLED = was
    keep = ("lambda_q1", "q_proj", "o_proj")
    return {n: p.grad.double().clone() for n, p in model.named_parameters() if any(k in n for k in keep)}


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "small"
    backend = sys.argv[2] if len(sys.argv) > 2 else "auto"
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset(preset).twin("diff").replace(attn_backend=backend)
    model = build_model(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 256))
    ref = grads(copy.deepcopy(model).double(), x, False, False)
    runs = {"fp32": grads(model, x, False, True), "bf16 native": grads(model, x, True, True),
            "bf16 torch": grads(model, x, True, False)}
    print(f"{preset} DIFF, attn_backend={backend}: relative L2 error against float64")
    print(f"| parameter | norm | {' | '.join(runs)} |\n|---|---:|" + "---:|" * len(runs))
    for n, r in ref.items():
        s = r.norm()
        print(f"| {n} | {s:.2e} | " + " | ".join(f"{(g[n] - r).norm() / s:.3f}" for g in runs.values()) + " |")


if __name__ == "__main__":
    main()
