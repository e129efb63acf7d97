"""Run under ``python -m torch.distributed.run --nproc-per-node 2``: DDP and FSDP2 runs of the tiny model.

argv: DATA CACHE OUT.  Writes OUT/{ddp,fsdp,fsdp_chunked,fsdp_resumed}/ run dirs and
OUT/grads_{mode}.safetensors (rank 0).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch.distributed as dist  # noqa: E402
from _helpers import GradRecorder, tiny  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from difftx.train import train  # noqa: E402

data, cache, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
dist.init_process_group("gloo")
for mode in ("ddp", "fsdp", "fsdp_chunked"):  # fsdp_chunked: FSDP2 with the chunked loss (--loss-chunk 5)
    rec = GradRecorder()
    tcfg, mcfg = tiny(data, cache, parallel=mode.removesuffix("_chunked"), batch_size=4, grad_accum=1,
                      loss_chunk=5 if mode.endswith("_chunked") else 0, eval_batches=3)
    train(tcfg, mcfg, out / mode, callbacks=[rec], announce=None)
    if dist.get_rank() == 0:
        save_file({f"{i}/{k}": v.contiguous() for i, g in enumerate(rec.grads) for k, v in g.items()},
                  str(out / f"grads_{mode}.safetensors"))
# FSDP2 resume through the sharded (torch.distributed.checkpoint) path
tcfg, mcfg = tiny(data, cache, parallel="fsdp", stop_at=2, eval_batches=3)
train(tcfg, mcfg, out / "fsdp_resumed", announce=None)
tcfg, mcfg = tiny(data, cache, parallel="fsdp", eval_batches=3)
train(tcfg, mcfg, out / "fsdp_resumed", resume="auto", announce=None)
dist.destroy_process_group()
