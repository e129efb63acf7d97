"""Cross-entropy of a linear LM head without its (tokens, vocab) logits: ``chunk`` tokens at a time.

The usual loss, ``cross_entropy(hidden @ weight.T, targets)``, holds the logits, their fp32 copy and the
log-softmax saved for backward: two to three T x V tensors (T tokens, V vocabulary), a quarter of a
paper-size model's activation memory at V = 100K.  :func:`linear_cross_entropy` computes the same sum a
chunk of tokens at a time and, while each chunk's probabilities are at hand, its gradients with respect to
``hidden`` and ``weight`` as well (the two matmuls backward would do, in the same dtype), so no chunk is
kept or recomputed: the step holds one chunk's logits, the T x d gradient of ``hidden`` and the V x d
gradient of ``weight``.  The same three matmuls as the usual loss; logits and softmax in fp32 (fp64 stays fp64).
"""

from __future__ import annotations

import torch

from .linear import grad_wanted
from .norms import upcast

IGNORE_INDEX = -100


def _chunked(hidden, weight, targets, chunk: int, want_h: bool, want_w: bool):
    """(summed loss, gradient of hidden or None, gradient of weight or None), ``chunk`` tokens at a time.

    Where difftx runs float32 products on oneDNN (:data:`difftx.nn.linear.ONEDNN_FP32`; float32, no autocast)
    the three products do too: the weight's gradient is summed transposed, W^T += h^T P (oneDNN reads P^T as a
    weight, as it lies, and copies only h^T, a chunk x d_model), and transposed back once at the end."""
    from . import linear as L

    dnn = not torch.is_autocast_enabled(hidden.device.type) and L._onednn_ok(hidden, weight)
    grad_h = torch.empty_like(hidden) if want_h else None
    grad_w = torch.zeros_like(weight, dtype=upcast(weight[:0]).dtype) if want_w and not dnn else None
    grad_wt = None  # oneDNN's transposed sum (d_model, vocab)
    total = torch.zeros((), dtype=upcast(hidden[:0]).dtype, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk):
        h, t = hidden[start:start + chunk], targets[start:start + chunk]
        # under autocast the matmul runs in its dtype, as the usual head's
        logits = L._onednn(h, weight) if dnn else upcast(h @ weight.t())
        valid = t != IGNORE_INDEX
        tt = torch.where(valid, t, 0)
        lse = torch.logsumexp(logits, dim=-1)
        picked = logits.gather(1, tt[:, None]).squeeze(1)
        total += torch.where(valid, lse - picked, 0).sum().to(total.dtype)
        if want_h or want_w:
            p = logits.sub_(lse[:, None]).exp_()  # the softmax, in place of the logits
            p[torch.arange(p.shape[0], device=p.device), tt] -= 1
            p.mul_(valid[:, None].to(p.dtype))
            p = p.to(hidden.dtype)
            if want_h:
                grad_h[start:start + chunk] = L._onednn(p, weight.t()) if dnn else p @ weight
            if want_w and dnn:
                grad_wt = L._onednn(h.t().contiguous(), p.t(), add=grad_wt)
            elif want_w:
                grad_w += upcast(p.t() @ h)
    if grad_wt is not None:
        grad_w = grad_wt.t().contiguous()
    elif want_w and dnn:  # no chunk (no tokens): a zero gradient
        grad_w = torch.zeros_like(weight)
    return total, grad_h, None if grad_w is None else grad_w.to(weight.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int):
        total, grad_h, grad_w = _chunked(hidden, weight, targets, chunk, *ctx.needs_input_grad[:2])
        ctx.grads = (grad_h, grad_w)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.grads  # kept with the graph: freed with it, reused by a retain_graph backward
        if torch.is_grad_enabled():
            raise RuntimeError("difftx linear_cross_entropy (loss_chunk > 0) computes its gradients in the forward "
                               "pass, without a graph: a second derivative (create_graph=True) needs loss_chunk=0")
        return (None if grad_h is None else grad_h * grad_out.to(grad_h.dtype),
                None if grad_w is None else grad_w * grad_out.to(grad_w.dtype), None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk: int) -> torch.Tensor:
    """Summed ``cross_entropy(hidden @ weight.T, targets, ignore_index=-100)``, at most ``chunk`` x V logits at once.

    ``hidden`` (T, d), ``weight`` (V, d), ``targets`` (T,); returns a 0-d fp32 (fp64 for fp64 inputs) sum over
    the targets that are not -100.  Differentiable in ``hidden`` and ``weight``; the gradients are computed
    in the forward pass only when autograd needs them (no cost under ``torch.no_grad``).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
    if grad_wanted(hidden, weight):
        return _LinearCrossEntropy.apply(hidden, weight, targets, int(chunk))
    return _chunked(hidden, weight, targets, int(chunk), False, False)[0]
