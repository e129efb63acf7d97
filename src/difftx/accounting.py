"""Counting facts about a config: parameters, FLOPs per token, KV-cache bytes per token, and a floor
under a training process's memory.

One function per fact; ``difftx info``, the benchmarks and the compare report
all call these.

FLOPs count multiply-adds as 2 and include:
* every matrix multiply of the model (2 x the parameters used in a matmul per
  token, the LM head included, embeddings' lookups excluded);
* attention: per token, 2 x context x (total query-key width + total value width
  that the maps are applied to), summed over layers, as the model's equations
  have it (model FLOPs, not a kernel's): DIFF's combined map (A1 - lambda A2) is
  applied to its 2d-wide value once, so QK width 2hd and PV width h x 2d, its
  Transformer twin's attention FLOPs ("the same parameter count and FLOPs", SPEC
  section 1); DIFF V2's 2h query heads give QK width 2hd and each pair's combined
  map its d-wide value once, PV width hd.  Formulations that apply each map to
  the value on its own do more work than this, and the count does not credit it:
  DIFF as two SDPA calls (SPEC App. A, the CUDA path) 1.5x the attention FLOPs
  counted here, V2 over SDPA 4/3x; the CPU's fused kernel and the eager
  reference do exactly the counted DIFF attention.

``context`` defaults to the sequence length (non-causal count, as in the
PaLM/Chinchilla convention); ``causal=True`` halves the attention term.  Under a
sliding window (``sliding_window`` W < N) a query has at most W keys: the causal
context is W - W^2 / (2N) (the same continuous count, which gives N / 2 at W = N),
the non-causal one (a decoding step's keys) W; the layers of ``full_attention_layers`` count the
whole context.
Training FLOPs = 3 x forward.

A vision model's FLOPs per token are its image's over its tokens (the patches,
plus the CLS token when it pools by it): the patch embedding runs on the patches
only and the classifier once per image, not on every token.
"""

from __future__ import annotations

import torch

from .models import build_model


def _built_counts(cfg) -> tuple[int, int, int]:
    """(parameters, non-embedding parameters, weights of the Linear layers) of ``cfg``'s model, built on meta."""
    try:
        model = build_model(cfg, device="meta")
    except (RuntimeError, TypeError) as e:  # torch's traceback for a tensor of 2^63 elements or more
        if "overflow" not in str(e).lower():
            raise
        from .errors import ConfigError

        raise ConfigError(None, f"a weight of this model has more elements than torch can count (2^63): vocab_size "
                                f"{cfg.vocab_size}, d_model {cfg.d_model}, ffn_dim {cfg.ffn_dim}, max_seq_len "
                                f"{cfg.max_seq_len}; use smaller sizes") from None
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return model.num_parameters(), model.num_parameters(non_embedding=True), linear


def _counts(cfg) -> tuple[int, int, int]:
    """:func:`_built_counts` of ``cfg`` from builds with one and two blocks: every block has the same shapes (only
    lambda_init, a number, differs by layer), so n blocks count the first one's parameters plus n - 1 times the
    second's.  Building all n took ~20 ms a block (``difftx info --set n_layers=5000``: 116 s)."""
    if cfg.n_layers <= 2:
        return _built_counts(cfg)
    # (which layers skip a sliding window changes no shape: not carried to the shorter builds)
    one, two = (_built_counts(cfg.replace(n_layers=k, full_attention_layers=None)) for k in (1, 2))
    return tuple(a + (cfg.n_layers - 1) * (b - a) for a, b in zip(one, two))


def count_parameters(cfg, non_embedding: bool = False) -> int:
    """Parameters of the model ``cfg`` describes, counted on the meta device (nothing allocated)."""
    return _counts(cfg)[1 if non_embedding else 0]


def matmul_parameters(cfg) -> int:
    """Parameters that take part in a matmul for every token (excludes embeddings unless tied as head)."""
    total = _counts(cfg)[2]
    if cfg.domain == "lm" and cfg.tie_embeddings:
        total += cfg.vocab_size * cfg.d_model
    return total


def attention_flops_per_token(cfg, context: float) -> float:
    """The attention maps' FLOPs per token over all layers, ``context`` keys each (module docstring)."""
    d, h = cfg.head_dim, cfg.n_heads
    if cfg.attention == "softmax":
        qk, pv = h * d, h * d
    elif cfg.attention == "diff":  # two d-wide maps a head; their difference applied once to the 2d-wide value
        qk, pv = 2 * h * d, h * 2 * d
    else:  # diff2: 2h query heads of d; a pair's combined map applied once to its d-wide value
        qk, pv = 2 * h * d, h * d
    return 2 * context * (qk + pv) * cfg.n_layers


def flops_per_token(cfg, seq_len: int | None = None, causal: bool = False, training: bool = False) -> int:
    """Forward (or training = 3x forward) FLOPs per token at sequence length ``seq_len`` (a vision model's: its
    tokens, the default)."""
    if seq_len is None:
        seq_len = cfg.max_seq_len if cfg.domain == "lm" else cfg.n_patches + (cfg.pooling == "cls")
    window = cfg.sliding_window if cfg.domain == "lm" else None
    whole = seq_len / 2 if causal else seq_len  # not rounded: an odd length's half counts too
    if window is not None and window < seq_len:  # each query's keys: at most the window's
        local = window - window * window / (2 * seq_len) if causal else window
        full = len(cfg.full_attention_layers or ())  # layers that attend over the whole context regardless
        context = (local * (cfg.n_layers - full) + whole * full) / cfg.n_layers
    else:
        context = whole
    weights = matmul_parameters(cfg)
    if cfg.domain == "vision":  # per image: the patch embedding on the patches, the classifier once
        patch, head = cfg.in_channels * cfg.patch_size ** 2 * cfg.d_model, cfg.d_model * cfg.num_classes
        tokens = cfg.n_patches + (cfg.pooling == "cls")
        weights += (patch * cfg.n_patches + head) / tokens - patch - head
    fwd = 2 * weights + attention_flops_per_token(cfg, context)
    return int(3 * fwd if training else fwd)


def kv_cache_bytes_per_token(cfg, bytes_per_element: int = 2) -> int:
    """Bytes of K and V cached per token per sequence over all layers (default 2-byte elements)."""
    if cfg.attention == "diff":
        width = 2 * cfg.n_kv_heads * cfg.head_dim  # K1, K2 (d each) + V (2d) per group, K and V each 2 h_kv d
    else:
        width = cfg.n_kv_heads * cfg.head_dim
    return 2 * width * cfg.n_layers * bytes_per_element


# optimizer state tensors per parameter (each the parameter's size, fp32) that every step keeps
OPTIMIZER_STATES = {"adamw": 2, "muon": 1}  # muon: one momentum (AdamW on the rest has two: at least 1)


def training_memory_floor(cfg, batch_size: int, seq_len: int, optimizer: str = "adamw", momentum: float = 0.9,
                          bf16: bool = False, shards: int = 1, loss_chunk: int = 0,
                          activation_checkpointing: int = 0) -> dict:
    """A lower bound, in bytes, on the peak memory of one training process of ``cfg``.

    ``state``: fp32 weights plus the optimizer's per-parameter state, held between steps.
    ``step``: what one step adds at its high-water mark, at least the larger of the gradients and
    the activations saved for backward.  The activations counted are only those every layer must keep
    per token: six ``d_model``-wide tensors (the residual input, the norm output, q, k, v and the
    attention output), two ``ffn_dim``-wide ones (the FFN's hidden activations), and for a language
    model the logits and their gradient (of ``loss_chunk`` tokens only when the loss is chunked); fp32, or 2
    bytes each under bf16 autocast.  With
    ``attn_backend: eager`` also the fp32 attention maps, N x N per head (two per DIFF head).  A block under
    ``activation_checkpointing`` (every that-many-th block, as ``set_activation_checkpointing``) keeps only
    its ``d_model``-wide input until its backward recomputes the rest: the activations are then the larger of
    those at the end of the forward pass and those in the last recomputed block's backward.  ``shards``
    divides weights, gradients and optimizer state (FSDP).  ``total`` = ``state`` + ``step``.

    It is a floor, not an estimate: a run whose floor exceeds the free memory cannot fit.  Measured
    peaks are 1.16-1.78x it (``benchmarks/memory_floor.py``, table in ``benchmarks/results/memory_floor.md``).
    """
    params = count_parameters(cfg)
    states = OPTIMIZER_STATES.get(optimizer, 1 if momentum > 0 else 0)
    state = params * 4 * (1 + states) // shards
    n = seq_len if cfg.domain == "lm" else cfg.n_patches + (cfg.pooling == "cls")
    tokens = batch_size * n
    size = 2 if bf16 else 4
    width = 6 * cfg.d_model + 2 * cfg.ffn_dim  # per token, what a block saves for backward
    maps = 0  # bytes of one block's attention maps: the eager backend keeps them (fp32), two per DIFF head
    if cfg.attn_backend == "eager":
        maps = batch_size * cfg.n_heads * (1 if cfg.attention == "softmax" else 2) * n * n * 4
    every = activation_checkpointing
    recomputed = -(-cfg.n_layers // every) if every > 0 else 0  # blocks 0, every, 2 every, ... (0-based)
    kept = cfg.n_layers - recomputed  # blocks whose activations stay saved until backward
    logit_tokens = (min(tokens, loss_chunk) if loss_chunk > 0 else tokens) if cfg.domain == "lm" else 0
    # at the end of the forward pass: every block's saved tensors, and the logits with their gradient
    activations = (tokens * (kept * width + recomputed * cfg.d_model) + logit_tokens * 2 * cfg.vocab_size) * size \
        + kept * maps
    if recomputed:  # in the backward of the last recomputed block: its activations again, and what precedes it
        last = (cfg.n_layers - 1) // every * every
        kept_before = last - (recomputed - 1)
        activations = max(activations, tokens * ((recomputed - 1) * cfg.d_model + (kept_before + 1) * width) * size
                          + (kept_before + 1) * maps)
    gradients = params * 4 // shards
    step = max(gradients, activations)
    return {"parameters": params, "state": state, "gradients": gradients, "activations": activations,
            "step": step, "total": state + step, "tokens": tokens}
