"""Markdown tables and files for :mod:`difftx.benchmarking` results."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from ..io import atomic_write_files, make_out_dir
from .speed import PHASES, speed_ratio


def _native(status: str) -> str:
    """``on (path; note)`` -> ``on; note`` (the build's path is in the JSON)."""
    head, _, rest = status.partition(" (")
    note = rest.rstrip(")").partition("; ")[2]
    return f"{head}; {note}" if note else head


def markdown(results: dict) -> str:
    bc = results["bench_config"]
    env = results["environment"]
    lines = [f"# difftx bench: preset `{bc['preset']}`, batch {bc['batch_size']} x {bc['seq_len']} tokens",
             "", f"{env['cpu']} ({env['threads']} threads), torch {env['torch']}"
             + (f", transformers {env['transformers']}" if "transformers" in env else "")
             + f"; {bc['repeats']} interleaved repeats, medians, `{bc['timer']}` time."
             + (" Compiled (`torch.compile`) for training and prefill; decoding eager." if bc.get("compile") else "")
             + (f" Native CPU kernels: {_native(env['native_kernels'])}." if "native_kernels" in env else "")
             + (" DIFF attention" + (" (--diff-attention)" if env.get("diff_attention_named") else "") + ": "
                + ", ".join(f"{v} ({dt})" for dt, v in env["diff_attention"].items()) + "."
                if "diff_attention" in env else ""),
             ""]
    arms = results["arms"]
    for dt in bc["dtypes"]:
        peak = results["matmul_peak_flops"][dt]
        slow = dt == "bf16" and env.get("native_bf16_matmul") is False
        lines += [f"## {dt}" + (" (autocast)" if dt == "bf16" else ""),
                  "", f"Matmul peak measured in this run: {peak / 1e9:.1f} GFLOP/s (best; square sizes up to "
                  + ("2048" if str(env.get("device", "cpu")).startswith("cpu") else "8192")
                  + (f", one {env['threads']}-thread matmul or {env['threads']} one-thread ones at once"
                     if env.get("threads", 1) > 1 and str(env.get("device", "cpu")).startswith("cpu")
                     and bc.get("timer") == "wall" else "")
                  + ("; torch's and oneDNN's, difftx's float32 GEMM here" if dt == "fp32"
                     and env.get("fp32_gemm") == "onednn" else "") + ")"
                  + _repeat_peaks(results, dt) + "."
                  + (" This device has no bf16 matmul hardware: torch's fallback kernels differ by op, so the "
                     "share of this peak means little." if slow else ""), "",
                  "| arm | params | train tok/s | x | prefill tok/s | x | decode tok/s | x | "
                  "train memory MiB | x | KV B/token | train % peak |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        base = arms["transformer"]["by_dtype"][dt]
        for name, a in arms.items():
            r = a["by_dtype"].get(dt, {})
            cells = [name, f"{a['params'] / 1e6:.2f}M"]
            for phase in PHASES:
                if phase in r:
                    x = speed_ratio(r[phase]["seconds"], base[phase]["seconds"])
                    cells += [f"{r[phase]['tokens_per_s']:.0f}", f"{x:.2f}"]
                else:
                    cells += ["-", "-"]
            if "memory" in r:
                cells += [f"{r['memory']['total_bytes'] / 2**20:.0f}",
                          f"{r['memory']['total_bytes'] / base['memory']['total_bytes']:.2f}"]
            else:
                cells += ["-", "-"]
            cells.append(f"{r['decode']['kv_bytes_per_token']:.0f}" if "decode" in r else "-")
            cells.append(f"{100 * r['train']['share_of_matmul_peak']:.1f}" if "train" in r else "-")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    for name, a in arms.items():
        if "failed" in a:
            lines += [f"{name} failed in the {a['failed']['phase']} phase ({a['failed']['error']}); left out of "
                      "the rest of the run (\"-\").", ""]
    if results.get("dtype_ratios"):
        lines += ["## bf16 over fp32, training, the dtypes alternated step by step", "",
                  "| arm | fp32 s a step | bf16 s a step | bf16 / fp32 tokens/s | range over repeats |",
                  "|---|---:|---:|---:|---|"]
        for name, r in results["dtype_ratios"].items():
            lines.append(f"| {name} | {statistics.median(r['seconds']['fp32']):.3f} | "
                         f"{statistics.median(r['seconds']['bf16']):.3f} | {r['bf16_over_fp32_train']:.2f} | "
                         f"{r['range'][0]:.2f}-{r['range'][1]:.2f} |")
        lines += ["", "Each repeat times one step in each dtype back to back (their order alternating), so the ratio "
                  "is the median of pairs that share the machine's state; the tables above time the dtypes one "
                  "after the other.", ""]
    spread = results.get("ratio_spread_by_dtype", {})
    lines += ["## Ratios (least favourable dtype)", "", "| ratio | value | range over repeats |", "|---|---:|---|"]
    for k, v in sorted(results["ratios"].items()):
        dt = next((d for d, rs in results["ratios_by_dtype"].items() if rs.get(k) == v), None)
        lo_hi = spread.get(dt, {}).get(k)
        lines.append(f"| {k} | {v:.3f} | " + (f"{lo_hi[0]:.3f}-{lo_hi[1]:.3f} ({dt})" if lo_hi else "") + " |")
    lines += ["", "x: tokens/s (memory: bytes) relative to our Transformer in the same dtype; a speed ratio is "
              "the median over repeats of the ratio of the two arms' times in that repeat.  Train memory: "
              "parameters + optimiser state + the step's peak of live tensor bytes "
              f"({_memory_method(results)}).  FLOPs per token from `difftx.accounting.flops_per_token`.", ""]
    return "\n".join(lines)


def _repeat_peaks(results: dict, dt: str) -> str:
    peaks = results.get("matmul_peak_by_repeat", {}).get(dt)
    if not peaks:
        return ""
    return (f"; {min(peaks) / 1e9:.0f}-{max(peaks) / 1e9:.0f} at the start of the training repeats, "
            "which the train % peak column is paired with")


def _memory_method(results: dict) -> str:
    for a in results["arms"].values():
        for r in a["by_dtype"].values():
            if "memory" in r:
                return r["memory"]["method"]
    return "not measured"


def write_results(results: dict, out: Path) -> tuple[Path, Path]:
    out = make_out_dir(out)
    js, md = out / "bench.json", out / "bench.md"
    # both or neither: a failed second write left this run's JSON beside the earlier run's table (--force)
    atomic_write_files({js: (json.dumps(results, indent=2, default=str) + "\n").encode("utf-8"),
                        md: markdown(results).encode("utf-8")})
    return js, md
