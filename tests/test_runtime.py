"""difftx.runtime.keep_freed_memory: freed large blocks are reused without new page faults."""

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                                reason="a glibc malloc setting")

_PROBE = r"""
import resource, sys, torch
from difftx.runtime import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "call" else False
def churn():  # a 64 MiB tensor written and freed, as a training step does with activations
    t = torch.empty(16 << 20, dtype=torch.float32); t.fill_(1.0); del t
churn(); churn()  # the heap grows once
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    churn()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
"""


def _faults(mode: str, **env) -> tuple[str, int]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "DIFFTX_KEEP_FREED_MEMORY"}
    e.update(env)
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, env=e, check=True)
    applied, faults = out.stdout.split()
    return applied, int(faults)


def test_freed_memory_is_reused_without_page_faults():
    applied, kept = _faults("call")
    _, default = _faults("skip")
    assert applied == "True"
    # glibc's default serves 64 MiB with mmap and unmaps it on free: 16K faults on every reuse.
    # Kept, the block is reused as it is (now and then the heap still grows: 16K faults once)
    assert default >= 9 * 16384, default
    assert kept <= 4 * 16384, kept


def test_opt_out_and_user_settings_win():
    applied, faults = _faults("call", DIFFTX_KEEP_FREED_MEMORY="0")
    assert applied == "False" and faults >= 9 * 16384
    applied, _ = _faults("call", MALLOC_TRIM_THRESHOLD_="131072")
    assert applied == "False"
