"""Two CPU processes (gloo) with DDP and with FSDP2 match one process at the same global batch.

One torchrun launch runs DDP, FSDP2 and an FSDP2 stop/resume (sharded checkpoint) so the
process start-up is paid once; the single-process reference runs here.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ._helpers import GradRecorder, losses, run_torchrun_worker, tiny, write_corpus, write_documents



@pytest.fixture(scope="module")
def dist_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    data, cache = write_corpus(tmp / "corpus.txt"), tmp / "cache"
    from difftx.train import train

    # the reference: one process, global batch 8 = 2 micro-batches of 4; 3 validation batches (not a multiple of
    # the 2 processes: the loss must still be over the same 3)
    rec = GradRecorder()
    tcfg, mcfg = tiny(data, cache, batch_size=4, grad_accum=2, eval_batches=3)
    train(tcfg, mcfg, tmp / "single", callbacks=[rec], announce=None)
    # and with document masking, on short documents (the worker's ddp_docs)
    docs = write_documents(tmp / "docs.jsonl")
    rec_docs = GradRecorder()
    tcfg, mcfg = tiny(docs, cache, batch_size=4, grad_accum=2, eval_batches=3, tokenizer="bpe", bpe_vocab_size=300,
                      document_masking=True)
    train(tcfg, mcfg, tmp / "single_docs", callbacks=[rec_docs], announce=None)
    runs = run_torchrun_worker(Path(__file__).parent / "dist_worker.py", data, cache, tmp)
    return runs, tmp, {"": rec.grads, "docs": rec_docs.grads}


@pytest.mark.parametrize("mode", ["ddp", "fsdp", "fsdp_chunked", "ddp_ac", "fsdp_ac", "ddp_docs"])
def test_same_losses_and_gradients_as_one_process(dist_runs, mode):
    """ddp_docs: with --document-masking (each window's documents attend only to themselves)."""
    tmp, ref_dir, refs = dist_runs
    docs = mode.endswith("_docs")
    single, ref_grads = ref_dir / ("single_docs" if docs else "single"), refs["docs" if docs else ""]
    assert losses(tmp / mode) == pytest.approx(losses(single), rel=1e-5, abs=1e-6)
    assert losses(tmp / mode, "val_loss") == pytest.approx(losses(single, "val_loss"), rel=1e-5)
    grads = load_file(str(tmp / f"grads_{mode}.safetensors"))
    assert len(grads) == sum(len(g) for g in ref_grads)
    for step, ref in enumerate(ref_grads):
        for name, g in ref.items():
            torch.testing.assert_close(grads[f"{step}/{name}"], g, rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"step {step} {name}: {m}")


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_activation_checkpointing_under_ddp_and_fsdp_changes_no_bit(dist_runs, mode):
    """Blocks recomputed in backward under DDP and FSDP2 (inside its unshard hooks): the same losses and gradients as
    without it, bit for bit."""
    import json

    tmp, _, _ = dist_runs
    assert json.loads((tmp / f"{mode}_ac" / "config.json").read_text())["train"]["activation_checkpointing"] == 1
    assert losses(tmp / f"{mode}_ac") == losses(tmp / mode)
    plain = load_file(str(tmp / f"grads_{mode}.safetensors"))
    ac = load_file(str(tmp / f"grads_{mode}_ac.safetensors"))
    assert plain.keys() == ac.keys()
    for name, g in plain.items():
        assert torch.equal(ac[name], g), name


def test_fsdp_sharded_checkpoint_resumes_exactly(dist_runs):
    tmp, _, _ = dist_runs
    import difftx

    assert (tmp / "fsdp_resumed" / "checkpoints" / "step_00000002" / "sharded").is_dir()
    assert losses(tmp / "fsdp_resumed") == losses(tmp / "fsdp")
    a, b = difftx.load_model(tmp / "fsdp"), difftx.load_model(tmp / "fsdp_resumed")
    for (k, v), w in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(v, w), k


def test_a_sharded_checkpoint_lacking_a_process_s_shard_file_is_incomplete(dist_runs, tmp_path):
    """Each of the N processes of an FSDP run writes its own sharded/__R_0.distcp; one of them missing (copied in
    part, deleted by hand) left the checkpoint "complete": --resume auto took it and failed reading it, instead of
    passing it over for the checkpoint before (as for a missing rng/rank_N.json).  Now it is incomplete, by name."""
    import shutil

    from difftx.train.checkpoint import missing_parts, resolve_resume

    tmp, _, _ = dist_runs
    run = tmp_path / "run"
    shutil.copytree(tmp / "fsdp_resumed", run)
    newest = run / "checkpoints" / "step_00000004"
    assert missing_parts(newest) == []
    (newest / "sharded" / "__1_0.distcp").unlink()
    assert missing_parts(newest) == ["sharded/__1_0.distcp"]
    skipped = []
    assert resolve_resume("auto", run, skipped=lambda paths, missing: skipped.extend(zip(paths, missing))) == \
        run / "checkpoints" / "step_00000002"
    assert skipped == [(newest, ["sharded/__1_0.distcp"])]

def test_a_damaged_optimizer_groups_file_of_a_sharded_checkpoint_is_one_line(dist_runs):
    """An FSDP checkpoint's optimizer_groups.json that is not JSON was a traceback (JSONDecodeError); one with no
    groups, or with the groups' parameters swapped (weight decay on the norms), resumed: now each is a
    CheckpointError naming the file.  An inf in one process's shard of an optimizer moment or a weight resumed
    silently (the one-process path checks them): now every process raises the same CheckpointError."""
    import json

    tmp, _, _ = dist_runs
    errors = json.loads((tmp / "fsdp_groups_errors.json").read_text())
    nonfinite = {name: errors.pop(name) for name in ("nonfinite_optim", "nonfinite_model")}
    assert set(errors) == {"not_json", "no_groups", "groups_swapped"}
    for name, err in errors.items():
        assert err.startswith("CheckpointError: ") and "optimizer_groups.json" in err and "corrupt" in err, (name, err)
        assert "\n" not in err, (name, err)
    # an inf in one process's shard only: every process refuses the checkpoint with the same line (none trains on,
    # none hangs)
    for name, (err, *others) in nonfinite.items():
        assert others == [err], (name, err, others)
        assert err.startswith("CheckpointError: ") and "sharded" in err and "NaN or inf" in err, (name, err)
        assert "\n" not in err, (name, err)


def test_a_finished_run_resumed_again_evaluates_on_every_process_or_none(tmp_path):
    """A run stopped by --stop-at, finished by a resume with --steps at that step (its validation evaluated after
    the loop, no new checkpoint), then resumed once more: rank 0 read the metrics file, found that val_loss and
    skipped the evaluation; the other processes (which write no file) did not find it and evaluated, waiting in
    its all-reduce for rank 0, which had left (a crash, "Connection closed by peer", or a hang).  Now every process
    takes rank 0's answer: none evaluates again, each returns the same summary, and the file holds one val_loss."""
    import json

    data, cache = write_corpus(tmp_path / "corpus.txt"), tmp_path / "cache"
    out = run_torchrun_worker(Path(__file__).parent / "dist_resume_worker.py", data, cache, tmp_path)
    summaries = [json.loads((out / f"summary_{rank}.json").read_text()) for rank in (0, 1)]
    assert summaries[0]["step"] == 2 and summaries[1] == summaries[0], summaries
    assert len(losses(out / "finished", "val_loss")) == 1


def test_a_truncated_shard_file_is_one_line_on_every_process(dist_runs):
    """A truncated sharded/__1_0.distcp (the checkpoint complete, a file corrupt) raised torch.distributed.checkpoint's
    CheckpointException, a BaseException that the one-line CheckpointError handling (except Exception) let through:
    a traceback of every process's error on every process.  Now every process raises the same CheckpointError."""
    import json

    tmp, _, _ = dist_runs
    err, *others = json.loads((tmp / "fsdp_shard_errors.json").read_text())
    assert others == [err], (err, others)
    assert err.startswith("CheckpointError: ") and "step_00000004/sharded: cannot read the sharded state" in err, err
    assert "\n" not in err, err
