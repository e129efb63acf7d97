"""Run under ``python -m torch.distributed.run --nproc-per-node 2``: DDP and FSDP2 runs of the tiny model.

argv: DATA CACHE OUT (DATA's directory also holds docs.jsonl).  Writes OUT/{ddp,fsdp,fsdp_chunked,ddp_ac,fsdp_ac,
ddp_docs,fsdp_resumed}/ run dirs,
OUT/grads_{mode}.safetensors, OUT/fsdp_groups_errors.json and OUT/fsdp_shard_errors.json (rank 0): the
damaged-checkpoint resumes' errors.
"""

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch.distributed as dist  # noqa: E402
from _helpers import GradRecorder, finish, phase, tiny  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from difftx.train import train  # noqa: E402

data, cache, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
dist.init_process_group("gloo")
RANK = dist.get_rank()


# fsdp_chunked: FSDP2 with the chunked loss (--loss-chunk 5); ddp_ac, fsdp_ac: with activation checkpointing (every
# block recomputed in backward; under FSDP2, inside its unshard hooks)
for mode in ("ddp", "fsdp", "fsdp_chunked", "ddp_ac", "fsdp_ac"):
    phase(mode)
    rec = GradRecorder()
    tcfg, mcfg = tiny(data, cache, parallel=mode.split("_")[0], batch_size=4, grad_accum=1,
                      loss_chunk=5 if mode.endswith("_chunked") else 0,
                      activation_checkpointing=1 if mode.endswith("_ac") else 0, eval_batches=3)
    train(tcfg, mcfg, out / mode, callbacks=[rec], announce=None)
    if dist.get_rank() == 0:
        save_file({f"{i}/{k}": v.contiguous() for i, g in enumerate(rec.grads) for k, v in g.items()},
                  str(out / f"grads_{mode}.safetensors"))
# DDP with document masking, on a JSONL corpus of short documents and a bpe tokenizer (rank 0 trains and shares it)
phase("ddp_docs")
rec = GradRecorder()
tcfg, mcfg = tiny(str(Path(data).parent / "docs.jsonl"), cache, parallel="ddp", batch_size=4, grad_accum=1,
                  eval_batches=3, tokenizer="bpe", bpe_vocab_size=300, document_masking=True)
train(tcfg, mcfg, out / "ddp_docs", callbacks=[rec], announce=None)
if dist.get_rank() == 0:
    save_file({f"{i}/{k}": v.contiguous() for i, g in enumerate(rec.grads) for k, v in g.items()},
              str(out / "grads_ddp_docs.safetensors"))
# FSDP2 resume through the sharded (torch.distributed.checkpoint) path
phase("fsdp_resumed")
tcfg, mcfg = tiny(data, cache, parallel="fsdp", stop_at=2, eval_batches=3)
train(tcfg, mcfg, out / "fsdp_resumed", announce=None)
tcfg, mcfg = tiny(data, cache, parallel="fsdp", eval_batches=3)
train(tcfg, mcfg, out / "fsdp_resumed", resume="auto", announce=None)
# a damaged optimizer_groups.json beside the sharded state: each process's error, one line each (rank 0 writes them)
errors = {}
for name, text in (("not_json", "[{"), ("no_groups", "[]"), ("groups_swapped", None)):
    phase(f"fsdp_groups_{name}")
    run = out / f"fsdp_groups_{name}"
    if dist.get_rank() == 0:
        shutil.copytree(out / "fsdp_resumed", run)
        for ckpt in (run / "checkpoints").iterdir():
            groups = ckpt / "optimizer_groups.json"
            if text is None:
                saved = json.loads(groups.read_text())  # the no-decay group's parameters under weight decay
                text = json.dumps([{**g, "params": s["params"]} for g, s in zip(saved, saved[::-1])])
            groups.write_text(text)
    dist.barrier()
    tcfg, mcfg = tiny(data, cache, parallel="fsdp", eval_batches=3, steps=6)
    try:
        train(tcfg, mcfg, run, resume="auto", announce=None)
        errors[name] = "resumed"
    except Exception as e:  # noqa: BLE001 -- what the CLI would print (DifftxError) or a traceback's last line
        errors[name] = f"{type(e).__name__}: {e}"
    dist.barrier()
# an inf in rank 1's shard only (the last row) of an optimizer moment, then of a weight: every rank's error
for part in ("optim", "model"):
    phase(f"fsdp_nonfinite_{part}")
    run = out / f"fsdp_nonfinite_{part}"
    if dist.get_rank() == 0:
        import torch
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

        shutil.copytree(out / "fsdp_resumed", run)
        for ckpt in (run / "checkpoints").iterdir():
            dcp_to_torch_save(ckpt / "sharded", run / "full.pt")
            sd = torch.load(run / "full.pt", weights_only=True)
            flat = [(d, k) for d in (sd[part].values() if part == "optim" else [sd[part]]) for k in d]
            d, k = next((d, k) for d, k in flat if (part == "model" or k == "exp_avg_sq") and d[k].dim() == 2)
            d[k][-1] = float("inf")
            torch.save(sd, run / "full.pt")
            shutil.rmtree(ckpt / "sharded")
            torch_save_to_dcp(run / "full.pt", ckpt / "sharded")
    dist.barrier()
    try:
        train(*tiny(data, cache, parallel="fsdp", eval_batches=3, steps=6), run, resume="auto", announce=None)
        err = "resumed"
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {e}"
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, err)
    errors[f"nonfinite_{part}"] = gathered
if dist.get_rank() == 0:
    (out / "fsdp_groups_errors.json").write_text(json.dumps(errors))
# a truncated shard file of rank 1 (present, so the checkpoint is complete, and corrupt): every rank's error
phase("fsdp_truncated_shard")
run = out / "fsdp_truncated_shard"
if dist.get_rank() == 0:
    shutil.copytree(out / "fsdp_resumed", run)
    for ckpt in (run / "checkpoints").iterdir():
        shard = ckpt / "sharded" / "__1_0.distcp"
        shard.write_bytes(shard.read_bytes()[:1000])
dist.barrier()
try:
    train(*tiny(data, cache, parallel="fsdp", eval_batches=3, steps=6), run, resume="auto", announce=None)
    err = "resumed"
except BaseException as e:  # noqa: BLE001 -- torch.distributed.checkpoint's CheckpointException is no Exception
    err = f"{type(e).__name__}: {e}"
gathered = [None] * dist.get_world_size()
dist.all_gather_object(gathered, err)
if dist.get_rank() == 0:
    (out / "fsdp_shard_errors.json").write_text(json.dumps(gathered))
phase("destroy_process_group")
dist.destroy_process_group()
finish()
