"""Runtime switches: bf16 autocast, the CPU attention policy, graceful stop, forks, padding the vocabulary."""

import json
import os
import signal

import pytest
import torch

import difftx
from difftx import ModelConfig
from difftx.train.trainer import autocast_dtype, training_attention_backend

from ._helpers import losses, tiny


def test_autocast_choice():
    cpu = torch.device("cpu")
    assert autocast_dtype("fp32", cpu) is None and autocast_dtype("bf16", cpu) == torch.bfloat16
    native = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    assert autocast_dtype("auto", cpu) == (torch.bfloat16 if native else None)
    from difftx.runtime import native_bf16_matmul

    assert native_bf16_matmul(cpu) == native


def test_cpu_bf16_training_uses_eager_attention_for_short_sequences():
    cfg = ModelConfig(d_model=32, n_layers=1, n_heads=2)
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    assert training_attention_backend(cfg, cpu, bf16, 64) == "eager"
    assert training_attention_backend(cfg, cpu, bf16, 1024) is None
    assert training_attention_backend(cfg, cpu, None, 64) is None
    assert training_attention_backend(cfg.replace(attn_backend="sdpa"), cpu, bf16, 64) is None


@pytest.mark.parametrize("attention", ["softmax", "diff", "diff2"])
def test_bf16_training_runs_and_learns(tmp_path, corpus, cache, attention):
    from difftx.train import train

    tcfg, mcfg = tiny(corpus, cache, dtype="bf16", steps=12, eval_every=0, diag_every=6)
    summary = train(tcfg, mcfg.twin(attention) if attention != "softmax" else mcfg, tmp_path / "run",
                    announce=None)
    ls = losses(tmp_path / "run")
    assert all(map(lambda x: x == x, ls)) and ls[-1] < ls[0] and summary["val_loss"] < ls[0]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    diag = [r for r in rows if "grad_norms" in r]
    assert [r["step"] for r in diag] == [6, 12] and len(diag[0]["layer_grad_norms"]) == 2
    assert len(diag[0]["lambdas"]) == (0 if attention == "softmax" else 2)
    assert difftx.load_model(tmp_path / "run").parameters().__next__().dtype == torch.float32


@pytest.mark.parametrize("native", [True, False])
def test_explicit_bf16_on_a_cpu_without_bf16_hardware_is_warned(tmp_path, corpus, cache, capsys, monkeypatch, native):
    """``--dtype bf16`` where bf16 matmuls have no hardware (~100x slower than fp32) says so, once; fp32 never does."""
    from difftx.train import run as run_mod
    from difftx.train import train

    monkeypatch.setattr(run_mod, "native_bf16_matmul", lambda device: native)
    for dtype in ("bf16", "fp32"):
        tcfg, mcfg = tiny(corpus, cache, dtype=dtype, steps=1, eval_every=0)
        train(tcfg, mcfg, tmp_path / dtype, announce=lambda line: None)
        err = capsys.readouterr().err
        assert err.count("no bf16 matrix hardware") == (1 if (dtype == "bf16" and not native) else 0), err


def test_sigterm_checkpoints_and_resume_is_exact(tmp_path, corpus, cache):
    from difftx.train import train

    class Kill:
        def on_step_end(self, trainer, row):
            if row["step"] == 3:
                os.kill(os.getpid(), signal.SIGTERM)

    tcfg, mcfg = tiny(corpus, cache, steps=6, eval_every=0)
    summary = train(tcfg, mcfg, tmp_path / "a", callbacks=[Kill()], announce=None)
    assert summary["stopped_by"] == "SIGTERM" and summary["step"] == 3
    assert (tmp_path / "a" / "checkpoints" / "step_00000003").is_dir()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handlers restored
    train(tcfg, mcfg, tmp_path / "a", resume="auto", announce=None)
    train(tcfg, mcfg, tmp_path / "b", announce=None)
    assert losses(tmp_path / "a") == losses(tmp_path / "b")


def test_a_stop_signal_after_an_update_that_made_the_weights_non_finite_saves_nothing(tmp_path, corpus, cache):
    """The weights are checked for non-finite values before a checkpoint at the checkpoint steps, but a stop signal's
    checkpoint (SIGTERM: a preempted job) skipped it: a step whose update overflowed the weights, then a SIGTERM
    before the next step's loss could show it, saved them as the newest checkpoint, which --resume auto takes."""
    from difftx.train import train
    from difftx.train.trainer import TrainingDiverged

    class OverflowThenKill:
        def on_step_end(self, trainer, row):
            if row["step"] == 3:
                with torch.no_grad():
                    next(trainer.model.parameters()).view(-1)[0] = float("inf")
                os.kill(os.getpid(), signal.SIGTERM)

    tcfg, mcfg = tiny(corpus, cache, steps=6, eval_every=0, checkpoint_every=2)
    with pytest.raises(TrainingDiverged, match="non-finite weights after the update of step 3"):
        train(tcfg, mcfg, tmp_path / "a", callbacks=[OverflowThenKill()], announce=None)
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir()) == ["step_00000002"]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handlers restored


def test_threads_hold_for_the_run_and_the_callers_count_comes_back(tmp_path, corpus, cache):
    """train(threads=N) ran torch.set_num_threads(N) and left it: a notebook or server that trained one run with
    --threads 1 then evaluated and generated on one thread for the rest of the process.  The count holds during the
    run and the caller's comes back after it, returned or raised."""
    from difftx.errors import ConfigError
    from difftx.train import train

    seen = []

    class Threads:
        def on_step_end(self, trainer, row):
            seen.append(torch.get_num_threads())

    torch.set_num_threads(2)  # the caller's (tests run on one: the fixture restores it)
    tcfg, mcfg = tiny(corpus, cache, steps=1, eval_every=0, threads=1)
    train(tcfg, mcfg, tmp_path / "a", callbacks=[Threads()], announce=None)
    assert seen == [1] and torch.get_num_threads() == 2
    tcfg, mcfg = tiny(corpus, cache, steps=1, eval_every=0, threads=1, stop_at=5)  # refused after the threads are set
    with pytest.raises(ConfigError, match="stop_at"):
        train(tcfg, mcfg, tmp_path / "b", announce=None)
    assert torch.get_num_threads() == 2


def test_resume_from_a_checkpoint_into_a_new_directory(tmp_path, train_cli):
    assert train_cli("--steps", 4, "--checkpoint-every", 2, "--eval-every", 0, "--out", tmp_path / "a") == 0
    fork = tmp_path / "fork"
    assert train_cli("--steps", 4, "--out", fork, "--resume", tmp_path / "a/checkpoints/step_00000002") == 0
    assert losses(fork, "step") == [1, 2, 3, 4, 4]  # the history up to the fork point is carried over
    assert losses(fork)[:2] == losses(tmp_path / "a")[:2]
    a, b = difftx.load_model(tmp_path / "a").state_dict(), difftx.load_model(fork).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_vocabulary_may_be_padded_up(tmp_path, train_cli):
    assert train_cli("--steps", 1, "--eval-every", 0, "--vocab-size", 64, "--out", tmp_path / "r") == 0
    assert difftx.load_model(tmp_path / "r").config.vocab_size == 64


def test_tensorboard_is_optional(tmp_path, train_cli, capsys):
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        assert train_cli("--steps", 1, "--tensorboard", "--out", tmp_path / "r") == 2
        assert "pip install 'difftx[tensorboard]'" in capsys.readouterr().err
        assert not (tmp_path / "r").exists()
    else:
        assert train_cli("--steps", 1, "--tensorboard", "--out", tmp_path / "r") == 0
        assert any((tmp_path / "r" / "tensorboard").iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["softmax", "diff"])
def test_compile_is_opt_in_and_keeps_clean_keys(tmp_path, corpus, cache, attention):
    """--compile trains the same losses as eager (the fused CPU kernel stays an eager island)."""
    from difftx.train import train

    tcfg, mcfg = tiny(corpus, cache, model={"attention": attention}, steps=3, eval_every=0, compile=True)
    train(tcfg, mcfg, tmp_path / "c", announce=None)
    plain, _ = tiny(corpus, cache, model={"attention": attention}, steps=3, eval_every=0)
    train(plain, mcfg, tmp_path / "p", announce=None)
    assert losses(tmp_path / "c") == pytest.approx(losses(tmp_path / "p"), rel=1e-4)
    keys = difftx.load_model(tmp_path / "c").state_dict().keys()
    assert not any("_orig_mod" in k for k in keys)


@pytest.mark.slow
def test_compile_with_activation_checkpointing(tmp_path, corpus, cache):
    """--compile --activation-checkpointing 1: the compiled graph recomputes the blocks (torch's checkpoint traced
    by dynamo): the losses of eager training within float rounding (the graph partitions differently)."""
    from difftx.train import train

    tcfg, mcfg = tiny(corpus, cache, model={"attention": "diff"}, steps=3, eval_every=0, compile=True,
                      activation_checkpointing=1)
    train(tcfg, mcfg, tmp_path / "c", announce=None)
    plain, _ = tiny(corpus, cache, model={"attention": "diff"}, steps=3, eval_every=0)
    train(plain, mcfg, tmp_path / "p", announce=None)
    assert losses(tmp_path / "c") == pytest.approx(losses(tmp_path / "p"), rel=1e-4)


def test_python_and_numpy_rngs_are_seeded_per_run(tmp_path):
    """Two runs of one seed start Python's and NumPy's global RNGs alike (they were left as the process had them);
    another seed starts them elsewhere."""
    import random

    import numpy as np

    from difftx.train import Domain, TrainConfig, Trainer
    from difftx.train.distributed import World

    def draws(seed):
        cfg = TrainConfig(batch_size=2, steps=1, seq_len=8, dtype="fp32", seed=seed)
        mcfg = ModelConfig(d_model=16, n_layers=1, n_heads=2, vocab_size=32, max_seq_len=8)
        Trainer(mcfg, cfg, Domain(cfg, World()), World(), tmp_path / str(seed), {})
        return random.random(), float(np.random.rand())

    first = draws(3)
    random.random(), np.random.rand()  # what ran between the two runs moved the process's streams
    assert draws(3) == first
    assert draws(4) != first


def test_diagnostic_gradient_norms_are_of_the_gradients_grad_norm_measures(tmp_path, corpus, cache):
    """The per-kind and per-layer gradient norms of a diagnostics row are of the step's gradients before clipping,
    as its grad_norm is: they were taken after clipping, so with --grad-clip 0.01 they all added up to 0.01 beside
    a grad_norm of ~3."""
    import math

    from difftx.train import train

    tcfg, mcfg = tiny(corpus, cache, steps=2, eval_every=0, diag_every=1, grad_clip=0.01)
    train(tcfg, mcfg.twin("diff"), tmp_path / "run", announce=None)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["grad_norm"] > 0.1, r  # clipping acted
        by_kind = math.sqrt(sum(v * v for v in r["grad_norms"].values()))
        assert by_kind == pytest.approx(r["grad_norm"], rel=1e-4), r
        assert all(0 < v < by_kind for v in r["layer_grad_norms"]), r
        # the layers' norms and those of the parameters outside the layers (embedding, final norm) make up the whole
        top = {n for n, _ in difftx.load_model(tmp_path / "run").named_parameters() if not n.startswith("layers.")}
        assert top and top <= set(r["grad_norms"]) and len(r["layer_grad_norms"]) == 2, (top, r)
        whole = sum(v * v for v in r["layer_grad_norms"]) + sum(r["grad_norms"][n] ** 2 for n in top)
        assert math.sqrt(whole) == pytest.approx(r["grad_norm"], rel=1e-4), r


def test_activation_checkpointing_trains_the_same_bits_and_may_change_on_resume(tmp_path, train_cli, capsys):
    """--activation-checkpointing 1 (every block recomputed in backward): the same losses and final weights, bit for
    bit, as without it, with dropout; a run stopped without it may resume with it (a runtime setting, as --threads),
    and gives the same bits again.  A bad value is one line, exit 2, nothing written."""
    common = ["--steps", 4, "--eval-every", 2, "--set", "dropout=0.1"]
    assert train_cli(*common, "--out", tmp_path / "plain") == 0
    assert "recomputing" not in capsys.readouterr().out
    assert train_cli(*common, "--activation-checkpointing", 1, "--out", tmp_path / "ac") == 0
    assert "(none, fp32, recomputing every block) ->" in capsys.readouterr().out  # the start line says so
    assert train_cli(*common, "--stop-at", 2, "--out", tmp_path / "switched") == 0
    assert train_cli(*common, "--activation-checkpointing", 2, "--resume", "auto", "--out", tmp_path / "switched") == 0
    ref = losses(tmp_path / "plain")
    assert len(ref) == 4
    for run in ("ac", "switched"):
        assert losses(tmp_path / run) == ref and losses(tmp_path / run, "val_loss") == losses(tmp_path / "plain",
                                                                                              "val_loss")
        for (k, v), w in zip(difftx.load_model(tmp_path / "plain").state_dict().items(),
                             difftx.load_model(tmp_path / run).state_dict().values()):
            assert torch.equal(v, w), (run, k)
    assert json.loads((tmp_path / "ac" / "config.json").read_text())["train"]["activation_checkpointing"] == 1
    capsys.readouterr()
    assert train_cli("--activation-checkpointing", -1, "--out", tmp_path / "bad") == 2
    err = capsys.readouterr().err
    assert "--activation-checkpointing" in err and "non-negative integer" in err and err.count("\n") == 1, err
    assert not (tmp_path / "bad").exists()
