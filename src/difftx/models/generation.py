"""Text generation: greedy, temperature, top-k, top-p, stop tokens, batched with left padding.

Decoding runs prefill once into a static :class:`~difftx.nn.cache.KVCache`
and then one token per step; ``use_cache=False`` recomputes the whole prefix
each step (the reference the cache is tested against).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from ..errors import DifftxError


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: Optional[int] = None,
                top_p: Optional[float] = None, do_sample: bool = True,
                generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Pick one token per row from logits (B, V)."""
    logits = logits.float()
    if not do_sample:
        return logits.argmax(-1)
    logits = logits / max(temperature, 1e-8)
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        # keep the smallest prefix whose mass reaches top_p, and always the most likely token (its mass before
        # is exactly 0: top_p = 0 is greedy)
        drop = probs.cumsum(-1) - probs >= max(top_p, 1e-12)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int = 32, temperature: float = 1.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None, do_sample: Optional[bool] = None,
             stop_tokens: Optional[Iterable[int]] = None, attention_mask: Optional[torch.Tensor] = None,
             pad_token_id: int = 0, generator: Optional[torch.Generator] = None,
             use_cache: bool = True) -> torch.Tensor:
    """Continue each row of ``input_ids`` (B, N) by up to ``max_new_tokens`` tokens.

    ``temperature=0`` (or ``do_sample=False``) is greedy.  For a batch of
    prompts of different lengths, left-pad them and pass ``attention_mask``
    (1 = token); right padding works too (a row continues from its own last
    token, and its new tokens follow its padding).  A row that emits one of
    ``stop_tokens`` is finished: later positions hold ``pad_token_id``;
    decoding ends when every row is finished.  A sliding-window model's cache holds the prompt or two windows,
    whichever is longer, however many tokens are asked for (the keys no later token sees are dropped); with
    ``full_attention_layers`` it holds every token, as those layers read them all.
    Returns (B, N + generated).
    """
    cfg = model.config
    if input_ids.dim() != 2:
        raise DifftxError(f"input_ids must be (batch, length); got shape {tuple(input_ids.shape)}")
    b, n = input_ids.shape
    if top_p is not None and not 0.0 <= top_p <= 1.0:
        raise DifftxError(f"top_p must be in [0, 1] (0: the most likely token only, 1: no filter); got {top_p}")
    if not temperature >= 0:  # NaN too: it was greedy (do_sample unset) or multinomial's traceback
        raise DifftxError(f"temperature must be >= 0 (0: greedy); got {temperature}")
    if top_k is not None and top_k < 0:
        raise DifftxError(f"top_k must be >= 0 (0: no filter); got {top_k}")
    if max_new_tokens < 0:
        raise DifftxError(f"max_new_tokens must be >= 0; got {max_new_tokens}")
    if max_new_tokens == 0:
        return input_ids
    # the model sees the prompt and every new token but the last
    if cfg.positions in ("learned", "sinusoidal") and n + max_new_tokens - 1 > cfg.max_seq_len:
        raise DifftxError(
            f"prompt ({n}) + max_new_tokens ({max_new_tokens}) - 1 exceeds max_seq_len={cfg.max_seq_len} "
            f"for positions={cfg.positions!r}; ask for fewer tokens"
        )
    sample = (temperature > 0) if do_sample is None else do_sample
    if isinstance(stop_tokens, torch.Tensor):
        stop_tokens = stop_tokens.flatten().tolist()
    elif isinstance(stop_tokens, int):
        stop_tokens = [stop_tokens]
    stops = torch.tensor(sorted(set(stop_tokens)), device=input_ids.device) if stop_tokens else None
    was_training = model.training
    model.eval()
    try:
        mask = None if attention_mask is None else attention_mask.to(input_ids.device).long()
        if mask is not None and mask.shape == input_ids.shape and not bool((mask != 0).any(-1).all()):
            empty = (mask == 0).all(-1).nonzero().flatten().tolist()
            raise DifftxError(f"attention_mask: row(s) {empty} have no tokens (an empty prompt); give each row at "
                              f"least one token")
        # on the inputs' device: an offloaded model's weights sit on the meta device between calls.  Under a sliding
        # window the cache holds the prompt or two windows, whichever is longer: the model drops the keys no later
        # token sees whenever it fills (KVCache.drop_oldest), about once a window
        room = n + max_new_tokens
        if getattr(cfg, "uniform_window", None) is not None:  # every layer windowed: the cache drops old keys
            room = min(room, max(n, 2 * cfg.uniform_window))
        cache = model.new_cache(b, room, device=input_ids.device) if use_cache else None
        hidden = model.features(input_ids, mask, cache=cache)
        last = n - 1  # the prompt's last logits only: each row's last token (before its padding if right-padded)
        if mask is not None:
            last = n - 1 - (mask != 0).long().flip(-1).argmax(-1)
        logits = model.head(hidden[torch.arange(b, device=hidden.device), last])
        out = [input_ids]
        fed = [input_ids]  # what the model reads: a finished row's sampled ids, a vocabulary id unlike pad_token_id
        finished = torch.zeros(b, dtype=torch.bool, device=input_ids.device)
        for step in range(max_new_tokens):
            sampled = sample_next(logits, temperature, top_k, top_p, sample, generator)
            nxt = torch.where(finished, torch.full_like(sampled, pad_token_id), sampled)
            out.append(nxt[:, None])
            fed.append(sampled[:, None])
            if stops is not None:
                finished |= torch.isin(nxt, stops)
                if bool(finished.all()):
                    break
            if step == max_new_tokens - 1:
                break
            if cache is not None:
                logits = model(sampled[:, None], cache=cache).logits[:, -1]
            else:
                seq = torch.cat(fed, dim=1)
                if mask is not None:
                    mask = torch.cat((mask, torch.ones(b, 1, dtype=mask.dtype, device=mask.device)), dim=1)
                logits = model.head(model.features(seq, mask)[:, -1])
        return torch.cat(out, dim=1)
    finally:
        model.train(was_training)
