"""Peak memory of a piece of work: what the tensors it allocates occupy at their high-water mark.

CUDA has allocator statistics (``torch.cuda.max_memory_allocated``).  The CPU allocator keeps
none, and process RSS is no measure either (freed memory stays mapped, other models share the
process), so on the CPU we replay ``torch.profiler``'s memory events: every tensor allocation
and free with its byte count, in time order; the running sum's maximum is the peak of live
tensor bytes the work added on top of what existed before it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable

import torch


def peak_live_bytes(fn: Callable[[], object], device: torch.device | str = "cpu") -> tuple[int, str]:
    """(peak bytes of tensors allocated and alive at once while ``fn()`` runs, the method used)."""
    from ..nn.fused import release_scratch

    device = torch.device(device)
    release_scratch()  # the fused kernel's cached scratch is part of the work's memory: count it
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base, "torch.cuda.max_memory_allocated"
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak, "torch.profiler memory events (peak of live CPU tensor bytes)"


@contextlib.contextmanager
def _quiet_stderr():
    """Silence the profiler backend's start/stop lines, written by C++ straight to fd 2."""
    try:
        saved = os.dup(2)
    except OSError:  # no real fd 2 (embedded interpreters): nothing to silence
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
