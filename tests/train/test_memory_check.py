"""The training-memory floor and the check built on it (difftx.train.memory_check).

The floor must never exceed what a training step really takes (else a run that fits would be refused),
and must not be vacuous (TYPICAL x the floor covers the measured peaks, the premise of the warning);
runs whose floor does not fit are refused in one line before anything is written.
"""

import pytest
import torch

from difftx.accounting import training_memory_floor
from difftx.benchmarking.memory import measured_training_memory
from difftx.config import ModelConfig
from difftx.errors import InsufficientMemory
from difftx.runtime import linux_free_memory
from difftx.train import memory_check

from ..conftest import needs_muon

GIB = 2 ** 30


@pytest.mark.parametrize("preset, changes, batch, seq, optimizer, bf16", [
    ("nano", {}, 12, 64, "adamw", False),
    ("nano", {"attention": "diff"}, 4, 256, "adamw", False),
    ("nano", {"attention": "diff2"}, 2, 512, "sgd", False),
    ("nano", {"attention": "diff", "norms": "dnt"}, 2, 512, "msgdw", False),
    pytest.param("nano", {"attention": "diff", "ffn_dim": 32}, 2, 256, "muon", False, marks=needs_muon),
    ("nano", {"attention": "diff"}, 4, 64, "adamw", True),
    ("nano", {"attention": "diff2", "attn_backend": "eager"}, 2, 256, "adamw", False),
    ("nanogpt", {}, 12, 64, "adamw", False),
    ("vdnt-tiny", {"attention": "diff"}, 32, 0, "msgdw", False),
])
def test_floor_is_below_the_measured_peak_and_within_typical(preset, changes, batch, seq, optimizer, bf16):
    cfg = ModelConfig.from_preset(preset, **changes, **({"max_seq_len": seq} if seq else {}))
    floor = training_memory_floor(cfg, batch, seq, optimizer, bf16=bf16)
    got = measured_training_memory(cfg, batch, seq, optimizer, bf16)
    assert floor["state"] <= got["state"] and floor["step"] <= got["step"], (floor, got)
    assert got["total"] <= memory_check.TYPICAL * floor["total"], (floor, got)


def test_the_floor_stays_below_the_peak_with_a_chunked_loss_and_a_large_vocabulary():
    """Logits dominate here; --loss-chunk takes them out of the peak, and out of the floor, together."""
    cfg = ModelConfig.from_preset("nano", attention="diff", vocab_size=8192)
    for chunk in (0, 64):
        floor = training_memory_floor(cfg, 4, 256, "adamw", loss_chunk=chunk)
        got = measured_training_memory(cfg, 4, 256, "adamw", loss_chunk=chunk)
        assert floor["state"] <= got["state"] and floor["step"] <= got["step"], (chunk, floor, got)
        assert got["total"] <= memory_check.TYPICAL * floor["total"], (chunk, floor, got)
        if chunk:
            assert got["step"] < 0.5 * full["step"], (got, full)  # the logits were most of the step
        full = got
    assert training_memory_floor(cfg, 4, 256, loss_chunk=64)["activations"] == \
        training_memory_floor(cfg, 4, 256)["activations"] - (4 * 256 - 64) * 2 * 8192 * 4


@pytest.mark.parametrize("changes", [{"attention": "diff"}, {"attention": "softmax", "attn_backend": "eager"}])
def test_the_floor_stays_below_the_peak_with_activation_checkpointing(changes):
    """--activation-checkpointing N leaves a recomputed block only its input until backward: the floor counts that
    (and no attention maps for it), stays under the measured peak, and still covers it within TYPICAL."""
    cfg = ModelConfig.from_preset("nano", **changes, max_seq_len=256)
    floors = {}
    for every in (0, 2, 1):
        floor = training_memory_floor(cfg, 4, 256, "adamw", activation_checkpointing=every)
        got = measured_training_memory(cfg, 4, 256, "adamw", activation_checkpointing=every)
        assert floor["state"] <= got["state"] and floor["step"] <= got["step"], (every, floor, got)
        assert got["total"] <= memory_check.TYPICAL * floor["total"], (every, floor, got)
        floors[every] = floor["activations"]
    assert floors[1] < floors[2] < floors[0], floors


def test_floor_counts_what_it_says():
    cfg = ModelConfig.from_preset("nano")
    p = training_memory_floor(cfg, 1, 64)["parameters"]
    adamw, sgd0 = training_memory_floor(cfg, 8, 64, "adamw"), training_memory_floor(cfg, 8, 64, "sgd", momentum=0)
    assert adamw["state"] == 12 * p and sgd0["state"] == 4 * p  # weights + 2 AdamW moments; plain SGD: weights
    assert training_memory_floor(cfg, 8, 64, "adamw", shards=4)["state"] == 3 * p
    act = training_memory_floor(cfg, 8, 64)["activations"]
    assert training_memory_floor(cfg, 16, 64)["activations"] == 2 * act  # linear in the batch ...
    assert training_memory_floor(cfg.replace(max_seq_len=128), 8, 128)["activations"] == 2 * act  # ... and length
    assert training_memory_floor(cfg, 8, 64, bf16=True)["activations"] == act // 2
    diff = ModelConfig.from_preset("nano", attention="diff")
    sdpa = training_memory_floor(diff, 8, 64)["activations"]
    eager = training_memory_floor(diff.replace(attn_backend="eager"), 8, 64)["activations"]
    maps = 2 * diff.n_heads  # two per DIFF head
    assert eager == sdpa + 4 * 8 * maps * 64 * 64 * 4  # + layers x batch x maps x N^2, fp32


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_free_memory_reads_meminfo_and_a_cgroup_limit(tmp_path):
    meminfo, cg = tmp_path / "meminfo", tmp_path / "cgroup"
    _write(meminfo, "MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\nSwapFree:        1000000 kB\n")
    assert linux_free_memory(str(meminfo), str(cg)) == 21_000_000 * 1024  # no cgroup files: the host
    _write(cg / "memory.max", "max\n")
    _write(cg / "memory.current", "123\n")
    assert linux_free_memory(str(meminfo), str(cg)) == 21_000_000 * 1024  # v2 without a limit
    _write(cg / "memory.max", str(8 * GIB))  # v2: 8 GiB limit, 5 GiB used of which 2 GiB page cache
    _write(cg / "memory.current", str(5 * GIB))
    _write(cg / "memory.stat", f"anon {3 * GIB}\nfile {2 * GIB}\n")
    assert linux_free_memory(str(meminfo), str(cg)) == 5 * GIB
    v1 = tmp_path / "v1"
    _write(v1 / "memory" / "memory.limit_in_bytes", str(4 * GIB))
    _write(v1 / "memory" / "memory.usage_in_bytes", str(3 * GIB))
    _write(v1 / "memory" / "memory.stat", f"cache {GIB}\nrss {2 * GIB}\ntotal_cache {GIB}\n")
    assert linux_free_memory(str(meminfo), str(v1)) == 2 * GIB
    _write(meminfo, "MemTotal: 1 kB\n")
    assert linux_free_memory(str(meminfo), str(cg)) is None  # no MemAvailable: unknown, nothing is refused


@pytest.fixture
def free(monkeypatch):
    """Set the CPU's free memory the check sees: ``free(bytes)``."""
    def set_free(n):
        monkeypatch.setattr(memory_check, "free_memory", lambda device: n)
    return set_free


def test_train_refuses_a_run_that_cannot_fit_and_writes_nothing(tmp_path, train_cli, capsys, free, monkeypatch):
    free(1 << 20)  # 1 MiB: the tiny model's weights alone (~0.2 MiB with AdamW) fit, its batch of 4 x 16 does not
    out = tmp_path / "run"
    assert train_cli("--steps", 2, "--batch-size", 64, "--out", out) == 2
    err = capsys.readouterr().err
    assert err.startswith("difftx train: error: not enough memory: this run needs at least") and err.count("\n") == 1
    assert "lower --batch-size" in err and "DIFFTX_MEMORY_CHECK=0" in err and "1,024 tokens per micro-batch" in err
    assert "--activation-checkpointing 1" in err  # the advice it can take
    assert not out.exists()
    assert train_cli("--steps", 2, "--batch-size", 64, "--activation-checkpointing", 1, "--out", out) == 2
    err = capsys.readouterr().err  # already taken: not advised again; its floor is lower, and still too much here
    assert "not enough memory" in err and "--activation-checkpointing" not in err and not out.exists()
    free(1000)  # not even the weights: a smaller model is the advice
    assert train_cli("--steps", 2, "--out", out) == 2
    assert "pick a smaller model" in capsys.readouterr().err and not out.exists()
    monkeypatch.setenv("DIFFTX_MEMORY_CHECK", "0")  # the way out the message names
    assert train_cli("--steps", 2, "--eval-every", 0, "--out", out) == 0
    assert (out / "config.json").is_file()


def test_a_step_whose_samples_cannot_fit_is_refused_before_anything_is_written(tmp_path, train_cli, capsys, free):
    """A step draws all its micro-batches' samples before the first one runs: --grad-accum 10^11 asked numpy for
    TiBs there and crashed with a traceback (past the model's floor, which counts one micro-batch)."""
    free(1 << 30)  # the tiny model and its micro-batch fit
    out = tmp_path / "run"
    assert train_cli("--steps", 2, "--grad-accum", 10 ** 11, "--out", out) == 2
    err = capsys.readouterr().err
    assert err.startswith("difftx train: error: not enough memory: a step draws all its 400,000,000,000 sequences") \
        and err.count("\n") == 1, err
    assert "lower --grad-accum or --global-batch" in err and not out.exists()


def test_a_resume_that_cannot_fit_changes_nothing(tmp_path, train_cli, capsys, free):
    out = tmp_path / "run"
    assert train_cli("--steps", 2, "--eval-every", 0, "--out", out) == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    free(1000)
    assert train_cli("--steps", 4, "--eval-every", 0, "--resume", "auto", "--out", out) == 2
    assert "not enough memory" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_train_warns_when_only_the_floor_fits(tmp_path, train_cli, capsys, free, monkeypatch):
    run_floor = memory_check.run_floor

    def floor_with_room_for_1_2x(*args, **kwargs):  # the run's own floor: free memory 1.2x it
        floor = run_floor(*args, **kwargs)
        free(int(1.2 * floor["total"]))
        return floor

    monkeypatch.setattr(memory_check, "run_floor", floor_with_room_for_1_2x)
    assert train_cli("--steps", 1, "--eval-every", 0, "--out", tmp_path / "run") == 0
    err = capsys.readouterr().err
    assert "difftx train: warning: this run needs at least" in err and "may run out of memory" in err


def test_a_gpu_reads_the_drivers_free_memory_and_advises_sharding(monkeypatch):
    """No GPU here: the CUDA branch is run against a stand-in driver."""
    import torch

    from difftx import runtime

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: asked.append(device) or (3 * GIB, 80 * GIB))
    assert runtime.free_memory("cuda:1") == 3 * GIB and asked == [torch.device("cuda:1")]
    monkeypatch.setattr(memory_check, "free_memory", runtime.free_memory)
    floor = {"total": 5 * GIB, "state": 4 * GIB, "gradients": GIB, "activations": GIB, "tokens": 2048}
    with pytest.raises(InsufficientMemory, match=r"on cuda:1 .*pick a smaller model, or shard it over more GPUs "
                                                 r"with --parallel fsdp"):
        memory_check.require_fit(floor, "cuda:1", "this run", "lower --batch-size", copies=1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert runtime.free_memory("cuda:0") is None  # unknown: nothing is refused
    assert memory_check.require_fit(floor, "cuda:0", "this run", "lower --batch-size") is None


def test_multi_process_cpu_runs_count_together(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert memory_check.host_processes("cpu") == 4
    assert memory_check.host_processes("cuda:0") == 1  # each rank its own GPU
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert memory_check.host_processes("cpu") == 1


# ----------------------------------------------------------------------------- compare
@pytest.fixture
def compare(capsys):
    from difftx.cli import main

    def run(*args):
        capsys.readouterr()
        code = main(["compare", *map(str, args)])
        return code, capsys.readouterr().err
    return run


def _study(**fields):
    """A two-arm study and the floor of its largest job (in the precision its jobs get on this CPU: ``auto`` is
    bf16 where the CPU has bf16 matrix hardware, whose floor is lower)."""
    from difftx.compare import StudyConfig
    from difftx.compare.jobs import plan, train_config
    from difftx.train.trainer import autocast_dtype

    study = StudyConfig(arms=["transformer:adamw", "diff:adamw"], seeds=1, retrieval="none", **fields)
    cfgs = [(study.model_config(j.arm, j.task), train_config(study, j)) for j in plan(study)]
    floor = max(memory_check.run_floor(m, t, autocast_dtype(t.dtype, torch.device("cpu")) is not None)["total"]
                for m, t in cfgs)
    return study, floor


STUDY = ["--arms", "transformer:adamw,diff:adamw", "--seeds", "1", "--set", "n_layers=1", "--set", "d_model=32",
         "--steps", "2", "--retrieval", "none", "--eval-points", "1", "--eval-batches", "1", "--outlier-tokens", "64",
         "--tail-batches", "2", "--no-progress"]


def test_compare_refuses_a_study_whose_job_cannot_fit(tmp_path, compare, free):
    free(1 << 20)
    code, err = compare("--out", tmp_path / "out", *STUDY, "--batch-size", 64)
    assert code == 2 and err.count("\n") == 1
    assert "not enough memory: the study's largest job" in err and "lower --batch-size or --seq-len" in err
    assert not (tmp_path / "out").exists()


def test_compare_jobs_are_not_checked_again_one_by_one(tmp_path, compare, monkeypatch):
    """The study checked every job up front, with its parallel jobs; a job's own check would see the memory of
    the jobs beside it and could stop the study midway with advice in difftx train's flags."""
    import difftx.train.run as run

    def no_second_check(*args, **kwargs):
        raise AssertionError("a compare job ran the per-run memory check")

    monkeypatch.setattr(run, "check_run", no_second_check)
    code, err = compare("--out", tmp_path / "out", *STUDY, "--workers", 1)
    assert code == 0, err
    assert len(list((tmp_path / "out").rglob("job.json"))) == 2


def test_compare_runs_fewer_jobs_at_once_when_all_would_not_fit(free):
    from difftx.compare.runner import fit_in_memory
    from difftx.train.distributed import World

    study, floor = _study()
    free(int(5 * floor))  # room for 2 jobs at TYPICAL (2) x their floor, not for 4
    assert fit_in_memory(study, 4, World()) == (2, True, None)
    assert fit_in_memory(study, 2, World()) == (2, False, None)
    asked, _ = _study(workers=4)  # asked for: 4 floors fit, so 4 run, with a warning
    workers, lowered, warning = fit_in_memory(asked, 4, World())
    assert (workers, lowered) == (4, False) and "4 processes at once" in warning and "lower --workers" in warning
    asked, _ = _study(workers=8)  # 8 floors do not fit: refused, not lowered
    with pytest.raises(InsufficientMemory, match="lower --workers"):
        fit_in_memory(asked, 8, World())


def test_every_process_of_a_torchrun_stops_on_rank0s_verdict(tmp_path, corpus, cache):
    """Two CPU processes: rank 0 decides and both stop, each with the line (a rank left waiting at a barrier would
    hang the run).  Launched as torchrun would, but without its agent, which kills the other processes once one
    has failed: so each process must stop by itself (under torchrun the second line raced that kill: torch 2.7)."""
    import socket
    import subprocess
    import sys

    from ._helpers import cli_env

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "difftx", "train", "--data", str(corpus), "--cache-dir", str(cache), "--tokenizer",
           "char", "--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--seq-len", "16", "--batch-size",
           str(10 ** 8), "--steps", "1", "--device", "cpu", "--no-progress",
           "--out", str(out)]  # a floor of terabytes: refused on any machine
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=cli_env(**env, RANK=str(r), LOCAL_RANK=str(r))) for r in (0, 1)]
    try:
        results = [p.communicate(timeout=240) + (p.returncode,) for p in procs]
    except subprocess.TimeoutExpired:  # a rank left waiting: what each printed
        for p in procs:
            p.kill()
        raise AssertionError([p.communicate()[1][-3000:] for p in procs]) from None
    for rank, (_, err, rc) in enumerate(results):
        assert rc == 2 and err.count("difftx train: error: not enough memory") == 1, (rank, rc, err[-3000:])
        assert "2 processes at once" in err
    assert not out.exists()
