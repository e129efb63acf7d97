"""Benchmarks behind ``difftx bench``: speed and memory side by side, and long-context attention memory.

* :mod:`.speed`: matched-parameter arms (and transformers' peers) timed in one process.
* :mod:`.long_context`: DIFF attention memory and time from 1K to 16K tokens.
* :mod:`.memory`: the peak-memory measurement both use.
* :mod:`.report`: markdown tables, JSON files.
"""

from .memory import peak_live_bytes
from .report import markdown, write_results
from .speed import ARMS, DTYPES, PEERS, PHASES, QUICK, BenchConfig, resolve_dtypes, run_bench

__all__ = ["ARMS", "DTYPES", "PEERS", "PHASES", "QUICK", "BenchConfig", "resolve_dtypes", "run_bench", "markdown",
           "write_results", "peak_live_bytes"]
