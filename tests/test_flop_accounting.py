"""``difftx.accounting.flops_per_token`` against the FLOPs ``torch.utils.flop_counter`` counts in real passes.

Every matmul runs as an aten op the counter sees: the eager attention backend (the maps materialised, full
N x N, so the count is the non-causal one) and the native CPU kernels off.  The counter counts a multiply-add
as 2 FLOPs and a backward as the products autograd runs (about 2x forward), as the accounting does.  The
conventions the two differ by, each checked exactly below:

* the accounting counts the model's FLOPs: DIFF's combined map (A1 - lambda A2) applied once to the 2d-wide
  value, as the eager backend (and the CPU's fused kernel) computes it, so DIFF's eager pass is counted
  exactly; DIFF as two SDPA calls (SPEC App. A, what runs on CUDA) applies each map to the value, one more
  value product, 2 x N x h(2d) per token and layer, that the accounting does not credit.  DIFF V2's eager
  reference and SDPA path apply each of the 2h maps to its value before combining: 2 x N x hd more;
* a vision model's images get no gradient, so its training pass skips the patch embedding's input
  gradient: 2 x (patch weights) x patches per image fewer than 3x forward.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from difftx import ModelConfig
from difftx.accounting import flops_per_token
from difftx.models import build_model
from difftx.nn import native

N = 16  # tokens of a language-model sequence


def _addmm_(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def counter() -> FlopCounterMode:
    """A FlopCounterMode that also counts ``addmm_`` (difftx.nn.linear accumulates dx of Q, K, V with it)."""
    return FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: _addmm_})


@pytest.fixture(autouse=True)
def _torch_only(monkeypatch):
    """torch's own ops, which FlopCounterMode counts: no native kernels, and float32 products on torch's GEMM (a
    oneDNN product is not counted)."""
    from difftx.nn import linear

    monkeypatch.setattr(native, "ENABLED", False)
    monkeypatch.setattr(linear, "ONEDNN_FP32", False)


def counted(cfg, training: bool, variant: str | None = None) -> int:
    """FLOPs of one forward (+ backward) of one sequence or image, as FlopCounterMode counts them."""
    model = build_model(cfg).train(training)
    if variant is not None:
        model.set_attention_backend("sdpa", variant)
    if cfg.domain == "lm":
        x = torch.randint(0, cfg.vocab_size, (1, N))
    else:
        x = torch.randn(1, cfg.in_channels, cfg.image_size, cfg.image_size)
    with sdpa_kernel(SDPBackend.MATH), counter() as fc:
        if training:
            model(x).logits.sum().backward()
        else:
            with torch.no_grad():
                model(x)
    return fc.get_total_flops()


def tokens(cfg) -> int:
    return N if cfg.domain == "lm" else cfg.n_patches + (cfg.pooling == "cls")


CONFIGS = {
    "softmax": ("nano", {}),
    "softmax-gqa": ("nano", {"n_kv_heads": 2}),
    "tied-gelu-learned": ("nanogpt", {}),
    "diff": ("nano", {"attention": "diff"}),
    "diff2": ("nano", {"attention": "diff2"}),
    "dnt": ("nano", {"norms": "dnt"}),
    "diff-dnt": ("nano", {"attention": "diff", "norms": "dnt"}),
    "post-norm": ("nano", {"norms": "post"}),
    "vit": ("vit-tiny", {}),
    "vdnt": ("vdnt-tiny", {}),
    "diff-vit-mean": ("vit-tiny", {"attention": "diff", "pooling": "mean"}),
}


def expected_difference(cfg, training: bool) -> int:
    """Accounted minus counted FLOPs of one sequence or image, by the conventions of the module docstring."""
    n = tokens(cfg)
    diff = 0
    if cfg.attention == "diff2":  # a pair's second value product, 2 x n x (h x d) per token and layer
        diff -= 2 * n * (cfg.n_heads * cfg.head_dim) * cfg.n_layers * n * (3 if training else 1)
    if cfg.domain == "vision" and training:  # no input gradient through the patch embedding
        diff += 2 * cfg.in_channels * cfg.patch_size ** 2 * cfg.d_model * cfg.n_patches
    return diff


@pytest.mark.parametrize("training", [False, True], ids=["forward", "training"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_accounting_matches_counted_flops(name, training):
    preset, overrides = CONFIGS[name]
    cfg = ModelConfig.from_preset(preset, attn_backend="eager", **overrides)
    n = tokens(cfg)
    accounted = flops_per_token(cfg, n, causal=False, training=training) * n
    got = counted(cfg, training)
    # flops_per_token is an int: a vision model's per-image terms spread over its tokens round down by < 1 a token
    slack = n - 1 if cfg.domain == "vision" else 0
    assert 0 <= got + expected_difference(cfg, training) - accounted <= slack, (accounted, got)


@pytest.mark.parametrize("training", [False, True], ids=["forward", "training"])
def test_diff_two_call_formulation_does_one_value_product_more_than_counted(training):
    """DIFF as two SDPA calls applies each map to the 2d-wide value: 1.5x the attention FLOPs the accounting
    counts (the model's, its Transformer twin's), which stays the twin's count."""
    cfg = ModelConfig.from_preset("nano", attention="diff")
    extra = 2 * N * (cfg.n_heads * 2 * cfg.head_dim) * cfg.n_layers * N * (3 if training else 1)
    assert counted(cfg, training, variant="2call") == flops_per_token(cfg, N, training=training) * N + extra
    twin = cfg.twin("softmax")
    assert flops_per_token(cfg, N, training=training) == flops_per_token(twin, N, training=training)


def test_bench_decode_flops_match_a_counted_decode(monkeypatch):
    """The bench's decode FLOPs per token: each step's token at position p attends to p + 1 keys (the prompt's
    and the tokens decoded so far, its own included), so decode_tokens steps after a prompt of P tokens average
    P + (decode_tokens + 1) / 2 keys.  It counted P + decode_tokens // 2: half a token short, or a whole one at
    an odd count."""
    from difftx.benchmarking import speed

    monkeypatch.setattr(speed, "matmul_peak", lambda *a, **k: 1e9)  # the peak's timing is not under test
    bc = speed.BenchConfig(preset="nano", seq_len=16, batch_size=1, repeats=1, warmup=0, dtypes=["fp32"],
                           arms=["transformer"], peers=False, phases=["decode"], decode_tokens=5, memory=False)
    n = torch.get_num_threads()
    try:
        res = speed.run_bench(bc, log=lambda *_: None)
    finally:
        torch.set_num_threads(n)
    per_token = res["arms"]["transformer"]["by_dtype"]["fp32"]["decode"]["flops_per_token"]

    cfg = ModelConfig.from_preset("nano", attn_backend="eager")
    arm = speed.Arm("transformer", build_model(cfg).eval(), cfg, peer=False)
    fc, calls = counter(), []

    def timer() -> float:  # Arm.decode reads the timer just before its first step and just after its last
        (fc.__enter__ if not calls else fc.__exit__)(*([] if not calls else [None, None, None]))
        calls.append(1)
        return 0.0

    with torch.no_grad():
        arm.decode(torch.randint(0, cfg.vocab_size, (1, 11)), 5, timer)
    assert len(calls) == 2
    assert per_token * 5 == fc.get_total_flops()


@pytest.mark.parametrize("window", [1, 5, 40, 64, 100])
def test_a_sliding_window_counts_only_the_keys_each_query_sees(window):
    """Under a sliding window the attention term counts each query's visible keys, min(t + 1, window) for the query
    at t, summed by a loop here: within the half-key convention of the causal count (N / 2 for N + 1 / 2); a
    decoding step's keys are the window's; a window as long as the sequence counts as none."""
    from difftx.accounting import attention_flops_per_token

    n = 64
    cfg = ModelConfig.from_preset("nano", attention="diff", max_seq_len=n)
    windowed = cfg.replace(sliding_window=window)
    per_key = attention_flops_per_token(cfg, 1.0)
    exact = sum(min(t + 1, window) for t in range(n)) / n  # mean visible keys
    base = flops_per_token(cfg, n, causal=True) - attention_flops_per_token(cfg, n / 2)
    got = (flops_per_token(windowed, n, causal=True) - base) / per_key
    assert exact - 0.5 - 1e-6 <= got <= exact + 1e-6, (got, exact)
    step = flops_per_token(windowed, 200, causal=False) - flops_per_token(cfg, 200, causal=False)
    assert abs(step - (attention_flops_per_token(cfg, window) - attention_flops_per_token(cfg, 200))) <= 1
    assert flops_per_token(cfg.replace(sliding_window=n), n, causal=True) == flops_per_token(cfg, n, causal=True)


def test_full_attention_layers_count_the_whole_context():
    """Local and global layers: each layer's visible keys summed by a loop over the layers and the queries."""
    from difftx.accounting import attention_flops_per_token

    n, window = 64, 8
    cfg = ModelConfig.from_preset("nano", attention="diff", max_seq_len=n)
    mixed = cfg.replace(sliding_window=window, full_attention_layers=[1, cfg.n_layers])
    per_key = attention_flops_per_token(cfg, 1.0) / cfg.n_layers  # one layer's FLOPs per key
    base = flops_per_token(cfg, n, causal=False) - attention_flops_per_token(cfg, n)
    keys = sum(n if mixed.layer_window(i) is None else window
               for i in range(1, cfg.n_layers + 1))  # a decoding step after n tokens: each layer's keys
    got = (flops_per_token(mixed, n, causal=False) - base) / per_key
    assert abs(got - keys) < 1e-6, (got, keys)
    causal = (flops_per_token(mixed, n, causal=True) - base) / per_key
    exact = sum(min(t + 1, n if mixed.layer_window(i) is None else window)
                for i in range(1, cfg.n_layers + 1) for t in range(n)) / n
    assert exact - 0.5 * cfg.n_layers - 1e-6 <= causal <= exact + 1e-6, (causal, exact)
    assert mixed.layer_window(1) is None and mixed.layer_window(2) == window  # the loops above use both
