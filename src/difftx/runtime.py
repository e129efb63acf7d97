"""Process-level settings for training and benchmarking on the CPU.

:func:`native_bf16_matmul` says whether this device multiplies bf16 matrices in hardware.
On a CPU without AMX or AVX512-BF16 (an AVX2-only laptop or server: many AMD EPYC/Ryzen and
consumer Intel parts) torch's bf16 GEMM falls back to a reference kernel: measured on an AVX2
AMD EPYC, torch 2.13, 1.0-1.4 GFLOP/s in bf16 against 150-170 GFLOP/s in fp32, so bf16 autocast
makes training about 100x slower there.  ``auto`` precision (training, ``difftx compare``,
``difftx bench``) therefore picks bf16 only where this is true, and an explicit bf16 request
elsewhere gets :data:`SLOW_BF16` as a warning.

:func:`keep_freed_memory` stops glibc's malloc from handing large freed blocks back to
the operating system.  By default glibc serves every allocation above a (dynamic) threshold
with its own ``mmap`` and unmaps it on free, and trims the heap top as soon as it is free;
a training step frees and reallocates hundreds of multi-MB activation and gradient tensors,
so each of them is faulted in and zeroed by the kernel again, every step (10^4 - 10^5
page faults per step at the ``small`` preset).  Keeping the memory in the process's heap
instead is what PyTorch's CPU tuning guide gets from jemalloc/tcmalloc; here it is one
``mallopt`` call, no extra library.  Measured (benchmarks/performance/results/, docs/performance.md):
the page faults of a ``small`` training step drop to ~0 and the step is ~8% faster in bf16,
1-4% in fp32.

The cost: the process keeps its high-water mark of memory (RSS does not shrink after a peak),
which is what a training or benchmark process wants.  ``difftx`` commands call it at start;
set ``DIFFTX_KEEP_FREED_MEMORY=0`` to leave malloc alone.  Library users can call it
themselves.  It does nothing off Linux/glibc, or when the user already set glibc's
``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` (theirs wins).
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
THRESHOLD = 1 << 30  # blocks up to 1 GiB come from (and return to) the heap, not mmap/munmap
ENV = "DIFFTX_KEEP_FREED_MEMORY"

_applied: bool | None = None

SLOW_BF16 = ("this CPU has no bf16 matrix hardware (AMX or AVX512-BF16): torch runs bf16 matmuls about 100x "
             "slower than fp32 here; the default precision, auto, uses fp32 on it: ask for bf16 only to test "
             "bf16 numerics")


def cache_root(*variables: str):
    """difftx's cache directory (kernels, token shards, bpe vocabularies): the first of the environment
    ``variables`` that is set ("~" expanded), else ``$XDG_CACHE_HOME/difftx``, else ``~/.cache/difftx``."""
    from pathlib import Path

    for var in variables:
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()  # "~/x" is a home path, not ./~/x
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "difftx"


def native_bf16_matmul(device) -> bool:
    """Whether bf16 matmuls on ``device`` run in hardware: CUDA with bf16 support, or a CPU with AMX or
    AVX512-BF16 (see the module doc; elsewhere they run ~100x slower than fp32)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    cpu = getattr(torch, "cpu", None)
    return any(getattr(cpu, f, lambda: False)() for f in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse (see the module doc); True if the setting is in effect.

    Idempotent and cheap; safe to call from every entry point and worker process.
    """
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if any(os.environ.get(v) for v in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = bool(mallopt(_M_MMAP_THRESHOLD, THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, THRESHOLD))
    return _applied


def keeps_threads(fn):
    """``fn``, with torch's thread count put back as the caller had it when ``fn`` returns or raises: for the entry
    points a caller may run in its own process (``run_bench``, ``run_study``, ``main(["grads", ...])``) that set the
    count for their work (``--threads``), as :func:`difftx.train.train` does."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import torch

        before = torch.get_num_threads()
        try:
            return fn(*args, **kwargs)
        finally:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)

    return wrapper


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one, else the CPU count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


def free_memory(device) -> int | None:
    """Bytes that new tensors on ``device`` can still get; None where that is unknown.

    CUDA: the driver's free memory on the device.  CPU (Linux): ``MemAvailable`` + ``SwapFree`` from
    /proc/meminfo, capped by a container's cgroup memory limit (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``) less its current usage other than page cache.  Elsewhere None.
    """
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    return linux_free_memory()


def linux_free_memory(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int | None:
    """:func:`free_memory` of the CPU from these files (None where ``meminfo`` is missing or lacks MemAvailable)."""
    try:
        with open(meminfo) as f:
            info = {k.strip(): int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f if ":" in line)
                    if v.split() and v.split()[0].isdigit()}
    except (OSError, ValueError):
        return None
    if "MemAvailable" not in info:
        return None
    free = info["MemAvailable"] + info.get("SwapFree", 0)
    for base, limit_name, usage_name, cache_keys in ((cgroup, "memory.max", "memory.current", ("file",)),
                                                     (f"{cgroup}/memory", "memory.limit_in_bytes",
                                                      "memory.usage_in_bytes", ("total_cache", "cache"))):
        try:
            with open(f"{base}/{limit_name}") as f:
                limit = f.read().strip()
            with open(f"{base}/{usage_name}") as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # "max" / a huge number: no limit
            usage -= _cgroup_cache(f"{base}/memory.stat", cache_keys)  # page cache is reclaimed under the limit
            free = min(free, max(0, int(limit) - max(0, usage)))
        break
    return free


def _cgroup_cache(stat_file: str, keys: tuple) -> int:
    """Page-cache bytes a cgroup's ``memory.stat`` reports under the first of ``keys`` it has (0 if none)."""
    try:
        with open(stat_file) as f:
            stat = dict(line.split()[:2] for line in f if len(line.split()) >= 2)
        return next((int(stat[k]) for k in keys if k in stat), 0)
    except (OSError, ValueError):
        return 0


def resolve_device(device, flag: str = "--device"):
    """``auto`` (CUDA when there is one, else the CPU), ``cpu``, ``cuda`` or ``cuda:N`` as a torch device;
    anything else, CUDA where there is none, or a missing device N is one ConfigError naming ``flag``."""
    import re

    import torch

    from .errors import ConfigError

    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ConfigError(flag, f"{device!r} is not a device; use cpu, cuda, cuda:N or auto")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(flag, f"{device!r} requested but CUDA is not available on this machine; use {flag} cpu")
        index, count = int(device.partition(":")[2] or 0), torch.cuda.device_count()
        if index >= count:
            raise ConfigError(flag, f"{device!r} requested but there are {count} CUDA device(s); "
                                    f"use cuda:0..cuda:{count - 1}")
    return torch.device(device)
