"""The differential-attention Triton kernels compile, without a GPU: each is lowered to Triton's IR (TTIR) for an
sm_90 target (an H100 / H200) at every combination of its mask switches and dtypes.  The interpreter
(test_triton_interpreter.py) runs the kernels as Python and does not see what only the compiler rejects: a
runtime value passed where a helper wants a ``tl.constexpr``, a name bound in one branch of a constexpr ``if`` only,
types that do not unify.  Skipped without Triton, or where its internal compile API is not the one used here
(pinned in .ci/run)."""

from __future__ import annotations

import itertools
import os

import pytest

triton = pytest.importorskip("triton")

# names of pointer arguments and their element types; every other non-constexpr argument is an int32 scalar, but
# for these float32 scalars
_HALF = {"Q", "K", "V", "Y", "OPRE", "O2", "DO", "DQ", "DK", "DV", "DY"}
_FP32_PTR = {"LQ1", "LK1", "LQ2", "LK2", "W", "STATS", "DELTA", "PART", "OUT", "DQ32"}
_FLOATS = {"qk_scale", "sm_scale", "lambda_init", "eps", "gain"}


def _lower(fn, dtype: str, constexprs: dict):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        import triton._C.libtriton as libtriton
        from triton.compiler.compiler import make_backend

        target = GPUTarget("cuda", 90, 32)
        backend = make_backend(target)
        options = backend.parse_options({})
        ctx = libtriton.ir.context()
        libtriton.ir.load_dialects(ctx)
        backend.load_dialects(ctx)
        codegen, modules = backend.get_codegen_implementation(options), backend.get_module_map()
    except (ImportError, AttributeError, TypeError, RuntimeError) as e:  # another Triton's internals
        pytest.skip(f"Triton {triton.__version__}: no offline lowering here ({type(e).__name__}: {e})")
    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            continue
        n = p.name
        sig[n] = (f"*{dtype}" if n in _HALF else "*fp32" if n in _FP32_PTR else "*i32" if n == "DOC"
                  else "fp32" if n in _FLOATS else "i32")
    given = {k: v for k, v in constexprs.items() if k in fn.arg_names}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in given.items()})
    return src.make_ir(target, options, codegen, modules, ctx)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the kernels are Python under the interpreter")
@pytest.mark.parametrize("name", ["diff_fwd", "diff_bwd_rows", "diff_bwd_reduce", "diff_bwd_kv", "diff_bwd_q"])
def test_each_kernel_lowers_for_sm90_at_every_mask_combination(name):
    from difftx.nn import _triton_kernels as K

    fn = getattr(K, name)
    for (doc, win), (dtype, prec), atomic in itertools.product(
            itertools.product((False, True), repeat=2), (("bf16", None), ("fp32", "ieee")), (False, True)):
        c = dict(D=64, BM=64, BN=64, BP=32, NORM=True, HAS_W=True, SAVE=True, PREC=prec, HAS_DOC=doc, HAS_WIN=win,
                 MASKED=doc or win, DQ_ATOMIC=atomic)
        module = _lower(fn, dtype, c)
        assert f"tt.func public @{name}" in str(module), (name, c)
