"""`difftx bench`: the JSON contract (INTERFACE.md), the markdown table, long-context mode, bad input."""

from __future__ import annotations

import json
import statistics
import time

import pytest

REQUIRED = ["diff_over_transformer_train", "diff_over_transformer_prefill", "diff_over_transformer_decode",
            "diff_over_transformer_kv_bytes", "diff_over_transformer_memory"]
PEER_KEYS = ["diff_over_hf_diffllama_train", "transformer_over_hf_llama_train"]


def test_bench_quick_writes_json_and_table(cli, tmp_path):
    r = cli("bench", "--quick", "--dtypes", "bf16", "--out", tmp_path)
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "bench.json").read_text())
    for key in REQUIRED:
        assert res["ratios"][key] > 0, key
    assert res["ratios"]["diff_over_transformer_kv_bytes"] == pytest.approx(1.0)  # DIFF caches what its twin does
    assert res["command"].startswith("difftx bench --quick")
    arms = res["arms"]
    assert {"transformer", "diff", "diff2", "dnt", "diff-dnt"} <= set(arms)
    # matched parameters: every arm within 1% of the Transformer
    base = arms["transformer"]["params"]
    assert all(abs(a["params"] - base) / base < 0.01 for a in arms.values())
    row = arms["diff"]["by_dtype"]["bf16"]
    assert row["train"]["tokens_per_s"] > 0 and row["train"]["share_of_matmul_peak"] > 0
    if res["environment"]["native_bf16_matmul"]:  # without bf16 hardware the bf16 "peak" is a slow fallback kernel's
        assert row["train"]["share_of_matmul_peak"] < 1
    assert row["memory"]["total_bytes"] > row["memory"]["state_bytes"] > 0
    assert res["matmul_peak_flops"]["bf16"] > 0
    assert len(res["matmul_peak_by_repeat"]["bf16"]) == res["bench_config"]["repeats"]  # one per training repeat
    assert res["matmul_peak_flops"]["bf16"] >= max(res["matmul_peak_by_repeat"]["bf16"])  # the run's best
    assert 0 < row["train"]["share_of_run_peak"] <= (1 if res["environment"]["native_bf16_matmul"] else float("inf"))
    for phase in ("prefill", "decode"):  # no peak per repeat: against the run's best, as documented
        assert row[phase]["share_of_matmul_peak"] == row[phase]["share_of_run_peak"]
    if "hf-llama" in arms:  # transformers installed: the peers' ratios are there too
        for key in PEER_KEYS:
            assert res["ratios"][key] > 0
        assert abs(arms["hf-diffllama"]["params"] - arms["diff"]["params"]) / base < 0.01
    table = (tmp_path / "bench.md").read_text()
    assert "| diff |" in table and "diff_over_transformer_train" in table
    from difftx.runtime import native_bf16_matmul

    # bf16 asked for on a CPU without bf16 matmul hardware (~100x slower than fp32 there): said once
    assert ("no bf16 matrix hardware" in r.stderr) == (not native_bf16_matmul("cpu"))
    assert "| diff |" in r.stdout


def test_bench_long_context_quick(cli, tmp_path):
    r = cli("bench", "--long-context", "--quick", "--out", tmp_path)
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "long_context.json").read_text())
    assert {row["variant"] for row in res["rows"]} == {"fused", "4call", "eager"}
    assert sorted({row["n"] for row in res["rows"]}) == [64, 256]  # --quick's lengths
    assert (tmp_path / "long_context.md").exists()


def test_bench_long_context_in_bf16_warns_where_bf16_has_no_hardware(tmp_path, capsys, monkeypatch):
    """The speed bench warned that bf16 runs on reference kernels on such a CPU; --long-context said nothing."""
    from difftx import runtime
    from difftx.cli import main

    monkeypatch.setattr(runtime, "native_bf16_matmul", lambda device=None: False)
    assert main(["bench", "--long-context", "--quick", "--lengths", "64", "--dtypes", "bf16",
                 "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().err.count("no bf16 matrix hardware") == 1


def test_bench_long_context_quick_keeps_explicit_lengths(tmp_path, capsys):
    """--quick's options are defaults: a --lengths given explicitly is the one measured."""
    from difftx.cli import main

    assert main(["bench", "--long-context", "--quick", "--lengths", "96", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "long_context.json").read_text())
    assert {row["n"] for row in res["rows"]} == {96}


@pytest.mark.parametrize("args,needle", [
    (["--arms", "diff,bogus"], "arms"),
    (["--arms", "diff"], "transformer"),
    # an arm named twice ran twice into one row: two timings per repeat under one name, its median over both
    (["--quick", "--arms", "transformer,diff,transformer"], "arms: 'transformer' given twice"),
    (["--dtypes", "fp8"], "dtypes"),
    (["--seq-len", "16", "--decode-tokens", "16"], "decode_tokens"),
    (["--preset", "nope"], "preset"),
    (["--long-context", "--lengths", "1k"], "lengths"),
    (["--threads", "0"], "threads"),
    (["--device", "tpu"], "device"),
    (["--warmup", "-1"], "warmup"),
    (["--phases", ","], "phases"),
    (["--quick", "--preset", "nope"], "preset"),  # --quick no longer hides explicit values
    (["--quick", "--repeats", "-1"], "repeats"),
    (["--quick", "--seq-len", "0"], "--seq-len: must be at least 1"),
    # torch's allocator error as a traceback before (a batch of 10^11 x 32 tokens, or of 2 x 10^11)
    (["--quick", "--seq-len", str(10 ** 11)], "not enough memory: the 5 arms' fp32 weights"),
    (["--quick", "--batch-size", str(10 ** 11)], "lower --batch-size or --seq-len"),
    (["--preset", "vit-tiny"], "language-model preset"),
    (["--long-context", "--quick", "--preset", "vit-tiny"], "language-model preset"),
    # an option the chosen mode does not read is refused, not ignored
    (["--lengths", "96"], "--lengths: sets the lengths of --long-context only"),
    (["--quick", "--lengths", "96"], "add --long-context"),
    (["--long-context", "--repeats", "3"], "--repeats: is an option of the speed benchmark"),
    (["--long-context", "--seq-len", "64"], "--seq-len"),
    (["--long-context", "--arms", "transformer,diff"], "--arms"),
    (["--long-context", "--phases", "train"], "--phases"),
    (["--long-context", "--timer", "cpu"], "--timer"),
    (["--long-context", "--no-peers"], "--no-peers"),
    (["--long-context", "--no-memory"], "--no-memory"),
    (["--long-context", "--foreach-adamw"], "--fused-adamw/--foreach-adamw"),
    (["--long-context", "--decode-tokens", "8"], "--decode-tokens"),
    (["--long-context", "--dtypes", "fp32,bf16"], "one dtype"),
    (["--long-context", "--compile"], "--compile"),
    (["--quick", "--compile", "--warmup", "0"], "warmup: must be at least 1 with compile"),
    (["--quick", "--compile", "--phases", "decode"], "--compile: compiles the train and prefill phases"),
    # an option of a phase --phases leaves out was accepted and ignored
    (["--quick", "--phases", "train", "--decode-tokens", "8"], "--decode-tokens: is read by the decode phase"),
    (["--quick", "--phases", "prefill,decode", "--no-memory"], "--no-memory: is read by the train phase"),
    (["--quick", "--phases", "prefill", "--foreach-adamw"], "--foreach-adamw: is read by the train phase"),
    (["--quick", "--phases", "decode", "--fused-adamw"], "--fused-adamw: is read by the train phase"),
    # a preset that is not LLaMA-shaped gets no transformers peers: --no-peers left out nothing
    (["--quick", "--preset", "nanogpt", "--no-peers"], "--no-peers: leaves out transformers' Llama and DiffLlama"),
    # torch's allocator error as a traceback, after --out was made
    (["--quick", "--long-context", "--lengths", str(10 ** 11)], "not enough memory: 1 sequence(s) of 100,000,000,000"),
    (["--quick", "--long-context", "--lengths", "64", "--batch-size", str(10 ** 11)], "a smaller --batch-size"),
])
def test_bench_bad_input_is_one_line(capsys, tmp_path, args, needle):
    from difftx.cli import main

    assert main(["bench", "--out", str(tmp_path), *args]) == 2  # in-process: the dispatcher's own path
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("difftx bench: error:")
    assert not any(tmp_path.iterdir())  # nothing written


def test_bench_long_context_reads_batch_size(tmp_path):
    """--batch-size is the long-context batch (it was left at 1 whatever was given)."""
    from difftx.cli import main

    assert main(["bench", "--long-context", "--quick", "--lengths", "32", "--batch-size", "2",
                 "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "long_context.json").read_text())
    assert (res["batch"], res["device"]) == (2, "cpu")
    assert "batch 2" in (tmp_path / "long_context.md").read_text()


def test_long_context_bytes_per_token_count_every_sequence_of_the_batch():
    """peak_bytes_per_token divided the batch's peak by N alone: 2 sequences read twice the KiB per token of 1."""
    from difftx.benchmarking.long_context import attention_scaling

    rows = {b: attention_scaling([64], preset="nano", batch=b, dtype="fp32", variants=("fused", "eager"),
                                 log=lambda s: None)["rows"] for b in (1, 2)}
    for one, two in zip(rows[1], rows[2]):
        assert two["peak_bytes_per_token"] == two["peak_bytes"] / (2 * 64)
        if two["variant"] == "fused":  # memory linear in the tokens: the same bytes per token at either batch
            assert two["peak_bytes_per_token"] == pytest.approx(one["peak_bytes_per_token"], rel=0.1)


def test_long_context_with_every_cell_left_out_returns_no_rows():
    """Only eager asked for, at lengths past eager_max: every cell is skipped and the result has no rows (the
    memory method, set only by a measured cell, was read unbound: UnboundLocalError)."""
    from difftx.benchmarking.long_context import attention_scaling, markdown

    res = attention_scaling([64], preset="nano", dtype="fp32", variants=("eager",), eager_max=32, log=lambda s: None)
    assert res["rows"] == [] and res["growth"] == {} and res["memory_method"] is None
    assert "| N | variant |" in markdown(res)


def test_bench_seq_len_past_learned_positions_makes_no_out_dir(capsys, tmp_path):
    """A --seq-len longer than a learned-position preset allows is refused before --out is created."""
    from difftx.cli import main

    out = tmp_path / "new"
    assert main(["bench", "--out", str(out), "--preset", "nanogpt", "--seq-len", "100000"]) == 2
    lines = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "max_seq_len" in lines[0]
    assert not out.exists()


def test_bench_long_context_on_a_learned_position_preset_ignores_seq_len(tmp_path):
    """--long-context times attention alone at --lengths: the (default 512) --seq-len is not held against the
    preset's learned positions."""
    from difftx.cli import main

    assert main(["bench", "--long-context", "--preset", "nanogpt", "--lengths", "32", "--out", str(tmp_path)]) == 0
    assert {r["n"] for r in json.loads((tmp_path / "long_context.json").read_text())["rows"]} == {32}


def _bench_one_line(capsys, argv) -> str:
    from difftx.cli import main

    assert main(["bench", *map(str, argv)]) == 2
    lines = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("difftx bench: error:"), lines
    return lines[0]


def test_bench_unusable_out_is_one_line(capsys, tmp_path):
    (tmp_path / "file").write_text("keep")
    for out in (tmp_path / "file", tmp_path / "file" / "sub"):
        assert "--out" in _bench_one_line(capsys, ["--quick", "--out", out])
    assert (tmp_path / "file").read_text() == "keep"


def test_bench_keeps_earlier_results_unless_force(capsys, tmp_path, monkeypatch):
    """A second run into the same --out is refused (the first run's files untouched); --force overwrites."""
    from difftx.benchmarking import speed

    for name in ("bench.json", "long_context.json"):
        (tmp_path / name).write_text("earlier")
    quick = ["--out", tmp_path, "--quick", "--arms", "transformer", "--no-peers", "--phases", "prefill",
             "--dtypes", "fp32"]
    assert "--force" in _bench_one_line(capsys, quick)
    assert "--force" in _bench_one_line(capsys, ["--long-context", "--out", tmp_path, "--quick", "--dtypes", "fp32"])
    assert (tmp_path / "bench.json").read_text() == "earlier" and not (tmp_path / "bench.md").exists()
    monkeypatch.setattr(speed, "matmul_peak", lambda *a, **k: 1e9)  # the peak's timing is not under test
    from difftx.cli import main

    assert main(["bench", *map(str, quick), "--force"]) == 0
    assert json.loads((tmp_path / "bench.json").read_text())["arms"]["transformer"]["params"] > 0
    assert (tmp_path / "long_context.json").read_text() == "earlier"  # another mode's results are not bench's


def test_bench_quick_keeps_explicit_values(tmp_path, monkeypatch):
    """--quick's tiny settings fill in what was not given; what was given is benchmarked."""
    import difftx.benchmarking as benchmarking
    from difftx.cli import main
    from difftx.errors import DifftxError

    seen = {}

    def fake_run_bench(bc, log=print):
        seen.update(vars(bc))
        raise DifftxError("stop here")

    monkeypatch.setattr(benchmarking, "run_bench", fake_run_bench)
    assert main(["bench", "--quick", "--out", str(tmp_path), "--repeats", "2", "--preset", "tiny"]) == 2
    assert (seen["repeats"], seen["preset"], seen["seq_len"], seen["threads"]) == (2, "tiny", 32, 1)


def test_bench_bad_flag_through_the_real_cli(cli, tmp_path):
    r = cli("bench", "--out", tmp_path, "--timer", "sundial")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "timer" in r.stderr


def test_bench_adamw_kernel_choice():
    """Every arm steps with the library's default AdamW (fused) unless --foreach-adamw says otherwise."""
    import torch

    from difftx.benchmarking.speed import QUICK, BenchConfig, build_arms
    from difftx.cli import build_parser

    for flag, fused in (([], True), (["--foreach-adamw"], False), (["--fused-adamw"], True)):
        args = build_parser("bench").parse_args(["bench", "--quick", "--out", "unused", *flag])
        bc = BenchConfig(**{**QUICK, "arms": ["transformer", "diff"], "peers": False, "fused_adamw": args.fused_adamw})
        for arm in build_arms(bc, torch.device("cpu")):
            assert bool(arm.optimizer.defaults["fused"]) == fused and bool(arm.optimizer.defaults["foreach"]) != fused


def test_speed_ratio_pairs_the_repeats():
    """A slow spell that hits one arm in one repeat moves one pair, not the ratio (a median of pairs)."""
    from difftx.benchmarking.speed import _ratios, speed_ratio

    t = [1.0, 3.0, 1.0]  # repeat 2 slow for everyone
    d = [1.1, 3.3, 3.3]  # and repeat 3 slow for DIFF alone
    assert speed_ratio(d, t) == pytest.approx(1 / 1.1)
    assert statistics.median(t) / statistics.median(d) == pytest.approx(1 / 3.3)  # what medians would say
    assert speed_ratio([2.0, 4.0], [1.0]) == pytest.approx(1 / 3.0)  # unequal counts: ratio of medians
    arms = {name: {"by_dtype": {"fp32": {"train": {"seconds": s}}}} for name, s in (("transformer", t), ("diff", d))}
    spread = {}
    ratios = _ratios(arms, "fp32", spread)
    assert ratios["diff_over_transformer_train"] == pytest.approx(1 / 1.1)
    assert spread["diff_over_transformer_train"] == pytest.approx([1 / 3.3, 1 / 1.1])


def test_bench_with_both_dtypes_writes_the_alternated_dtype_ratio(tmp_path):
    """fp32 and bf16 together: a last training phase alternates them per arm (ours, not the peers), into
    ``dtype_ratios`` and a table; one dtype alone: no such phase."""
    from difftx.benchmarking.report import markdown
    from difftx.benchmarking.speed import BenchConfig, run_bench

    bc = BenchConfig(preset="nano", seq_len=32, batch_size=2, repeats=2, arms=["transformer", "diff"], peers=False,
                     phases=["train"], dtypes=["fp32", "bf16"], memory=False)
    res = run_bench(bc, log=lambda s: None)
    assert set(res["dtype_ratios"]) == {"transformer", "diff"}
    for r in res["dtype_ratios"].values():
        pairs = [a / b for a, b in zip(r["seconds"]["fp32"], r["seconds"]["bf16"])]
        assert len(pairs) == 2 and r["bf16_over_fp32_train"] == pytest.approx(statistics.median(pairs))
        assert r["range"] == pytest.approx([min(pairs), max(pairs)])
    assert "## bf16 over fp32, training, the dtypes alternated" in markdown(res)
    one = run_bench(BenchConfig(preset="nano", seq_len=32, batch_size=2, repeats=1, arms=["transformer"], peers=False,
                                phases=["train"], dtypes=["fp32"], memory=False), log=lambda s: None)
    assert "dtype_ratios" not in one and "alternated" not in markdown(one)


def test_dtype_ratio_alternates_the_dtypes_and_pairs_each_repeat():
    """bf16 / fp32 from steps run back to back: the order alternates (fp32 first, then bf16 first), arms rotate,
    and the ratio is the median of the pairs, so a machine that slows down between repeats moves nothing."""
    from types import SimpleNamespace

    from difftx.benchmarking.speed import _dtype_pairs

    clock, calls = [0.0], []
    slow = {0: 1.0, 1: 3.0, 2: 1.0, 3: 2.0}  # each repeat's machine speed: both dtypes of a pair share it

    def step(arm, dt):
        calls.append((arm.name, dt))
        repeat = max(0, (len(calls) - 1 - 4) // 4)  # 4 warm-up steps (2 arms x 2 dtypes), then 4 per repeat
        clock[0] += slow[repeat] * (2.0 if dt == "fp32" else 1.0) * (1.5 if arm.name == "diff" else 1.0)

    model = SimpleNamespace(train=lambda: None)
    arms = [SimpleNamespace(name="transformer", model=model), SimpleNamespace(name="diff", model=model)]
    out = _dtype_pairs(arms, 4, 1, step, lambda: clock[0])
    timed = calls[4:]
    assert timed[:4] == [("transformer", "fp32"), ("transformer", "bf16"), ("diff", "fp32"), ("diff", "bf16")]
    assert timed[4:8] == [("diff", "bf16"), ("diff", "fp32"), ("transformer", "bf16"), ("transformer", "fp32")]
    for name in ("transformer", "diff"):
        assert out[name]["bf16_over_fp32_train"] == pytest.approx(2.0)
        assert out[name]["range"] == pytest.approx([2.0, 2.0])
        assert len(out[name]["seconds"]["fp32"]) == len(out[name]["seconds"]["bf16"]) == 4


def test_share_of_peak_is_paired_with_each_repeats_peak():
    """A VM whose matmul speed halves mid-run: the step and the peak slow down together, so the paired
    share stays put where a share against the run's best peak would halve."""
    from difftx.benchmarking.speed import _speed

    times, peaks = [1.0, 2.0, 2.0], [100.0, 50.0, 50.0]  # FLOP/s: 50 then 25, 25
    s = _speed(times, tokens=10, flops_per_tok=5, round_peaks=peaks)
    assert s["share_of_matmul_peak"] == pytest.approx(0.5)
    # without a peak per repeat (prefill, decode) run_bench sets it at the end, against the run's best peak
    assert "share_of_matmul_peak" not in _speed(times, 10, 5)


def test_peers_only_for_llama_shaped_presets():
    """transformers' Llama / DiffLlama take LLaMA shapes only: a GPT-2-style preset (GELU MLP, learned
    positions) gets no peers instead of unmatched ones."""
    import torch

    from difftx import ModelConfig
    from difftx.benchmarking.speed import QUICK, BenchConfig, build_arms, peers_match

    assert peers_match(ModelConfig.from_preset("small")) and peers_match(ModelConfig.from_preset("nano"))
    assert not peers_match(ModelConfig.from_preset("nanogpt")) and not peers_match(ModelConfig.from_preset("gpt2-124m"))
    bc = BenchConfig(**{**QUICK, "preset": "nanogpt", "arms": ["transformer"], "peers": True})
    bc.validate()
    assert [a.name for a in build_arms(bc, torch.device("cpu"))] == ["transformer"]


def test_a_peer_that_cannot_be_built_is_left_out_with_a_warning(monkeypatch):
    """A transformers version whose Llama / DiffLlama API moved made the whole bench a traceback; the peer is
    left out with one warning line and the run goes on."""
    pytest.importorskip("transformers")
    import torch

    from difftx.benchmarking import speed

    def broken(name, cfg):
        if name == "hf-diffllama":
            raise TypeError("DiffLlamaConfig.__init__() got an unexpected keyword argument 'x'")
        return real(name, cfg)

    real = speed._hf_model
    monkeypatch.setattr(speed, "_hf_model", broken)
    bc = speed.BenchConfig(**{**speed.QUICK, "arms": ["transformer", "diff"], "peers": True})
    bc.validate()
    lines = []
    arms = speed.build_arms(bc, torch.device("cpu"), lines.append)
    assert [a.name for a in arms] == ["transformer", "diff", "hf-llama"]
    assert len(lines) == 1 and "hf-diffllama could not be built here (TypeError" in lines[0], lines


@pytest.mark.parametrize("native", [True, False])
def test_bench_auto_dtypes_follow_the_bf16_hardware(monkeypatch, native):
    """``auto`` (the default) benchmarks bf16 only where matmuls run it in hardware; named dtypes stay."""
    import torch

    from difftx.benchmarking import speed

    monkeypatch.setattr(speed, "native_bf16_matmul", lambda device: native)
    cpu = torch.device("cpu")
    assert speed.resolve_dtypes(["auto"], cpu) == (["fp32", "bf16"] if native else ["fp32"])
    assert speed.resolve_dtypes(["bf16", "auto"], cpu) == (["bf16", "fp32"])
    assert speed.resolve_dtypes(["fp32", "fp32"], cpu) == ["fp32"]
    assert speed.BenchConfig().dtypes == ["auto"]


def test_matmul_peak_size_stops_growing_when_a_matmul_gets_slow():
    """The peak's matmul grows from 256 by doubling while 8x one matmul fits the budget (a fake clock)."""
    import torch

    from difftx.benchmarking.speed import PEAK_BUDGET_S, matmul_peak

    def clock(step):
        t = [0.0]

        def now():
            t[0] += step  # one matmul between two readings: it "takes" step seconds
            return t[0]
        return now

    slow = 1.0  # every matmul "takes" 1 s: 8 s > the budget, so the 256 matmul is the measure
    assert 8 * slow > PEAK_BUDGET_S
    assert matmul_peak(torch.float32, torch.device("cpu"), n=1024, repeats=2, timer=clock(slow), workers=1) \
        == pytest.approx(2 * 256 ** 3 / slow)
    fast = 1e-4  # fits: it grows to n
    assert matmul_peak(torch.float32, torch.device("cpu"), n=1024, repeats=2, timer=clock(fast), workers=1) \
        == pytest.approx(2 * 1024 ** 3 / fast)


@pytest.fixture
def _torchs_gemm_only(monkeypatch):
    """The peak read from torch's matmul alone (as everywhere but float32 where difftx runs it on oneDNN)."""
    import torch

    from difftx.benchmarking import speed

    monkeypatch.setattr(speed, "_peak_products", lambda dtype, device: [torch.matmul])


def test_matmul_peak_is_the_fastest_size_not_the_largest(_torchs_gemm_only):
    """Every size is timed and the best rate counts: a (fake) clock on which 512^3 is the fastest size."""
    import torch

    from difftx.benchmarking.speed import matmul_peak

    seconds = {256: [2e-3, 1e-3], 512: [3e-3, 1e-3], 1024: [1e-2, 2e-2]}  # per size, its two timed matmuls
    spans = [s for size in (256, 512, 1024) for s in seconds[size]]
    t, calls = [0.0], [0]

    def clock():  # readings come in (start, end) pairs, one pair per timed matmul
        if calls[0] % 2:
            t[0] += spans[calls[0] // 2]
        calls[0] += 1
        return t[0]

    peak = matmul_peak(torch.float32, torch.device("cpu"), n=1024, repeats=2, timer=clock, workers=1)
    assert calls[0] == 2 * len(spans)  # every size timed, repeats times each
    assert peak == pytest.approx(2 * 512 ** 3 / 1e-3)  # 512's best; 1024's best is 2 * 1024^3 / 1e-2, lower


def test_matmul_peak_counts_one_thread_matmuls_run_at_once(monkeypatch, _torchs_gemm_only):
    """With workers > 1 every size reached is also timed as that many one-thread matmuls at once, and the
    better rate counts (the concurrent timing faked here; the single matmuls on a fake clock)."""
    import torch

    from difftx.benchmarking import speed

    sizes = []

    def concurrent(dtype, size, workers, repeats, timer, per_round, product):
        sizes.append(size)
        return 1e-3 if size == 512 else 1.0  # per matmul: 512 at once is the best rate

    monkeypatch.setattr(speed, "_concurrent_matmul_time", concurrent)
    step = 1e-2  # every single matmul "takes" 10 ms: it grows to n (8 x 10 ms fits the budget)
    t = [0.0]

    def clock():  # step seconds between two readings
        t[0] += step
        return t[0]

    peak = speed.matmul_peak(torch.float32, torch.device("cpu"), n=1024, repeats=2, timer=clock, workers=3)
    assert sizes == [256, 512, 1024]
    assert peak == pytest.approx(3 * 2 * 512 ** 3 / 1e-3)
    sizes.clear()
    slow = speed.matmul_peak(torch.float32, torch.device("cpu"), n=1024, repeats=2, timer=clock, workers=1)
    assert sizes == [] and slow == pytest.approx(2 * 1024 ** 3 / step)  # one worker: single matmuls only


def test_a_float32_peak_on_a_onednn_cpu_is_the_best_of_both_gemms(monkeypatch):
    """Where difftx runs float32 products on oneDNN, the float32 peak times torch's matmul and oneDNN's product at
    every size (a fake clock: torch's take 4 ms, oneDNN's 1 ms), and the faster counts; bf16 times torch's only."""
    import operator

    import torch

    from difftx.benchmarking import speed
    from difftx.nn import linear

    monkeypatch.setattr(linear, "ONEDNN_FP32", True)
    monkeypatch.setattr(linear, "_onednn", lambda a, w, b=None, add=None: ("dnn", a, w))
    real = torch.matmul
    current = ["torch"]

    def fake_torch(a, b):
        current[0] = "torch"
        return real(a[:1, :1], b[:1, :1])

    def fake_dnn_product(a, b):
        current[0] = "dnn"

    products = speed._peak_products(torch.float32, torch.device("cpu"))
    assert len(products) == 2 and products[0] is operator.matmul
    assert products[1](torch.ones(2, 2), torch.ones(2, 2))[0] == "dnn"
    assert speed._peak_products(torch.bfloat16, torch.device("cpu")) == [operator.matmul]
    monkeypatch.setattr(speed, "_peak_products", lambda dtype, device: [fake_torch, fake_dnn_product])
    t, start = [0.0], [None]

    def clock():  # readings in (start, end) pairs; the span is that of the product last called
        if start[0] is None:
            start[0] = t[0]
        else:
            t[0] += 4e-3 if current[0] == "torch" else 1e-3
            start[0] = None
        return t[0]

    peak = speed.matmul_peak(torch.float32, torch.device("cpu"), n=512, repeats=2, timer=clock, workers=1)
    assert peak == pytest.approx(2 * 512 ** 3 / 1e-3)


def test_concurrent_matmul_time_rounds_and_threads():
    """Each timed round spans releasing the workers to the last one done, over its matmuls per round; torch's
    thread count is 1 inside the workers and restored after (a fake clock: 1 s between readings)."""
    import threading

    import torch

    from difftx.benchmarking.speed import _concurrent_matmul_time

    seen, lock = set(), threading.Lock()
    real_mm = torch.Tensor.__matmul__

    def spy(a, b):
        with lock:
            seen.add((threading.get_ident(), torch.get_num_threads()))
        return real_mm(a, b)

    t, calls = [0.0], [0]

    def clock():
        calls[0] += 1
        t[0] += 1.0
        return t[0]

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.Tensor, "__matmul__", spy)
            best = _concurrent_matmul_time(torch.float32, 1024, 2, 3, clock, per_round=2)
        assert torch.get_num_threads() == 2  # restored
    finally:
        torch.set_num_threads(before)
    assert calls[0] == 2 * 3  # one untimed round, then 3 timed ones, two readings each
    assert best == pytest.approx(1.0 / 2)  # 1 s a round, 2 matmuls per round
    main = threading.get_ident()
    assert len(seen) == 2 and all(tid != main and n == 1 for tid, n in seen)  # two workers, one thread each


def test_concurrent_matmul_time_hands_a_workers_error_back(monkeypatch):
    """A matmul that fails in a worker breaks the barriers: the error comes back to the caller (no hang) and
    torch's thread count is restored."""
    import torch

    from difftx.benchmarking.speed import _concurrent_matmul_time

    def fail(a, b):
        raise RuntimeError("no matmul here")

    before = torch.get_num_threads()
    monkeypatch.setattr(torch.Tensor, "__matmul__", fail)
    with pytest.raises(RuntimeError, match="no matmul here"):
        _concurrent_matmul_time(torch.float32, 256, 2, 2, time.perf_counter)
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("timer, threads, workers", [("wall", 2, 2), ("cpu", 2, 1), ("wall", 1, 1)])
def test_bench_counts_concurrent_matmuls_only_on_a_wall_clock(tmp_path, monkeypatch, timer, threads, workers):
    """The bench asks for the cores' peak (one-thread matmuls at once) only where it can time it: a wall
    clock on a CPU with more than one thread (a process CPU clock reads multi-thread spans short)."""
    from difftx.benchmarking import speed
    from difftx.cli import main

    import torch

    asked = []
    monkeypatch.setattr(speed, "matmul_peak", lambda *a, **k: asked.append(k.get("workers", 1)) or 1e9)
    before = torch.get_num_threads()
    try:
        assert main(["bench", "--out", str(tmp_path), "--quick", "--arms", "transformer", "--no-peers", "--phases",
                     "train", "--no-memory", "--dtypes", "fp32", "--timer", timer, "--threads", str(threads)]) == 0
    finally:
        torch.set_num_threads(before)
    assert asked and set(asked) == {workers}
    header = (tmp_path / "bench.md").read_text()
    assert ("one-thread ones at once" in header) == (workers > 1)


@pytest.mark.slow
def test_bench_compiled_arms_compute_the_eager_loss_and_record_it(tmp_path):
    """--compile: each arm's training forward goes through torch.compile (the peers' too) and gives its eager loss
    and gradients; decoding calls the model itself; bench.json and bench.md say it was compiled (~90 s)."""
    import torch

    from difftx.benchmarking import BenchConfig, markdown, run_bench
    from difftx.benchmarking.speed import build_arms

    bc = BenchConfig(preset="nano", seq_len=32, batch_size=2, arms=["transformer", "diff"], peers=False,
                     compile=True, decode_tokens=4)
    bc.validate()
    x = torch.randint(0, 64, (2, 32))
    for arm, eager in zip(build_arms(bc, torch.device("cpu")),
                          build_arms(BenchConfig(preset="nano", seq_len=32, batch_size=2, arms=["transformer", "diff"],
                                                 peers=False), torch.device("cpu"))):
        assert arm.forward is not arm.model and eager.forward is eager.model
        losses = []
        for a in (arm, eager):
            loss = a.loss(x, x.roll(-1, 1))
            loss.backward()
            losses.append((loss.item(), [p.grad.clone() for p in a.model.parameters()]))
        assert losses[0][0] == pytest.approx(losses[1][0], rel=1e-5, abs=1e-6), arm.name
        for g1, g2 in zip(losses[0][1], losses[1][1]):
            torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-5)
    res = run_bench(BenchConfig(preset="nano", seq_len=32, batch_size=2, repeats=1, arms=["transformer", "diff"],
                                peers=False, dtypes=["fp32"], decode_tokens=4, compile=True, memory=False),
                    log=lambda s: None)
    assert res["bench_config"]["compile"] is True and res["ratios"]["diff_over_transformer_train"] > 0
    assert "Compiled (`torch.compile`) for training and prefill" in markdown(res)


def test_cpu_timer_is_refused_on_a_gpu(monkeypatch):
    """--timer cpu reads the process's CPU time, which a GPU's asynchronous kernels do not take (nothing synchronises
    with it): a CUDA run timed the launches, and the matmul peak of 10 launched products came out absurd."""
    import torch

    from difftx.benchmarking import speed
    from difftx.errors import ConfigError

    monkeypatch.setattr(speed, "resolve_device", lambda device: torch.device("cuda"))
    with pytest.raises(ConfigError, match="timer"):
        speed.BenchConfig(preset="nano", device="cuda", timer="cpu").validate()
    speed.BenchConfig(preset="nano", device="cuda", timer="wall").validate()


def test_a_peer_that_fails_mid_run_is_left_out_of_the_rest_with_a_warning(tmp_path, capsys, monkeypatch):
    """A transformers peer built fine but failing in a phase (its generate or cache API moved) ended the whole
    bench in a traceback; it is left out of that phase and the rest with one warning, and the report is written."""
    pytest.importorskip("transformers")
    from difftx.benchmarking import speed
    from difftx.cli import main

    real = speed.Arm.decode

    def decode(self, *a, **k):
        if self.name == "hf-diffllama":
            raise AttributeError("'DynamicCache' object has no attribute 'seen_tokens'")
        return real(self, *a, **k)

    monkeypatch.setattr(speed.Arm, "decode", decode)
    monkeypatch.setattr(speed, "matmul_peak", lambda *a, **k: 1e9)  # the peak's timing is not under test
    args = ["bench", "--out", str(tmp_path), "--quick", "--arms", "transformer,diff", "--dtypes", "fp32"]
    assert main(args) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "hf-diffllama failed in the fp32 decode phase (AttributeError" in warnings[0], err
    res = json.loads((tmp_path / "bench.json").read_text())
    rows = res["arms"]["hf-diffllama"]["by_dtype"]["fp32"]
    assert "train" in rows and "prefill" in rows and "decode" not in rows
    assert all("decode" in res["arms"][name]["by_dtype"]["fp32"] for name in ("transformer", "diff", "hf-llama"))
    assert "diff_over_hf_diffllama_train" in res["ratios"] and "diff_over_hf_diffllama_decode" not in res["ratios"]
    assert "hf-diffllama failed in the fp32 decode phase (AttributeError: " in (tmp_path / "bench.md").read_text()
    assert res["arms"]["hf-diffllama"]["failed"]["phase"] == "fp32 decode"


def test_arms_are_their_kinds_whatever_the_presets_kind():
    """A DIFF preset (--preset diff-830m) made the 'transformer' arm the preset itself, a DIFF model, and the
    'dnt' arm DIFF inside DNT (transformers' Llama peer was built at DIFF's shapes too): every ratio 'over
    transformer' compared DIFF with itself.  Each arm is now its kind, the preset's matched twin."""
    from difftx import ModelConfig
    from difftx.benchmarking.speed import ARMS

    kinds = {"transformer": "softmax", "diff": "diff", "diff2": "diff2", "dnt": "softmax", "diff-dnt": "diff"}
    for preset in ("diff-830m", "transformer-830m", "small"):
        for name, overrides in ARMS.items():
            cfg = ModelConfig.from_preset(preset, **overrides)
            assert cfg.attention == kinds[name], (preset, name)
            assert cfg.norms == ("dnt" if "dnt" in name else "S1"), (preset, name)
    twin = ModelConfig.from_preset("diff-830m", **ARMS["transformer"])
    assert twin == ModelConfig.from_preset("transformer-830m").replace(preset="diff-830m")


def test_a_bench_write_that_fails_midway_keeps_the_earlier_pair(tmp_path, monkeypatch, full_disk, capsys):
    """bench.json and bench.md (long_context.json and .md) were written one after the other: a full disk (or Ctrl-C)
    between them, under --force, left this run's JSON beside the earlier run's table.  Both or neither now."""
    from difftx.benchmarking import long_context, report
    from difftx.cli import main

    monkeypatch.setattr(report, "markdown", lambda results: f"table of run {results['run']}\n")
    report.write_results({"run": 1}, tmp_path)
    restore = full_disk()  # the second file (the table) hits a full disk
    with pytest.raises(OSError, match="No space"):
        report.write_results({"run": 2}, tmp_path)
    restore()
    assert json.loads((tmp_path / "bench.json").read_text()) == {"run": 1}
    assert (tmp_path / "bench.md").read_text() == "table of run 1\n"

    runs = iter(range(1, 3))
    monkeypatch.setattr(long_context, "attention_scaling", lambda lengths, **kw: {"run": next(runs)})
    monkeypatch.setattr(long_context, "markdown", lambda result, command=None: f"table of run {result['run']}\n")
    argv = ["bench", "--long-context", "--quick", "--lengths", "64", "--dtypes", "fp32", "--out", str(tmp_path)]
    assert main(argv) == 0
    restore = full_disk()
    assert main([*argv, "--force"]) == 2
    restore()
    assert json.loads((tmp_path / "long_context.json").read_text())["run"] == 1
    assert (tmp_path / "long_context.md").read_text() == "table of run 1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "bench.md", "long_context.json",
                                                          "long_context.md"]


def test_bench_restores_the_callers_thread_count(tmp_path, monkeypatch):
    """run_bench(threads=N) and bench --long-context --threads N set torch's thread count and left it in the calling
    process; each runs on its count and the caller's comes back after it, returned or raised."""
    import torch

    from difftx.benchmarking import long_context, speed
    from difftx.cli import main
    from difftx.errors import ConfigError

    seen = []

    def stop(*args, **kwargs):
        seen.append(torch.get_num_threads())
        raise ConfigError("stop", "here")

    monkeypatch.setattr(speed, "build_arms", stop)
    monkeypatch.setattr(long_context, "attention_scaling", stop)
    torch.set_num_threads(2)  # the caller's (the autouse fixture restores the test process's own)
    with pytest.raises(ConfigError, match="here"):
        speed.run_bench(speed.BenchConfig(preset="nano", seq_len=32, batch_size=2, decode_tokens=4, threads=1),
                        log=lambda s: None)
    assert seen == [1] and torch.get_num_threads() == 2
    assert main(["bench", "--long-context", "--quick", "--lengths", "32", "--threads", "1",
                 "--out", str(tmp_path)]) == 2
    assert seen == [1, 1] and torch.get_num_threads() == 2


def test_a_gpu_bench_names_the_diff_formulation_it_ran(monkeypatch):
    """On CUDA the environment records, per dtype, what DIFF attention took under auto (the Triton kernels or two
    SDPA calls), and the report's header says it: GPU tables are read against it."""
    import torch

    from difftx.benchmarking import speed
    from difftx.benchmarking.report import markdown
    from difftx.benchmarking.speed import BenchConfig, run_bench
    from difftx.nn import triton_diff

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "H200 (mocked)")
    monkeypatch.setattr(triton_diff, "available", lambda device: True)
    env = speed.environment(torch.device("cuda"))
    assert env["diff_attention"] == {"fp32": "2call", "bf16": "triton"}
    # float32 takes the kernels at the small preset's 4 x 512 (4 heads), 2call at 16 x 2048
    assert speed.environment(torch.device("cuda"), work=4 * 4 * 512 * 512)["diff_attention"]["fp32"] == "triton"
    assert speed.environment(torch.device("cuda"), work=16 * 4 * 2048 * 2048)["diff_attention"]["fp32"] == "2call"
    res = run_bench(BenchConfig(preset="nano", seq_len=32, batch_size=2, repeats=1, arms=["transformer"],
                                peers=False, phases=["train"], dtypes=["fp32"], memory=False), log=lambda s: None)
    assert "DIFF attention" not in markdown(res)  # the CPU: no such line
    res["environment"] = dict(res["environment"], diff_attention=env["diff_attention"])
    assert "DIFF attention: 2call (fp32), triton (bf16)." in markdown(res)
    monkeypatch.setattr(triton_diff, "available", lambda device: False)
    assert speed.environment(torch.device("cuda"))["diff_attention"]["bf16"] == "2call"


def test_diff_attention_names_the_diff_arms_formulation(tmp_path, monkeypatch, capsys):
    """--diff-attention VARIANT: the diff and diff-dnt arms run that formulation (the others keep their own), the
    results record it, and a name no arm can take is one line and exit 2, before anything is written."""
    import torch

    from difftx.benchmarking import speed
    from difftx.cli import main
    from difftx.nn import backends

    seen = []
    real = backends.diff_sdpa
    monkeypatch.setattr(backends, "diff_sdpa", lambda *a, **k: seen.append(a[-1]) or real(*a, **k))
    assert main(["bench", "--quick", "--arms", "transformer,diff,diff2", "--phases", "prefill", "--dtypes", "fp32",
                 "--no-peers", "--diff-attention", "4call", "--out", str(tmp_path / "a")]) == 0
    assert seen and set(seen) == {"4call"}  # DIFF took two 4call SDPA pairs; V2 and the Transformer their own paths
    res = json.loads((tmp_path / "a" / "bench.json").read_text())
    assert res["bench_config"]["diff_attention"] == "4call"
    assert res["environment"]["diff_attention"] == {"fp32": "4call", "bf16": "4call"}
    assert "DIFF attention (--diff-attention): 4call (fp32), 4call (bf16)." in (tmp_path / "a" / "bench.md").read_text()
    arms = speed.build_arms(speed.BenchConfig(preset="nano", arms=["transformer", "diff-dnt"], peers=False,
                                              diff_attention="2call"), torch.device("cpu"))
    assert [{m.diff_variant for m in a.model.attention_modules()} for a in arms] == [{"auto"}, {"2call"}]
    seen.clear()
    assert main(["bench", "--quick", "--arms", "transformer,diff", "--phases", "prefill", "--dtypes", "fp32",
                 "--no-peers", "--out", str(tmp_path / "b")]) == 0
    assert seen == []  # auto on the CPU: the fused kernel
    capsys.readouterr()
    for bad, what in ((["--diff-attention", "tritn"], "unknown DIFF attention formulation 'tritn'"),
                      (["--arms", "transformer,dnt", "--diff-attention", "2call"], "has neither")):
        assert main(["bench", "--quick", *bad, "--out", str(tmp_path / "c")]) == 2
        err = capsys.readouterr().err
        assert what in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "c").exists()
