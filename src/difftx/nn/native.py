"""Native CPU kernels, compiled on first use (optional; pure torch without them).

``cpu_kernels.c`` (beside this file) does in one pass per row what torch does in several passes
over whole tensors: the fused attention's causal triangle + softmax of each map + combined map
P1 - lambda P2 (forward) and its softmax backward; RMSNorm, SwiGLU and rotary embeddings, forward
and backward; and bf16 DIFF decoding over a paired KV cache with the per-head norm.  Statistics
and sums are float32.  Loops run on torch's own OpenMP threads.

It is built once per machine with the system C compiler (``$CC``, else ``cc``/``gcc``/``clang``;
a few seconds) into ``$DIFFTX_CACHE_DIR`` (else ``$DIFFTX_CACHE``, else ``$XDG_CACHE_HOME/difftx``, else
``~/.cache/difftx``),
keyed by the source, the compiler, its flags and the CPU's features, and loaded with ctypes: no Python
extension ABI, no build step at install time.  Vectors are as wide as the CPU's registers (16 floats with
AVX-512, 8 with AVX2, 4 elsewhere: SSE, Arm's NEON); ``$DIFFTX_NATIVE_CFLAGS`` adds compiler flags.  Without a
compiler, off Linux, or with ``DIFFTX_NATIVE=0``, everything runs the pure-torch path (same results up to rounding; the
native paths round less: e.g. the combined map once from float32 probabilities).  :func:`status` says
which, and ``difftx bench`` records it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch

from ..io import atomic_write_text

_SOURCE = Path(__file__).with_name("cpu_kernels.c")
_FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-strict-aliasing", "-fPIC", "-shared"]
# The machine's own instruction set, by architecture: x86 names it with -march (and asks GCC for whole 512-bit
# vectors where it has AVX-512); Arm with -mcpu (GCC and Clang on AArch64 reject -mprefer-vector-width, so a
# build with x86's flags failed there and every kernel fell back to torch); elsewhere the compiler's default.
_ARCH_FLAGS = {"x86": ["-march=native", "-mprefer-vector-width=512"], "arm": ["-mcpu=native"]}
_LOCK = threading.Lock()
# False forces the pure-torch path everywhere (tests compare the two); DIFFTX_NATIVE=0 also skips the build.
ENABLED = True
_STATE: dict = {}  # "lib": CDLL or None, "status": str


_ON = ("", "1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def _enabled_by_env() -> bool:
    """``DIFFTX_NATIVE`` unset or 1/true/yes/on: build and use the kernels; 0/false/no/off, or anything else
    (a typo such as ``of`` must not leave them on unnoticed; :func:`status` names the value): pure torch."""
    return os.environ.get("DIFFTX_NATIVE", "1").strip().lower() in _ON


def _cache_dir() -> Path:
    from ..runtime import cache_root

    return cache_root("DIFFTX_CACHE_DIR", "DIFFTX_CACHE")  # the token shards' variable too: either moves it all


def cpuinfo_line(*keys: str) -> str:
    """The first line of /proc/cpuinfo that starts with one of ``keys`` (e.g. "flags"), or "" (no such line, or
    no /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(keys):
                    return line
    except OSError:
        pass
    return ""


def cpuinfo_value(*keys: str) -> str:
    """The value (after the colon) of the first /proc/cpuinfo line that starts with one of ``keys``, or ""."""
    line = cpuinfo_line(*keys)
    return line.split(":", 1)[1].strip() if ":" in line else ""


def _cpu_features() -> str:
    return cpuinfo_line("flags", "Features") or platform.processor()


def cpu_vendor() -> str:
    """The CPU's vendor string (``AuthenticAMD``, ``GenuineIntel``, ...) from /proc/cpuinfo; "" elsewhere."""
    return cpuinfo_value("vendor_id")


def _compiler() -> Optional[list[str]]:
    """The compiler's command: ``$CC`` (a program with arguments, e.g. ``ccache gcc``), else the first of cc, gcc,
    clang on PATH, else None.  A ``$CC`` whose program is not found is an error (RuntimeError), not a reason to
    take another compiler unannounced."""
    env = os.environ.get("CC", "").strip()
    if env:
        cmd = shlex.split(env)
        if not shutil.which(cmd[0]):
            raise RuntimeError(f"CC={env!r}: {cmd[0]} is not a program on PATH; point CC at a C compiler or unset it")
        return cmd
    for cand in ("cc", "gcc", "clang"):
        if shutil.which(cand):
            return [cand]
    return None


def _flags() -> list[str]:
    """The compiler flags: _FLAGS, the machine's instruction set (:func:`_arch_flags`), then
    ``$DIFFTX_NATIVE_CFLAGS`` (e.g. ``-mno-avx512f`` builds the 8-lane AVX2 kernels on an AVX-512 CPU, ``-mno-avx``
    the 4-lane ones; the tests build each width this way)."""
    return _FLAGS + _arch_flags(platform.machine()) + shlex.split(os.environ.get("DIFFTX_NATIVE_CFLAGS", ""))


def _arch_flags(machine: str) -> list[str]:
    """The instruction-set flags for a machine as ``platform.machine()`` names it (x86_64 / AMD64, aarch64 /
    arm64, ...)."""
    m = machine.lower()
    if m in ("x86_64", "amd64", "i386", "i686"):
        return _ARCH_FLAGS["x86"]
    if m in ("aarch64", "arm64") or m.startswith("armv8"):
        return _ARCH_FLAGS["arm"]
    return []


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _intact(library: Path, digest: Path) -> bool:
    """The cached library is the one that was built: its SHA-256 is the one recorded beside it.  Loading a
    truncated or overwritten library can kill the process with SIGBUS, past any exception handler; checking
    ~120 KB costs well under a millisecond, once per process."""
    try:
        return digest.read_text().strip() == _sha256(library)
    except (OSError, UnicodeDecodeError):
        return False


def _version(cc: list[str]) -> str:
    """The compiler's ``--version`` text (part of the library's cache key)."""
    return subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout


def _build(cc: list[str], version: Optional[str] = None) -> Path:
    source = _SOURCE.read_bytes()
    version = _version(cc) if version is None else version
    flags = _flags()
    key = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(flags).encode(),
                                     _cpu_features().encode(), platform.machine().encode()])).hexdigest()[:16]
    out_dir = _cache_dir()
    target = out_dir / f"cpu_kernels-{key}.so"
    digest = target.with_suffix(".sha256")
    if _intact(target, digest):
        return target
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    except OSError as e:
        raise RuntimeError(f"cache directory {out_dir} is not writable ({e.strerror or e}); set DIFFTX_CACHE_DIR "
                           "to a writable directory") from None
    os.close(fd)
    try:
        proc = subprocess.run([*cc, *flags, str(_SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True,
                              timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cc)} failed: {proc.stderr.strip()[-500:]}")
        os.chmod(tmp, 0o755)  # as a compiler leaves a library (mkstemp made it 0600): a shared cache serves all
        atomic_write_text(digest, _sha256(Path(tmp)) + "\n")  # before the library: never one without it
        os.replace(tmp, target)  # atomic: concurrent builders never load a partial file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _scratch_check(result, func, args):
    """ctypes errcheck of the kernels that allocate per-thread scratch: 1 means an allocation failed (the
    output is incomplete)."""
    if result:
        raise MemoryError(f"{func.__name__}: the native kernel could not allocate its scratch buffers")
    return result


def _declare(lib: ctypes.CDLL) -> None:
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    lib.difftx_softmax_combine.argtypes = [p, i, p, p, i, i64, i64, i64, i64, i64, i64, f, p, i]
    lib.difftx_softmax_combine.restype = i
    lib.difftx_softmax_combine.errcheck = _scratch_check
    lib.difftx_softmax_backward.argtypes = [p, p, p, i, p, i64, i64, i64, i64, i64, i64, i]
    lib.difftx_softmax_backward.restype = i
    lib.difftx_softmax_backward.errcheck = _scratch_check
    lib.difftx_rms_norm.argtypes = [p, i, p, i, p, p, f, f, i64, i64, i]
    lib.difftx_rms_norm.restype = i
    lib.difftx_rms_norm.errcheck = _scratch_check
    lib.difftx_diff_decode.argtypes = [p, p, p, p, p, i, i] + [i64] * 17 + [f, f, p, i, p, f, f, i]
    lib.difftx_diff_decode.restype = i
    lib.difftx_diff_decode.errcheck = _scratch_check
    lib.difftx_rms_norm_backward.argtypes = [p, i, p, i, p, p, f, p, p, i64, i64, p, p, i, i]
    lib.difftx_rms_norm_backward.restype = i
    lib.difftx_rms_norm_backward.errcheck = _scratch_check
    lib.difftx_add_rms_norm.argtypes = [p, p, i, p, p, i, p, p, f, f, i64, i64, i]
    lib.difftx_add_rms_norm.restype = i
    lib.difftx_add_rms_norm.errcheck = _scratch_check
    lib.difftx_swiglu.argtypes = [p, p, p, i, i64, i]
    lib.difftx_swiglu.restype = None
    lib.difftx_swiglu_backward.argtypes = [p, p, p, p, p, i, i64, i]
    lib.difftx_swiglu_backward.restype = None
    lib.difftx_rope.argtypes = [p, p, p, p, i, p, p, i64, i64, i64, i64, i64, i64, i, f, i]
    lib.difftx_rope.restype = i
    lib.difftx_rope.errcheck = _scratch_check
    lib.difftx_few_rows_linear.argtypes = [p, i64, i64, p, i64, p, p, i]
    lib.difftx_few_rows_linear.restype = None
    lib.difftx_gemm_nr.argtypes = []
    lib.difftx_gemm_nr.restype = i
    lib.difftx_attn_forward.argtypes = ([p, p, i64, i64, p, i64, i64, i64, p, p, p, p] + [i64] * 10
                                        + [i, i64, i64, f, f, p, i])
    lib.difftx_attn_forward.restype = i
    lib.difftx_attn_forward.errcheck = _scratch_check
    lib.difftx_attn_backward.argtypes = ([p, p, i64, i64, p, i64, i64, i64, p, p, p, p, p, i64, i64, i64, p, p, p]
                                         + [i64] * 10 + [i, i64, i64, f, f, p, i])
    lib.difftx_attn_backward.restype = i
    lib.difftx_attn_backward.errcheck = _scratch_check
    lib.difftx_amx.argtypes = []
    lib.difftx_amx.restype = i
    lib.difftx_bf16_attention.argtypes = []
    lib.difftx_bf16_attention.restype = i
    lib.difftx_attn_forward_bf16.argtypes = [p, p, i64, i64, p, i64, i64, i64, p, p] + [i64] * 10 + [i, i64, i64, f, f, p, i]
    lib.difftx_attn_forward_bf16.restype = i
    lib.difftx_attn_backward_bf16.argtypes = ([p, p, i64, i64, p, i64, i64, i64, p, p, p, p, p, i64, i64, i64, p]
                                              + [i64] * 10 + [i, i64, i64, f, f, p, i])
    lib.difftx_attn_backward_bf16.restype = i
    lib.difftx_attn_bwd_form.argtypes = [i]
    lib.difftx_attn_bwd_form.restype = i
    lib.difftx_transpose_bf16.argtypes = [p, i64, i64, i64, p, i64, i]
    lib.difftx_transpose_bf16.restype = i
    lib.difftx_transpose_bf16_f32.argtypes = [p, i64, i64, i64, p, i64, i]
    lib.difftx_transpose_bf16_f32.restype = i
    lib.difftx_dot_linear.argtypes = [p, i64, i64, p, i64, i64, p, i64, i, p, i64, p, i, p, i]
    lib.difftx_dot_linear.restype = i
    lib.difftx_dot_linear_sum.argtypes = [i, p, p, i64, p, p, i64, p, i64, p, i64, p, i]
    lib.difftx_dot_linear_sum.restype = i
    lib.difftx_pack_wt.argtypes = [p, i, i64, i64, i64, p, i]
    lib.difftx_pack_wt.restype = i
    lib.difftx_pack_rows.argtypes = [p, i, i64, i64, i64, i64, p, i]
    lib.difftx_pack_rows.restype = i


def _load() -> None:
    if not _enabled_by_env():
        value = os.environ.get("DIFFTX_NATIVE", "").strip()
        if value.lower() in _OFF:
            _STATE.update(lib=None, status=f"off (DIFFTX_NATIVE={value})")
        else:
            _STATE.update(lib=None, status=f"off (DIFFTX_NATIVE={value!r} is neither 1/on nor 0/off; pure torch)")
        return
    if not sys.platform.startswith("linux"):
        _STATE.update(lib=None, status=f"not built on {sys.platform} (pure torch)")
        return
    try:
        cc = _compiler()
        if cc is None:
            _STATE.update(lib=None, status="no C compiler found (pure torch; set CC to enable)")
            return
        version = _version(cc)
        path = _build(cc, version)  # a damaged cached file fails its digest and is built again
        if "clang" in version.lower():
            # Clang's OpenMP is libomp, beside torch's libgomp: two thread pools on the same cores.  libomp's
            # threads spin 200 ms after each parallel region (KMP_BLOCKTIME), taking the cores from torch's
            # next GEMM: a 2-thread fp32 DIFF step took 3.44-3.52 s against GCC's 2.00 (2.23-2.36 with this;
            # docs/performance.md, Known limits).  Read when libomp starts, at the kernels' first parallel region.
            os.environ.setdefault("KMP_BLOCKTIME", "0")
        lib = ctypes.CDLL(str(path))
        _declare(lib)
    except Exception as e:  # noqa: BLE001 -- any failure means the torch path, with the reason kept
        _STATE.update(lib=None, status=f"build failed, pure torch ({type(e).__name__}: {str(e)[:300]})")
        return
    amx_ok = bool(lib.difftx_amx())  # asks Linux for the tile state once; attention_ok reads the answer
    products = lib.difftx_bf16_attention()  # 2 AMX tiles, 1 AVX512-BF16 dot products, 0 neither
    tiles = {2: "bf16 attention on AMX tiles", 1: "bf16 attention on AVX512-BF16 dot products"}.get(
        products, "no AMX or AVX512-BF16: bf16 attention on torch GEMMs")
    _STATE.update(lib=lib, amx=amx_ok, bf16_attention=products > 0, dot_linear=products == 1,
                  status=f"on ({path}; {tiles}{'; bf16 linear layers too' if products == 1 else ''})")


def library() -> Optional[ctypes.CDLL]:
    """The loaded kernels, or None (disabled, unavailable or failed; see :func:`status`)."""
    if "lib" not in _STATE:
        with _LOCK:
            if "lib" not in _STATE:
                _load()
    return _STATE["lib"]


def status() -> str:
    library()
    return _STATE["status"]


def problem() -> Optional[str]:
    """The status when a setting of the user's kept the kernels off (a build that failed: compiler flags,
    cache directory, compiler; or a ``DIFFTX_NATIVE`` value that is neither on nor off), else None: the
    commands print it as one warning line.  No compiler, off Linux or ``DIFFTX_NATIVE=0`` are not problems."""
    text = status()
    return text if text.startswith("build failed") or "is neither 1/on nor 0/off" in text else None


def warn_problem(prog: str, device) -> None:
    """One warning line on stderr from command ``prog`` when :func:`problem` has something to say and ``device``
    is the CPU (the only device the kernels serve)."""
    text = problem() if torch.device(device).type == "cpu" else None
    if text:
        print(f"{prog}: warning: native CPU kernels: {text}", file=sys.stderr)


def reset() -> None:
    """Forget the loaded state so the next call re-reads ``DIFFTX_NATIVE`` (tests)."""
    with _LOCK:
        _STATE.clear()


def supports(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernels take ``dtype`` data on ``device``: CPU, float32/bfloat16, enabled and built."""
    return ENABLED and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and library() is not None


# Elementwise and row kernels over fewer values than this run on the calling thread: waking the other threads
# costs more than the work (decoding's norms, RoPE and SwiGLU: a few thousand values).
SERIAL_BELOW = 1 << 15


def _threads(work: int) -> int:
    return 1 if work < SERIAL_BELOW else torch.get_num_threads()


def _empty_as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor of x's shape and device in ``dtype``: ``empty_like`` takes ~1.5 us here where
    ``torch.empty(x.shape, dtype=, device=)`` takes ~5-7 (AMD EPYC, torch 2.13); decoding calls them per layer."""
    return torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def softmax_combine(s: torch.Tensor, p: Optional[torch.Tensor], comb: Optional[torch.Tensor], maps: int,
                    rows: int, c: int, diag0: int, lam: float = 0.0,
                    lam_rows: Optional[torch.Tensor] = None) -> None:
    """Per row of ``s`` (B, maps, rows, ke): softmax of each map into ``p`` (same layout and dtype, or
    None) and P1 - lam P2 (P for one map) into ``comb`` (B, rows, ke) (or None).

    ``diag0`` >= 0: causal, row j is query ``diag0 + j % c``; < 0: every key visible.
    ``lam_rows``: float32 (B, rows) per-row lambda (DIFF V2), else the scalar ``lam``.
    All tensors contiguous; ``s`` and ``p`` may be the same tensor.
    """
    ke = s.shape[-1]
    b = s.numel() // (maps * rows * ke)
    for t in (p, comb, lam_rows):
        assert t is None or t.is_contiguous()
    assert s.is_contiguous() and (lam_rows is None or lam_rows.dtype == torch.float32)
    library().difftx_softmax_combine(
        s.data_ptr(), int(s.dtype == torch.bfloat16), _ptr(p), _ptr(comb),
        int(comb is not None and comb.dtype == torch.bfloat16), b, maps, rows, ke, c, diag0, float(lam),
        _ptr(lam_rows), torch.get_num_threads())


def softmax_backward(p: torch.Tensor, dp: torch.Tensor, ds: torch.Tensor, rs: torch.Tensor, maps: int,
                     rows: int, c: int, diag0: int) -> None:
    """Per row and map: rs = sum(p * dp) (float32, (B, maps, rows)), ds = p * (dp - rs).

    ``p``, ``ds`` (B, maps, rows, ke) and ``dp`` (B, rows, ke) share one dtype; all contiguous.
    """
    ke = p.shape[-1]
    b = p.numel() // (maps * rows * ke)
    assert p.is_contiguous() and dp.is_contiguous() and ds.is_contiguous() and rs.is_contiguous()
    assert p.dtype == dp.dtype == ds.dtype and rs.dtype == torch.float32
    library().difftx_softmax_backward(
        p.data_ptr(), dp.data_ptr(), ds.data_ptr(), int(p.dtype == torch.bfloat16), rs.data_ptr(),
        b, maps, rows, ke, c, diag0, torch.get_num_threads())


def rms_norm(x: torch.Tensor, wg: Optional[torch.Tensor], gain: float, eps: float, out_dtype: torch.dtype,
             rstd: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * wg (or * gain) over the last dim, float32 statistics, as ``out_dtype``.

    ``x`` contiguous float32/bfloat16; ``wg`` the float32 weight with the gain folded in, or None;
    ``rstd`` (float32, one per row) receives 1 / rms when given.
    """
    dim = x.shape[-1]
    rows = x.numel() // dim if dim else 0
    y = _empty_as(x, out_dtype)
    assert x.is_contiguous() and (wg is None or (wg.is_contiguous() and wg.dtype == torch.float32))
    assert rstd is None or (rstd.is_contiguous() and rstd.dtype == torch.float32 and rstd.numel() == rows)
    library().difftx_rms_norm(x.data_ptr(), int(x.dtype == torch.bfloat16), y.data_ptr(),
                              int(out_dtype == torch.bfloat16), _ptr(rstd), _ptr(wg), float(gain), float(eps),
                              rows, dim, _threads(rows * dim))
    return y


def rms_norm_backward(x: torch.Tensor, dy: torch.Tensor, rstd: torch.Tensor, wg: Optional[torch.Tensor], gain: float,
                      want_dw: bool, acc: Optional[torch.Tensor] = None, dx2_dtype: Optional[torch.dtype] = None):
    """Gradients of :func:`rms_norm`: dx (x's dtype) and, when ``want_dw``, sum over rows of xhat * dy
    (float32; the weight's gradient before the gain).  ``dy`` float32 or bfloat16; all contiguous.

    ``acc`` (float32 x only): a float32 gradient reaching x by another path, added to dx as autograd would add
    it.  ``dx2_dtype``: also return a copy of dx in that dtype (float32/bfloat16), else None.
    """
    dim = x.shape[-1]
    rows = x.numel() // dim
    assert x.is_contiguous() and dy.is_contiguous() and rstd.is_contiguous() and dy.shape == x.shape
    assert dy.dtype in (torch.float32, torch.bfloat16) and rstd.dtype == torch.float32
    assert acc is None or (x.dtype == acc.dtype == torch.float32 and acc.is_contiguous() and acc.shape == x.shape)
    dx = torch.empty_like(x)
    dw = torch.empty(dim, dtype=torch.float32, device=x.device) if want_dw else None
    dx2 = torch.empty(x.shape, dtype=dx2_dtype, device=x.device) if dx2_dtype is not None else None
    assert dx2 is None or (x.dtype == torch.float32 and dx2.dtype in (torch.float32, torch.bfloat16))
    library().difftx_rms_norm_backward(x.data_ptr(), int(x.dtype == torch.bfloat16), dy.data_ptr(),
                                       int(dy.dtype == torch.bfloat16), rstd.data_ptr(), _ptr(wg), float(gain),
                                       dx.data_ptr(), _ptr(dw), rows, dim, _ptr(acc), _ptr(dx2),
                                       int(dx2_dtype == torch.bfloat16), torch.get_num_threads())
    return dx, dw, dx2


def add_rms_norm(x: torch.Tensor, a: torch.Tensor, wg: Optional[torch.Tensor], gain: float, eps: float,
                 out_dtype: torch.dtype, rstd: torch.Tensor):
    """x1 = x + a and y = :func:`rms_norm` (x1) in one pass per row; returns (x1, y).  ``x`` float32, ``a``
    float32/bfloat16, both contiguous and of one shape; ``rstd`` receives 1 / rms per row."""
    dim = x.shape[-1]
    rows = x.numel() // dim
    assert x.dtype == torch.float32 and a.dtype in (torch.float32, torch.bfloat16) and a.shape == x.shape
    assert x.is_contiguous() and a.is_contiguous() and rstd.is_contiguous() and rstd.numel() == rows
    x1 = torch.empty_like(x)
    y = _empty_as(x, out_dtype)
    library().difftx_add_rms_norm(x.data_ptr(), a.data_ptr(), int(a.dtype == torch.bfloat16), x1.data_ptr(),
                                  y.data_ptr(), int(out_dtype == torch.bfloat16), rstd.data_ptr(), _ptr(wg),
                                  float(gain), float(eps), rows, dim, _threads(rows * dim))
    return x1, y


def few_rows_linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, w, b) for float32 x with few rows (decoding): each thread streams its share of w's rows
    once.  x (..., K) and w (N, K) contiguous float32, b (N,) or None; a row's values do not depend on the
    other rows or on the thread count."""
    assert x.dtype == w.dtype == torch.float32 and x.is_contiguous() and w.is_contiguous()
    assert b is None or (b.dtype == torch.float32 and b.is_contiguous() and b.shape == (w.shape[0],))
    n, k = w.shape
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32, device=x.device)
    library().difftx_few_rows_linear(x.data_ptr(), x.numel() // k if k else 0, k, w.data_ptr(), n, _ptr(b),
                                     y.data_ptr(), torch.get_num_threads())
    return y


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u elementwise (float32 math), in g's dtype; g and u contiguous, same shape and dtype."""
    assert g.is_contiguous() and u.is_contiguous() and g.shape == u.shape and g.dtype == u.dtype
    h = torch.empty_like(g)
    library().difftx_swiglu(g.data_ptr(), u.data_ptr(), h.data_ptr(), int(g.dtype == torch.bfloat16), g.numel(),
                            _threads(g.numel()))
    return h


def swiglu_backward(g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor):
    """Gradients of :func:`swiglu` with respect to g and u, given dh (all one dtype, contiguous)."""
    assert dh.is_contiguous() and dh.dtype == g.dtype and dh.shape == g.shape
    dg, du = torch.empty_like(g), torch.empty_like(u)
    library().difftx_swiglu_backward(g.data_ptr(), u.data_ptr(), dh.data_ptr(), dg.data_ptr(), du.data_ptr(),
                                     int(g.dtype == torch.bfloat16), g.numel(), torch.get_num_threads())
    return dg, du


def amx() -> bool:
    """Whether AMX bf16 tiles run here: the kernels built for a CPU with them and allowed to use them (Linux
    grants the tile state per process; the kernel asks once)."""
    return ENABLED and library() is not None and _STATE.get("amx", False)


def bf16_attention() -> bool:
    """Whether the bfloat16 attention kernel runs here: its products on AMX tiles (:func:`amx`) or, without
    them, on AVX512-BF16 dot products (vdpbf16ps: AMD Zen 4, Intel Cooper Lake and later)."""
    return ENABLED and library() is not None and _STATE.get("bf16_attention", False)


def attention_backward_form(form: Optional[int] = None) -> int:
    """The bf16 attention backward's form for dK and dV on AVX512-BF16 without AMX: 1 (the default) multiplies
    the packed maps as they are (dS^T Q, G^T dO: no operand transposed, causal blocks skipped), 0 the transposed
    products AMX runs (Q^T dS, dO^T G).  Both give the same bits; ``form`` sets it (for tests and benchmarks),
    None reads it."""
    lib = library()
    if lib is None:
        return 0
    return lib.difftx_attn_bwd_form(-1 if form is None else int(form))


def dot_linear() -> bool:
    """Whether the bfloat16 training products of :class:`difftx.nn.linear.Linear` run on the native kernels'
    AVX512-BF16 dot products: here without AMX (with AMX they stay torch's GEMMs, see that module)."""
    return ENABLED and library() is not None and _STATE.get("dot_linear", False)


def _packed_numel(k: int, n: int) -> int:
    """Elements of a packed B operand for a contraction over k and n columns (whole 32-deep tiles per 16-column
    strip: an odd multiple of 16 of k is padded with zeros)."""
    return -(-k // 32) * 32 * n


def pack_wt(w: torch.Tensor) -> Optional[torch.Tensor]:
    """W^T packed as :func:`dot_mm`'s B operand, for a 2-d float32 or bfloat16 ``w`` (n, k) with a unit column
    stride (float32 rounded to bfloat16 nearest-even, as autocast casts it); None where n or k is not a multiple
    of 16 or the kernel is not here."""
    if (w.dim() != 2 or w.dtype not in (torch.float32, torch.bfloat16) or w.stride(1) != 1 or not dot_linear()
            or w.shape[0] % 16 or w.shape[1] % 16 or w.device.type != "cpu"):
        return None
    out = torch.empty(_packed_numel(w.shape[1], w.shape[0]), dtype=torch.bfloat16)
    ok = library().difftx_pack_wt(w.data_ptr(), int(w.dtype == torch.float32), w.stride(0), w.shape[0], w.shape[1],
                                  out.data_ptr(), torch.get_num_threads())
    return out if ok else None


def pack_rows(x: torch.Tensor, rows_pad: int) -> Optional[torch.Tensor]:
    """X packed as :func:`dot_mm`'s B operand for a product over ``rows_pad`` rows (X's, then zero rows; a multiple
    of 16), for a 2-d float32 or bfloat16 ``x`` with a unit column stride and columns a multiple of 16; else None."""
    if (x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16) or x.stride(1) != 1 or not dot_linear()
            or x.shape[1] % 16 or rows_pad % 16 or x.shape[0] > rows_pad or x.device.type != "cpu"):
        return None
    out = torch.empty(_packed_numel(rows_pad, x.shape[1]), dtype=torch.bfloat16)
    ok = library().difftx_pack_rows(x.data_ptr(), int(x.dtype == torch.float32), x.stride(0), x.shape[0], rows_pad,
                                    x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out if ok else None


def transpose_rows_bf16(x: torch.Tensor) -> Optional[torch.Tensor]:
    """x^T (contiguous bfloat16) for a 2-d bfloat16 ``x`` with a unit column stride, rows a multiple of 32 and
    columns of 16, where :func:`dot_linear` holds; else None.  (:func:`transpose_bf16` is the AMX path's.)"""
    return _transpose_bf16(x, 0, torch.bfloat16) if dot_linear() else None


def dot_mm(a: torch.Tensor, bp: torch.Tensor, n: int, out: torch.Tensor, add: Optional[torch.Tensor] = None,
           bias: Optional[torch.Tensor] = None, pack_a: Optional[torch.Tensor] = None) -> bool:
    """out (m, n) = a (m, k) @ B (+ ``add``, float32 (m, n), when given: ``out`` itself, or a float32 tensor
    beside a bfloat16 ``out``; +
    ``bias``, float32 (n,), when given), B packed by :func:`pack_wt` or :func:`pack_rows` for this k (``bp``);
    ``a`` bfloat16 with a unit column stride, k and n multiples of 16; ``out`` contiguous, bfloat16 (rounded
    nearest-even from the float32 sums) or float32.  ``pack_a`` (bfloat16, :func:`packed_rows_numel` (m, k)
    elements; m a multiple of 32): the same call also writes ``pack_rows(a, m)`` there, each block of a's rows
    packed while it is in cache (for a later product over a's rows: :func:`dot_mm_t`).  False where the kernel
    does not take it (nothing written)."""
    m, k = a.shape
    f32 = out.dtype == torch.float32
    if (a.dtype != torch.bfloat16 or a.stride(1) != 1 or not k or not n or k % 16 or n % 16
            or bp.numel() != _packed_numel(k, n)
            or out.shape != (m, n) or not out.is_contiguous() or out.dtype not in (torch.float32, torch.bfloat16)
            or not dot_linear()
            or (add is not None and (add.dtype != torch.float32 or add.shape != (m, n) or not add.is_contiguous()
                                     or (f32 and add is not out)))
            or (bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()))
            or (pack_a is not None and (m % 32 or pack_a.dtype != torch.bfloat16 or not pack_a.is_contiguous()
                                        or pack_a.numel() != _packed_numel(m, k)))):
        return False
    acc = add if add is not None else (out if f32 else None)
    return bool(library().difftx_dot_linear(
        a.data_ptr(), a.stride(0), m, bp.data_ptr(), k, n, None if acc is None else acc.data_ptr(), n,
        int(add is not None), None if f32 else out.data_ptr(), n, None if bias is None else bias.data_ptr(),
        0, None if pack_a is None else pack_a.data_ptr(), torch.get_num_threads()))


def packed_rows_numel(rows: int, cols: int) -> int:
    """Elements of ``pack_rows(x, rows)`` for an x of ``cols`` columns (the buffer :func:`dot_mm`'s ``pack_a``
    fills)."""
    return _packed_numel(rows, cols)


DOT_SUM_MAX = 8  # products one dot_mm_sum call takes (the kernel's DOT_SEGS)


def dot_mm_sum(a_list: list, bp_list: list, n: int, out: torch.Tensor, pack_a: Optional[list] = None) -> bool:
    """out (m, n) = sum over i of a_list[i] (m, k_i) @ B_i, B_i packed by :func:`pack_rows` or :func:`pack_wt` for
    k_i (``bp_list[i]``), summed in float32 registers and rounded once (the bits of a chain of :func:`dot_mm`
    calls that pass their float32 sums on with ``add``, without storing and reloading them between the
    products).  Each a bfloat16 with a unit column stride, every k_i and n multiples of 16; ``out``
    contiguous, float32 or bfloat16.  ``pack_a`` (None or a list with None entries): a_i packed along its rows
    there too, as :func:`dot_mm`'s.  At most :data:`DOT_SUM_MAX` products; False where the kernel does not
    take the call (nothing written)."""
    count = len(a_list)
    pack_a = list(pack_a) if pack_a is not None else [None] * count
    if not 1 <= count <= DOT_SUM_MAX or len(bp_list) != count or len(pack_a) != count or not dot_linear():
        return False
    m = a_list[0].shape[0]
    if (out.shape != (m, n) or not out.is_contiguous() or out.dtype not in (torch.float32, torch.bfloat16)
            or not n or n % 16):
        return False
    for a, bp, pa in zip(a_list, bp_list, pack_a):
        k = a.shape[1] if a.dim() == 2 else -1
        if (a.dim() != 2 or a.dtype != torch.bfloat16 or a.shape[0] != m or a.stride(1) != 1 or not k or k % 16
                or bp is None or bp.numel() != _packed_numel(k, n) or bp.dtype != torch.bfloat16
                or not bp.is_contiguous()
                or (pa is not None and (m % 32 or pa.dtype != torch.bfloat16 or not pa.is_contiguous()
                                        or pa.numel() != _packed_numel(m, k)))):
            return False
    ptrs = ctypes.c_void_p * count
    i64s = ctypes.c_int64 * count
    f32 = out.dtype == torch.float32
    packs = ptrs(*(None if pa is None else pa.data_ptr() for pa in pack_a))
    return bool(library().difftx_dot_linear_sum(
        count, ptrs(*(a.data_ptr() for a in a_list)), i64s(*(a.stride(0) for a in a_list)), m,
        ptrs(*(bp.data_ptr() for bp in bp_list)), i64s(*(a.shape[1] for a in a_list)), n,
        out.data_ptr() if f32 else None, n, None if f32 else out.data_ptr(), n,
        packs if any(pa is not None for pa in pack_a) else None, torch.get_num_threads()))


def dot_mm_t(ap: torch.Tensor, rows: int, cols: int, bp: torch.Tensor, n: int, out: torch.Tensor) -> bool:
    """out (cols, n) = Y^T @ B for Y (``rows`` x ``cols``) given packed as ``ap`` (:func:`pack_rows` (Y, rows), or
    :func:`dot_mm`'s ``pack_a``; rows a multiple of 32, cols of 16) and B packed for a product over ``rows``
    (:func:`pack_rows` of X: a weight gradient dY^T X with no transpose of dY).  ``out`` contiguous, float32 or
    bfloat16 (rounded nearest-even from the float32 sums); False where the kernel does not take it."""
    if (ap.dtype != torch.bfloat16 or bp.dtype != torch.bfloat16 or rows % 32 or cols % 16 or n % 16 or not n
            or not rows or not cols or ap.numel() != _packed_numel(rows, cols) or bp.numel() != _packed_numel(rows, n)
            or not ap.is_contiguous() or not bp.is_contiguous()
            or out.shape != (cols, n) or not out.is_contiguous() or out.dtype not in (torch.float32, torch.bfloat16)
            or not dot_linear()):
        return False
    f32 = out.dtype == torch.float32
    return bool(library().difftx_dot_linear(
        ap.data_ptr(), 2, cols, bp.data_ptr(), rows, n, out.data_ptr() if f32 else None, n, 0,
        None if f32 else out.data_ptr(), n, None, 1, None, torch.get_num_threads()))


def transpose_bf16(x: torch.Tensor, pad: int = 0, dtype: torch.dtype = torch.bfloat16) -> Optional[torch.Tensor]:
    """x^T as a new tensor of ``dtype`` (bfloat16, or float32: the same values), for a 2-d bfloat16 ``x`` with a
    unit column stride, on an AMX CPU (:func:`amx`); None where the kernel does not take it.  bfloat16 output:
    rows a multiple of 32 and columns of 16, each output row ``pad`` elements longer in memory (``pad=32``
    keeps rows 4 KiB apart from sharing cache sets); float32: rows and columns multiples of 16, contiguous."""
    return _transpose_bf16(x, pad, dtype) if amx() else None


def _transpose_bf16(x: torch.Tensor, pad: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """:func:`transpose_bf16` wherever the kernels' bf16 part is built (the callers choose where it is worth it)."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(1) != 1 or not supports(x.dtype, x.device):
        return None
    rows, cols = x.shape
    if dtype == torch.bfloat16 and not rows % 32 and not cols % 16:
        out = torch.empty(cols, rows + pad, dtype=dtype)[:, :rows]
        ok = library().difftx_transpose_bf16(x.data_ptr(), x.stride(0), rows, cols, out.data_ptr(), out.stride(0),
                                             torch.get_num_threads())
    elif dtype == torch.float32 and not rows % 16 and not cols % 16:
        out = torch.empty(cols, rows, dtype=dtype)
        ok = library().difftx_transpose_bf16_f32(x.data_ptr(), x.stride(0), rows, cols, out.data_ptr(), rows,
                                                 torch.get_num_threads())
    else:
        return None
    return out if ok else None


def attention_ok(q: torch.Tensor, k3: torch.Tensor, v: torch.Tensor, nk: int, padded: bool) -> bool:
    """Whether :func:`attention_forward` takes a fused-attention call: on the CPU, no key padding, K rows (k3,
    (B*M*Hk or B*Hk, nk, d)) and V rows (v, (B, Hk, nk, dv), any strides) with a contiguous last dim and exactly
    ``nk`` keys; float32 with head widths multiples of the micro-kernel's column block (16 floats with AVX2, 32 with
    AVX-512), or bfloat16 where :func:`bf16_attention` holds, with head widths multiples of 32."""
    if not supports(q.dtype, q.device) or not q.dtype == k3.dtype == v.dtype or padded:
        return False
    if q.dtype == torch.float32:
        nr = library().difftx_gemm_nr()
    elif q.dtype == torch.bfloat16 and bf16_attention():
        nr = 32
    else:
        return False
    return (q.shape[-1] % nr == 0 and v.shape[-1] % nr == 0 and v.dim() == 4 and k3.shape[1] == v.shape[2] == nk >= 1
            and k3.stride(-1) == 1 and v.stride(-1) == 1)


def _pack(name: str, numel: int, device: torch.device) -> torch.Tensor:
    from .fused import _scratch  # the fused kernel's per-thread buffers

    return _scratch(name, numel, torch.float32, device)


def _panels(nk: int) -> int:
    nr = library().difftx_gemm_nr()
    return (nk + nr - 1) // nr * nr


def _key_maps(k3: torch.Tensor, b: int, m: int, hk: int) -> int:
    """How many K slices per (batch, K/V head) ``k3`` holds: ``m`` (one K per map) or 1 (both maps read one K, as
    DIFF V2's query heads 2i, 2i+1 do; the kernels then return that K's gradient summed over the maps)."""
    mk = k3.shape[0] // (b * hk)
    assert mk * b * hk == k3.shape[0] and mk in (1, m) and hk >= 1, (tuple(k3.shape), b, m, hk)
    return mk


def attention_forward(q: torch.Tensor, k3: torch.Tensor, v: torch.Tensor, causal: bool, q_start: int, chunk: int,
                      scale: float, lam: float, lam_rows: Optional[torch.Tensor], want_lse: bool, window: int = 0):
    """The fused attention (one or two maps over one value) in native blocks: (out, lse or None).  float32 on
    the register micro-kernel (``chunk`` a multiple of 6), or bfloat16 on AMX tiles or AVX512-BF16 dot products
    (``chunk`` a multiple of 32; maps, softmax and statistics in float32, products bf16 x bf16 -> float32); see
    :func:`attention_ok`.

    ``q`` (B, M, H, N, d) contiguous; ``k3`` (B*M*Hk, nk, d), or (B*Hk, nk, d) for one K that both maps read,
    with contiguous rows; ``v`` (B, Hk, nk, dv) with contiguous rows, read in place (a head view of the value
    projection); ``lam_rows`` float32 (B, H, N) or None (the scalar ``lam``); ``window`` > 0: a sliding window (a
    query sees keys fewer than ``window`` positions away, :class:`~difftx.nn.mask.AttnMask`), whose blocks multiply
    only the keys from their first query's window on.  out (B, N, H, dv); lse (B, M, H, N), the rows' log-sum-exp that
    :func:`attention_backward` rebuilds the maps from."""
    b, m, h, n, d = q.shape
    hk, nk, dv = v.shape[1], k3.shape[1], v.shape[-1]
    mk = _key_maps(k3, b, m, hk)
    assert q.is_contiguous() and (lam_rows is None or (lam_rows.is_contiguous() and lam_rows.dtype == torch.float32))
    assert v.shape[0] == b and h % hk == 0
    out = q.new_empty(b, n, h, dv)
    lse = torch.empty(b, m, h, n, dtype=torch.float32, device=q.device) if want_lse else None
    if q.dtype == torch.bfloat16:
        assert chunk % 32 == 0
        done = library().difftx_attn_forward_bf16(
            q.data_ptr(), k3.data_ptr(), k3.stride(0), k3.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
            v.stride(2), out.data_ptr(), _ptr(lse), b, m, mk, h, hk, n, nk, d, dv, q_start, int(causal), int(window),
            chunk, float(scale), float(lam), _ptr(lam_rows), torch.get_num_threads())
        if not done:
            raise MemoryError("the bf16 attention kernel could not allocate its buffers")
        return out, lse
    kpack = _pack("kpack", k3.shape[0] * _panels(nk) * d, q.device)
    vpack = _pack("vpack", b * hk * _panels(nk) * dv, q.device)
    library().difftx_attn_forward(q.data_ptr(), k3.data_ptr(), k3.stride(0), k3.stride(1), v.data_ptr(), v.stride(0),
                                  v.stride(1), v.stride(2), out.data_ptr(), _ptr(lse), kpack.data_ptr(),
                                  vpack.data_ptr(), b, m, mk, h, hk, n, nk, d, dv, q_start, int(causal), int(window),
                                  chunk, float(scale), float(lam), _ptr(lam_rows), torch.get_num_threads())
    return out, lse


def dense_layout(t: torch.Tensor) -> Optional[tuple]:
    """(shape, strides) of t when it is dense (a permutation of a contiguous tensor) with contiguous rows,
    else None: the layout to write t's gradient in, so that the gradient of a head view of a projection's
    output reaches the projection without a copy."""
    if t.stride(-1) == 1 and torch.empty_like(t, device="meta").stride() == t.stride():  # preserve_format
        return tuple(t.shape), t.stride()
    return None


def empty_in(layout: Optional[tuple], shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty tensor of ``shape`` in ``layout`` (from :func:`dense_layout`), or contiguous when None."""
    if layout is not None:
        return torch.empty_strided(*layout, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def attention_backward(q, k3, v, dout, lse, causal: bool, q_start: int, chunk: int, scale: float, lam: float,
                       lam_rows: Optional[torch.Tensor], window: int = 0):
    """Gradients of :func:`attention_forward`: dq (like q), dk (like k3, contiguous; a shared K's summed over the
    maps), dv (v's shape, in v's layout when dense, see :func:`dense_layout`), and for two maps rowsum(P2 dP)
    (B, H, N) (lambda's gradient is minus it, summed for a scalar lambda), else None."""
    b, m, h, n, d = q.shape
    hk, nk, dv_w = v.shape[1], k3.shape[1], v.shape[-1]
    mk = _key_maps(k3, b, m, hk)
    assert dout.is_contiguous() and dout.shape == (b, n, h, dv_w) and dout.dtype == q.dtype
    dq = torch.empty_like(q)
    dk = q.new_empty(k3.shape[0], nk, d)
    dv = empty_in(dense_layout(v), v.shape, v.dtype, v.device)
    rs2 = torch.empty(b, h, n, dtype=torch.float32, device=q.device) if m == 2 else None
    if q.dtype == torch.bfloat16:
        done = library().difftx_attn_backward_bf16(
            q.data_ptr(), k3.data_ptr(), k3.stride(0), k3.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
            v.stride(2), dout.data_ptr(), lse.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), dv.stride(0),
            dv.stride(1), dv.stride(2), _ptr(rs2), b, m, mk, h, hk, n, nk, d, dv_w, q_start, int(causal), int(window),
            chunk, float(scale), float(lam), _ptr(lam_rows), torch.get_num_threads())
        if not done:
            raise MemoryError("the bf16 attention kernel could not allocate its buffers")
        return dq, dk, dv, rs2
    kpack = _pack("kpack", k3.shape[0] * _panels(nk) * d, q.device)
    vpack = _pack("vpack", b * hk * _panels(nk) * dv_w, q.device)
    library().difftx_attn_backward(q.data_ptr(), k3.data_ptr(), k3.stride(0), k3.stride(1), v.data_ptr(),
                                   v.stride(0), v.stride(1), v.stride(2), dout.data_ptr(), lse.data_ptr(),
                                   dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), dv.stride(0), dv.stride(1),
                                   dv.stride(2), _ptr(rs2), kpack.data_ptr(), vpack.data_ptr(), b, m, mk, h, hk, n, nk,
                                   d, dv_w, q_start, int(causal), int(window), chunk, float(scale), float(lam),
                                   _ptr(lam_rows), torch.get_num_threads())
    return dq, dk, dv, rs2


def _rows4(t: torch.Tensor):
    """((B, A1, A2, N), their element strides) of t (..., N, d), 2 to 5 dims with a contiguous last dim
    (the first dim of 3+ is the batch; missing head dims are 1), or None."""
    if not 2 <= t.dim() <= 5 or t.stride(-1) != 1:
        return None
    sizes, strides = list(t.shape[:-1]), list(t.stride()[:-1])
    pad = 3 if t.dim() == 2 else 5 - t.dim()
    at = 0 if t.dim() == 2 else 1  # after the batch dim
    return sizes[:at] + [1] * pad + sizes[at:], strides[:at] + [0] * pad + strides[at:]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, inverse: bool = False,
         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rotate x (..., N, d) by float32 angles cos/sin (Bc, N, d/2) (Bc 1 or x's first dim); ``inverse``
    rotates backwards (the gradient).  x may be strided (its last dim contiguous, at most 5 dims); the
    result goes to ``out`` (x's shape and dtype, any such strides; x itself, or memory not overlapping x)
    or to a new contiguous tensor."""
    assert cos.is_contiguous() and sin.is_contiguous() and cos.dtype == torch.float32
    if x.numel() == 0:  # no rows (an empty tensor's strides need not be any rows' strides): nothing to rotate
        return _empty_as(x, x.dtype) if out is None else out
    rows = _rows4(x)
    if rows is None:  # rows not contiguous, or more than three leading dims: (B, heads..., N, d) flattened
        shape = x.shape
        x = x.contiguous()
        if x.dim() > 5:
            x = x.view(shape[0], -1, *shape[-2:])
            return rope(x, cos, sin, interleaved, inverse, None if out is None else out.view(x.shape)).view(shape)
        rows = _rows4(x)
    if out is None:
        out = _empty_as(x, x.dtype)
    out_rows = _rows4(out)
    assert out.shape == x.shape and out.dtype == x.dtype and out_rows is not None
    (b, a1, a2, n), xs = rows
    os_ = out_rows[1]
    arr = ctypes.c_int64 * 4
    library().difftx_rope(x.data_ptr(), arr(*xs), out.data_ptr(), arr(*os_), int(x.dtype == torch.bfloat16),
                          cos.data_ptr(), sin.data_ptr(), b, a1, a2, n, x.shape[-1], cos.shape[0], int(interleaved),
                          -1.0 if inverse else 1.0, _threads(x.numel()))
    return out


def diff_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: Optional[torch.Tensor], lam,
                scale: float, norm: bool, wg: Optional[torch.Tensor], gain: float, eps: float,
                out_dtype: torch.dtype) -> torch.Tensor:
    """One decoding query of differential attention per head over a KV cache: (B, 1, H, dv).

    ``q`` (B, M, H, 1, d), ``k`` (B, M, Hk, T, d) and ``v`` (B, Hk, T, dv) any strided views whose
    last dim is contiguous (a cache's prefix in either key layout; DIFF V2's one set of keys as a stride-0
    map dim, its queries as heads 2i, 2i + 1 of one projection), dv = 2d (DIFF V1) or d (DIFF V2, and softmax
    attention); M = 2 maps, or 1: softmax attention (``lam`` unused).  ``valid`` (B, T) bool or None (every key).
    ``lam``: a float, or float32 (B, H) per sequence and head (DIFF V2).  ``norm``: apply RMSNorm over dv with
    ``wg`` (float32 weight x gain) or the scalar ``gain``.  float32 or bfloat16 throughout (q, k, v one dtype).
    """
    b, m, h, _, d = q.shape
    hk, t, dv = k.shape[2], k.shape[3], v.shape[-1]
    assert m in (1, 2) and k.shape == (b, m, hk, t, d) and v.shape == (b, hk, t, dv) and dv in (d, 2 * d)
    assert m == 2 or dv == d
    assert k.dtype == v.dtype == q.dtype and (valid is None or valid.shape == (b, t))
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if q.stride(-1) != 1:
        q = q.contiguous()
    vm = None if valid is None else valid.to(torch.uint8).contiguous()
    out = torch.empty(b, 1, h, dv, dtype=out_dtype, device=q.device)
    wg = None if wg is None else wg.to(torch.float32).contiguous()
    lam_bh = None
    if isinstance(lam, torch.Tensor) and lam.numel() > 1:
        lam_bh = lam.to(torch.float32).reshape(b, h).contiguous()
    qs, ks, vs = q.stride(), k.stride(), v.stride()
    library().difftx_diff_decode(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), _ptr(vm), out.data_ptr(), int(q.dtype == torch.bfloat16),
        int(out_dtype == torch.bfloat16), m, b, h, hk, t, d, dv, qs[0], qs[1], qs[2], ks[0], ks[2], ks[3], ks[1],
        vs[0], vs[1], vs[2],
        float(scale), 0.0 if lam_bh is not None else float(lam), _ptr(lam_bh), int(norm), _ptr(wg), float(gain),
        float(eps), torch.get_num_threads())
    return out
