"""``Linear`` and ``project``: ``torch.nn.Linear`` (same parameters, state dict and outputs, up to the
summation order of the split products below) with a faster training path on the CPU.

Three things torch leaves on the table there:

* Projections of one input (Q, K and V; SwiGLU's gate and up) each hand back their own dx, which autograd
  then sums with separate adds.  :func:`project` runs them as one autograd node that accumulates dx inside
  the GEMMs (``addmm_``).
* bfloat16 on an AMX CPU: torch computes a weight gradient as ``dY^T @ X`` with ``dY^T`` a transposed view,
  and its bfloat16 GEMM runs that layout at about half the speed of the same product with both operands
  row-major (a Xeon with AMX, 2048 tokens, 512/1408 wide: 580-650 against 1000-1260 GFLOP/s), while
  torch's own transposing copy of a bfloat16 matrix moves ~3 GB/s.  Here the native kernels transpose the
  smaller side (:func:`difftx.nn.native.transpose_bf16`): X once for all of its projections
  (dW^T = X^T dY, transposed back in the pass that casts it to the weight's dtype), or dY.
* bfloat16 on two or more threads: oneDNN keeps some products on one thread, or splits them badly.  Those
  measured to gain run as two halves of their output (:func:`_forward`, :func:`_mm`); each half is torch's
  product of that half, and the whole's float32 sums can round differently from the halves'.

* bfloat16 on a CPU with AVX512-BF16 and without AMX (AMD Zen 4, Intel Cooper Lake): every product runs on
  the native kernels' ``vdpbf16ps`` register block (:class:`_DotLinear`, :func:`difftx.nn.native.dot_mm`),
  the weights packed straight from float32 (no bfloat16 copy), weight gradients written in the weight's
  dtype from the float32 sums, dx of a :func:`project` summed in float32.  On a 2-core Zen 4 the weight
  gradients' products ran 6-14% faster than torch's (oneDNN reads dY^T as a transposed view), the others
  within a few percent either way, and the small preset's bf16 training step 0-6% faster (within that VM's
  noise) with 7% less memory: no bf16 weight copies (``benchmarks/performance/results/amd-zen4/dot-linear/``).
  A weight gradient's operands both run over the tokens, so each needs its token pairs side by side: x
  comes out packed that way from the forward product (kept instead of x, the same size) and dY from the dx
  product, each block packed while the product has it in cache, in place of a transpose of dY and a pack of
  x that each read the whole tensor back from memory (``results/amd-zen4/session48/``).  The dx products of a
  :func:`project` group run as one call (:func:`difftx.nn.native.dot_mm_sum`) whose float32 sums stay in
  registers from one projection's product to the next and are written once: the bits of the chain of
  products, Q/K/V's backward 1.04x faster (``results/amd-zen4/session49/``).

* float32 on an AMD Zen 5 (or later) CPU: torch's float32 GEMM (MKL) takes a path there that runs at less than
  half the cores' AVX-512 rate, while oneDNN, which torch ships too, runs AVX-512 kernels: on a 2-core Zen 5
  (one core's FMA peak 266 GFLOP/s) MKL reached 92-106 GFLOP/s a thread at the ``small`` preset's shapes and
  oneDNN 184-243 (``benchmarks/performance/fp32_gemm.py``).  There every float32 product of this module (the
  forward, dx -- the projections of one input summed in oneDNN's add post-op -- and the weight gradients), and
  float32 inference calls of :func:`linear` past :data:`FEW_ROWS` rows, run on oneDNN
  (``torch.ops.mkldnn._linear_pointwise``; :data:`ONEDNN_FP32`), compiled graphs' too (``difftx::onednn_linear``).

Every product is a GEMM in the same dtype as torch's (bfloat16 with float32 accumulation under autocast,
float32 otherwise; on oneDNN above, the same float32 sums in another order); weight gradients come back in
the weight's dtype, as autocast's cast would hand them.  Everywhere else (inference but for the two cases of
:func:`linear`, no grad for the weight, float16/float64, CUDA, bfloat16 without AMX or AVX512-BF16) the layer
is ``F.linear`` unchanged, and :func:`project` calls the modules one by one.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import weakref
from typing import Optional

import torch
import torch.autograd.forward_ad as _forward_ad
import torch.nn.functional as F
from torch import nn

from . import native

_BF16 = torch.bfloat16
_TAKEN = (torch.float32, torch.bfloat16)
_FP32 = torch.float32
FP32_GEMM_ENV = "DIFFTX_FP32_GEMM"  # "onednn" or "torch": overrides the choice below (benchmarks, A/B runs)


def _default_onednn_fp32() -> bool:
    """Whether float32 products run on oneDNN (see the module docstring): on AMD CPUs of family 26 (Zen 5) or
    later with AVX-512, whose FMA units are 512 bits wide, where torch has oneDNN's linear op; unless
    ``DIFFTX_FP32_GEMM`` says ``torch`` (or ``onednn``: anywhere torch has it).  Not measured with oneDNN on
    Zen 4 (512-bit instructions on 256-bit units: MKL's path reached ~86% of its FMA peak there, little to
    gain), on AMD CPUs without AVX-512, or on Intel CPUs, where MKL takes its own AVX-512 paths."""
    have = (torch.backends.mkldnn.is_available() and hasattr(torch.ops, "mkldnn")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn._linear_pointwise, "binary"))  # (the add post-op: dx of a project)
    choice = os.environ.get(FP32_GEMM_ENV, "").strip().lower()
    if choice in ("onednn", "torch"):
        return have and choice == "onednn"
    try:
        family = int(native.cpuinfo_value("cpu family"))
    except ValueError:
        return False
    return (have and native.cpu_vendor() == "AuthenticAMD" and family >= 26
            and "avx512f" in native.cpuinfo_value("flags").split())


# Float32 products on oneDNN instead of torch's GEMM (MKL); a module-level switch, as FEW_ROWS.
ONEDNN_FP32 = _default_onednn_fp32()


def _onednn_eager(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor],
                  add: Optional[torch.Tensor]) -> torch.Tensor:
    if add is not None:
        return torch.ops.mkldnn._linear_pointwise.binary(x, add, w, b, "add")
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


@torch.library.custom_op("difftx::onednn_linear", mutates_args=())
def _onednn_op(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor],
               add: Optional[torch.Tensor]) -> torch.Tensor:
    """:func:`_onednn` as an op that compiled graphs call as it is (inductor has no lowering for oneDNN's
    linear op on a weight it did not pack itself)."""
    return _onednn_eager(x, w, b, add)


@_onednn_op.register_fake
def _(x, w, b, add):
    return x.new_empty(*x.shape[:-1], w.shape[0])


def _onednn(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None,
            add: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x @ w^T (+ b) (+ add) in float32 on oneDNN: x (..., k) and w (n, k) may be strided views (a transposed
    operand is read as it lies); ``add`` (x's rows, n) is summed in the product's add post-op.  Eager calls go
    straight to oneDNN's op (the custom op's dispatch costs ~25 us a call), compiled ones through ``difftx::``."""
    if torch.compiler.is_compiling():
        return _onednn_op(x, w, b, add)
    return _onednn_eager(x, w, b, add)


def _onednn_ok(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether a float32 product of these CPU tensors (None: an absent bias) runs on oneDNN here (not an empty
    one: oneDNN has no primitive for it)."""
    return ONEDNN_FP32 and all(t is None or (t.dtype == _FP32 and t.device.type == "cpu" and t.numel() > 0)
                               for t in tensors)


class _Linear(torch.autograd.Function):
    """y_i = x W_i^T + b_i for one input and n weights in ``dtype`` (x, W, b cast as autocast casts them)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: torch.dtype, n: int, *params):
        xc = x.to(dtype)
        ws = [params[2 * i].to(dtype) for i in range(n)]
        bs = [None if params[2 * i + 1] is None else params[2 * i + 1].to(dtype) for i in range(n)]
        ctx.save_for_backward(xc, *ws)
        ctx.dtypes = (x.dtype, [None if p is None else p.dtype for p in params])
        return tuple(_forward(xc, w, b) for w, b in zip(ws, bs))

    @staticmethod
    def backward(ctx, *dys):
        xc, *ws = ctx.saved_tensors
        x_dtype, dtypes = ctx.dtypes
        dtype, n, need = xc.dtype, len(ws), ctx.needs_input_grad
        if torch.is_grad_enabled() and dtype == _BF16:  # create_graph=True: the kernels' outputs have no graph
            raise RuntimeError("difftx Linear: a second derivative through its bf16 AMX backward is not "
                               "supported; run this in float32, or set DIFFTX_NATIVE=0 for torch's own path")
        dy2s = [dy.to(dtype).reshape(-1, dy.shape[-1]) for dy in dys]
        grads: list = [None] * (2 * n)
        dx = None
        # float32 on oneDNN, but under create_graph (torch's ops, which have a derivative)
        dnn = _onednn_ok(xc) and not torch.is_grad_enabled()
        if need[0]:
            if dnn:  # w^T read as it lies; each further projection's product added in its post-op
                for dy2, w in zip(dy2s, ws):
                    dx = _onednn(dy2, w.t(), add=dx)
            else:
                for dy2, w in zip(dy2s, ws):
                    dx = dy2 @ w if dx is None else dx.addmm_(dy2, w)
            dx = dx.view(xc.shape).to(x_dtype)
        wanted = [i for i in range(n) if need[3 + 2 * i]]
        if wanted:
            x2 = xc.reshape(-1, xc.shape[-1])
            xt = None
            if dtype == _BF16 and x2.shape[1] < sum(dy2s[i].shape[1] for i in wanted):
                xt = native.transpose_bf16(x2, pad=32)
            if dnn:
                _onednn_weight_grads(x2, dy2s, wanted, dtypes, grads)
            else:
                for i in wanted:
                    grads[2 * i] = _weight_grad(x2, xt, dy2s[i], dtypes[2 * i])
        for i in range(n):
            if dtypes[2 * i + 1] is not None and need[4 + 2 * i]:
                grads[2 * i + 1] = dy2s[i].sum(0).to(dtypes[2 * i + 1])
        return (dx, None, None, *grads)


class _DotLinear(torch.autograd.Function):
    """:class:`_Linear` in bfloat16 with every product on the native kernels' AVX512-BF16 dot products
    (:func:`difftx.nn.native.dot_mm`; a CPU with them and without AMX).  Same operands as autocast's GEMMs:
    x and the weights rounded to bfloat16 (the weights packed straight from their float32 values, with no
    bfloat16 copy), float32 sums; y in bfloat16, dx in x's dtype (the projections' float32 sums added in
    float32), each weight gradient written in its weight's dtype from the float32 sums.  :func:`_dot_ok`
    says which calls it takes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: torch.dtype, n: int, *params):
        x2 = _rows_bf16(x)
        m, k = x2.shape
        # The weight gradients' B operand is x packed along the tokens (whole 32-row tiles): the first product
        # writes it while x's rows are in cache, and it is kept instead of x2 (same size).
        xp = None
        if m % 32 == 0 and any(ctx.needs_input_grad[3 + 2 * i] for i in range(n)):
            xp = torch.empty(native.packed_rows_numel(m, k), dtype=_BF16)
        outs = []
        for i in range(n):
            w, b = params[2 * i], params[2 * i + 1]
            y = _dot_product(x2, native.pack_wt(w), w.shape[0], b, pack_a=xp if i == 0 else None)
            if y is None:
                raise RuntimeError("difftx Linear: the bf16 dot-product kernel refused a call it was given")
            outs.append(y.view(*x.shape[:-1], w.shape[0]))
        ctx.save_for_backward(x2 if xp is None else xp, *(params[2 * i] for i in range(n)))
        ctx.dtypes = (x.dtype, x.shape, [None if p is None else p.dtype for p in params], (m, k), xp is not None)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *dys):
        xs, *ws = ctx.saved_tensors
        x_dtype, x_shape, dtypes, (m, k), packed = ctx.dtypes
        n, need = len(ws), ctx.needs_input_grad
        if torch.is_grad_enabled():  # create_graph=True: the kernels' outputs have no graph
            raise RuntimeError("difftx Linear: a second derivative through its bf16 native backward is not "
                               "supported; run this in float32, or set DIFFTX_NATIVE=0 for torch's own path")
        dy2s = [dy.to(_BF16).reshape(m, -1).contiguous() for dy in dys]
        wanted = [i for i in range(n) if need[3 + 2 * i]]
        # dY packed along the tokens, the weight gradient's A operand (dY^T's rows): written by the dx product
        # that reads dY anyway, or packed on its own where dx is not wanted
        dyps: list = [None] * n
        if packed and need[0]:
            for i in wanted:
                dyps[i] = torch.empty(native.packed_rows_numel(m, dy2s[i].shape[1]), dtype=_BF16)
        grads: list = [None] * (2 * n)
        dx = None
        if need[0]:  # float32 sums across the projections, rounded once into x's dtype
            sums = None
            bps = [native.pack_rows(w, w.shape[0]) for w in ws]
            if 1 < n <= native.DOT_SUM_MAX:  # one call: the sums stay in registers from product to product
                sums = torch.empty(m, k, dtype=_BF16 if x_dtype == _BF16 else torch.float32)
                if not native.dot_mm_sum(dy2s, bps, k, sums, pack_a=dyps):
                    raise RuntimeError("difftx Linear: the bf16 dot-product kernel refused a call it was given")
            else:  # one projection (or more than one call takes): a chain of products passing float32 sums on
                for i, (dy2, bp) in enumerate(zip(dy2s, bps)):
                    last = i == n - 1
                    if last and x_dtype == _BF16:
                        out = torch.empty(m, k, dtype=_BF16)
                    else:
                        out = sums if sums is not None else torch.empty(m, k, dtype=torch.float32)
                    if not native.dot_mm(dy2, bp, k, out, add=sums, pack_a=dyps[i]):
                        raise RuntimeError("difftx Linear: the bf16 dot-product kernel refused a call it was given")
                    sums = out
            dx = sums.view(x_shape).to(x_dtype)
        for i in wanted:
            if packed:
                dyp = dyps[i] if need[0] else native.pack_rows(dy2s[i], m)
                dw = torch.empty(ws[i].shape, dtype=dtypes[2 * i])
                if dyp is None or not native.dot_mm_t(dyp, m, dy2s[i].shape[1], xs, k, dw):
                    raise RuntimeError("difftx Linear: the bf16 dot-product kernel refused a call it was given")
            else:  # rows not a multiple of 32: torch's GEMM
                dw = (dy2s[i].t() @ xs).to(dtypes[2 * i])
            grads[2 * i] = dw
        for i in range(n):
            if dtypes[2 * i + 1] is not None and need[4 + 2 * i]:
                grads[2 * i + 1] = dy2s[i].sum(0, dtype=torch.float32).to(dtypes[2 * i + 1])
        return (dx, None, None, *grads)


def _rows_bf16(x: torch.Tensor) -> torch.Tensor:
    """x as bfloat16 rows (-1, its last dim) with a unit column stride: the dot kernels' A operand."""
    x2 = x.to(_BF16).reshape(-1, x.shape[-1])
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def _dot_product(x2: torch.Tensor, bp: Optional[torch.Tensor], n: int, bias: Optional[torch.Tensor],
                 pack_a: Optional[torch.Tensor] = None):
    """x2 @ B (+ bias rounded to bf16) in bfloat16 (float32 sums, one rounding) for B packed by
    :func:`difftx.nn.native.pack_wt` (``bp``; n columns), or None where the kernel refuses it; ``pack_a``:
    x2 packed along its rows there too (:func:`difftx.nn.native.dot_mm`)."""
    y = torch.empty(x2.shape[0], n, dtype=_BF16)
    b = None if bias is None else bias.detach().to(_BF16).float().contiguous()
    return y if bp is not None and native.dot_mm(x2, bp, n, y, bias=b, pack_a=pack_a) else None


def _dot_ok(x: torch.Tensor, modules) -> bool:
    """Whether :class:`_DotLinear` takes a bfloat16 training call of ``modules`` on ``x``: the kernel is here
    (:func:`difftx.nn.native.dot_linear`) and every width (x's, each weight's rows and columns) is a multiple
    of 16, the weights 2-d float32 or bfloat16 with unit column strides."""
    if not native.dot_linear() or x.shape[-1] % 16 or x.numel() == 0:
        return False
    for m in modules:
        w = m.weight
        if (w.dim() != 2 or w.dtype not in _TAKEN or w.stride(1) != 1 or w.shape[0] % 16 or w.shape[1] != x.shape[-1]
                or (m.bias is not None and m.bias.dtype not in _TAKEN)):
            return False
    return True


def _linear_fn(dtype: torch.dtype, x: torch.Tensor, modules):
    """The autograd Function for a training call in ``dtype`` (see :func:`_training_dtype`)."""
    return _DotLinear if dtype == _BF16 and _dot_ok(x, modules) else _Linear


def _onednn_weight_grads(x2: torch.Tensor, dy2s: list, wanted: list, dtypes: list, grads: list) -> None:
    """grads[2 i] = dY_i^T x (in the weight's dtype) for i in ``wanted``, float32 on oneDNN.  Its linear op reads
    a transposed weight operand as it lies but copies a transposed input first, and both operands of a weight
    gradient run over the tokens: either dW_i = linear(dY_i^T, x^T) (a copy of each dY_i, M x N_i) or, with x
    transposed once for all of them, dW_i^T = linear(x^T, dY_i^T), transposed back (M x K, then K x N_i each).
    The fewer elements moved wins: Q/K/V's and gate/up's weight gradients share one x^T, a lone projection
    (out, down, the LM head) copies its dY.  Both are the same float32 sums over the tokens."""
    m, k = x2.shape
    widths = [dy2s[i].shape[1] for i in wanted]
    if m * k + k * sum(widths) < m * sum(widths):
        xt = x2.t().contiguous()
        for i in wanted:
            dwt = _onednn(xt, dy2s[i].t())  # (K, N_i), written back transposed in the weight's dtype
            grads[2 * i] = torch.empty(dwt.shape[1], k, dtype=dtypes[2 * i]).copy_(dwt.t())
    else:
        for i in wanted:
            grads[2 * i] = _onednn(dy2s[i].t().contiguous(), x2.t()).to(dtypes[2 * i])


def _weight_grad(x2: torch.Tensor, xt: Optional[torch.Tensor], dy2: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    """dy2^T x2 in ``dtype``: from x's transpose ``xt`` when given; else, in bfloat16, from dy2's."""
    if xt is not None:
        dwt = _mm(xt, dy2)  # (in, out): dW^T
        dw = native.transpose_bf16(dwt, dtype=dtype)
        return dw if dw is not None else dwt.t().to(dtype, memory_format=torch.contiguous_format)
    dyt = native.transpose_bf16(dy2, pad=32) if dy2.dtype == _BF16 else None  # None: the kernel is not here
    return (_mm(dyt, x2) if dyt is not None else dy2.t() @ x2).to(dtype)


# Products that torch's bfloat16 GEMM (oneDNN, torch 2.13) runs on one of two threads, or splits badly, and
# that run faster as two column halves written into one output: (m, k, n) of a (m, k) @ (k, n).  Measured on a
# 2-core Xeon with AMX (benchmarks/performance/gemm_split.py, whole against halves, interleaved).  oneDNN's
# choice is not monotone in the shape (neighbouring shapes gain nothing or lose), so this is a table of
# measured shapes, not a range: the ``small`` preset's SwiGLU products at 2048 tokens.
_FORWARD_COLUMN_HALVES = {(2048, 512, 1408)}  # x @ W^T (W row-major): gate and up, 1.57 -> 1.30 ms
_WGRAD_COLUMN_HALVES = {(512, 2048, 1408)}  # a row-major weight gradient: gate/up's dW^T, down's dW, 1.75 -> 1.34


def _forward(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    """F.linear(x, w, b); on two or more threads a bfloat16 product listed in ``_FORWARD_COLUMN_HALVES`` runs
    as two halves of w's rows, each writing its columns of one output."""
    if _onednn_ok(x, w, b):
        return _onednn(x, w, b)
    n, k = w.shape
    m = x.numel() // k if k else 0
    if (x.dtype != _BF16 or torch.get_num_threads() < 2 or (m, k, n) not in _FORWARD_COLUMN_HALVES
            or not (x.is_contiguous() and w.is_contiguous())):
        return F.linear(x, w, b)
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    x2, o2, h = x.view(m, k), out.view(m, n), n // 2
    for lo, hi in ((0, h), (h, n)):
        if b is None:
            torch.mm(x2, w[lo:hi].t(), out=o2[:, lo:hi])
        else:
            torch.addmm(b[lo:hi], x2, w[lo:hi].t(), out=o2[:, lo:hi])
    return out


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for a bfloat16 weight gradient (row-major operands, a long inner dimension).  On two or more
    threads, where torch's bfloat16 GEMM (oneDNN) keeps the product on one thread or splits it badly:

    * an output of at most 512 x 512 and at least 384 x 512 runs as two row halves (a 2-core Xeon with AMX,
      torch 2.13, 2048 tokens: 512 x 512 0.87 ms whole against 0.58 in halves, 512 x 384 0.66 against 0.45,
      384 x 512 0.72 against 0.48), while smaller outputs use both threads whole and lose to the split
      (384 x 384 0.32 against 0.37, 512 x 256 0.27 against 0.32);
    * a product listed in ``_WGRAD_COLUMN_HALVES`` runs as two column halves.

    Each half is torch's product of that half; the whole's float32 sums may round differently (oneDNN blocks
    them differently); both are the bfloat16 GEMM torch runs."""
    (m, k), n = a.shape, b.shape[1]
    if torch.get_num_threads() < 2:
        return a @ b
    if (m, k, n) in _WGRAD_COLUMN_HALVES:
        out, h = torch.empty(m, n, dtype=a.dtype, device=a.device), n // 2
        torch.mm(a, b[:, :h], out=out[:, :h])
        torch.mm(a, b[:, h:], out=out[:, h:])
        return out
    if m > 512 or n > 512 or m * n < 384 * 512 or m % 32:
        return a @ b
    out, h = torch.empty(m, n, dtype=a.dtype, device=a.device), m // 2
    torch.mm(a[:h], b, out=out[:h])
    torch.mm(a[h:], b, out=out[h:])
    return out


def functorch_active() -> bool:
    """Inside a torch.func transform (grad, vmap, jvp), where autograd Functions without setup_context cannot run,
    or within ``torch.autograd.forward_ad.dual_level()``, where they have no jvp and the native kernels (raw
    pointers) would drop the dual tensors' tangents: the fast paths step aside for torch ops."""
    if getattr(_forward_ad, "_current_level", -1) >= 0:  # a private attribute: read with a default
        return True
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(active and active())


def grad_wanted(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether autograd would record a call on ``tensors`` (None entries skipped): grad mode on and one of them
    requires a gradient.  Where it does not (no_grad, inference mode, frozen inputs), the fast paths skip their
    autograd Functions."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def autocast_on(device_type: str) -> bool:
    """``torch.is_autocast_enabled(device_type)``, False for device types without autocast (meta: a model
    built there runs its forward for shapes)."""
    return device_type != "meta" and torch.is_autocast_enabled(device_type)


def no_autocast(device_type: str):
    """A context that turns autocast off on ``device_type`` where it is on (a no-op context otherwise)."""
    return torch.autocast(device_type, enabled=False) if autocast_on(device_type) else contextlib.nullcontext()


def traced() -> bool:
    """Under torch.compile or a torch.func transform: the eager-only fast paths step aside for plain torch ops."""
    return torch.compiler.is_compiling() or functorch_active()


def _training_dtype(x: torch.Tensor, weight: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype of a CPU training call whose weight gradient is wanted, where :class:`_Linear` or
    :class:`_DotLinear` takes it: bfloat16 (autocast, or bfloat16 input and weight) on a CPU with AMX or
    AVX512-BF16, or float32 without autocast; else None."""
    if not (weight.requires_grad and torch.is_grad_enabled()) or x.device.type != "cpu":
        return None
    if functorch_active():  # torch.func sees F.linear
        return None
    if torch.compiler.is_compiling():  # compiled graphs see F.linear, but for float32 products on oneDNN
        ok = (ONEDNN_FP32 and x.dtype == weight.dtype == _FP32 and not torch.is_autocast_enabled("cpu"))
        return _FP32 if ok else None
    if x.dtype not in _TAKEN or weight.dtype not in _TAKEN:  # autocast leaves float64 as it is
        return None
    if torch.is_autocast_enabled("cpu"):
        dtype = torch.get_autocast_dtype("cpu")
    elif x.dtype == weight.dtype:
        dtype = x.dtype
    else:
        return None  # F.linear raises on the mismatch; let it
    if dtype == torch.float32:
        return dtype
    if dtype != _BF16:
        return None
    return dtype if native.supports(_BF16, x.device) and (native.amx() or native.dot_linear()) else None


def _default_few_rows() -> int:
    """8 on AMD CPUs, else 0 (off).  On a 2-core AMD EPYC (AVX2, torch 2.13) F.linear (MKL) read the weight at
    3-6 GB/s for 2-8 rows and native.few_rows_linear at 5-16 on two threads (1.3-3.9x); at 16 rows on one
    thread F.linear was about as fast (benchmarks/performance/few_rows.py).  On Intel CPUs, where MKL takes its own tuned paths, the kernel is
    not measured yet: the Intel VM decoded the same model in float32 at 296 tokens/s with F.linear, against
    76 here.  The script measures both on any CPU; set FEW_ROWS to use the kernel there."""
    return 8 if native.cpu_vendor() == "AuthenticAMD" else 0


# Float32 inputs of at most this many rows (decoding: one token per sequence) take native.few_rows_linear
# when no gradient is wanted; 0 turns that off.
FEW_ROWS = _default_few_rows()


# The store of packed bf16 weights that inference calls may use (see packed_weights), or None.
_PACKED: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("difftx_packed_weights", default=None)


@contextlib.contextmanager
def packed_weights(store: dict):
    """Within this context, bf16 inference calls of :func:`linear` on AVX512-BF16 CPUs without AMX run the
    dot-product kernels on weights packed once and kept in ``store`` (keyed by the weight, held weakly; a weight
    updated in place, which bumps its version, or given new storage is packed again).  A :class:`KVCache` holds such a
    store for its decoding (``model(ids, cache=cache)``): a decoding step then reads each weight once as packed
    bf16, where autocast's F.linear runs oneDNN's small-row product on its cast copy, 2.3-2.6x slower at 4 rows
    (Zen 4).  In-place changes through ``.data``, and torch's fused optimisers
    (``fused=True``), bypass the version counter: reset the cache after them."""
    token = _PACKED.set(store)
    try:
        yield
    finally:
        _PACKED.reset(token)


def _dot_inference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """F.linear for a bf16 inference call (bf16 autocast, or bf16 x and weight; no gradient wanted) inside
    :func:`packed_weights` on the dot-product kernels (:func:`difftx.nn.native.dot_linear`), widths multiples of
    16: autocast's operands (x and the weight rounded to bf16, the bias too), float32 sums, one rounding; a
    row's values do not depend on the other rows or the thread count.  None where it does not apply."""
    if traced() or x.device.type != "cpu":  # (compiled graphs: no context variable read)
        return None
    store = _PACKED.get()
    if store is None or not native.dot_linear() or grad_wanted(x, weight, bias):
        return None
    if torch.is_autocast_enabled("cpu"):
        if torch.get_autocast_dtype("cpu") != _BF16 or x.dtype not in _TAKEN or weight.dtype not in _TAKEN:
            return None
    elif not x.dtype == weight.dtype == _BF16:
        return None
    k = x.shape[-1]
    if (weight.dim() != 2 or weight.shape[1] != k or k % 16 or weight.shape[0] % 16 or weight.stride(1) != 1
            or x.numel() == 0 or (bias is not None and (bias.dtype not in _TAKEN or bias.shape != weight.shape[:1]))):
        return None
    key = (weight.data_ptr(), weight.shape, weight.dtype)
    storage = weight.untyped_storage()
    # (weak references to the weight and its storage: the store keeps neither alive; the storage's tells new storage
    # at a freed one's address, as two `.data =` replacements between calls can give, from the packed one)
    entry = store.get(id(weight))
    if (entry is None or entry[0]() is not weight or entry[1] != weight._version or entry[2] != key
            or entry[4]() is not storage):
        packed = native.pack_wt(weight.detach())
        if packed is None:
            return None
        if entry is None:  # a new weight: first drop the packed copies of weights that are gone.  A weight made
            # anew at each call (a parametrization, pruning's pre-hook, accelerate's offload hooks) left one entry per
            # layer and decoding step, each a packed copy: the store grew with every token.  (Only on a miss: a plain
            # model's steps after the first never get here.)
            for gone in [k for k, e in store.items() if e[0]() is None]:
                del store[gone]
        entry = store[id(weight)] = (weakref.ref(weight), weight._version, key, packed, weakref.ref(storage))
    n = weight.shape[0]
    y = _dot_product(_rows_bf16(x), entry[3], n, bias)
    return None if y is None else y.view(*x.shape[:-1], n)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; float32 on the CPU with at most :data:`FEW_ROWS` rows (8 on AMD CPUs, else
    off) and no gradient wanted (decoding) runs :func:`difftx.nn.native.few_rows_linear` (same values up to
    summation order); bf16 inference within :func:`packed_weights` (a KV cache's decoding) on AVX512-BF16 CPUs
    without AMX the dot-product kernels on packed weights (:func:`_dot_inference`); float32 past that where
    :data:`ONEDNN_FP32` holds on oneDNN, a training call (the LM head) through :class:`_Linear`."""
    y = _dot_inference(x, weight, bias)
    if y is not None:
        return y
    k = weight.shape[-1]
    if (FEW_ROWS and not traced()  # first: a compiled graph gets no guard on x's size from here
            and 0 < x.numel() <= FEW_ROWS * k and x.dtype == torch.float32 and weight.dtype == torch.float32
            and (bias is None or bias.dtype == torch.float32) and x.device.type == "cpu"
            and not grad_wanted(x, weight, bias)
            and weight.dim() == 2 and x.shape[-1] == k and x.is_contiguous() and weight.is_contiguous()
            and (bias is None or bias.is_contiguous()) and not torch.is_autocast_enabled("cpu")
            and native.supports(torch.float32, x.device)):
        return native.few_rows_linear(x, weight, bias)
    if ONEDNN_FP32 and not functorch_active() and not torch.is_autocast_enabled("cpu") and weight.dim() == 2 \
            and x.dim() >= 2 and x.shape[-1] == k and _onednn_ok(x, weight, bias):
        if _training_dtype(x, weight) == _FP32:  # a float32 training call (the LM head): _Linear's products
            return _Linear.apply(x, _FP32, 1, weight, bias)[0]
        if not grad_wanted(x, weight, bias):
            return _onednn(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``torch.nn.Linear`` with the faster CPU training backward of this module (see its docstring) and the
    few-rows inference product of :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _training_dtype(x, self.weight)
        if dtype is not None:
            return _linear_fn(dtype, x, (self,)).apply(x, dtype, 1, self.weight, self.bias)[0]
        return linear(x, self.weight, self.bias)


_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


def no_hooks(m: nn.Module) -> bool:
    """Whether calling ``m`` would run no hooks (its own or global ones) and its class's forward (none patched on
    the instance, as accelerate's hooks and ad hoc checkpointing do): a caller may then compute what its forward
    computes without calling it."""
    return (not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)
            and "forward" not in m.__dict__
            and not any(getattr(nn.modules.module, name, None) for name in _GLOBAL_HOOKS))


def plain_layer(m: nn.Module) -> bool:
    """A torch ``nn.Linear`` itself (not a subclass, a wrapper such as peft's LoRA layer, or a quantized layer) with no
    hooks that calling it would run: a caller may then read its ``weight`` / ``bias`` instead of calling it."""
    return type(m) is nn.Linear and no_hooks(m)


def _plain(m: nn.Module) -> bool:
    """A difftx ``Linear`` itself (not a subclass or a wrapper) with no hooks that calling it would run."""
    return type(m) is Linear and no_hooks(m)


def project(x: torch.Tensor, modules) -> list:
    """``[m(x) for m in modules]``: the projections of one input (Q/K/V, SwiGLU's gate and up).

    On the CPU training path of :class:`Linear` they share one autograd node: dx accumulates in the GEMMs,
    and in bfloat16 x's transpose is taken once for all weight gradients.  Modules that are not plain
    difftx ``Linear`` layers (a LoRA wrapper, a hooked layer) are called one by one, as they would be anyway.
    """
    dtype = _training_dtype(x, modules[0].weight) if len(modules) > 1 else None
    if dtype is not None and all(_plain(m) for m in modules):
        params = [p for m in modules for p in (m.weight, m.bias)]
        return list(_linear_fn(dtype, x, modules).apply(x, dtype, len(modules), *params))
    return [m(x) for m in modules]
