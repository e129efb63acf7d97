"""Exact chunked attention for one or two softmax maps over one shared value (the ``fused`` kernel).

For differential attention the two maps are combined *before* the value
product, (A1 - lambda A2) V, so the value is read once and the attention
matmuls cost exactly what a Transformer of the same width pays: Q K^T over 2h
heads of d and one P V over h heads of 2d.  Stock kernels cannot do this (they
return A V, never A), which is why two or four SDPA calls cost 1.5-2x.

The maps are materialised one block of queries at a time (``chunk`` rows over
the keys they can see), so memory grows linearly in the sequence length; with a
causal mask a block only multiplies the keys up to its last query (the flash
kernels' block skipping).  Nothing of size N x N is saved for the backward pass:
it recomputes each block's maps (flash-style), and the -lambda weight of map 2 is
applied to the small dQ/dK products rather than to the map.

Numerics: logits are scaled inside the GEMM; lambda, the softmax statistics and the
row sums of the backward are float32 (float64 for float64 inputs).  fp32 inputs keep
the maps in fp32.  Under bf16 the maps are bf16 tensors whose softmax and sums still
accumulate in fp32 inside their kernels (``FP32_MAPS_FOR_BF16`` switches to fp32 maps:
~15% slower, barely more accurate, since the GEMM's bf16 logits dominate the error).

CPU specifics: scratch buffers are reused across blocks and calls (per thread), the
causal diagonal is an additive -inf triangle, and every reduced-precision GEMM operand
is compact (oneDNN would otherwise gather a transposed copy).

float32 on the CPU without key padding (head widths a multiple of 16 floats with AVX2, 32
with AVX-512) runs the whole loop natively instead (:func:`difftx.nn.native.attention_forward`
/ ``attention_backward``): the same blocks and the same math, each block's products through one
register-blocked micro-kernel that skips the causal tiles past the diagonal, the maps kept in the
core's cache; the forward saves each row's log-sum-exp, from which the backward rebuilds the maps
(one exp per entry, no max or sum pass).  One task per K/V head in the backward, so dK and dV are
summed in one order whatever the thread count.

Layouts (views; only a block of Q is copied at a time):
    q   (B, M, H, Nq, d)    M maps (1: softmax, 2: differential), H query heads
    k   (B, M, Hk, Nk, d)   H a multiple of Hk (GQA: query head i uses K/V head i // (H / Hk)); or
        (B, 1, Hk, Nk, d)   one K that both maps read (DIFF V2): the native kernels pack it once and sum its
                            gradient over the maps themselves; the torch blocks read it expanded
    v   (B, Hk, Nk, dv)     Nk may exceed mask.n_k (a static cache's buffers): positions past n_k
                            get zero weight (they must hold finite values, as a KVCache does)
    lam None (M = 1), a 0-dim tensor (DIFF V1) or (B, H, Nq, 1) (DIFF V2, per token)
    out (B, Nq, H, dv)      the order out_proj reads, no transpose needed
"""

from __future__ import annotations

import functools
import threading
from typing import Optional

import torch

from . import native
from .linear import functorch_active, grad_wanted, no_autocast, traced
from .norms import upcast
from .mask import AttnMask

# Rows per block: one head's block of one map (rows x keys) holds about SLICE_BYTES, so it stays
# in the core's L2 through the GEMM -> softmax -> GEMM sequence.  Measured on the 2-core
# AVX-512/AMX CPU at the small preset's shapes (B=4, N=512; forward + backward, 1 thread, CPU
# time; the Transformer's 8 heads and DIFF's 4 differential heads alike): fp32 best at 64 rows
# (109 ms; 128 rows: 117, 256: 140-147), bf16 at 128 rows (55 ms; 64 rows: 64, 256: 59), and
# the same without grad.  BLOCK_BYTES caps a whole block (all batches, heads and maps) so large
# batches x heads keep a bounded scratch; at least MIN_CHUNK rows, so memory stays linear in N.
SLICE_BYTES = 128 << 10
BLOCK_BYTES = 32 << 20
MIN_CHUNK = 64  # rows per block at least (GEMM efficiency at long N); memory stays linear in N
NATIVE_CHUNK = 48  # the float32 kernel's blocks: multiples of this (see fused_attention)
# Long keys: from NATIVE_LONG_KEYS keys on, the float32 kernel's blocks are NATIVE_LONG_ROWS tall, while its
# block buffers ((maps + 1) x rows x keys floats per thread, allocated in C) stay under NATIVE_SCRATCH for all
# threads together (64 MiB a thread on 2; many threads keep shorter blocks at the longest keys).  Past
# ~1K keys a block's maps, its K / V panels and its dK / dV rows no longer stay in L2 and every block streams
# them again: taller blocks stream them fewer times.  Forward + backward of one DIFF layer (4 heads of 64,
# AVX2 EPYC, medians of alternating runs) over 48-row blocks: 1 thread 1.17x at 2K keys, 1.09x at 4K, 1.27x
# at 8K, 1.28x at 16K; 2 threads 1.02x, 1.13x, 1.08x, 1.32x; at 1K-1.5K keys no change (docs/performance.md,
# "Long context").
NATIVE_LONG_KEYS = 2048
NATIVE_LONG_ROWS = 4 * NATIVE_CHUNK
NATIVE_SCRATCH = 128 << 20
# Under a sliding window a native block multiplies the keys from its first query's window to its last query
# (about window + rows of them), so short blocks skip the most: at most WINDOW_ROWS_FP32 (float32) or
# WINDOW_ROWS_BF16 rows.  A one-off sweep of block heights, a DIFF layer's forward + backward (8 heads of 32, 2
# threads, Zen 5), against the default blocks: 4 x 512 tokens, window 128, 12.2 -> 11.1 ms (fp32), 7.8 -> 6.9
# (bf16); 1 x 4096, window 512, 55 -> 50 and 36 -> 36; fp32 blocks of 48-96 rows and bf16 of 32-64 were within
# 10% of each other in every case (docs/performance.md, "Sliding windows").
WINDOW_ROWS_FP32 = NATIVE_CHUNK
WINDOW_ROWS_BF16 = 2 * 32


def native_rows(chunk: int, n_q: int, n_k: int, maps: int, threads: int = 0) -> int:
    """Query rows per block of the float32 native kernel for block-path blocks of ``chunk`` rows: 3/4 of
    them in whole multiples of NATIVE_CHUNK (8 tiles of the 6-row micro-kernel), NATIVE_LONG_ROWS at long
    ``n_k`` (see NATIVE_LONG_KEYS) where the block buffers of ``threads`` threads (0: torch's count) fit
    NATIVE_SCRATCH, never taller than the queries need."""
    rows = max(NATIVE_CHUNK, chunk // MIN_CHUNK * NATIVE_CHUNK)
    if n_k < NATIVE_LONG_KEYS:
        return rows
    per_thread = NATIVE_SCRATCH // max(1, threads or torch.get_num_threads())
    fits = per_thread // ((maps + 1) * n_k * 4) // NATIVE_CHUNK * NATIVE_CHUNK
    return max(rows, min(NATIVE_LONG_ROWS, fits, -(-n_q // 6) * 6))


# Under bf16 the maps' elementwise math runs on bf16 tensors (the softmax and row sums still
# accumulate in fp32 inside their kernels): ~15% faster than fp32 maps, and about as accurate,
# since the bf16 logits out of the GEMM dominate the error either way (docs/performance.md).
FP32_MAPS_FOR_BF16 = False


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _map_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the maps' elementwise math for inputs of ``dtype`` (see FP32_MAPS_FOR_BF16)."""
    return dtype if (dtype == torch.bfloat16 and not FP32_MAPS_FOR_BF16) else _compute_dtype(dtype)


def chunk_size(b: int, m: int, h: int, n_q: int, n_k: int, element_size: int = 4, slices: bool = True) -> int:
    """Query rows per block: one head's rows x keys of one map in about SLICE_BYTES (unless not
    ``slices``), the whole block (b x m x h heads) in at most BLOCK_BYTES, a multiple of MIN_CHUNK
    and at least that.

    ``element_size`` is the maps' (2 for bf16 maps, 4 for fp32): bf16 blocks get twice the rows.
    """
    row = n_k * element_size
    c = BLOCK_BYTES // max(1, b * m * h * row)
    if slices:
        c = min(c, SLICE_BYTES // max(1, row))
    c = max(MIN_CHUNK, (c // MIN_CHUNK) * MIN_CHUNK)
    return min(n_q, c)


def _key_end(mask: AttnMask, i1: int) -> int:
    """Keys a block of queries ending (exclusive) at ``i1`` can see end here: the causal prefix, the last query's
    window (bidirectional), or all."""
    if mask.causal:
        return min(mask.n_k, mask.q_start + i1)
    return min(mask.n_k, mask.q_start + i1 - 1 + mask.window) if mask.windowed else mask.n_k


def _key_start(mask: AttnMask, i0: int) -> int:
    """The first key a block of queries starting at ``i0`` can see: its first query's window's, or 0."""
    return max(0, mask.q_start + i0 - mask.window + 1) if mask.windowed else 0


def _block_mask(mask: AttnMask, i0: int, i1: int, ke: int, device, ks: int = 0) -> Optional[torch.Tensor]:
    """With padding, documents or a sliding window: boolean (B, 1, 1, 1, C, ke - ks), True = attend, over key
    columns [ks, ke).

    Without any of them the mask is causal only and handled by :meth:`_Blocks.probs` with an
    additive triangle on the diagonal block; this returns None then.
    """
    if mask.key_valid is None and mask.doc_ids is None and not mask.windowed:
        return None
    qpos = torch.arange(mask.q_start + i0, mask.q_start + i1, device=device)[:, None]
    kpos = torch.arange(ks, ke, device=device)[None]
    allowed = torch.ones(1, 1, ke - ks, dtype=torch.bool, device=device)
    if mask.key_valid is not None:
        allowed = mask.key_valid[:, None, ks:ke].to(device)  # (B, 1, ke - ks)
    if mask.doc_ids is not None:
        allowed = allowed & mask.same_document(i0, i1, ke, device)[:, :, ks:]  # (B, C, ke - ks)
    if mask.causal:
        allowed = allowed & (kpos <= qpos)[None]
    if mask.windowed:
        allowed = allowed & mask.in_window(qpos, kpos)[None]
    allowed = allowed | (kpos == qpos)[None]  # a query always sees itself (no empty rows)
    return allowed[:, None, None, None]


def _batched(t: torch.Tensor) -> torch.Tensor:
    """(..., N, x) -> (batch, N, x): a view when the leading dims merge (a cache slice does), else a copy."""
    return t.reshape(-1, t.shape[-2], t.shape[-1])


_SCRATCH = threading.local()


def _scratch(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat scratch buffer of at least ``numel`` elements, kept per thread and reused across calls.

    On the CPU every fresh multi-MB allocation pays page faults on first touch (as much as the
    softmax itself at N=512); CUDA's caching allocator already reuses memory, so there each call
    allocates.  Buffers never hold data across calls.
    """
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    cache = getattr(_SCRATCH, "buffers", None)
    if cache is None:
        cache = _SCRATCH.buffers = {}
    key = (name, dtype)
    buf = cache.get(key)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):  # kept past this call: an inference tensor could not be written outside
            buf = cache[key] = torch.empty(numel, dtype=dtype, device=device)  # inference_mode afterwards
    return buf[:numel]


def release_scratch() -> None:
    """Free this thread's cached scratch buffers.

    They grow to the largest block seen: ~4 MB per buffer at the small preset's training shapes,
    at most BLOCK_BYTES unless MIN_CHUNK rows need more (~100 MB after a 16K-token call).
    """
    _SCRATCH.buffers = {}


_ZEROS: dict = {}


def _zero(t: torch.Tensor) -> torch.Tensor:
    """The ignored ``input`` of baddbmm(beta=0), broadcastable to any batch (one per dtype/device)."""
    key = (t.dtype, t.device)
    z = _ZEROS.get(key)
    if z is None:
        with torch.inference_mode(False):  # as _scratch: usable outside inference_mode whenever it was made
            z = _ZEROS[key] = torch.zeros(1, 1, 1, dtype=t.dtype, device=t.device)
    return z


def _compact(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A (batch, rows, cols) operand the CPU's reduced-precision bmm takes without its own copy.

    oneDNN's bf16 bmm needs batch stride = rows x cols; given a prefix slice it copies the
    *transposed* view (a slow gather, 4x the GEMM), so copy the plain slice here instead.
    fp32/fp64 GEMMs take strided slices as they are.  ``dtype`` other than t's (float16 operands of float32
    products): a converted copy.
    """
    if t.dtype != dtype:
        return t.to(dtype)
    if dtype in (torch.float32, torch.float64) or t.is_contiguous():
        return t
    return t.contiguous()


class _Blocks:
    """Geometry, scratch buffers and the shared per-block steps of the forward and backward passes."""

    def __init__(self, q, k3, v3, lam, mask: AttnMask, scale: float, chunk: int):
        b, m, h, n, d = q.shape
        self.b, self.m, self.h, self.n, self.d = b, m, h, n, d
        self.hk = k3.shape[0] // (b * m)
        self.rep = h // self.hk
        self.q, self.k3, self.v3, self.mask, self.scale, self.chunk = q, k3, v3, mask, scale, chunk
        # the products' dtype: float16's would round logits and overflow past 65504, so it multiplies in float32
        self.dtype = torch.float32 if q.dtype == torch.float16 else q.dtype
        self.cd = _compute_dtype(q.dtype)  # gradient sums, lambda
        self.md = _map_dtype(q.dtype)  # the maps' elementwise math
        self.lam_s = float(lam) if (lam is not None and lam.dim() == 0) else None
        self.lam_rows = lam.to(self.md) if (lam is not None and lam.dim() > 0) else None
        # The native row kernels (difftx.nn.native) when built and the maps are in the matmul dtype.
        self.native = self.md == self.dtype and native.supports(self.dtype, q.device)
        if self.native and self.lam_rows is not None:
            self.lam_rows = lam.to(torch.float32)
        rows = self.rep * min(chunk, n)
        n_maps = b * m * self.hk * rows * k3.shape[1]
        dev = q.device
        self._s = _scratch("s", n_maps, self.md, dev)  # logits in the maps' dtype, later p * dP
        self._p = _scratch("p", n_maps, self.md, dev)  # probabilities
        self._low = _scratch("low", n_maps, self.dtype, dev) if self.dtype != self.md else None
        self._comb = _scratch("comb", n_maps // m, self.dtype, dev)  # combined map / dP, matmul dtype
        self._zero = _zero(q if q.dtype == self.dtype else q.new_empty(0, dtype=self.dtype))  # no copy of q
        # Causal without padding: key columns [q_start + i0, ke) of a block form a square whose
        # strict upper triangle is masked; adding -inf there is ~8x cheaper than masked_fill_.
        # The native kernels skip those columns themselves and need no triangle.
        self.plain_causal = mask.causal and mask.key_valid is None and mask.doc_ids is None and not mask.windowed
        self._tri = None
        if self.plain_causal and not self.native:
            c = min(chunk, n)
            self._tri = torch.full((c, c), float("-inf"), dtype=self.md, device=dev).triu_(1)

    def blocks(self, reverse: bool = False):
        """(i0, i1, ks, ke) per block: its queries [i0, i1) and the keys [ks, ke) they can see (under a sliding
        window the keys left of its first query's window are left out)."""
        starts = range(0, self.n, self.chunk)
        for i0 in (reversed(starts) if reverse else starts):
            i1 = min(self.n, i0 + self.chunk)
            yield i0, i1, _key_start(self.mask, i0), _key_end(self.mask, i1)

    @staticmethod
    def _take(buf: torch.Tensor, *shape: int) -> torch.Tensor:
        numel = 1
        for s in shape:
            numel *= s
        return buf[:numel].view(*shape)

    def q_block(self, i0: int, i1: int) -> torch.Tensor:
        """(B*M*Hk, rep*C, d): the block's queries, grouped by K/V head."""
        qc = self.q[:, :, :, i0:i1].reshape(self.b * self.m * self.hk, self.rep * (i1 - i0), self.d)
        return _compact(qc, self.dtype)

    def keys(self, ks: int, ke: int) -> torch.Tensor:
        return _compact(self.k3[:, ks:ke], self.dtype)

    def values(self, ks: int, ke: int) -> torch.Tensor:
        return _compact(self.v3[:, ks:ke], self.dtype)

    def logits(self, qc: torch.Tensor, kk: torch.Tensor, i0: int, i1: int, ks: int, ke: int) -> torch.Tensor:
        """Q K^T scale of the block's keys [ks, ke) in the maps' dtype, (B, M, Hk, rep*C, ke - ks); padding masked
        with -inf.

        The causal triangle of a mask without padding is left to the caller (:meth:`probs`, or the
        native kernel, which never reads the keys past a row's query)."""
        b, m, hk, rep, c, w = self.b, self.m, self.hk, self.rep, i1 - i0, ke - ks
        kt = kk.transpose(1, 2)
        s = self._take(self._s, b * m * hk, rep * c, w)
        if self._low is not None:
            low = self._take(self._low, b * m * hk, rep * c, w)
            torch.baddbmm(self._zero, qc, kt, beta=0, alpha=self.scale, out=low)
            s.copy_(low)
        else:
            torch.baddbmm(self._zero, qc, kt, beta=0, alpha=self.scale, out=s)
        if not self.plain_causal:
            allowed = _block_mask(self.mask, i0, i1, ke, qc.device, ks)
            if allowed is not None:
                s.view(b, m, hk, rep, c, w).masked_fill_(~allowed, float("-inf"))
        return s.view(b, m, hk, rep * c, w)

    def probs(self, qc: torch.Tensor, kk: torch.Tensor, i0: int, i1: int, ks: int, ke: int) -> torch.Tensor:
        """softmax(Q K^T scale) of the block, masked, in the maps' dtype: (B, M, Hk, rep*C, ke - ks).

        ``kk`` is :meth:`keys` (ks, ke), which the backward reuses for dQ."""
        b, m, hk, rep, c = self.b, self.m, self.hk, self.rep, i1 - i0
        s = self.logits(qc, kk, i0, i1, ks, ke)
        if self._tri is not None:  # plain causal: ks is 0
            k0 = self.mask.q_start + i0  # keys left of the block's first query are all visible
            if ke - k0 > 1:
                s.view(b * m * hk * rep, c, ke)[:, :, k0:].add_(self._tri[:c, : ke - k0])
        p = self._take(self._p, b, m, hk, rep * c, ke - ks)
        torch.ops.aten._softmax.out(s, -1, False, out=p)
        return p

    def _diag0(self, i0: int) -> int:
        """The native kernels' causal offset: the block's first query among the keys, or -1 (none)."""
        return self.mask.q_start + i0 if self.plain_causal else -1

    def maps(self, qc: torch.Tensor, kk: torch.Tensor, i0: int, i1: int, ks: int, ke: int, lam_c, want_p: bool):
        """(probs or None, combined map) of the block's keys [ks, ke): :meth:`probs` and :meth:`combine` in one
        native pass per row when available."""
        if not self.native:
            p = self.probs(qc, kk, i0, i1, ks, ke)
            return p, self.combine(p, lam_c)
        b, m, hk, r, w = self.b, self.m, self.hk, self.rep * (i1 - i0), ke - ks
        s = self.logits(qc, kk, i0, i1, ks, ke)
        p = self._take(self._p, b, m, hk, r, w) if (want_p or m == 1) else None
        comb = None if m == 1 else self._take(self._comb, b, hk, r, w)
        lam_rows = None if lam_c is None else lam_c.reshape(b, hk * r).contiguous()
        native.softmax_combine(s, p, comb, m, hk * r, i1 - i0, self._diag0(i0), self.lam_s or 0.0, lam_rows)
        if m == 1:
            comb = p.view(b, hk, r, w)
        return p, comb.view(b * hk, r, w)

    def lam_block(self, i0: int, i1: int) -> Optional[torch.Tensor]:
        """Per-token lambda of the block as (B, Hk, rep*C, 1), or None."""
        if self.lam_rows is None:
            return None
        return self.lam_rows[:, :, i0:i1].reshape(self.b, self.hk, self.rep * (i1 - i0), 1)

    def combine(self, p: torch.Tensor, lam_c: Optional[torch.Tensor]) -> torch.Tensor:
        """P1 - lambda P2 (or P), rounded once to the matmul dtype: (B*Hk, rep*C, ke)."""
        b, _, hk, r, ke = p.shape
        if self.m == 1 and self._low is None:
            return p.view(b * hk, r, ke)
        out = self._take(self._comb, b, hk, r, ke)
        if self.m == 1:
            out.copy_(p[:, 0])
        elif lam_c is None:
            torch.add(p[:, 0], p[:, 1], alpha=-self.lam_s, out=out)
        else:
            torch.addcmul(p[:, 0], p[:, 1], lam_c, value=-1.0, out=out)
        return out.view(b * hk, r, ke)


class _FusedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, lam, mask: AttnMask, scale: float, chunk: int, native_chunk: int):
        k3 = _batched(k)  # (B*M*Hk, Nk, d), or (B*Hk, Nk, d) for a shared K; q is contiguous (fused_attention)
        # bf16 (on AMX) takes blocks of 32-row tile pairs (see fused_attention's native_chunk)
        # a sliding window is the kernels' own (each block multiplies the keys from its first query's window on)
        ctx.native_attn = (native.attention_ok(q, k3, v, mask.n_k, mask.key_valid is not None
                                               or mask.doc_ids is not None)
                           and (q.dtype == torch.float32 or native_chunk % 32 == 0))
        if ctx.native_attn:  # every block's products and maps in one native call; V read in place
            want = any(ctx.needs_input_grad[:4])
            lam_s, lam_rows = _lam_args(lam, q.shape)
            out, lse = native.attention_forward(q, k3, v, mask.causal, mask.q_start, native_chunk, scale, lam_s,
                                                lam_rows, want, _window(mask))
            if want:
                ctx.save_for_backward(q, k, v, lam, lse)  # the inputs themselves (a second derivative's graph)
                ctx.mask, ctx.scale, ctx.chunk, ctx.shapes = mask, scale, native_chunk, (k.shape, v.shape)
            return out
        k3 = _batched(_per_map(k, q.shape[1]))
        v3 = _batched(v)  # (B*Hk, Nk, dv)
        g = _Blocks(q, k3, v3, lam, mask, scale, chunk)
        out = q.new_empty(g.b, g.n, g.h, v.shape[-1])
        for i0, i1, ks, ke in g.blocks():
            _, comb = g.maps(g.q_block(i0, i1), g.keys(ks, ke), i0, i1, ks, ke, g.lam_block(i0, i1), want_p=False)
            o = torch.bmm(comb, g.values(ks, ke))  # (B*Hk, rep*C, dv)
            out[:, i0:i1] = o.view(g.b, g.h, i1 - i0, -1).transpose(1, 2)
        if any(ctx.needs_input_grad[:4]):
            ctx.save_for_backward(q, k, v, lam)
            ctx.mask, ctx.scale, ctx.chunk, ctx.shapes = mask, scale, chunk, (k.shape, v.shape)
        return out

    @staticmethod
    def backward(ctx, dout):
        if torch.is_grad_enabled():  # create_graph=True: gradients with a graph, through the eager formula
            q, k, v, lam = ctx.saved_tensors[:4]
            fn = functools.partial(_attention_torch, mask=ctx.mask, scale=ctx.scale)
            return _graph_grads(fn, (q, k, v, lam), ctx.needs_input_grad[:4], dout) + (None,) * 4
        with no_autocast(dout.device.type), torch.no_grad():
            if ctx.native_attn:
                return _native_backward(ctx, dout)
            return _backward(ctx, dout)


def _graph_grads(fn, inputs: tuple, needs, grad_outputs) -> tuple:
    """The gradients of ``fn(*inputs)`` (the torch formula of a fast op) for the ``inputs`` that ``needs`` marks,
    with a graph: what a fast op's backward returns under ``create_graph=True`` (a second derivative: gradient
    penalties, Hessian-vector products), since its kernels' outputs have none.  ``inputs``: the op's own inputs
    as it saved them (not its outputs: autograd would run the op's backward again); None where not needed."""
    wanted = [t for t, n in zip(inputs, needs) if n]
    if not wanted:
        return (None,) * len(inputs)
    device = wanted[0].device.type
    with torch.enable_grad(), no_autocast(device):
        outs = fn(*inputs)
    got = iter(torch.autograd.grad(outs, wanted, grad_outputs, create_graph=True, allow_unused=True))
    return tuple(next(got) if n else None for n in needs)


def _attention_torch(q, k, v, lam, mask: AttnMask, scale: float) -> torch.Tensor:
    """What :class:`_FusedAttention` computes, in torch ops over whole maps (the eager reference): for its
    gradients with a graph."""
    from .backends import eager_logits, masked_softmax, repeat_kv

    maps = [masked_softmax(eager_logits(q[:, i], k[:, i % k.shape[1]], scale), mask) for i in range(q.shape[1])]
    comb = maps[0] if lam is None else maps[0] - lam.to(maps[0].dtype) * maps[1]
    out = torch.matmul(comb, upcast(repeat_kv(v, q.shape[2] // v.shape[1])))  # (B, H, Nq, dv)
    return out.transpose(1, 2).to(q.dtype)


def _window(mask: AttnMask) -> int:
    """The native kernels' sliding window: the mask's when it hides a key, else 0 (none)."""
    return int(mask.window) if mask.windowed else 0


def _lam_args(lam: Optional[torch.Tensor], q_shape) -> tuple:
    """(scalar lambda, per-row lambda (B, H, N) float32 or None) for the native kernels."""
    if lam is None:
        return 0.0, None
    if lam.dim() == 0:
        return float(lam), None
    b, _, h, n, _ = q_shape
    return 0.0, lam.detach().to(torch.float32).reshape(b, h, n).contiguous()


def _native_backward(ctx, dout):
    q, k, v, lam, lse = ctx.saved_tensors
    k3 = _batched(k)
    k_shape, _ = ctx.shapes
    lam_s, lam_rows = _lam_args(lam, q.shape)
    dout = dout.to(q.dtype).contiguous()
    dq, dk, dv, rs2 = native.attention_backward(q, k3, v, dout, lse, ctx.mask.causal, ctx.mask.q_start, ctx.chunk,
                                                ctx.scale, lam_s, lam_rows, _window(ctx.mask))
    dlam = None
    if lam is not None and ctx.needs_input_grad[3]:
        dlam = (-rs2.sum() if lam.dim() == 0 else -rs2.view(lam.shape)).to(lam.dtype)
    return dq, dk.view(k_shape), dv, dlam, None, None, None, None


def _backward(ctx, dout):
    q, k, v, lam = ctx.saved_tensors
    k3, v3 = _batched(_per_map(k, q.shape[1])), _batched(v)
    k_shape, v_shape = ctx.shapes
    g = _Blocks(q, k3, v3, lam, ctx.mask, ctx.scale, ctx.chunk)
    b, m, h, n, d, hk, rep, cd = g.b, g.m, g.h, g.n, g.d, g.hk, g.rep, g.cd
    nk = k3.shape[1]
    # Gradients are summed in the compute dtype; under bf16 those sums are scratch (the results
    # are cast copies), in fp32 they are the returned tensors.
    dv_w = v3.shape[-1]
    if cd != q.dtype:
        dq = _scratch("dq", b * m * h * n * d, cd, q.device).view(b * m * hk, rep, n, d)
        dk = _scratch("dk", b * m * hk * nk * d, cd, q.device).view(b * m * hk, nk, d)
        dv = _scratch("dv", b * hk * nk * dv_w, cd, q.device).view(b * hk, nk, dv_w)
    else:
        dq = torch.empty(b * m * hk, rep, n, d, dtype=cd, device=q.device)
        dk = torch.empty(b * m * hk, nk, d, dtype=cd, device=q.device)
        dv = torch.empty(b * hk, nk, dv_w, dtype=cd, device=q.device)
    dlam = torch.zeros((), dtype=cd, device=q.device) if g.lam_s is not None else None
    if g.lam_rows is not None:
        dlam = torch.empty(g.lam_rows.shape, dtype=cd, device=q.device)
    dout = dout.to(g.dtype)  # the products' dtype (float16: float32)
    # Blocks run last to first: with a causal mask the first sees every key it will ever see, so it
    # writes the sums and later blocks add to prefixes of them (no zero-filling).  Under a sliding window
    # the blocks' keys are windows, not prefixes: the sums start from zero.
    seen = 0  # keys [0, seen) hold a partial sum
    if ctx.mask.windowed:
        dk.zero_()
        dv.zero_()
        seen = nk
    for i0, i1, ks, ke in g.blocks(reverse=True):
        fresh = seen == 0
        if not fresh and ke > seen:  # only with unusual masks: a block sees keys no earlier block saw
            dk[:, seen:ke].zero_()
            dv[:, seen:ke].zero_()
        seen = max(seen, ke)
        c, w = i1 - i0, ke - ks
        r = rep * c
        qc, kk, vv = g.q_block(i0, i1), g.keys(ks, ke), g.values(ks, ke)
        lam_c = g.lam_block(i0, i1)
        p, comb = g.maps(qc, kk, i0, i1, ks, ke, lam_c, want_p=True)  # recomputed: (B, M, Hk, R, w)
        doc = dout[:, i0:i1].transpose(1, 2).reshape(b * hk, r, -1)
        _acc(dv[:, ks:ke], comb.transpose(1, 2), doc, fresh)
        dp = g._take(g._comb, b * hk, r, w)  # the combined map is consumed: reuse its buffer
        torch.bmm(doc, vv.transpose(1, 2), out=dp)
        if g.native:  # softmax backward p_m (dP - r_m) and the row sums r_m in one pass per row
            ds = g._take(g._s, b, m, hk, r, w)
            rs = torch.empty(b, m, hk, r, 1, dtype=torch.float32, device=q.device)
            native.softmax_backward(p, dp, ds, rs, m, hk * r, c, g._diag0(i0))
        else:
            t = g._take(g._s, b, m, hk, r, w)
            torch.mul(p, dp.view(b, 1, hk, r, w), out=t)  # p_m * dP
            # rowsum(p_m * dP) accumulated and kept in the compute dtype (lambda's gradient sums it, as the native
            # kernel's float32 row sums); the maps' elementwise math reads a copy in their dtype
            rs = t.sum(-1, keepdim=True, dtype=cd)
            rsm = rs.to(t.dtype)
            if g._low is not None:  # softmax backward p_m (dP - r_m), rounded once for the matmuls
                ds = torch.addcmul(t, p, rsm, value=-1.0, out=g._take(g._low, b, m, hk, r, w))
            else:
                ds = t.addcmul_(p, rsm, value=-1.0)
        rs = rs.to(cd)
        ds = ds.view(b * m * hk, r, w)
        dqc = torch.bmm(ds, kk).view(b, m, hk, r, d)
        if m == 2:  # map 2 enters with weight -lambda: scale its small products, not the map
            if lam_c is None:
                dlam -= rs[:, 1].sum()
                dqc[:, 1].mul_(-g.lam_s)
            else:
                dlam[:, :, i0:i1] = (-rs[:, 1]).reshape(b, h, c, 1)
                dqc[:, 1].mul_(-lam_c.to(dqc.dtype))
                qc = qc.view(b, m, hk, r, d).clone()
                qc[:, 1].mul_(-lam_c.to(qc.dtype))
                qc = qc.view(b * m * hk, r, d)
        dq[:, :, i0:i1] = dqc.view(b * m * hk, rep, c, d)
        _acc(dk[:, ks:ke], ds.transpose(1, 2), qc, fresh)
    if seen < nk:  # keys no query could see
        dk[:, seen:].zero_()
        dv[:, seen:].zero_()
    if m == 2 and g.lam_s is not None:
        dk.view(b, m, hk, nk, d)[:, 1].mul_(-g.lam_s)
    # Scratch sums are copied out even where K/V already have the compute dtype (float32 K/V under bf16 Q): a
    # returned gradient must not be a buffer that the next call overwrites.
    scratch = cd != q.dtype
    dq = dq.mul_(g.scale).view(b, m, h, n, d).to(q.dtype)
    dk = dk.mul_(g.scale).view(b, m, *k_shape[2:])
    shared = k_shape[1] != m  # a shared K: both maps' sum (a new tensor)
    dk = (dk.sum(1, keepdim=True) if shared else dk).to(k3.dtype, copy=scratch and not shared)
    if dlam is not None:
        dlam = dlam.to(lam.dtype)
    return dq, dk, dv.view(v_shape).to(v3.dtype, copy=scratch), dlam, None, None, None, None


def _per_map(k: torch.Tensor, m: int) -> torch.Tensor:
    """K as (B, m, Hk, Nk, d): a shared K (B, 1, ...) expanded over the maps (a view), else k itself."""
    return k if k.shape[1] == m else k.expand(k.shape[0], m, *k.shape[2:])


def _acc(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, fresh: bool) -> None:
    """acc = a @ b (fresh) or acc += a @ b; acc in the compute dtype, a/b possibly lower precision."""
    if acc.dtype == a.dtype:
        if fresh:
            torch.bmm(a, b, out=acc)
        else:
            acc.baddbmm_(a, b)
    elif fresh:
        acc.copy_(torch.bmm(a, b))
    else:
        acc += torch.bmm(a, b)


def _eager_under_compile(fn):
    """``fn`` as an eager island under torch.compile: ``torch.compiler.disable(fn)``, made when a trace first
    reaches it.  Applying ``torch.compiler.disable`` at import would import torch._dynamo, which took 2.4 of the
    6.1 s that ``difftx info`` needed to print one line (2026-11-26, AMD EPYC); eagerly, the wrapper costs one
    flag read."""
    disabled = []

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling():
            if not disabled:  # the first trace: one more graph break, at this call
                disabled.append(torch.compiler.disable(fn))
            return disabled[0](*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper


@_eager_under_compile  # the kernel's per-thread scratch and Python block loop stay eager under torch.compile
def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttnMask, scale: float,
                    lam: Optional[torch.Tensor] = None, chunk: Optional[int] = None) -> torch.Tensor:
    """(softmax(Q1 K1^T s) [- lam softmax(Q2 K2^T s)]) V in query blocks; layouts in the module docstring."""
    b, m, h, n, _ = q.shape
    if m not in (1, 2) or (m == 2) != (lam is not None):
        raise ValueError("fused_attention takes one map without lambda or two maps with lambda")
    if k.dim() != 5 or k.shape[1] not in (1, m):
        raise ValueError(f"fused_attention: k must be (B, {m} or 1, Hk, Nk, d) (a K per map, or one K both maps "
                         f"read); got {tuple(k.shape)}")
    needs_grad = grad_wanted(q, k, v, lam)
    native_chunk = given_chunk = chunk
    if chunk is None:
        # Reduced-precision inference takes blocks as large as BLOCK_BYTES allows (at the small
        # preset's prefill, 4 x 512 tokens: one block): fewer K/V prefix copies and Python steps,
        # which do not parallelise (docs/performance.md, "Inference blocks").
        es = _map_dtype(q.dtype).itemsize
        nk = min(k.shape[3], mask.n_k)
        chunk = chunk_size(b, m, h, n, nk, es, slices=needs_grad or es >= 4)
        # The float32 kernel's blocks: 3/4 as many rows, a multiple of 48 = 8 tiles of its 6-row
        # micro-kernel (64 rows end in a 4-row tile) whose maps stay further inside L2: 1 ms (2%)
        # less per DIFF layer at the small preset (docs/performance.md); taller at long keys.
        # bf16 keeps the chunk itself (a multiple of MIN_CHUNK: whole 32-row tile pairs), rounded up to 32 rows
        # where it is all the queries (one block either way: 100 queries are one block of 128 padded rows, which
        # the kernel pads to anyway), so that no query count keeps bf16 off the native kernel.
        native_chunk = native_rows(chunk, n, nk, m) if q.dtype == torch.float32 else -(-chunk // 32) * 32
        if mask.windowed:
            native_chunk = min(native_chunk, WINDOW_ROWS_FP32 if q.dtype == torch.float32 else WINDOW_ROWS_BF16)
    with no_autocast(q.device.type):
        if b == 0:  # an empty batch (the kernels' per-head geometry divides by it): empty maps in torch ops
            return _attention_torch(q, k[:, :, :, : mask.n_k], v[:, :, : mask.n_k], lam, mask, scale)
        if not needs_grad and n <= SMALL_QUERY:
            return _few_queries(q, k, v, lam, mask, scale)
        if k.shape[3] > mask.n_k:  # a cache's whole buffers: keep the written part
            k, v = k[:, :, :, : mask.n_k], v[:, :, : mask.n_k]
        if functorch_active():  # torch.func (grad, vmap, jvp): torch ops over whole maps, which it can transform
            return _attention_torch(q, k, v, lam, mask, scale)
        segments = mask.segments() if mask.doc_ids is not None else None
        if segments is not None:
            return _by_document(q, k, v, lam, mask, scale, segments, given_chunk)
        # one pass over Q so that every block of it is a strided view; made here, it is the Function's input,
        # which the backward can differentiate again (create_graph=True)
        return _FusedAttention.apply(q.contiguous(), k, v, lam, mask, scale, chunk, native_chunk)


def _by_document(q, k, v, lam, mask: AttnMask, scale: float, segments: list, chunk: Optional[int]) -> torch.Tensor:
    """Packed documents (:meth:`AttnMask.segments`) as plain causal (or bidirectional) calls on the CPU's fused
    kernels, at the cost of each document's own length squared, where the packed sequence under a document mask
    would take the masked torch blocks over the whole triangle.

    The documents are gathered into batches of similar lengths (the same power of two at or above the length),
    each document from position 0 of its own row, right-padded to the batch's longest: under a causal mask no
    real query sees a padding key, and the padding queries' outputs are dropped (their output gradients are
    zeros), so the padding changes nothing, gradients included; without causality each length is a batch of its
    own (no padding).  One call per batch (a handful per layer, not one per document); tokens move to and from
    the batches by gathers, forward and backward (:class:`_ToDocuments`, :class:`_FromDocuments`).  A sliding window
    stays each call's own.  The same values as the masked call, to float rounding."""
    b, m, h, n, _ = q.shape
    plan = _document_plan(mask, segments, b, q.device)
    if plan is None:  # one document a row: the plain call
        return fused_attention(q, k, v, AttnMask(causal=mask.causal, n_q=n, n_k=n, window=mask.window), scale, lam,
                               chunk)
    per_row = lam is not None and lam.dim() > 0
    qs = _ToDocuments.apply(q, plan, 3)
    ks = _ToDocuments.apply(k, plan, 3)
    vs = _ToDocuments.apply(v, plan, 2)
    ls = _ToDocuments.apply(lam, plan, 2) if per_row else [lam] * len(qs)
    outs = [fused_attention(qb, kb, vb, AttnMask(causal=mask.causal, n_q=length, n_k=length, window=mask.window), scale,
                            lb, chunk)
            for qb, kb, vb, lb, (_, length, _) in zip(qs, ks, vs, ls, plan[0])]  # each (D, L, H, dv)
    return _FromDocuments.apply(plan, b, *outs)


def _document_plan(mask: AttnMask, segments: list, b: int, device):
    """For :func:`_by_document`: the batches of documents, each (token index (D, L) into the B*N tokens, L,
    real (D, L) bool: False at padding, whose index repeats the document's first token), and the gather (B*N,)
    from the batches' real tokens, in order, back to the tokens; None when every row is one document.  Once per
    forward (cached on the mask)."""
    key = ("documents", str(device), b)
    if key in mask._dense:
        return mask._dense[key]
    rows = segments if len(segments) == b else segments * b
    n = mask.n_k
    plan = None
    if any(len(spans) > 1 for spans in rows):
        groups: dict = {}
        for r, spans in enumerate(rows):
            for s0, s1 in spans:
                # causal: similar lengths share a batch; bidirectional: a batch per length (no padding keys)
                groups.setdefault((s1 - s0 - 1).bit_length() if mask.causal else s1 - s0, []).append((r, s0, s1))
        batches, order = [], []
        for g in sorted(groups):
            docs = groups[g]
            length = max(s1 - s0 for _, s0, s1 in docs)
            steps = torch.arange(length)[None]
            first = torch.tensor([r * n + s0 for r, s0, _ in docs])[:, None]
            real = steps < torch.tensor([s1 - s0 for _, s0, s1 in docs])[:, None]
            idx = torch.where(real, first + steps, first)
            order.append(idx[real])
            batches.append((idx.to(device), length, real.to(device)))
        flat = torch.cat(order)
        inverse = torch.empty(len(rows) * n, dtype=torch.long)
        inverse[flat] = torch.arange(flat.numel())
        plan = (batches, inverse.to(device))
    mask._dense[key] = plan
    return plan


def _token_major(x: torch.Tensor, tdim: int) -> torch.Tensor:
    """(B, ..., N at ``tdim``, ...) -> (B*N, rest): the tokens as rows."""
    x = x.movedim(tdim, 1)
    return x.reshape(x.shape[0] * x.shape[1], -1)


class _ToDocuments(torch.autograd.Function):
    """x (B, ..., N at ``tdim``, ...) -> one tensor per batch of documents (D, ..., L, ...), contiguous, from the
    plan's token index; backward: the batches' gradients at their real tokens, gathered back to x's tokens (each
    token is one real position of one batch; the padding's gradients are dropped)."""

    @staticmethod
    def forward(ctx, x, plan, tdim: int):
        batches, _ = plan
        ctx.plan, ctx.tdim, ctx.shape = plan, tdim, x.shape
        flat = _token_major(x, tdim)
        rest = x.movedim(tdim, 1).shape[2:]
        return tuple(flat.index_select(0, idx.reshape(-1)).view(*idx.shape, *rest).movedim(1, tdim).contiguous()
                     for idx, _, _ in batches)

    @staticmethod
    def backward(ctx, *grads):
        batches, inverse = ctx.plan
        tdim = ctx.tdim
        reals = [_token_major(g, tdim)[real.reshape(-1)] for g, (_, _, real) in zip(grads, batches)]
        flat = (torch.cat(reals) if len(reals) > 1 else reals[0]).index_select(0, inverse)
        shape = list(ctx.shape)
        n = shape.pop(tdim)
        gx = flat.view(shape[0], n, *shape[1:]).movedim(1, tdim)
        return gx, None, None


class _FromDocuments(torch.autograd.Function):
    """The batches' outputs (D, L, H, dv) back to the tokens (B, N, H, dv); backward: each batch's output
    gradient gathered from its tokens, zero at the padding (whose queries see the document's real keys: a
    nonzero gradient there would reach them)."""

    @staticmethod
    def forward(ctx, plan, b: int, *outs):
        batches, inverse = plan
        ctx.plan = plan
        reals = [o.reshape(o.shape[0] * o.shape[1], -1)[real.reshape(-1)] for o, (_, _, real) in zip(outs, batches)]
        flat = (torch.cat(reals) if len(reals) > 1 else reals[0]).index_select(0, inverse)
        return flat.view(b, -1, *outs[0].shape[2:])

    @staticmethod
    def backward(ctx, g):
        batches, _ = ctx.plan
        flat = g.reshape(g.shape[0] * g.shape[1], -1)
        grads = []
        for idx, _, real in batches:
            gb = flat.index_select(0, idx.reshape(-1)).view(*idx.shape, *g.shape[2:])
            grads.append(gb.masked_fill(~real.view(*real.shape, *([1] * (g.dim() - 2))), 0))
        return (None, None, *grads)


SMALL_QUERY = 4  # up to this many queries (decoding), a single block without scratch bookkeeping


def _few_queries(q, k, v, lam, mask: AttnMask, scale: float) -> torch.Tensor:
    """Decoding: one block, no autograd, no scratch bookkeeping.

    Logits come from Q K^T in fp32/fp64 (MKL streams K: measured 3x faster than K Q^T for one
    token over a 512-token cache) and from K (Q^T) in bf16, so oneDNN reads K without a
    transposed gather.  When K/V
    are a static cache's whole buffers (longer than ``mask.n_k``), a bf16 GEMM over the whole
    (compact) buffer with the unwritten tail masked beats copying the visible prefix, which
    oneDNN would do on every call, as long as the tail is shorter than the prefix.
    """
    b, m, h, n, d = q.shape
    k = _per_map(k, m)
    hk = k.shape[2]
    r = (h // hk) * n
    ke = _key_end(mask, n)
    md = _map_dtype(q.dtype)
    k3, v3 = _batched(k), _batched(v)
    if q.dtype == torch.float16:  # float16 products would round the logits and overflow past 65504
        return _few_queries(q.float(), k.float(), v.float(), lam, mask, scale).to(q.dtype)
    ks = _key_start(mask, 0)  # a sliding window: the keys from the first query's window on only
    width = ke
    if ks == 0 and k3.shape[1] > ke and q.dtype not in (torch.float32, torch.float64) and k3.is_contiguous() \
            and v3.is_contiguous() and k3.shape[1] <= 2 * ke:
        width = k3.shape[1]  # the whole buffer; keys [ke, width) are masked below
    k3, v3 = k3[:, ks:width], v3[:, ks:width]
    if q.dtype in (torch.float32, torch.float64):  # MKL: Q K^T streams K, ~3x faster than K Q^T here
        s = torch.bmm(q.reshape(b * m * hk, r, d) * scale, k3.transpose(1, 2))  # (BMH, r, width)
    else:
        qt = q.reshape(b * m * hk, r, d).transpose(1, 2)  # (BMH, d, r)
        s = torch.baddbmm(_zero(q), k3, qt, beta=0, alpha=scale).transpose(1, 2)  # (BMH, r, width)
    if s.dtype != md:
        s = s.to(md)
    width -= ks
    s = s.reshape(b, m, hk, h // hk, n, width)
    allowed = _block_mask(mask, 0, n, ke, q.device, ks)
    if allowed is None and mask.causal and n > 1:  # causal rows within the block
        qpos = torch.arange(mask.q_start, mask.q_start + n, device=q.device)[:, None]
        allowed = (torch.arange(ke, device=q.device)[None] <= qpos)[None, None, None, None]
    if width > ke:  # (ks is 0)
        s[..., ke:].fill_(float("-inf"))
    if allowed is not None:
        s[..., :ke - ks] = s[..., :ke - ks].masked_fill(~allowed, float("-inf"))
    # two maps: their softmax and combine in the compute dtype (float32 under bf16), as the native decoding kernel
    # does; in bf16, torch.add rounds its alpha (lambda) to bf16 too: a bias of up to 2^-9 lambda on every key
    p = torch.softmax(s, dim=-1, dtype=_compute_dtype(s.dtype) if m == 2 else None).reshape(b, m, hk, r, width)
    if m == 1:
        p = p[:, 0]
    elif lam.dim() == 0:
        p = torch.add(p[:, 0], p[:, 1], alpha=-float(lam))
    else:
        p = torch.addcmul(p[:, 0], p[:, 1], lam.to(p.dtype).reshape(b, hk, r, 1), value=-1.0)
    o = torch.bmm(p.reshape(b * hk, r, width).to(v.dtype), v3)  # (B*Hk, r, dv)
    return o.view(b, h, n, -1).transpose(1, 2).contiguous()


# ----------------------------------------------------------------------------- RMSNorm
def _gained(w: Optional[torch.Tensor], gain: float) -> Optional[torch.Tensor]:
    """The native norm kernels' weight: float32 ``w * gain``, contiguous (None without a weight; a float32
    contiguous ``w`` itself when the gain is 1, as the residual-adding norm's always is)."""
    if w is None:
        return None
    w32 = w.to(torch.float32)
    return (w32 if gain == 1.0 else w32 * gain).contiguous()


class _RMSNorm(torch.autograd.Function):
    """y = x / sqrt(mean(x^2) + eps) * (w * gain) over the last dim, statistics in the compute dtype.

    About half the passes of autograd through ``F.rms_norm``; saves x in its own dtype and
    the per-row 1/rms.  Mixed-dtype elementwise ops cost a hidden cast copy on the CPU, so
    inputs are converted once, explicitly.
    """

    @staticmethod
    def forward(ctx, x, w, eps: float, gain: float, out_dtype, use_native: bool):
        cd = _compute_dtype(x.dtype)
        ctx.gain, ctx.eps = gain, eps
        ctx.native = use_native  # rms_norm asked _native_norm (and made x contiguous for it)
        if ctx.native:  # one pass per row instead of five over the tensor (forward and backward); x contiguous
            wg = _gained(w, gain)
            rstd = torch.empty(*x.shape[:-1], 1, dtype=torch.float32, device=x.device)
            y = native.rms_norm(x, wg, gain, eps, out_dtype, rstd)
            ctx.save_for_backward(x, w, rstd)
            return y
        xf = x.to(cd)
        rstd = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)
        rstd = rstd.square_().div_(x.shape[-1]).add_(eps).rsqrt_()
        y = torch.mul(xf, rstd)
        if w is not None:
            y.mul_(w.to(cd) * gain if gain != 1.0 else w.to(cd))
        elif gain != 1.0:
            y.mul_(gain)
        ctx.save_for_backward(x, w, rstd)
        return y.to(out_dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w, rstd = ctx.saved_tensors
        gain = ctx.gain
        if torch.is_grad_enabled():  # create_graph=True: gradients with a graph, in torch ops
            return _rms_norm_grads(x, w, dy, ctx.eps, gain, ctx.needs_input_grad[1]) + (None,) * 4
        with no_autocast(dy.device.type), torch.no_grad():
            if ctx.native and dy.dtype in (torch.float32, torch.bfloat16):
                want_dw = w is not None and ctx.needs_input_grad[1]
                wg = _gained(w, gain)
                dx, dw, _ = native.rms_norm_backward(x, dy.contiguous(), rstd, wg, gain, want_dw)
                return dx, (dw.mul_(gain).to(w.dtype) if want_dw else None), None, None, None, None
            cd = rstd.dtype
            dim = x.shape[-1]
            xhat = x.to(cd).mul_(rstd) if x.dtype != cd else torch.mul(x, rstd)
            dyf = dy.to(cd)
            g = torch.mul(dyf, w.to(cd) * gain) if w is not None else dyf * gain
            c = torch.linalg.vecdot(g, xhat, dim=-1).unsqueeze_(-1).div_(-dim)
            dx = g.addcmul_(xhat, c).mul_(rstd)
            dw = None
            if w is not None and ctx.needs_input_grad[1]:
                dw = xhat.mul_(dyf).reshape(-1, dim).sum(0).mul_(gain).to(w.dtype)
            return dx.to(x.dtype), dw, None, None, None, None


def _rms_norm_grads(x: torch.Tensor, w: Optional[torch.Tensor], dy: torch.Tensor, eps: float, gain: float,
                    want_dw: bool) -> tuple:
    """(dx, dw or None) of :func:`rms_norm` in differentiable torch ops, from its input ``x``: what the norm
    Functions' backwards return under create_graph=True (a second derivative), where their kernels' and in-place
    passes would return gradients without a graph."""
    cd = _compute_dtype(x.dtype)
    xf = x.to(cd)
    rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    xhat = xf * rstd
    dyf = dy.to(cd)
    g = dyf * (w.to(cd) * gain if w is not None else gain)
    dx = (g - xhat * (g * xhat).mean(-1, keepdim=True)) * rstd
    dw = (dyf * xhat).reshape(-1, x.shape[-1]).sum(0).mul(gain).to(w.dtype) if want_dw and w is not None else None
    return dx.to(x.dtype), dw


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, gain: float = 1.0,
             out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dim times ``weight * gain`` (either may be absent), fp32 statistics.

    Returns ``out_dtype`` (default: the compute dtype, fp32 or fp64, as :class:`~difftx.nn.norms.RMSNorm`
    computes).  Folding a constant ``gain`` in saves a pass (DIFF's (1 - lambda_init)).
    """
    _check_weight(x, weight)
    cd = _compute_dtype(x.dtype)
    out_dtype = out_dtype or cd
    if _inference_norm(x, weight, out_dtype):  # decoding-sized, no autograd: the kernel alone
        return native.rms_norm(x.contiguous(), _gained(weight, gain), gain, eps, out_dtype)
    with no_autocast(x.device.type):
        # Off the CPU, torch's fused RMSNorm kernels (CUDA: one launch each way, not ~8 and ~10); on the CPU for
        # decoding-sized calls without autograd, where the fewest ops win.
        if (x.device.type != "cpu" or (x.numel() <= SMALL_NORM and not grad_wanted(x, weight))
                or traced()):  # torch.func cannot transform the autograd Function below; a compiled graph fuses
            # torch's ops itself (the native pass broke the graph at every norm, recompiling past dynamo's limit)
            w = None if weight is None else weight.to(cd)
            w = w * gain if (w is not None and gain != 1.0) else w
            y = torch.nn.functional.rms_norm(x.to(cd), (x.shape[-1],), w, eps)
            return (y * gain if (w is None and gain != 1.0) else y).to(out_dtype)
        # the native pass reads rows: x made contiguous here is the Function's input, which the backward can
        # differentiate again (create_graph=True)
        use_native = _native_norm(x, weight, out_dtype)
        return _RMSNorm.apply(x.contiguous() if use_native else x, weight, eps, gain, out_dtype, use_native)


SMALL_NORM = 1 << 16


def _check_weight(x: torch.Tensor, weight: Optional[torch.Tensor]) -> None:
    """A norm's weight must be (x's last dim,): the native kernels read that many weights per row, whatever the
    weight holds (a wrong-sized one read out of bounds, silently).  A 0-dim x has no last dim (was IndexError)."""
    if x.dim() == 0:
        raise ValueError("RMSNorm: the input is a 0-dim tensor (a scalar) and the norm runs over the last dim; give "
                         "it at least one dim of the norm's size, e.g. x.reshape(1)")
    if weight is not None and weight.numel() != x.shape[-1]:  # numel: what the kernels read (~0.2 us)
        raise ValueError(f"RMSNorm: an input of shape {tuple(x.shape)} with a weight of shape {tuple(weight.shape)}: "
                         "the input's last dim must be the norm's dim (the weight's length)")


def _inference_norm(x: torch.Tensor, weight: Optional[torch.Tensor], out_dtype: torch.dtype) -> bool:
    """Whether a norm call of at most :data:`SMALL_NORM` values (decoding) runs the native kernel directly, with
    no autograd node: CPU, no gradient wanted, eager, dtypes the kernel takes.  One ctypes call costs a third of
    ``F.rms_norm``'s composite ops at these sizes (11-14 against 20-29 us for 4 x 512 floats, AMD EPYC)."""
    return (x.numel() <= SMALL_NORM and x.device.type == "cpu"
            and not grad_wanted(x, weight) and not traced() and _native_norm(x, weight, out_dtype))


class _AddRMSNorm(torch.autograd.Function):
    """(x1, y) = (x + a, RMSNorm(x + a)): a residual addition and the PreNorm that reads its sum, one native
    pass each way.  Backward adds the gradient reaching x1 by the residual path to the norm's dx in the same
    pass and hands ``a`` its copy already in a's dtype (autograd: a norm pass, an addition, a cast copy).
    Every output and gradient is bitwise what autograd gives through ``x + a`` and :func:`rms_norm`."""

    @staticmethod
    def forward(ctx, x, a, w, eps: float, out_dtype):
        x, a = x.contiguous(), a.contiguous()
        wg = _gained(w, 1.0)
        rstd = torch.empty(*x.shape[:-1], 1, dtype=torch.float32, device=x.device)
        x1, y = native.add_rms_norm(x, a, wg, 1.0, eps, out_dtype, rstd)
        ctx.save_for_backward(x1, w, rstd, wg)
        ctx.a_dtype, ctx.eps = a.dtype, eps
        return x1, y

    @staticmethod
    def backward(ctx, dx1, dy):
        x1, w, rstd, wg = ctx.saved_tensors
        need = ctx.needs_input_grad
        if dy is None:  # only the sum was used
            return dx1, (None if dx1 is None else dx1.to(ctx.a_dtype)), None, None, None
        if torch.is_grad_enabled():  # create_graph=True: gradients with a graph, in torch ops
            dx, dw = _rms_norm_grads(x1, w, dy, ctx.eps, 1.0, need[2])
            dx = dx if dx1 is None else dx + dx1
            return dx, (dx.to(ctx.a_dtype) if need[1] else None), dw, None, None
        with no_autocast(dy.device.type), torch.no_grad():
            want_dw = w is not None and need[2]
            acc = None if dx1 is None else dx1.to(torch.float32).contiguous()
            dx, dw, da = native.rms_norm_backward(x1, dy.contiguous(), rstd, wg, 1.0, want_dw, acc=acc,
                                                  dx2_dtype=ctx.a_dtype if need[1] else None)
        return dx, da, (dw.to(w.dtype) if want_dw else None), None, None


def add_rms_norm(x: torch.Tensor, a: torch.Tensor, weight: Optional[torch.Tensor], eps: float,
                 out_dtype: torch.dtype):
    """``(x + a, rms_norm(x + a, weight, eps, out_dtype=out_dtype))`` in one native pass each way where the
    kernels take it (CPU, ``x`` float32, ``a`` float32/bfloat16 of x's shape, above the decoding size), else
    those two calls."""
    _check_weight(x, weight)
    if (x.dtype == torch.float32 and a.dtype in (torch.float32, torch.bfloat16) and a.shape == x.shape
            and out_dtype in (torch.float32, torch.bfloat16) and x.numel() > SMALL_NORM
            and (weight is None or weight.dtype in (torch.float32, torch.bfloat16))
            and native.supports(x.dtype, x.device) and not functorch_active()):
        with no_autocast(x.device.type):
            return _AddRMSNorm.apply(x, a, weight, eps, out_dtype)
    if (x.dtype == torch.float32 and a.dtype in (torch.float32, torch.bfloat16) and a.shape == x.shape
            and not grad_wanted(a) and _inference_norm(x, weight, out_dtype)):
        rstd = torch.empty(x.shape[:-1].numel(), dtype=torch.float32, device=x.device)
        return native.add_rms_norm(x.contiguous(), a.contiguous(), _gained(weight, 1.0), 1.0, eps, out_dtype, rstd)
    x1 = x + a
    return x1, rms_norm(x1, weight, eps, out_dtype=out_dtype)


def _native_norm(x: torch.Tensor, w: Optional[torch.Tensor], out_dtype: torch.dtype) -> bool:
    """Whether :func:`native.rms_norm` takes this call: float32/bfloat16 in and out, CPU, kernels built."""
    ok = (torch.float32, torch.bfloat16)
    return (x.dtype in ok and out_dtype in ok and (w is None or w.dtype in ok)
            and x.shape[-1] > 0 and native.supports(x.dtype, x.device))
