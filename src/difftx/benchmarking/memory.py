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
from typing import Callable, Optional

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


def measured_training_memory(cfg, batch_size: int, seq_len: int, optimizer: str = "adamw",
                             bf16: bool = False, loss_chunk: int = 0, activation_checkpointing: int = 0,
                             document_ids: Optional[torch.Tensor] = None) -> dict:
    """Peak bytes of a CPU training step of ``cfg`` as the trainer runs it: ``state`` (fp32 weights and the
    optimizer's state after a first step, held between steps) + ``step`` (the step's high-water mark of tensor
    bytes, :func:`peak_live_bytes`) = ``total``.  Random tokens (images); the attention backend the trainer
    picks; ``document_ids`` (batch_size, seq_len): packed documents (language models).  What
    ``benchmarks/memory_floor.py`` and the tests hold the memory floor against."""
    from ..models import build_model
    from ..optim import build_optimizer
    from ..train.trainer import training_attention_backend

    torch.manual_seed(0)
    model = build_model(cfg)
    backend = training_attention_backend(cfg, torch.device("cpu"), torch.bfloat16 if bf16 else None, seq_len)
    if backend is not None:
        model.set_attention_backend(backend)
    model.set_activation_checkpointing(activation_checkpointing)
    opt = build_optimizer(model, optimizer, lr=1e-3, weight_decay=0.1, momentum=0.9)
    if cfg.domain == "lm":
        x = torch.randint(0, cfg.vocab_size, (batch_size, seq_len))
        y = torch.randint(0, cfg.vocab_size, (batch_size, seq_len))
    else:
        x = torch.randn(batch_size, cfg.in_channels, cfg.image_size, cfg.image_size)
        y = torch.randint(0, cfg.num_classes, (batch_size,))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            chunked = {"loss_chunk": loss_chunk} if loss_chunk else {}  # language models only
            if document_ids is not None:
                chunked["document_ids"] = document_ids
            loss = model(x, targets=y, loss_reduction="sum", **chunked).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the optimizer state exists from here on, as in every step after the first
    state = held_bytes(model, opt)
    peak, _ = peak_live_bytes(step)
    return {"state": state, "step": peak, "total": state + peak}


def held_bytes(model, optimizer) -> int:
    """Bytes held between steps: the parameters and every optimiser state tensor (Muon's
    :class:`~difftx.optim.CombinedOptimizer` keeps its state in its two optimisers)."""
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    for st in (s for o in getattr(optimizer, "optimizers", [optimizer]) for s in o.state.values()):
        held += sum(t.numel() * t.element_size() for t in st.values() if isinstance(t, torch.Tensor))
    return int(held)


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
