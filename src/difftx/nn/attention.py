"""Softmax attention, differential attention (DIFF V1) and DIFF V2, as drop-in modules.

All three take x (B, N, d_model) and return (B, N, d_model), share one mask, one
rotary table and one KV cache per model, and reach their kernels through
:mod:`difftx.nn.backends`.  Parameter names follow the official DIFF code
(``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``, ``lambda_q1`` ...) so
checkpoints map over by name; only the row layout (``pairing``) differs between
checkpoint families.

Differential attention (SPEC eq. 1-3), per differential head i of a layer l:

    [Q1; Q2] = X W^Q,  [K1; K2] = X W^K,  V = X W^V     (Q*, K* d wide, V 2d wide)
    lambda   = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init(l)
    head_i   = (softmax(Q1 K1^T / sqrt d) - lambda softmax(Q2 K2^T / sqrt d)) V
    out      = Concat_i((1 - lambda_init) RMSNorm(head_i)) W^O

lambda, the softmax statistics and the per-head norm are computed in float32.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import backends, triton_diff
from .cache import KVCache
from .fused import rms_norm
from .linear import Linear, autocast_on, functorch_active, no_autocast, no_hooks, plain_layer, project, traced
from .mask import AttnMask
from .norms import RMSNorm, make_norm, upcast
from .rope import apply_rope


class AttentionBase(nn.Module):
    """What every attention kind shares: head bookkeeping, QK-norm, RoPE, cache, backend choice."""

    kind = "base"
    # The input only feeds the Q/K/V projections, so under autocast a PreNorm may hand it over already in the
    # autocast dtype (Block._pre); DIFF V2 also computes lambda from it in fp32 and wants it as it is.
    low_precision_input = True

    def __init__(self, cfg, layer: int):
        super().__init__()
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 1:
            raise ValueError(f"{type(self).__name__}: layer is the 1-based layer index (an int >= 1; it picks "
                             f"the layer's KV-cache slot and DIFF's lambda_init); got {layer!r}")
        self.layer = layer  # 1-based, as in the paper
        self.d_model = cfg.d_model
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.rope_style = cfg.rope_style if cfg.positions == "rope" else None
        self.dropout = cfg.dropout
        self.backend = cfg.attn_backend
        self.diff_variant = "auto"
        self.probe = None  # an evaluation probe (difftx.nn.probe); forces the eager path
        if cfg.qk_norm:
            self.q_norm = make_norm(cfg.norm, cfg.head_dim, cfg.norm_eps)
            self.k_norm = make_norm(cfg.norm, cfg.head_dim, cfg.norm_eps)
        else:
            self.q_norm = self.k_norm = None

    # helpers ----------------------------------------------------------------
    def _check(self, x: torch.Tensor, rope, mask: AttnMask, cache) -> None:
        if not isinstance(mask, AttnMask):
            raise TypeError(f"{type(self).__name__}: mask must be a difftx.nn.mask.AttnMask, e.g. "
                            f"AttnMask(causal=True, n_q=N, n_k=N); got {type(mask).__name__}")
        mask.check(x, self.d_model, cache.length if cache is not None else 0)
        if (rope is None) != (self.rope_style is None):  # silently no positions, or tables that do nothing
            raise ValueError(
                f"{type(self).__name__}: built with positions='rope', so rope=(cos, sin) is required: "
                f"RotaryEmbedding({self.head_dim}).cos_sin(positions) (or build it with positions='none')"
                if rope is None else
                f"{type(self).__name__}: rope tables given to a module built without RoPE (its positions are not "
                "'rope'); pass rope=None, or build it with positions='rope'")
        if rope is not None:
            n, half = x.shape[1], self.head_dim // 2
            if not (isinstance(rope, (tuple, list)) and len(rope) == 2 and all(
                    isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[0] in (1, x.shape[0])
                    and t.shape[1] == 1 and t.shape[2:] == (n, half) for t in rope)):
                got = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in rope] \
                    if isinstance(rope, (tuple, list)) else type(rope).__name__
                raise ValueError(f"{type(self).__name__}: rope must be (cos, sin), each (batch or 1, 1, tokens={n}, "
                                 f"head_dim/2={half}), for the positions of this input's {n} tokens: "
                                 f"RotaryEmbedding({self.head_dim}).cos_sin(positions); got {got}")

    @staticmethod
    def _qk_norm(p: torch.Tensor, norm: Optional[nn.Module], d: int) -> torch.Tensor:
        """QK-norm of each d-wide head of a projection's output (B, N, n*d), in that layout: the norm reads and
        writes whole rows, where the head view (B, n, N, d) would cost it a copy each way."""
        if norm is None:
            return p
        b, t, w = p.shape
        return norm(p.view(b, t, w // d, d)).view(b, t, w)

    def _qk(self, t: torch.Tensor, rope) -> torch.Tensor:
        """RoPE on (B, H, N, d), or DIFF's (B, 2, H, N, d) (maps first), after :meth:`_qk_norm`."""
        if rope is not None and self.rope_style is not None:
            cos, sin = rope  # (B|1, 1, N, d/2): apply_rope lines them up with DIFF's maps axis itself
            t = apply_rope(t, cos, sin, self.rope_style)
        return t

    def _backend(self, device: torch.device) -> str:
        return backends.pick_backend(self.backend, self.probe, self._dropout_p(), device)

    def _dropout_p(self) -> float:
        return self.dropout if self.training else 0.0

    def _attend(self, q, k, v, mask: AttnMask, compiled_step: bool = False) -> torch.Tensor:
        """Plain softmax attention through the chosen backend: (B, H, N, d).  ``compiled_step``: see
        :func:`_compiled_step`."""
        backend, p = self._backend(q.device), self._dropout_p()
        if backend == "eager":
            return backends.eager_attention(q, k, v, mask, self.scale, p, self.probe, self.layer)
        if backend == "flex":
            return backends.flex(q, k, v, mask, self.scale)
        if not compiled_step and backends.resolve_softmax_variant(self.diff_variant, q, p, mask.windowed) == "fused":
            return backends.fused_attention(q[:, None], k[:, None], v, mask, self.scale).transpose(1, 2)
        return backends.sdpa(q, k, v, mask, self.scale, p)


def _compiled_step(cache, n_queries: int) -> bool:
    """A one-query decoding step under torch.compile: it takes SDPA, not the fused kernel, which is a
    compiler-disabled island (a graph break; with the cache's length as a dynamic size, inductor then failed to
    compile the step: "name 's29' is not defined", torch 2.13).  One query gains nothing from the fused kernel."""
    return n_queries == 1 and cache is not None and cache.length > 0 and traced()


def _heads(x: torch.Tensor, n: int, d: int) -> torch.Tensor:
    """(B, N, n*d) -> (B, n, N, d) as a view."""
    b, t, _ = x.shape
    return x.view(b, t, n, d).transpose(1, 2)


def _autocast_input(x: torch.Tensor) -> torch.Tensor:
    """Under autocast, cast x once for the three projections (autocast would cast it per call)."""
    if autocast_on(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        if x.dtype != dtype and x.is_floating_point():
            return x.to(dtype)
    return x


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype out_proj computes in: the autocast dtype under autocast, else the input's."""
    if autocast_on(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _merge(x: torch.Tensor) -> torch.Tensor:
    """(B, H, N, d) -> (B, N, H*d)."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


def _cache_keys(k: torch.Tensor, own_cache: bool) -> torch.Tensor:
    """DIFF keys (B, 2, h_kv, n, d) -> what a cache stores; the bytes of a Transformer with 2 h_kv heads of d.

    difftx's KVCache in reduced precision: (B, h_kv, n, 2d), [K1 | K2] side by side per head
    ("paired"), so that decoding is one GQA flash call (:func:`backends.diff_decode_paired`).
    fp32/fp64, and transformers' caches (which allocate K like V from the config): (B, 2 h_kv,
    n, d), [K1 heads; K2 heads], the layout the MKL decoding path streams per map.  The shape
    tells the layouts apart (h_kv heads of 2d vs 2 h_kv heads of d).
    """
    b, _, hk, n, d = k.shape
    if own_cache and k.dtype in (torch.bfloat16, torch.float16):
        return k.permute(0, 2, 3, 1, 4).reshape(b, hk, n, 2 * d)
    return k.reshape(b, 2 * hk, n, d)


def _cached_keys(kk: torch.Tensor, b: int, hk: int, d: int) -> torch.Tensor:
    """A cache's keys in either layout of :func:`_cache_keys` -> (B, 2, h_kv, T, d), a view."""
    if kk.shape[1] == hk and kk.shape[-1] == 2 * d:
        return kk.view(b, hk, kk.shape[2], 2, d).permute(0, 3, 1, 2, 4)
    return kk.view(b, 2, hk, kk.shape[2], d)


class SoftmaxAttention(AttentionBase):
    """Standard multi-head (or grouped-query) attention with RoPE."""

    kind = "softmax"

    def __init__(self, cfg, layer: int):
        super().__init__(cfg, layer)
        d, h, hk = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        self.q_proj = Linear(cfg.d_model, h * d, bias=cfg.qkv_bias)
        self.k_proj = Linear(cfg.d_model, hk * d, bias=cfg.qkv_bias)
        self.v_proj = Linear(cfg.d_model, hk * d, bias=cfg.qkv_bias)
        self.out_proj = Linear(h * d, cfg.d_model, bias=cfg.bias)

    def forward(self, x, rope, mask: AttnMask, cache=None) -> torch.Tensor:
        self._check(x, rope, mask, cache)
        d = self.head_dim
        qp, kp, vp = project(_autocast_input(x), (self.q_proj, self.k_proj, self.v_proj))
        q = self._qk(_heads(self._qk_norm(qp, self.q_norm, d), self.n_heads, d), rope)
        k = self._qk(_heads(self._qk_norm(kp, self.k_norm, d), self.n_kv_heads, d), rope)
        v = _heads(vp, self.n_kv_heads, d)
        decoding = cache is not None and cache.length > 0
        if cache is not None:
            k, v = cache.update(self.layer - 1, k, v)
        out_dtype = _out_dtype(x)
        if decoding and q.shape[2] == 1 and self._native_decode(q, k, v, mask, out_dtype):
            # a decoding step: logits, softmax and the value sum over the cache's prefix views in one native pass
            o = backends.native_diff_decode(q[:, None], k[:, None], v, mask, self.scale, 0.0, False, None, 1.0,
                                            0.0, out_dtype)  # (B, 1, H, d)
            return self.out_proj(o.reshape(x.shape[0], 1, self.n_heads * d))
        return self.out_proj(_merge(self._attend(q, k, v, mask, _compiled_step(cache, q.shape[2]))))

    def _native_decode(self, q, k, v, mask: AttnMask, out_dtype: torch.dtype) -> bool:
        """Whether a one-query decoding step takes the native kernel: the sdpa backend (no probe, no dropout)
        with the ``auto`` or ``fused`` variant, no autograd, and a step the kernel serves."""
        return (self.diff_variant in ("auto", "fused", "2call", "4call", "triton")
                and self._backend(q.device) == "sdpa" and self._dropout_p() == 0 and not torch.is_grad_enabled()
                and backends.native_diff_decode_ok(q[:, None], k[:, None], v, mask, out_dtype))


class DifferentialAttention(AttentionBase):
    """DIFF V1: ``n_heads`` differential heads, each with Q1, Q2, K1, K2 (d) and V (2d).

    ``pairing`` says how the rows of q_proj / k_proj / v_proj are grouped:
    ``adjacent`` (official code: component heads 2i, 2i+1 are Q1, Q2 of head i;
    V of a K/V group is 2d contiguous) or ``halves`` (transformers' DiffLlama:
    component heads i and i + h; V = cat(v_j, v_{j + h_kv})).
    """

    kind = "diff"

    def __init__(self, cfg, layer: int):
        super().__init__(cfg, layer)
        d, h, hk = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        self.pairing = cfg.pairing
        self.lambda_init = cfg.lambda_init_for(layer)
        self.q_proj = Linear(cfg.d_model, 2 * h * d, bias=cfg.qkv_bias)
        self.k_proj = Linear(cfg.d_model, 2 * hk * d, bias=cfg.qkv_bias)
        self.v_proj = Linear(cfg.d_model, 2 * hk * d, bias=cfg.qkv_bias)
        self.out_proj = Linear(2 * h * d, cfg.d_model, bias=cfg.bias)
        std = cfg.lambda_std
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            self.register_parameter(name, nn.Parameter(torch.zeros(d, dtype=torch.float32).normal_(0, std)))
        self.head_norm = RMSNorm(2 * d, eps=cfg.head_norm_eps, weight=cfg.head_norm_weight) if cfg.head_norm else None

    def lambda_full(self) -> torch.Tensor:
        """The layer's scalar lambda, in float32 (SPEC eq. 2); float64 for float64 parameters.

        Computed in float64 whatever the parameters' dtype: each exp overflows float32 from an exponent of
        88.7, so two large equal terms (lq1 . lk1 = lq2 . lk2 = 100, a finite lambda of lambda_init) gave
        inf - inf = NaN in float32, and every output and gradient of the layer with it."""
        return backends.diff_lambda(self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2, self.lambda_init)

    def __getstate__(self):
        # the decoding memo holds a weak reference to a cache: not picklable (torch.save(model), deepcopy of a
        # model that has decoded), and meaningless away from that cache
        state = self.__dict__.copy()
        state.pop("_lambda_memo", None)
        return state

    def _lambda(self, cache=None, decoding: bool = False) -> torch.Tensor:
        """:meth:`lambda_full`, computed once per generation while decoding.

        A generation's KV cache holds keys and values made by the current weights, so the
        lambda computed when that cache was filled holds for its later decoding steps
        (``decoding``: the cache already held tokens); every other call computes it afresh.
        The memo is also keyed on the lambda parameters (the same tensors, their version
        counters) and ``lambda_init``: a lambda changed between decoding steps (an ablation
        mid-generation, ``lambda_q1.mul_(0)``, ``load_state_dict``, a new Parameter) is read
        again.  Changes that bypass the version counters (``.data``, torch's fused
        optimisers) are not seen: reset the cache after them.
        """
        if torch.is_grad_enabled() or cache is None or traced():  # compiled: part of the graph, no memo to guard on
            if cache is not None and not decoding:  # a new generation: a memo of the cache's last one is stale
                self._lambda_memo = None
            return self.lambda_full()
        ps = self._parameters  # (four nn.Module.__getattr__ calls took 3 us per layer and step; a memo hit 0.2)
        try:
            q1, k1, q2, k2 = ps["lambda_q1"], ps["lambda_k1"], ps["lambda_q2"], ps["lambda_k2"]
        except KeyError:  # parametrized (a property) or no longer parameters: what lambda_full reads
            q1, k1, q2, k2 = self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2
        key = (self.lambda_init, q1._version, k1._version, q2._version, k2._version)
        memo = self.__dict__.get("_lambda_memo")
        if decoding and memo is not None and memo[0]() is cache and memo[2] == key:
            held = memo[3]
            if held[0] is q1 and held[1] is k1 and held[2] is q2 and held[3] is k2:
                return memo[1]
        lam = self.lambda_full()
        try:
            self._lambda_memo = (weakref.ref(cache), lam, key, (q1, k1, q2, k2))
        except TypeError:  # a cache type without weak references: no memo
            self._lambda_memo = None
        return lam

    def split(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Projection outputs -> q1, q2 (B, h, N, d); k1, k2 (B, h_kv, N, d); v (B, h_kv, N, 2d)."""
        b, t, _ = q.shape
        d, h, hk = self.head_dim, self.n_heads, self.n_kv_heads
        if self.pairing == "adjacent":
            qv, kv_ = q.view(b, t, h, 2, d), k.view(b, t, hk, 2, d)
            q1, q2 = qv[:, :, :, 0], qv[:, :, :, 1]
            k1, k2 = kv_[:, :, :, 0], kv_[:, :, :, 1]
            vv = v.view(b, t, hk, 2 * d)
        else:  # halves
            qv, kv_ = q.view(b, t, 2, h, d), k.view(b, t, 2, hk, d)
            q1, q2 = qv[:, :, 0], qv[:, :, 1]
            k1, k2 = kv_[:, :, 0], kv_[:, :, 1]
            v2 = v.view(b, t, 2, hk, d)
            vv = torch.cat((v2[:, :, 0], v2[:, :, 1]), dim=-1)
        tr = lambda z: z.transpose(1, 2)  # noqa: E731
        return tr(q1), tr(q2), tr(k1), tr(k2), tr(vv)

    def _stack(self, t: torch.Tensor, n: int) -> torch.Tensor:
        """(B, 2n, N, d) component heads in pairing order -> (B, 2, n, N, d), map first; a view."""
        b, _, t_len, d = t.shape
        if self.pairing == "adjacent":
            return t.view(b, n, 2, t_len, d).transpose(1, 2)
        return t.view(b, 2, n, t_len, d)

    def _value(self, v: torch.Tensor) -> torch.Tensor:
        """v_proj output -> (B, h_kv, N, 2d): a view for ``adjacent``, a gather for ``halves``."""
        b, t, _ = v.shape
        d, hk = self.head_dim, self.n_kv_heads
        if self.pairing == "adjacent":
            return _heads(v, hk, 2 * d)
        return v.view(b, t, 2, hk, d).permute(0, 3, 1, 2, 4).reshape(b, hk, t, 2 * d)

    def forward(self, x, rope, mask: AttnMask, cache=None) -> torch.Tensor:
        self._check(x, rope, mask, cache)
        b, t, _ = x.shape
        d, h, hk = self.head_dim, self.n_heads, self.n_kv_heads
        # QK-norm and RoPE act per d-wide component head: one call covers both maps.
        qp, kp, vp = project(_autocast_input(x), (self.q_proj, self.k_proj, self.v_proj))
        # Stacked maps-first before RoPE, whose output is a new tensor: so it comes out contiguous in
        # (B, 2, h, N, d) order, which the fused kernel reads as one batch without copying Q or K.
        q = self._qk(self._stack(_heads(self._qk_norm(qp, self.q_norm, d), 2 * h, d), h), rope)  # (B, 2, h, N, d)
        k = self._qk(self._stack(_heads(self._qk_norm(kp, self.k_norm, d), 2 * hk, d), hk), rope)
        v = self._value(vp)  # (B, h_kv, N, 2d)
        read_buffers = False  # the fused path reads the cache's whole static buffers
        decode_gqa = False
        decoding = cache is not None and cache.length > 0
        if cache is not None:
            fresh = (k, v) if cache.length == 0 else None
            kk, v = cache.update(self.layer - 1, _cache_keys(k, isinstance(cache, KVCache)), v)
            k = _cached_keys(kk, b, hk, d)
            if isinstance(cache, KVCache) and fresh is None:  # its whole static buffers (fused decoding)
                read_buffers = True
                decode_gqa = t == 1 and kk.shape[1] == hk  # the paired layout: one GQA flash call
            elif fresh is not None:  # prefill into an empty cache: the keys as computed, not strided buffers
                k, v = fresh
        backend, p = self._backend(q.device), self._dropout_p()
        variant = backends.resolve_diff_variant(self.diff_variant, q.device, p, q.dtype,
                                                work=b * h * t * k.shape[3])
        if variant == "fused" and _compiled_step(cache, t):
            variant = "2call"
        out_dtype = _out_dtype(x)
        plain_norm = self.head_norm is None or (type(self.head_norm) is RMSNorm and no_hooks(self.head_norm))
        if variant == "triton":
            # documents, windows and a cached prefix (decoding) take the kernels when asked for by name: auto's choice
            # is measured on the plain causal mask only (docs/performance.md)
            masked = not mask.is_plain_causal
            if (backend == "sdpa" and plain_norm and (not masked or self.diff_variant == "triton")
                    and triton_diff.supports(q, k, v, mask, p)):
                # lambda, both maps, the combine and the head norm in the kernels: no host ops for lambda
                if cache is not None:  # a new generation (as _lambda does): the next decoding step computes it
                    self._lambda_memo = None
                hn = self.head_norm
                o = triton_diff.diff_attention(
                    q, k, v, (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2), self.lambda_init,
                    self.scale, None if hn is None else hn.weight, norm=hn is not None,
                    eps=0.0 if hn is None else hn.eps, gain=1.0 - self.lambda_init, out_dtype=out_dtype,
                    doc_ids=None if mask.doc_ids is None else mask.doc_ids.to(q.device),
                    window=mask.window if mask.windowed else None)
                return self.out_proj(o.reshape(b, t, 2 * h * d))
            variant = "fused" if q.device.type == "cpu" else "2call"
        lam = self._lambda(cache, decoding)
        fast = backend == "sdpa" and variant == "fused" and not torch.is_grad_enabled()
        if fast and decoding and t == 1 and plain_norm and backends.native_diff_decode_ok(q, k, v, mask, out_dtype):
            hn = self.head_norm  # attention and head norm in one call over the cache's prefix views
            o = backends.native_diff_decode(q, k, v, mask, self.scale, lam, hn is not None,
                                            None if hn is None else hn.weight, 1.0 - self.lambda_init,
                                            hn.eps if hn is not None else 0.0, out_dtype)
            return self.out_proj(o.reshape(b, t, 2 * h * d))
        if fast and decode_gqa:
            o = backends.diff_decode_paired(q, kk, v, mask, self.scale, lam)  # (B, 1, h, 2d)
        elif backend == "sdpa" and variant == "fused":
            kf, vf = (k, v) if not read_buffers else \
                (_cached_keys(cache.k[self.layer - 1], b, hk, d), cache.v[self.layer - 1])
            o = backends.fused_attention(q, kf, vf, mask, self.scale, lam)  # (B, N, h, 2d)
        else:
            q1, q2, k1, k2 = q[:, 0], q[:, 1], k[:, 0], k[:, 1]
            if backend == "eager":
                o = backends.eager_diff_attention(q1, q2, k1, k2, v, lam, mask, self.scale, p, self.probe,
                                                  self.layer)
            else:
                if backend == "flex":
                    o1, o2 = backends.flex(q1, k1, v, mask, self.scale), backends.flex(q2, k2, v, mask, self.scale)
                else:
                    o1, o2 = backends.diff_sdpa(q1, q2, k1, k2, v, mask, self.scale, p, variant)
                o = backends.combine(o1, o2, lam)
            o = o.transpose(1, 2)
        if self.head_norm is not None and plain_norm:  # fp32 statistics; (1 - lambda_init) folded into the gain
            o = rms_norm(o, self.head_norm.weight, self.head_norm.eps, 1.0 - self.lambda_init, out_dtype)
        elif self.head_norm is not None:  # a hooked or swapped-in norm: called as it is
            o = self.head_norm(o) * (1.0 - self.lambda_init)
        return self.out_proj(o.reshape(b, t, 2 * h * d).to(out_dtype))


class DiffV2Attention(AttentionBase):
    """DIFF V2 (microsoft/unilm Diff-Transformer-V2): 2h query heads over h_kv K/V heads.

    out_i = attn_{2i} - sigmoid(W_lambda x)_i * attn_{2i+1}; heads 2i and 2i+1
    share a GQA group; no per-head norm, no lambda_init.
    """

    low_precision_input = False  # lambda = sigmoid(W_lambda x) is computed from the fp32 x

    kind = "diff2"

    def __init__(self, cfg, layer: int):
        super().__init__(cfg, layer)
        d, h, hk = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        self.q_proj = Linear(cfg.d_model, 2 * h * d, bias=cfg.qkv_bias)
        self.k_proj = Linear(cfg.d_model, hk * d, bias=cfg.qkv_bias)
        self.v_proj = Linear(cfg.d_model, hk * d, bias=cfg.qkv_bias)
        self.out_proj = Linear(h * d, cfg.d_model, bias=cfg.bias)
        self.lambda_proj = nn.Linear(cfg.d_model, h, bias=False)
        self._last_lam: Optional[torch.Tensor] = None  # the last forward's sigmoid(W x), detached

    @property
    def last_lambda(self) -> Optional[torch.Tensor]:
        """The mean of sigmoid(W_lambda x) over the last forward pass outside torch.func transforms (a 0-dim
        float32 or float64 tensor; None before any); computed when read, not at every decoding step."""
        lam = self.__dict__.get("_last_lam")  # (absent on a module pickled whole before it was introduced)
        return None if lam is None else lam.mean()

    def _lambdas(self, x: torch.Tensor) -> torch.Tensor:
        """sigmoid(W_lambda x): (B, N, h), at least float32, from the float32 x (autocast off)."""
        xf, lp = upcast(x), self.lambda_proj
        with no_autocast(x.device.type):  # F.linear is on autocast's bf16 list
            if plain_layer(lp):
                w = lp.weight.to(xf.dtype)
                if xf.shape[1] == 1 and xf.dim() == 3 and not torch.is_grad_enabled():  # a decoding step: one mm
                    return torch.sigmoid(torch.mm(xf.reshape(xf.shape[0], -1), w.t())).view(xf.shape[0], 1, -1)
                return torch.sigmoid(F.linear(xf, w))
            # a hooked or swapped-in layer (a LoRA wrapper): called as it is, in its parameters' dtype
            w = next(lp.parameters(), None)
            return torch.sigmoid(upcast(lp(xf if w is None or w.dtype == xf.dtype else xf.to(w.dtype))))

    def forward(self, x, rope, mask: AttnMask, cache=None) -> torch.Tensor:
        self._check(x, rope, mask, cache)
        d = self.head_dim
        qp, kp, vp = project(_autocast_input(x), (self.q_proj, self.k_proj, self.v_proj))
        qh = _heads(self._qk_norm(qp, self.q_norm, d), 2 * self.n_heads, d)  # (B, 2h, N, d)
        b, _, n, _ = qh.shape
        # heads 2i, 2i+1 -> maps 1, 2, stacked before RoPE (as DIFF's _stack), whose output is a new tensor: so it
        # comes out contiguous in (B, 2, h, N, d) order, which the fused and decoding kernels read without a copy
        qs = self._qk(qh.view(b, self.n_heads, 2, n, d).transpose(1, 2), rope)
        k = self._qk(_heads(self._qk_norm(kp, self.k_norm, d), self.n_kv_heads, d), rope)
        v = _heads(vp, self.n_kv_heads, d)
        if cache is not None:
            k, v = cache.update(self.layer - 1, k, v)
        lam = self._lambdas(x)  # (B, N, h), >= fp32
        if not functorch_active():  # inside torch.func (grad, vmap) lam is the transform's wrapper: kept on the
            # module past it, it breaks deepcopy, pickling and lambdas()
            self._last_lam = lam.detach() if lam.requires_grad else lam
        backend, p = self._backend(qs.device), self._dropout_p()
        ks = k[:, None].expand(b, 2, *k.shape[1:])  # both maps over the one set of keys (a view)
        if (backend == "sdpa" and self.diff_variant in ("auto", "fused", "2call", "4call", "triton") and n == 1
                and p == 0.0
                and cache is not None and cache.length > 0 and not torch.is_grad_enabled()
                and backends.native_diff_decode_ok(qs, ks, v, mask, _out_dtype(x))):
            # a decoding step: both maps over the cache's keys and the combine in one native pass
            o = backends.native_diff_decode(qs, ks, v, mask, self.scale, lam.reshape(b, self.n_heads), False,
                                            None, 1.0, 0.0, _out_dtype(x))
            return self.out_proj(o.reshape(b, n, -1))
        lam = lam.transpose(1, 2)[..., None]  # (B, h, N, 1)
        if (backend == "sdpa" and backends.resolve_v2_variant(self.diff_variant, qs, p, mask.windowed) == "fused"
                and not _compiled_step(cache, n)):
            o = backends.fused_attention(qs, k[:, None], v, mask, self.scale, lam)  # (B, N, h, d); K read by both maps
            return self.out_proj(o.reshape(b, n, -1).to(_out_dtype(x)))
        q = qs.transpose(1, 2).reshape(b, 2 * self.n_heads, n, d)  # the 2h heads in projection order (a copy)
        if backend == "eager":
            o = backends.eager_v2_attention(q, k, v, lam, mask, self.scale, p, self.probe, self.layer)
        else:
            o = self._attend(q, k, v, mask, _compiled_step(cache, n))
            o = upcast(o[:, 0::2]) - lam * upcast(o[:, 1::2])
        return self.out_proj(_merge(o.to(x.dtype)))


ATTENTION_CLASSES = {"softmax": SoftmaxAttention, "diff": DifferentialAttention, "diff2": DiffV2Attention}


def make_attention(cfg, layer: int) -> AttentionBase:
    return ATTENTION_CLASSES[cfg.attention](cfg, layer)
