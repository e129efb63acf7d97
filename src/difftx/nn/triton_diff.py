"""Differential attention as Triton kernels: the GPU's form of the fused formulation.

One forward kernel computes, per differential head and query block, the layer's lambda (from the four lambda
vectors: no host ops), both maps' online softmaxes over one pass of K1, K2 and V, the combine
o = A1 V - lambda A2 V in float32, and the per-head RMSNorm times ``weight * (1 - lambda_init)``.  The backward
is four launches: a row pass (the norm's backward, the two softmaxes' row terms, partial sums of the norm weight's
and lambda's gradients), a one-program pass reducing those partials in a fixed order (deterministic) into the
norm weight's and the four lambda vectors' gradients, and the flash-attention pair of K/V and Q passes, in which
the combined map (A1 - lambda A2) meets ONE value gradient product and ONE dO V^T product, so that the backward
does the products of the Transformer twin's (2h heads of d) in the same two-pass form; the forward does 1.5x (two
value products).  ``DIFFTX_TRITON_DQ=atomic`` (:func:`dq_atomic`) drops the Q pass: the K/V pass adds each query
block's share of dQ into a float32 buffer with atomics (as flash-attention 2), in a run-to-run varying order.

Against the two-SDPA-call path (``2call``) it replaces about 45 launches a layer and step (lambda's ~25 host ops,
the second SDPA call, the combine's, the norm's and their casts) with 5: at the small preset's 4 x 512 tokens a GPU
step waits on launches, not arithmetic (docs/performance.md).

Serves: CUDA tensors (or CPU tensors under ``TRITON_INTERPRET=1``, Triton's interpreter, for tests), float32 /
bfloat16 / float16, a causal mask over square Q/K (training, a prompt without a cache) or, without gradients, over
the last queries of a longer key sequence (a prompt after a cached prefix, decoding steps), within packed documents
and a sliding window or not (masked in the kernels), no dropout, no padding mask, head dims 16-128 that are
powers of two, grouped-query K/V.  Anything else takes ``2call``.  ``create_graph``
backwards recompute through the ``2call`` ops (differentiable), so second derivatives keep working.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from typing import Optional

import torch


def _interpret() -> bool:
    """Triton's interpreter (``TRITON_INTERPRET=1``, read by ``triton.jit`` when the kernels are first built)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _triton():
    """The kernels (None without Triton): built on first use, so importing difftx never imports Triton."""
    try:
        from . import _triton_kernels  # imports triton
    except Exception:  # not installed (CPU wheels of torch ship without it), too old, or broken
        return None
    return _triton_kernels


_FAILED: list[str] = []  # the first failure of the kernels in this process (they are then left alone)


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    """An NVIDIA GPU of compute capability 8.0 or newer (Ampere on: bf16 tensor-core products; measured on Hopper).
    ROCm builds report their GPUs as "cuda" too: not measured, left to ``2call``."""
    return torch.version.hip is None and torch.cuda.get_device_capability(index) >= (8, 0)


def available(device: torch.device) -> bool:
    """Whether the kernels can run on ``device``: an NVIDIA GPU (compute capability >= 8.0) with Triton, or the CPU
    under Triton's interpreter; ``DIFFTX_TRITON=0`` switches them off (``auto`` then takes ``2call`` on CUDA), as
    does a first failure of theirs (a warning says which)."""
    if os.environ.get("DIFFTX_TRITON", "1") == "0" or _FAILED:
        return False
    if device.type == "cuda":
        if not torch.cuda.is_available() or _triton() is None:
            return False
        return _capable(device.index if device.index is not None else torch.cuda.current_device())
    return device.type == "cpu" and _interpret() and _triton() is not None


def _failed(err: Exception) -> None:
    """The kernels failed to build or launch (an unforeseen GPU or Triton version): warn once, and every later
    call takes ``2call``."""
    import warnings

    _FAILED.append(f"{type(err).__name__}: {err}"[:300])
    warnings.warn(f"difftx: the Triton kernels of differential attention failed ({_FAILED[0]}); DIFF attention "
                  "takes two SDPA calls from here on (DIFFTX_TRITON=0 skips the kernels from the start)",
                  RuntimeWarning, stacklevel=3)


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, dropout_p: float) -> bool:
    """Whether this call fits the kernels (see the module's docstring); q (B, 2, h, N, d), k (B, 2, h_kv, Nk, d),
    v (B, h_kv, Nk, 2d); the mask causal, with or without documents and a window, no padding: over square Q/K, or,
    where no gradient is wanted, the last N of Nk positions (a prompt after a cached prefix, a decoding step)."""
    from .linear import grad_wanted, traced

    d = q.shape[-1]
    causal = mask.causal and mask.key_valid is None and mask.n_q == q.shape[3] and mask.n_k == k.shape[3] == v.shape[2]
    square = causal and mask.q_start == 0 and mask.n_q == mask.n_k
    prefix = causal and mask.q_start + mask.n_q == mask.n_k and not grad_wanted(q, k, v)
    return (dropout_p == 0 and (square or prefix) and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and k.dtype == v.dtype == q.dtype and 16 <= d <= 128 and d & (d - 1) == 0 and q.stride(-1) == 1
            and k.stride(-1) == 1 and v.stride(-1) == 1 and q.shape[2] % k.shape[2] == 0 and q.shape[3] > 0
            and not traced() and available(q.device))


def _blocks(dtype: torch.dtype, d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): two accumulators of 2d columns per query row live in registers."""
    if dtype == torch.float32:  # the products in IEEE float32 (no tensor cores): small tiles
        return 32, 32, 4, 2
    if d >= 128:  # (not measured: half of d=64's accumulator rows a warp)
        return 64, 32, 8, 2
    # bf16, d=64 on an H200 (benchmarks/performance/triton_diff.py): 64x64 tiles, 4 warps took a layer's forward +
    # backward in 1.58 ms at 16 x 2048 (64x32: 1.96; 128x32, 8 warps: 2.21; 64x32, 8 warps, 3 stages: 3.02)
    return 64, 64, 4, 2


DQ_ENV = "DIFFTX_TRITON_DQ"  # "atomic": dQ added by the K/V pass; "pass" (the default): its own pass


def dq_atomic() -> bool:
    """Whether the backward adds dQ's shares into a float32 buffer from the K/V pass with atomics (one
    recomputation of both maps where the Q pass makes a second; float sums in an order that varies from run to
    run, as SDPA's flash and memory-efficient backwards on CUDA) rather than in a pass of its own (the same bits
    every run).  Off unless ``DIFFTX_TRITON_DQ=atomic``, and off under
    ``torch.use_deterministic_algorithms(True)``: not yet timed against the Q pass on a GPU
    (``benchmarks/performance/triton_diff.py --dq pass,atomic``)."""
    return (os.environ.get(DQ_ENV, "pass").strip().lower() == "atomic"
            and not torch.are_deterministic_algorithms_enabled())


def _flat_params(lam_params, d: int) -> list[torch.Tensor]:
    out = []
    for p in lam_params:
        if p.shape != (d,):
            raise ValueError(f"differential attention: lambda vectors must be (head_dim={d},); got {tuple(p.shape)}")
        out.append(p.detach().contiguous())
    return out


def _doc_args(doc: Optional[torch.Tensor], window: int, like: torch.Tensor):
    """The kernels' document-id pointer and batch stride (0: one row for the whole batch), and the window."""
    if doc is None:
        return like, 0, window
    return doc, (doc.stride(0) if doc.shape[0] > 1 else 0), window


def _forward(q, k, v, lam_params, weight, lambda_init: float, scale: float, norm: bool, eps: float, gain: float,
             out_dtype: torch.dtype, save: bool, doc: Optional[torch.Tensor] = None, window: int = 0):
    K = _triton()
    b, _, h, n, d = q.shape
    hk, nk = k.shape[2], k.shape[3]
    bm, bn, warps, stages = _blocks(q.dtype, d)
    if n <= 16 < bm:  # a decoding step: one 16-row block (the products' least) rather than 64 rows, 63 of them idle
        bm = 16
    y = torch.empty(b, n, h, 2 * d, dtype=out_dtype, device=q.device)
    if save:
        opre = torch.empty(b, h, n, 2 * d, dtype=q.dtype, device=q.device)
        o2 = torch.empty_like(opre)
        stats = torch.empty(3, b * h * n, dtype=torch.float32, device=q.device)
    else:  # not read: the kernel skips the stores (SAVE=False)
        opre = o2 = stats = y
    lq1, lk1, lq2, lk2 = _flat_params(lam_params, d)
    w = weight.detach().contiguous() if weight is not None else y
    dp, s_db, win = _doc_args(doc, window, y)
    grid = (math.ceil(n / bm), b * h)
    K.diff_fwd[grid](
        q, k, v, lq1, lk1, lq2, lk2, w, y, opre, o2, stats, dp,
        q.stride(0), q.stride(1), q.stride(2), q.stride(3),
        k.stride(0), k.stride(1), k.stride(2), k.stride(3),
        v.stride(0), v.stride(1), v.stride(2), s_db,
        n, nk, nk - n, h, h // hk, scale * 1.4426950408889634, float(lambda_init), float(eps), float(gain), win,
        D=d, BM=bm, BN=bn, NORM=norm, HAS_W=weight is not None, SAVE=save,
        PREC="ieee" if q.dtype == torch.float32 else None, HAS_DOC=doc is not None, HAS_WIN=window > 0,
        MASKED=doc is not None or window > 0, num_warps=warps, num_stages=stages)
    return y, opre, o2, stats


def _reference(q, k, v, lam_params, weight, lambda_init: float, scale: float, norm: bool, eps: float, gain: float,
               out_dtype: torch.dtype, doc: Optional[torch.Tensor] = None, window: int = 0) -> torch.Tensor:
    """The same output through differentiable torch ops (the ``2call`` path): (B, N, h, 2d)."""
    from . import backends
    from .fused import rms_norm
    from .mask import AttnMask

    lam = backends.diff_lambda(*lam_params, lambda_init)
    n, nk = q.shape[3], k.shape[3]
    mask = AttnMask(causal=True, n_q=n, n_k=nk, q_start=nk - n, doc_ids=doc, window=window or None)
    o1, o2 = backends.diff_sdpa(q[:, 0], q[:, 1], k[:, 0], k[:, 1], v, mask, scale, 0.0, "2call")
    o = backends.combine(o1, o2, lam).transpose(1, 2)
    if norm:
        return rms_norm(o, weight, eps, gain, out_dtype)
    return o.to(out_dtype)


class _DiffAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, lq1, lk1, lq2, lk2, weight, doc, meta):
        lambda_init, scale, norm, eps, gain, out_dtype, window = meta
        y, opre, o2, stats = _forward(q, k, v, (lq1, lk1, lq2, lk2), weight, lambda_init, scale, norm, eps, gain,
                                      out_dtype, True, doc, window)
        ctx.save_for_backward(q, k, v, lq1, lk1, lq2, lk2, weight, opre, o2, stats, doc)
        ctx.meta = meta
        return y

    @staticmethod
    def backward(ctx, dy):
        *inputs, opre, o2, stats, doc = ctx.saved_tensors  # the eight inputs (q, k, v, the lambdas, the weight)
        need = ctx.needs_input_grad[:8]
        if torch.is_grad_enabled():  # create_graph: a differentiable recomputation through torch's ops
            return (*_reference_grads(dy, inputs, doc, ctx.meta, need, create_graph=True), None, None)
        try:
            return (*_backward(dy, inputs, opre, o2, stats, doc, ctx.meta, need), None)
        except torch.OutOfMemoryError:
            raise
        except Exception as err:  # the backward's kernels did not build or launch: the gradients through torch's ops
            _failed(err)
            return (*_reference_grads(dy, inputs, doc, ctx.meta, need, create_graph=False), None, None)


def _reference_grads(dy, inputs, doc, meta, need, create_graph: bool) -> list:
    """The eight inputs' gradients through :func:`_reference`, recomputed from the inputs themselves (so that with
    ``create_graph`` they stay functions of them, on SDPA's math kernel: CUDA's memory-efficient and flash kernels
    have no double backward); None where not needed."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, lq1, lk1, lq2, lk2, weight = inputs
    lambda_init, scale, norm, eps, gain, out_dtype, window = meta
    with torch.enable_grad(), (sdpa_kernel(SDPBackend.MATH) if create_graph else contextlib.nullcontext()):
        y = _reference(q, k, v, (lq1, lk1, lq2, lk2), weight, lambda_init, scale, norm, eps, gain, out_dtype, doc,
                       window)
    wanted = [i for i, (t, r) in enumerate(zip(inputs, need)) if r and t is not None]
    grads = torch.autograd.grad(y, [inputs[i] for i in wanted], dy, create_graph=create_graph, allow_unused=True)
    out = [None] * 8
    for i, gr in zip(wanted, grads):
        out[i] = gr
    return out


def _backward(dy, inputs, opre, o2, stats, doc, meta, need):
    """The kernels' backward (see the module's docstring)."""
    q, k, v, lq1, lk1, lq2, lk2, weight = inputs
    lambda_init, scale, norm, _, gain, _, window = meta
    K = _triton()
    b, _, h, n, d = q.shape
    hk = k.shape[2]
    g = h // hk
    bm, bn, warps, stages = _blocks(q.dtype, d)
    dy = dy.contiguous()
    do = torch.empty(b, h, n, 2 * d, dtype=q.dtype, device=q.device)
    delta = torch.empty(2, b * h * n, dtype=torch.float32, device=q.device)
    n_m = math.ceil(n / bm)
    part = torch.empty(n_m * b * h, 2 * d + 1, dtype=torch.float32, device=q.device)
    lam_params = _flat_params((lq1, lk1, lq2, lk2), d)
    w = weight.detach().contiguous() if weight is not None else dy
    K.diff_bwd_rows[(n_m, b * h)](
        dy, opre, o2, w, stats, do, delta, part, *lam_params,
        n, h, float(lambda_init), float(gain),
        D=d, BM=bm, NORM=norm, HAS_W=weight is not None, num_warps=warps, num_stages=stages)
    small = torch.empty(6 * d, dtype=torch.float32, device=q.device)  # dq1, dk1, dq2, dk2 (lambda), dw
    K.diff_bwd_reduce[(1,)](part, part.shape[0], *lam_params, small, D=d, BP=32, num_warps=4)
    atomic = dq_atomic()
    # dQ: its own pass (deterministic), or float32 shares added by the K/V pass (atomic: no second recomputation)
    dq32 = torch.zeros(b, 2, h, n, d, dtype=torch.float32, device=q.device) if atomic else dy
    dk = torch.empty(b, 2, hk, n, d, dtype=q.dtype, device=q.device)
    dv = torch.empty(b, hk, n, 2 * d, dtype=q.dtype, device=q.device)
    qk_scale = scale * 1.4426950408889634
    prec = "ieee" if q.dtype == torch.float32 else None
    dp, s_db, win = _doc_args(doc, window, dy)
    strides = (q.stride(0), q.stride(1), q.stride(2), q.stride(3),
               k.stride(0), k.stride(1), k.stride(2), k.stride(3),
               v.stride(0), v.stride(1), v.stride(2), s_db)
    masks = {"HAS_DOC": doc is not None, "HAS_WIN": window > 0, "MASKED": doc is not None or window > 0}
    K.diff_bwd_kv[(math.ceil(n / bn), b * hk)](
        q, k, v, do, stats, delta, dk, dv, dq32, *lam_params, dp, *strides,
        n, h, hk, g, qk_scale, scale, float(lambda_init), win, D=d, BM=bm, BN=bn, PREC=prec, **masks,
        DQ_ATOMIC=atomic, num_warps=warps, num_stages=stages)
    if atomic:
        dq = dq32.to(q.dtype)
    else:
        dq = torch.empty(b, 2, h, n, d, dtype=q.dtype, device=q.device)
        K.diff_bwd_q[(n_m, b * h)](
            q, k, v, do, stats, delta, dq, *lam_params, dp, *strides,
            n, h, g, qk_scale, scale, float(lambda_init), win, D=d, BM=bm, BN=bn, PREC=prec, **masks,
            num_warps=warps, num_stages=stages)
    lam_grads = [small[i * d:(i + 1) * d] for i in range(4)]
    lam_grads = [gr.to(p.dtype) if need[3 + i] else None for i, (gr, p) in enumerate(zip(lam_grads, inputs[3:7]))]
    dw = small[4 * d:].to(weight.dtype) if weight is not None and need[7] else None
    return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None, *lam_grads, dw, None)


def diff_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam_params, lambda_init: float, scale: float,
                   weight: Optional[torch.Tensor] = None, norm: bool = True, eps: float = 1e-5, gain: float = 1.0,
                   out_dtype: Optional[torch.dtype] = None, doc_ids: Optional[torch.Tensor] = None,
                   window: Optional[int] = None) -> torch.Tensor:
    """Causal differential attention, its combine and (``norm``) the per-head RMSNorm: (B, N, h, 2d).

    q (B, 2, h, N, d) (maps first), k (B, 2, h_kv, Nk, d), v (B, h_kv, Nk, 2d), Nk >= N: the queries are the last
    N of the Nk positions (Nk > N: a prompt after a cached prefix, a decoding step); ``lam_params`` the four lambda
    vectors (lq1, lk1, lq2, lk2), each (d,); lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init, in float32.
    With ``norm`` each row of 2d is RMS-normalised (float32 statistics) and scaled by ``weight`` (or 1) times
    ``gain``; without it the combined output as it is.  ``out_dtype``: default q's dtype.  ``doc_ids`` (B or 1, Nk)
    integer: a query sees only the keys of its own document (packed sequences); ``window``: a query sees only the
    keys less than that many positions before it (itself included), as :class:`~difftx.nn.mask.AttnMask`.
    Gradients through the kernels need Nk = N; with Nk > N they come from torch's ops (:func:`reference`)."""
    out_dtype = out_dtype or q.dtype
    win = int(window or 0)
    doc = None if doc_ids is None else doc_ids.contiguous()
    meta = (float(lambda_init), float(scale), bool(norm), float(eps), float(gain), out_dtype, win)
    params = tuple(lam_params)
    tensors = (q, k, v, *params, weight)
    _flat_params(params, q.shape[-1])  # (wrong shapes are the caller's error, raised here, not a kernel failure)
    if k.shape[3] < q.shape[3] or v.shape[2] != k.shape[3]:
        raise ValueError(f"differential attention: {q.shape[3]} queries need at least as many keys and one value per "
                         f"key; got {k.shape[3]} keys and {v.shape[2]} values")
    try:
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
            if k.shape[3] != q.shape[3]:  # the backward's kernels take square Q/K
                return _reference(q, k, v, params, weight, *meta[:2], norm, eps, gain, out_dtype, doc, win)
            return _DiffAttention.apply(q, k, v, *params, weight, doc, meta)
        return _forward(q, k, v, params, weight, meta[0], meta[1], norm, eps, gain, out_dtype, False, doc, win)[0]
    except torch.OutOfMemoryError:
        raise
    except Exception as err:  # the kernels did not build or launch here: the same output through torch's ops
        _failed(err)
        return _reference(q, k, v, params, weight, *meta[:2], norm, eps, gain, out_dtype, doc, win)


def reference(q, k, v, lam_params, lambda_init: float, scale: float, weight=None, norm: bool = True,
              eps: float = 1e-5, gain: float = 1.0, out_dtype: Optional[torch.dtype] = None,
              doc_ids: Optional[torch.Tensor] = None, window: Optional[int] = None) -> torch.Tensor:
    """:func:`diff_attention` through torch's ops (``2call``), for tests and second derivatives."""
    return _reference(q, k, v, lam_params, weight, lambda_init, scale, norm, eps, gain, out_dtype or q.dtype,
                      doc_ids, int(window or 0))
