"""Optimisers and learning-rate schedules.

* :class:`MSGDW`: momentum SGD with decoupled weight decay, as DNT uses it
  (timm's SGDW semantics):  p <- p (1 - lr wd);  m <- mu m + g (m = g on the
  first step);  p <- p - lr m  (``nesterov``: p <- p - lr (g + mu m)).
  ``torch.optim.SGD`` only has coupled (L2) decay, which DNT warns against.
* :func:`param_groups`: no weight decay on norms, biases, lambda vectors and
  embeddings unless asked.
* :func:`build_optimizer`: ``adamw`` (fused where available), ``msgdw``,
  ``sgd``, ``muon`` (:class:`Muon`, momentum 0.95, on 2-D hidden matrices + AdamW on the rest).
* :class:`Muon`: torch.optim.Muon with its Newton-Schulz iteration in bf16 only where the
  device multiplies bf16 in hardware, else in fp32 (torch always uses bf16, which a CPU without
  AMX / AVX512-BF16 runs about 100x slower than fp32).
* Schedules: ``cosine`` (warmup + cosine to a minimum), ``linear`` (warmup +
  linear decay, the DIFF recipe), ``constant`` (warmup then flat).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from .errors import ConfigError

OPTIMIZERS = ("adamw", "msgdw", "sgd", "muon")
SCHEDULES = ("cosine", "linear", "constant")

NO_DECAY_LEAVES = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2", "cls_token", "pos_embed")
EMBEDDING_PREFIXES = ("embed.", "pos_embed.")


def _closure_loss(closure):
    """An optimizer step's ``closure()`` (the loss, evaluated with gradients on), or None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class MSGDW(torch.optim.Optimizer):
    """Momentum SGD with decoupled weight decay (mSGDW, DNT).

    Per step, per parameter: ``p *= 1 - lr * weight_decay``; ``buf = momentum *
    buf + grad`` (``buf = grad`` on the first step); ``p -= lr * buf`` (or
    ``lr * (grad + momentum * buf)`` with ``nesterov``).
    """

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.9, weight_decay: float = 0.0,
                 nesterov: bool = False):
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError("lr, momentum and weight_decay must be >= 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov))

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            lr, mu, wd, nesterov = group["lr"], group["momentum"], group["weight_decay"], group["nesterov"]
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            if wd != 0:
                torch._foreach_mul_(params, 1.0 - lr * wd)
            bufs = []
            for p, g in zip(params, grads):
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = g.detach().clone()
                else:
                    state["momentum_buffer"].mul_(mu).add_(g)
                bufs.append(state["momentum_buffer"])
            if nesterov:
                updates = torch._foreach_add(grads, bufs, alpha=mu)
                torch._foreach_add_(params, updates, alpha=-lr)
            else:
                torch._foreach_add_(params, bufs, alpha=-lr)
        return loss


def is_no_decay(name: str, param: torch.Tensor) -> bool:
    """Norm gains, biases, lambda vectors, embeddings, class tokens and position tables."""
    leaf = name.rsplit(".", 1)[-1]
    if param.ndim < 2 or leaf == "bias" or leaf in NO_DECAY_LEAVES:
        return True
    return name.startswith(EMBEDDING_PREFIXES) or ".embed." in name


def param_groups(model: nn.Module, weight_decay: float, decay_all: bool = False) -> list[dict]:
    """Two groups: decayed matrices and the rest (``decay_all`` puts everything in the first)."""
    decay, no_decay = [], []
    seen = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if decay_all or not is_no_decay(name, p) else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, "name": "no_decay"})
    return groups


def _adamw_kernel(groups: list, fused: Optional[bool]) -> dict:
    """AdamW's implementation: torch's fused kernel wherever every parameter lives on a device that has
    one (CPU included: one pass per tensor, measured 16-22 ms against foreach's 90-96 ms for the 26M
    parameters of the ``small`` preset on 2 cores), else foreach.  ``fused`` True/False forces it."""
    if fused is None:
        try:
            from torch.optim.optimizer import _get_fused_kernels_supported_devices

            devices = set(_get_fused_kernels_supported_devices())
        except ImportError:  # older torch: CUDA only
            devices = {"cuda"}
        fused = all(p.device.type in devices and p.is_floating_point() for g in groups for p in g["params"])
    return {"fused": True} if fused else {"foreach": True}


def build_optimizer(model: nn.Module, name: str = "adamw", lr: float = 1e-3, weight_decay: float = 0.0,
                    betas: tuple[float, float] = (0.9, 0.95), momentum: float = 0.9, nesterov: bool = False,
                    eps: float = 1e-8, decay_all: bool = False, fused: Optional[bool] = None):
    """An optimiser over ``model``'s parameters with the standard no-decay groups."""
    if name not in OPTIMIZERS:
        raise ConfigError("optimizer", f"must be one of {', '.join(OPTIMIZERS)}; got {name!r}")
    groups = param_groups(model, weight_decay, decay_all)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **_adamw_kernel(groups, fused))
    if name == "msgdw":
        return MSGDW(groups, lr=lr, momentum=momentum, nesterov=nesterov)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=nesterov)
    return _build_muon(model, lr, weight_decay, betas, eps, decay_all)


class CombinedOptimizer(torch.optim.Optimizer):
    """Several optimisers stepped together (e.g. Muon for matrices + AdamW for the rest).

    ``param_groups`` is the concatenation, so schedulers and clipping see every group: read from the
    optimisers at each access, as ``load_state_dict`` replaces their group dicts.
    """

    def __init__(self, optimizers: list):
        self.optimizers = optimizers
        self.defaults = {}
        self.state = {}

    @property
    def param_groups(self) -> list:
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for o in self.optimizers:
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True):
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state):
        if len(state["optimizers"]) != len(self.optimizers):  # zip would load some and leave the rest fresh
            raise ValueError(f"holds the states of {len(state['optimizers'])} optimizer(s), this one combines "
                             f"{len(self.optimizers)}")
        for o, s in zip(self.optimizers, state["optimizers"]):
            o.load_state_dict(s)


def newton_schulz(update: torch.Tensor, coefficients: tuple, steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """Muon's orthogonalisation of a 2-D ``update`` in ``dtype``: scale to unit Frobenius norm, then ``steps``
    quintic iterations X <- a X + (b A + c A^2) X with A = X X^T, on the wide orientation (Keller Jordan's
    Muon; torch.optim.Muon's order of operations, so that in bf16 the two agree exactly)."""
    a, b, c = coefficients
    x = update.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class Muon(torch.optim.Muon if hasattr(torch.optim, "Muon") else torch.optim.Optimizer):
    """``torch.optim.Muon`` (same hyperparameters, state and checkpoints) whose Newton-Schulz iteration runs in
    ``ns_dtype``: bf16 as torch does where the device has bf16 matmul hardware, fp32 elsewhere.

    Measured on an AVX2-only CPU (torch 2.13, one thread): a Muon step over the ``small`` preset's 56 matrices
    (25.7M parameters) takes 140 s with torch's bf16 iteration and 4.0 s in fp32
    (``benchmarks/results/muon_cpu.md``).
    """

    def __init__(self, params, ns_dtype: torch.dtype = torch.bfloat16, **kwargs):
        if not hasattr(torch.optim, "Muon"):  # (the base is a bare Optimizer then: a TypeError on lr=...)
            raise _muon_missing()
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.ndim != 2 or p.grad.is_complex():
                    raise ValueError("Muon updates real 2-D matrices only")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)  # B <- mu B + (1 - mu) g
                update = p.grad.lerp(buf, mu) if group["nesterov"] else buf
                ortho = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
                p.mul_(1 - lr * wd)
                p.add_(ortho, alpha=-lr * _muon_lr_ratio(group["adjust_lr_fn"], p.shape))
        return loss


def _muon_lr_ratio(rule: Optional[str], shape) -> float:
    """Muon's per-matrix lr scale: ``original`` sqrt(max(1, rows / cols)); ``match_rms_adamw`` 0.2 sqrt(max dim)
    (Moonshot's, to reuse AdamW's lr and weight decay)."""
    rows, cols = shape[:2]
    if rule in (None, "original"):
        return math.sqrt(max(1.0, rows / cols))
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return 1.0


def _muon_missing() -> ConfigError:
    return ConfigError("optimizer", f"muon needs torch >= 2.9 (torch.optim.Muon); this is torch {torch.__version__}: "
                                    "upgrade torch, or use adamw or msgdw")


def _build_muon(model, lr, weight_decay, betas, eps, decay_all):
    if not hasattr(torch.optim, "Muon"):
        raise _muon_missing()
    hidden, rest = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_matrix = p.ndim == 2 and not name.startswith(EMBEDDING_PREFIXES) and "lm_head" not in name \
            and not name.endswith(("head.weight", "patch_embed.weight"))
        (hidden if is_matrix else rest).append((name, p))
    from .runtime import native_bf16_matmul

    fast_bf16 = all(native_bf16_matmul(p.device) for _, p in hidden)
    muon = Muon([p for _, p in hidden], lr=lr, weight_decay=weight_decay, momentum=0.95,
                adjust_lr_fn="match_rms_adamw", ns_dtype=torch.bfloat16 if fast_bf16 else torch.float32)
    rest_groups = [
        {"params": [p for n, p in rest if decay_all or not is_no_decay(n, p)], "weight_decay": weight_decay},
        {"params": [p for n, p in rest if not decay_all and is_no_decay(n, p)], "weight_decay": 0.0},
    ]
    rest_groups = [g for g in rest_groups if g["params"]]
    adamw = torch.optim.AdamW(rest_groups, lr=lr, betas=betas, eps=eps, **_adamw_kernel(rest_groups, None))
    return CombinedOptimizer([muon, adamw])


def lr_at(step: int, total_steps: int, peak_lr: float, schedule: str = "cosine", warmup: int = 0,
          min_lr: float = 0.0) -> float:
    """Learning rate at 0-based ``step`` of ``total_steps``.

    Warmup rises linearly from peak/warmup to peak over ``warmup`` steps; then
    ``cosine`` decays to ``min_lr`` at the last step, ``linear`` decays linearly to
    ``min_lr``, ``constant`` stays at the peak.
    """
    if schedule not in SCHEDULES:
        raise ConfigError("schedule", f"must be one of {', '.join(SCHEDULES)}; got {schedule!r}")
    if warmup > 0 and step < warmup:
        return peak_lr * (step + 1) / warmup
    if schedule == "constant":
        return peak_lr
    span = max(1, total_steps - warmup - 1)
    t = min(1.0, max(0.0, (step - warmup) / span))
    if schedule == "linear":
        return peak_lr + (min_lr - peak_lr) * t
    return min_lr + 0.5 * (peak_lr - min_lr) * (1 + math.cos(math.pi * t))


def set_lr(optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr
