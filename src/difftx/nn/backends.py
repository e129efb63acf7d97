"""Attention backends: the same math through different kernels.

* ``eager``: the reference.  Materialises the logits and the softmax maps in
  float32; the only path that evaluation probes (attention maps, logit
  statistics, logit quantization) can see into.
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention``.  Differential
  attention goes through :func:`diff_sdpa`, in one of several formulations
  (``DIFF_SDPA_VARIANTS``); ``auto`` picks the one measured fastest for the
  device (see benchmarks/).
* ``flex``: FlexAttention (compiled when ``DIFFTX_FLEX_COMPILE`` is not 0).

Every backend takes q (B, Hq, Nq, d), k (B, Hk, Nk, d), v (B, Hk, Nk, dv) with
Hq a multiple of Hk (GQA: query head i uses K/V head i // (Hq / Hk)), and an
:class:`~difftx.nn.mask.AttnMask`.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from .linear import grad_wanted, no_autocast, traced
from .mask import AttnMask
from .norms import upcast

# How attention reaches its kernel under the sdpa backend (``model.set_attention_backend("sdpa", v)``):
# auto (the measured winner), fused (difftx.nn.fused), sdpa (SDPA; for DIFF = 2call), 2call, 4call, triton
# (difftx.nn.triton_diff).
DIFF_SDPA_VARIANTS = ("auto", "fused", "sdpa", "2call", "4call", "triton")
_FLEX = None


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, Hk, N, d) -> (B, Hk * n_rep, N, d), each K/V head repeated for its query group."""
    if n_rep == 1:
        return x
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, n, d).reshape(b, h * n_rep, n, d)


# ----------------------------------------------------------------------------- eager reference
def eager_logits(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention logits q k^T * scale in float32 (outside autocast: the eager functions leave it), K/V heads
    repeated to the query heads."""
    k = repeat_kv(k, q.shape[1] // k.shape[1])
    return torch.matmul(upcast(q), upcast(k).transpose(-1, -2)) * scale


def masked_softmax(logits: torch.Tensor, mask: AttnMask) -> torch.Tensor:
    m = mask.dense(logits.device)
    if m is not None:
        logits = logits.masked_fill(~m, float("-inf"))
    return torch.softmax(logits, dim=-1)


def _reference(fn):
    """The eager functions compute in float32 (their matmuls are on autocast's low-precision list, which would
    undo :func:`upcast`: bf16 logits and maps, lambda rounded to bf16, fp16 logits that overflow)."""

    @functools.wraps(fn)
    def wrapper(q, *args, **kwargs):
        with no_autocast(q.device.type):
            return fn(q, *args, **kwargs)

    return wrapper


@_reference
def eager_attention(q, k, v, mask: AttnMask, scale: float, dropout_p: float = 0.0,
                    probe=None, layer: int = 0) -> torch.Tensor:
    logits = eager_logits(q, k, scale)
    if probe is not None:
        logits = probe.transform_logits(layer, 0, logits, mask)
    probs = masked_softmax(logits, mask)
    if probe is not None:
        probe.observe(layer, [logits], probs, mask.dense(logits.device))
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    v = repeat_kv(v, q.shape[1] // v.shape[1])
    return torch.matmul(probs, upcast(v)).to(q.dtype)


@_reference
def eager_diff_attention(q1, q2, k1, k2, v, lam: torch.Tensor, mask: AttnMask, scale: float,
                         dropout_p: float = 0.0, probe=None, layer: int = 0) -> torch.Tensor:
    """(softmax(Q1 K1^T s) - lam softmax(Q2 K2^T s)) V in float32 (SPEC eq. 1)."""
    l1, l2 = eager_logits(q1, k1, scale), eager_logits(q2, k2, scale)
    if probe is not None:
        l1, l2 = probe.transform_logits(layer, 0, l1, mask), probe.transform_logits(layer, 1, l2, mask)
    a1, a2 = masked_softmax(l1, mask), masked_softmax(l2, mask)
    if probe is not None:
        probe.observe(layer, [l1, l2], a1 - lam * a2, mask.dense(l1.device))
    if dropout_p > 0:
        a1, a2 = F.dropout(a1, dropout_p), F.dropout(a2, dropout_p)
    v = upcast(repeat_kv(v, q1.shape[1] // v.shape[1]))
    return torch.matmul(a1 - lam * a2, v)


@_reference
def eager_v2_attention(q, k, v, lam: torch.Tensor, mask: AttnMask, scale: float, dropout_p: float = 0.0,
                       probe=None, layer: int = 0) -> torch.Tensor:
    """DIFF V2 reference: (A_{2i} - lam_i A_{2i+1}) V over 2h query heads, float32; lam (B, h, N, 1)."""
    logits = eager_logits(q, k, scale)
    if probe is not None:
        logits = probe.transform_logits(layer, 0, logits, mask)
    probs = masked_softmax(logits, mask)
    if probe is not None:
        probe.observe(layer, [logits], probs[:, 0::2] - lam * probs[:, 1::2], mask.dense(logits.device))
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    o = torch.matmul(probs, upcast(repeat_kv(v, q.shape[1] // v.shape[1])))
    return o[:, 0::2] - lam * o[:, 1::2]


# ----------------------------------------------------------------------------- sdpa
def sdpa(q, k, v, mask: AttnMask, scale: float, dropout_p: float = 0.0) -> torch.Tensor:
    """SDPA with grouped-query heads.  On CUDA in float32 (no flash kernel) K and V are repeated to the
    query heads instead of ``enable_gqa``, which only flash and the math kernel take: the math kernel
    materialises every N x N map (DIFF V2 at 16 x 2048 tokens on an H200: 5.4x the Transformer's
    training memory and 0.43x its speed, docs/performance.md)."""
    kw = {"scale": scale, "dropout_p": dropout_p}
    if q.shape[1] != k.shape[1]:
        if q.device.type == "cuda" and q.dtype == torch.float32:
            rep = q.shape[1] // k.shape[1]
            k, v = repeat_kv(k, rep), repeat_kv(v, rep)
        else:
            kw["enable_gqa"] = True
    if mask.is_plain_causal:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense(q.device), **kw)


# float32's auto takes the Triton kernels for calls of at most this much work (batch x heads x queries x keys): on an
# H200 at the small preset's 4 x 512 (4 heads) a layer's forward + backward took 1.20 ms against 2call's 1.60, and
# the bench's DIFF / Transformer float32 training read 0.76 against 0.63 in one call; at 16 x 2048 (64x the work) the
# kernels' IEEE float32 products took 34.6 ms against 12.1.  The crossover between the two is not measured.
FP32_TRITON_MAX_WORK = 4 * 4 * 512 * 512


def resolve_diff_variant(variant: str, device: torch.device, dropout_p: float = 0.0,
                         dtype: Optional[torch.dtype] = None, work: Optional[int] = None) -> str:
    """The differential-attention formulation for ``auto``: the one measured fastest (docs/performance.md).

    * ``fused``: :func:`difftx.nn.fused.fused_attention`, (A1 - lambda A2) V in query blocks, one
      value product; the Transformer's attention FLOPs, memory linear in N.  Wins on the CPU in
      every dtype (no CPU SDPA kernel takes a 2d-wide value, and 4 calls cost 2x).
    * ``2call``: two SDPA calls with the 2d-wide value (1.5x the FLOPs).  The winner on CUDA: on an
      H200 (torch 2.11) cuDNN takes it in bf16 and the memory-efficient kernel in fp32 (flash needs equal
      widths); 1.4-1.8x the Transformer twin's attention time (forward + backward, 8 x 2048 tokens), where
      4call takes 2.3-2.4x, compiled FlexAttention 1.9x and ``fused`` (no GPU kernel of its own: a
      Python loop of torch ops) 2-3x in fp32, 17-33x in bf16.  Also the only formulation
      with attention dropout, one dropout mask per map as in the reference.
    * ``4call``: four SDPA calls of width d (2x), for kernels that need equal widths.
    * ``triton``: :mod:`difftx.nn.triton_diff`, the fused formulation as Triton kernels with lambda, the
      combine and the per-head norm inside them (a causal mask over square Q/K, with documents, windows and,
      without gradients, a cached prefix (decoding) when asked for by name; other calls take ``2call``).
      ``auto`` on CUDA in bfloat16 / float16 where Triton is installed, for the plain causal mask (H200, small preset:
      a layer's forward + backward 0.85 ms against 2call's 1.91 at 4 x 512, 1.58 against 2.48 at 16 x 2048).
      float32's ``auto`` only for calls of ``work`` (batch x heads x queries x keys) up to
      :data:`FP32_TRITON_MAX_WORK`: its products in IEEE float32 ran 1.3x faster than 2call at 4 x 512 and 2.9x
      slower at 16 x 2048.

    With attention dropout every variant, ``fused``, ``4call`` and ``triton`` too, runs as ``2call``: the others
    have no dropout (``4call`` would need one mask for both halves of a map's value).
    """
    if variant == "sdpa" or (dropout_p > 0 and variant in ("auto", "fused", "4call", "triton")):
        return "2call"
    if variant != "auto":
        return variant
    if device.type == "cpu":
        return "fused"
    small_fp32 = dtype == torch.float32 and work is not None and work <= FP32_TRITON_MAX_WORK
    if (dtype not in (torch.bfloat16, torch.float16) and not small_fp32) or traced():  # compiled graphs, torch.func
        return "2call"
    from . import triton_diff

    return "triton" if triton_diff.available(device) else "2call"


FUSED_INFERENCE_MIN_QUERIES = 5  # fp32 inference with fewer queries (decoding steps) keeps CPU flash


# whether this CPU has AMX tiles, where CPU flash's bf16 kernel is the fast one (asked once, at import: a constant
# for torch.compile)
CPU_HAS_AMX = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def _cpu_fused_wins(q: torch.Tensor, dropout_p: float, windowed: bool = False) -> bool:
    """Where the fused kernel beats SDPA for softmax attention and DIFF V2 (``auto``), as measured on the
    CPU (docs/performance.md): training in every dtype (CPU flash's backward is slow: a layer's
    forward + backward 5% faster in fp32, 10% in bf16), and fp32/fp64 inference over a prompt (small
    preset, 4 x 512: prefill 5% faster for softmax and 10% for V2 on an AVX2 EPYC; on par on the AMX
    Xeon).  CPU flash keeps fp32 decoding steps (it reads K once; the fused kernel would stack K for V2's
    two maps) and bf16 inference on AMX, where its bf16 kernel won; without AMX (AVX512-BF16: AMD Zen 4)
    the fused path wins bf16 inference, decoding steps included (small preset, 4 x 512: Transformer prefill
    1.13-1.16x, decoding 1.39-1.40x; V2 1.34x and 2.29x).  CUDA keeps SDPA.  On the CPU, one-query decoding
    steps over a KV cache take the native decoding kernel before this choice (:func:`native_diff_decode`;
    softmax attention: 1.13x CPU flash in fp32, 1.41x the fused path in bf16, on an AMD Zen 5).  Under a
    sliding window (``windowed``) the fused path everywhere on the CPU: it multiplies only each block's window of
    keys, where SDPA takes the window as a dense N x N mask over every key (4 x 4096 keys, a window of 512, 8 heads
    of 64, Zen 5: 1, 3 and 512 queries 5.0x, 6.2x and 11.5x faster in fp32, 13x, 5.3x and 19x in bf16;
    ``benchmarks/sliding_window.py --inference``; CPU flash's AMX bf16 kernel not measured)."""
    if dropout_p > 0 or q.device.type != "cpu":
        return False
    if windowed or (torch.is_grad_enabled() and q.requires_grad):
        return True
    if q.dtype == torch.bfloat16:
        return not CPU_HAS_AMX
    return q.dtype in (torch.float32, torch.float64) and q.shape[-2] >= FUSED_INFERENCE_MIN_QUERIES


def resolve_softmax_variant(variant: str, q: torch.Tensor, dropout_p: float = 0.0, windowed: bool = False) -> str:
    """Softmax attention: ``sdpa`` or ``fused`` (the one-map case of the fused kernel); ``auto``:
    fused where it was measured faster (:func:`_cpu_fused_wins`).  With attention dropout: ``sdpa``
    (the fused kernel has no dropout)."""
    if variant in ("fused", "sdpa"):
        return "sdpa" if dropout_p > 0 else variant
    if variant not in ("auto", "2call", "4call", "triton"):  # (DIFF V1 formulations: nothing to choose here)
        raise ValueError(f"unknown softmax attention variant {variant!r}; one of auto, fused, sdpa")
    return "fused" if _cpu_fused_wins(q, dropout_p, windowed) else "sdpa"


def resolve_v2_variant(variant: str, q: torch.Tensor, dropout_p: float = 0.0, windowed: bool = False) -> str:
    """DIFF V2: ``fused`` (the per-token lambda combines the two maps before one d-wide value
    product) or ``sdpa`` (one call over the 2h query heads, then the combine); ``auto``: fused where
    it was measured faster (:func:`_cpu_fused_wins`).  With attention dropout: ``sdpa`` (the fused
    kernel has no dropout)."""
    if variant in ("fused", "sdpa"):
        return "sdpa" if dropout_p > 0 else variant
    if variant not in ("auto", "2call", "4call", "triton"):  # (DIFF V1 formulations: nothing to choose here)
        raise ValueError(f"unknown DIFF V2 variant {variant!r}; one of auto, fused, sdpa")
    return "fused" if _cpu_fused_wins(q, dropout_p, windowed) else "sdpa"


def fused_attention(q, k, v, mask: AttnMask, scale: float, lam: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One or two maps over one value, chunked and exact; q (B, M, H, N, d) -> (B, N, H, dv)."""
    from .fused import fused_attention as _fused

    return _fused(q, k, v, mask, scale, lam)


def diff_decode_paired(q, kk, v, mask: AttnMask, scale: float, lam: torch.Tensor) -> torch.Tensor:
    """One decoding query of DIFF V1 over a paired-layout cache as ONE SDPA call; (B, 1, h, 2d).

    kk (B, h_kv, T, 2d) holds [K1 | K2] per head and v (B, h_kv, T, 2d).  Query rows [q1, 0] and
    [0, q2] of width 2d give exactly the logits q1.K1 and q2.K2, and grouped-query attention lets
    both rows of every head share that head's keys and values; so the kernel reads K and V once
    (the KV bytes of the Transformer twin) and returns A1 V and A2 V, combined here in fp32.  On
    the CPU this is the flash kernel: in bf16, 0.82 ms per layer call at the small preset's decoding
    shapes against 1.0 ms for two GEMMs and a softmax (docs/performance.md).
    """
    b, _, h, n, d = q.shape
    hk = kk.shape[1]
    g = h // hk
    qq = q.new_zeros(b, hk, g, 2, n, 2 * d)
    qq[..., 0, :, :d] = q[:, 0].reshape(b, hk, g, n, d)
    qq[..., 1, :, d:] = q[:, 1].reshape(b, hk, g, n, d)
    allowed = mask.dense(q.device)
    o = F.scaled_dot_product_attention(qq.view(b, hk * g * 2, n, 2 * d), kk, v, attn_mask=allowed, scale=scale,
                                       enable_gqa=True)
    o = o.view(b, h, 2, n, 2 * d).float()
    out = o[:, :, 0] - lam * o[:, :, 1]  # (B, h, n, 2d), fp32
    return out.transpose(1, 2)


def native_diff_decode_ok(q, k, v, mask: AttnMask, out_dtype: torch.dtype) -> bool:
    """Whether :func:`native_diff_decode` takes this decoding step: one causal query over a cache's
    keys ``k`` (B, 2, h_kv, T, d) in float32 or bfloat16 on the CPU, the native kernels built
    (difftx.nn.native) and not switched off; not under torch.compile (a ctypes call is no graph op: inductor
    failed to compile the decoding step around it) or a torch.func transform."""
    from . import native

    if traced():
        return False
    ok = (torch.float32, torch.bfloat16)
    return (q.dtype in ok and k.dtype == v.dtype == q.dtype and out_dtype in ok and mask.causal
            and mask.n_q == 1 and k.shape[3] == mask.n_k and mask.q_start == mask.n_k - 1
            and native.supports(q.dtype, q.device))


def native_diff_decode(q, k, v, mask: AttnMask, scale: float, lam: torch.Tensor, norm: bool,
                       weight: Optional[torch.Tensor], gain: float, eps: float, out_dtype: torch.dtype):
    """One decoding step of DIFF V1 and its per-head RMSNorm (weight x gain) in one native call over the
    cache's keys (B, 2, h_kv, T, d) and values (B, h_kv, T, 2d), strided views of either key layout
    (:func:`difftx.nn.attention._cache_keys`): (B, 1, h, 2d).  DIFF V2: keys (B, h_kv, T, d) expanded to both
    maps, values (B, h_kv, T, d), ``lam`` (B, h) per sequence and head, no norm: (B, 1, h, d).

    Replaces the logits and value GEMMs (or the paired SDPA call), the two softmaxes, the combine
    and the norm's casts (about a dozen small ops per layer and step) with one pass over K and V."""
    from . import native

    # A sliding window: the cache's last ``window`` keys only, as views (the older keys are not read at all)
    start = max(0, mask.q_start - mask.window + 1) if mask.windowed else 0
    if start:
        k, v = k[..., start:, :], v[..., start:, :]
    valid = None
    if mask.key_valid is not None or mask.doc_ids is not None:
        # one row may serve the whole batch (AttnMask.check allows it); the kernel reads one row per sequence.
        # The one query's document mask is a key mask: the keys of its document.
        valid = torch.ones(1, mask.n_k, dtype=torch.bool, device=q.device)
        if mask.key_valid is not None:
            valid = mask.key_valid[:, : mask.n_k].to(q.device)
        if mask.doc_ids is not None:
            valid = valid & mask.same_document(0, 1, mask.n_k, q.device)[:, 0]
        valid = valid[:, start:].expand(q.shape[0], -1).clone()
        valid[:, mask.q_start - start] = True  # a query always sees itself
    wg = None if weight is None else weight.to(torch.float32) * gain
    return native.diff_decode(q, k, v, valid, lam, scale, norm, wg, gain, eps, out_dtype)


class _Combine(torch.autograd.Function):
    """o1 - lam o2 in float32 (at least) from the two maps' outputs, saving nothing but ``o2`` as it came
    (the SDPA kernels keep their outputs for their own backward anyway): autograd through
    ``o1.float() - lam * o2.float()`` would save a float32 copy of o2 (under bf16, 2x its bytes)."""

    @staticmethod
    def forward(ctx, o1, o2, lam):
        ctx.save_for_backward(o2, lam)
        ctx.dtypes = (o1.dtype, o2.dtype)
        with torch.no_grad():
            return upcast(o1) - lam * upcast(o2)

    @staticmethod
    def backward(ctx, dout):
        o2, lam = ctx.saved_tensors
        need = ctx.needs_input_grad
        d1 = dout.to(ctx.dtypes[0]) if need[0] else None
        d2 = (dout * -lam).to(ctx.dtypes[1]) if need[1] else None
        dlam = -(dout * upcast(o2)).sum().to(lam.dtype) if need[2] else None
        return d1, d2, dlam


def diff_lambda(lq1: torch.Tensor, lk1: torch.Tensor, lq2: torch.Tensor, lk2: torch.Tensor,
                lambda_init: float) -> torch.Tensor:
    """exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init (SPEC eq. 2), computed in float64, returned in float32 (float64 for
    float64 vectors): see :meth:`difftx.nn.attention.DifferentialAttention.lambda_full`."""
    f = torch.float64 if lq1.dtype == torch.float64 else torch.float32
    w = torch.float64
    l1 = torch.exp(torch.sum(lq1.to(w) * lk1.to(w)))
    l2 = torch.exp(torch.sum(lq2.to(w) * lk2.to(w)))
    return (l1 - l2 + lambda_init).to(f)


def combine(o1: torch.Tensor, o2: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """``upcast(o1) - lam * upcast(o2)`` (DIFF's two maps' outputs, SPEC eq. 1), lam a 0-dim tensor.  Without
    autograd (prefill, decoding) the expression itself: an autograd Function costs a decoding step its
    Python overhead for nothing; so do compiled graphs (which fuse it) and torch.func transforms."""
    if grad_wanted(o1, o2, lam) and not traced():
        return _Combine.apply(o1, o2, lam)
    return upcast(o1) - lam * upcast(o2)


def diff_sdpa(q1, q2, k1, k2, v, mask: AttnMask, scale: float, dropout_p: float = 0.0,
              variant: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """A1 V and A2 V, each (B, h, N, 2d), via SDPA calls (SPEC section 1, App. A)."""
    variant = resolve_diff_variant(variant, q1.device, dropout_p)
    if variant in ("2call", "triton"):  # (triton: these are the maps it would fuse)
        return sdpa(q1, k1, v, mask, scale, dropout_p), sdpa(q2, k2, v, mask, scale, dropout_p)
    if variant == "4call":
        va, vb = v.chunk(2, dim=-1)
        o1 = torch.cat((sdpa(q1, k1, va, mask, scale), sdpa(q1, k1, vb, mask, scale)), dim=-1)
        o2 = torch.cat((sdpa(q2, k2, va, mask, scale), sdpa(q2, k2, vb, mask, scale)), dim=-1)
        return o1, o2
    raise ValueError(f"differential sdpa variant {variant!r} is not a pair of SDPA calls; one of 2call, 4call")


# ----------------------------------------------------------------------------- flex
def _flex_fn():
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        if os.environ.get("DIFFTX_FLEX_COMPILE", "1") != "0":
            _FLEX = torch.compile(flex_attention, dynamic=False)
        else:  # unfused: materialises the scores (slow, exact); used by quick tests
            _FLEX = flex_attention
    return _FLEX


def flex(q, k, v, mask: AttnMask, scale: float) -> torch.Tensor:
    bm = mask.block_mask(q.shape[0], q.device)
    fn = _flex_fn()
    if q.device.type == "cpu" and q.dtype == torch.float64:
        # Inductor's CPU FlexAttention takes float32, float16 and bfloat16 only (a LoweringException otherwise):
        # float64 runs unfused, which is exact
        from torch.nn.attention.flex_attention import flex_attention as fn
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return fn(q, k, v, block_mask=bm, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def flex_available() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except Exception:  # pragma: no cover - old torch
        return False
    return True


def pick_backend(requested: str, probe=None, dropout_p: float = 0.0, device: Optional[torch.device] = None) -> str:
    """The backend a layer uses for this call.

    Probes force eager.  Flex falls back to sdpa where it cannot serve the call:
    attention dropout, or a backward pass on the CPU (FlexAttention has no CPU backward).
    """
    if probe is not None:
        return "eager"
    if requested == "auto":
        return "sdpa"
    if requested == "flex":
        cpu_grad = device is not None and device.type == "cpu" and torch.is_grad_enabled()
        if dropout_p > 0 or cpu_grad or not flex_available():
            return "sdpa"
    return requested
