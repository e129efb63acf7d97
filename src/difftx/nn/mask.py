"""Attention masks: causal, key padding, documents, sliding windows and bidirectional, described once per forward.

An :class:`AttnMask` is built by the model and shared by every layer.  Backends
ask it for what they can use: ``is_plain_causal`` (no explicit mask needed), a
dense boolean mask, a FlexAttention block mask, or the documents of a packed
sequence as segments (:meth:`AttnMask.segments`).  Every query may always
attend to its own position, so a row is never fully masked (a left-padding
query would otherwise produce NaN); outputs at padded positions are finite and
meaningless, and losses ignore them.

Document masking (``doc_ids``): several documents packed into one sequence,
each attending only within itself, as if each were its own sequence.  A query
sees a key only when both carry the same document id.

Sliding window (``window``): a query sees only the keys fewer than ``window``
positions (key indices, a cache's included) away: with causality, itself and the
``window - 1`` keys before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class AttnMask:
    causal: bool
    n_q: int
    n_k: int
    q_start: int = 0  # index of the first query among the keys (the cache length before this step)
    key_valid: Optional[torch.Tensor] = None  # (B, n_k) bool, True = a real token
    doc_ids: Optional[torch.Tensor] = None  # (B, n_k) integer: a query sees only keys of its own document
    window: Optional[int] = None  # sliding window: a query sees keys less than this many positions before it
    _dense: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        # plain isinstance checks (the forward builds one per call): causal="yes" was accepted as truthy, and a
        # float n_q was a TypeError from deep inside torch.arange; SymInt: sizes under torch.compile
        if not isinstance(self.causal, bool):
            raise ValueError(f"AttnMask: causal must be True or False; got {self.causal!r}")
        for name, v in (("n_q", self.n_q), ("n_k", self.n_k), ("q_start", self.q_start)):
            if isinstance(v, bool) or not isinstance(v, (int, torch.SymInt)):
                raise ValueError(f"AttnMask: {name} must be an integer; got {v!r} ({type(v).__name__})")
        if not (self.n_q >= 1 and self.n_k >= self.n_q and 0 <= self.q_start <= self.n_k - self.n_q):
            raise ValueError(f"AttnMask: needs 1 <= n_q <= n_k and 0 <= q_start <= n_k - n_q; got n_q={self.n_q}, "
                             f"n_k={self.n_k}, q_start={self.q_start}")
        kv = self.key_valid
        if kv is not None and not (isinstance(kv, torch.Tensor) and kv.dtype == torch.bool and kv.dim() == 2
                                   and kv.shape[1] == self.n_k):
            what = f"a {kv.dtype} tensor of shape {tuple(kv.shape)}" if isinstance(kv, torch.Tensor) else type(kv)
            raise ValueError(f"AttnMask: key_valid must be a bool tensor (B, n_k={self.n_k}), True for real "
                             f"tokens; got {what} (use .bool())")
        w = self.window
        if w is not None and (isinstance(w, bool) or not isinstance(w, (int, torch.SymInt)) or w < 1):
            raise ValueError(f"AttnMask: window must be a positive integer (the keys a query sees, itself "
                             f"included) or None; got {w!r}")
        doc = self.doc_ids
        if doc is not None and not (isinstance(doc, torch.Tensor) and doc.dim() == 2 and doc.shape[1] == self.n_k
                                    and not doc.dtype.is_floating_point and not doc.dtype.is_complex
                                    and doc.dtype != torch.bool):
            what = f"a {doc.dtype} tensor of shape {tuple(doc.shape)}" if isinstance(doc, torch.Tensor) else type(doc)
            raise ValueError(f"AttnMask: doc_ids must be an integer tensor (B, n_k={self.n_k}), each key's "
                             f"document id; got {what}")

    def check(self, x: torch.Tensor, d_model: int, cache_length: int = 0) -> None:
        """Raise a ValueError unless ``x`` is an attention input (B, N, d_model) that this mask describes: N =
        n_q queries, and n_k keys (``cache_length`` of them already in a cache)."""
        if x.dim() != 3 or x.shape[-1] != d_model or x.shape[0] == 0:
            raise ValueError(f"attention input must be (batch >= 1, tokens, d_model={d_model}); got {tuple(x.shape)}")
        if x.shape[1] != self.n_q or cache_length + self.n_q != self.n_k or self.q_start != cache_length:
            raise ValueError(f"the AttnMask (n_q={self.n_q}, n_k={self.n_k}, q_start={self.q_start}) does not "
                             f"describe this input: {x.shape[1]} tokens after {cache_length} cached; build it as "
                             f"AttnMask(causal, n_q={x.shape[1]}, n_k={cache_length + x.shape[1]}, "
                             f"q_start={cache_length})")
        for name, t in (("key_valid", self.key_valid), ("doc_ids", self.doc_ids)):
            if t is not None and t.shape[0] not in (1, x.shape[0]):
                raise ValueError(f"AttnMask: {name} has {t.shape[0]} rows for a batch of {x.shape[0]}")

    @property
    def is_plain_causal(self) -> bool:
        """True when ``is_causal=True`` on square q/k describes the mask exactly."""
        return (self.causal and self.key_valid is None and self.doc_ids is None and not self.windowed
                and self.q_start == 0 and self.n_q == self.n_k)

    @property
    def windowed(self) -> bool:
        """True when the sliding window hides some key from some query (a window as long as the keys does not)."""
        return self.window is not None and self.window < self.n_k

    @property
    def is_empty(self) -> bool:
        """True when nothing is masked at all (every query sees every key)."""
        if self.key_valid is not None or self.doc_ids is not None or self.windowed:
            return False
        return not self.causal or self.q_start >= self.n_k - 1

    def dense(self, device: torch.device) -> Optional[torch.Tensor]:
        """Boolean mask (B|1, 1, n_q, n_k), True = attend; None when nothing is masked."""
        if self.is_empty:
            return None
        key = str(device)
        if key not in self._dense:
            q_pos = torch.arange(self.q_start, self.q_start + self.n_q, device=device)[:, None]
            k_pos = torch.arange(self.n_k, device=device)[None, :]
            allowed = torch.ones(self.n_q, self.n_k, dtype=torch.bool, device=device)
            if self.causal:
                allowed = k_pos <= q_pos
            if self.windowed:
                allowed = allowed & self.in_window(q_pos, k_pos)
            allowed = allowed[None, None]
            if self.key_valid is not None:
                allowed = allowed & self.key_valid.to(device)[:, None, None, :]
            if self.doc_ids is not None:
                allowed = allowed & self.same_document(0, self.n_q, self.n_k, device)[:, None]
            allowed = allowed | (k_pos == q_pos)[None, None]
            self._dense[key] = allowed
        return self._dense[key]

    def additive(self, device: torch.device, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """The dense mask as 0 / -inf, for reference code."""
        m = self.dense(device)
        if m is None:
            return None
        return torch.zeros(m.shape, dtype=dtype, device=device).masked_fill(~m, float("-inf"))

    def block_mask(self, batch: int, device: torch.device):
        """A FlexAttention BlockMask (or None when nothing is masked)."""
        if self.is_empty:
            return None
        key = ("block", str(device), batch)
        if key in self._dense:
            return self._dense[key]
        from torch.nn.attention.flex_attention import create_block_mask

        q_start, causal, window = self.q_start, self.causal, (self.window if self.windowed else None)
        valid = None if self.key_valid is None else self.key_valid.to(device)
        if valid is not None and valid.shape[0] != batch:  # one row for every sequence (check() allows it)
            valid = valid.expand(batch, -1)
        doc = None if self.doc_ids is None else self.doc_ids.to(device)
        if doc is not None and doc.shape[0] != batch:
            doc = doc.expand(batch, -1)

        def mask_mod(b, h, q_idx, kv_idx):
            q_abs = q_idx + q_start
            ok = (kv_idx <= q_abs) if causal else (kv_idx >= 0)
            if valid is not None:
                ok = ok & valid[b, kv_idx]
            if doc is not None:
                ok = ok & (doc[b, kv_idx] == doc[b, q_abs])
            if window is not None:
                ok = ok & (q_abs - kv_idx < window) & (kv_idx - q_abs < window)
            return ok | (kv_idx == q_abs)

        per_row = valid is not None or doc is not None
        bm = create_block_mask(mask_mod, batch if per_row else None, None, self.n_q, self.n_k, device=device)
        self._dense[key] = bm
        return bm

    def in_window(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Whether keys at ``k_pos`` lie within the sliding window of queries at ``q_pos`` (positions among the keys,
        broadcast against each other): fewer than ``window`` positions apart."""
        return (q_pos - k_pos < self.window) & (k_pos - q_pos < self.window)

    def same_document(self, i0: int, i1: int, ke: int, device) -> torch.Tensor:
        """(B|1, i1 - i0, ke) bool: whether query i (of this call's queries [i0, i1)) and key j < ``ke`` belong to
        the same document (``doc_ids`` must be set)."""
        doc = self.doc_ids.to(device)
        q_doc = doc[:, self.q_start + i0: self.q_start + i1]
        return q_doc[:, :, None] == doc[:, None, :ke]

    def segments(self) -> Optional[list]:
        """The documents of a packed self-attention call as (start, end) token ranges, one list per ``doc_ids``
        row, when each document is one contiguous run of tokens and nothing else is masked but causality and a
        sliding window: then attention over the packed sequence is attention over each document on its own, and a
        kernel may run them one by one (a plain causal or bidirectional call each, under the same window: positions
        within a run are as far apart as in the packed sequence).  None otherwise (no ``doc_ids``, padding, queries
        after a cache, or an id that comes back after another)."""
        doc = self.doc_ids
        if doc is None or self.key_valid is not None or self.q_start != 0 or self.n_q != self.n_k:
            return None
        if "segments" not in self._dense:  # once per forward: every layer asks
            self._dense["segments"] = self._segments(doc)
        return self._dense["segments"]

    def _segments(self, doc: torch.Tensor) -> Optional[list]:
        change = doc[:, 1:] != doc[:, :-1]  # (R, N-1)
        rows, cols = torch.nonzero(change, as_tuple=True)
        # contiguous: as many runs as distinct ids in every row, i.e. no id seen before a different one comes back
        runs = change.sum(1) + 1
        distinct = torch.tensor([int(torch.unique(r).numel()) for r in doc], device=runs.device)
        if not bool((runs == distinct).all()):
            return None
        cuts: list = [[0] for _ in range(doc.shape[0])]
        for r, c in zip(rows.tolist(), cols.tolist()):
            cuts[r].append(c + 1)
        return [list(zip(c, c[1:] + [self.n_k])) for c in cuts]


def document_ids(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B, N) int64 document ids of packed token sequences whose documents end with ``eos_id``: the end-of-text
    token belongs to the document it ends, and the token after it starts the next (ids count from 0 in each
    row; a window that starts mid-document starts with that document)."""
    ends = input_ids == eos_id
    return (ends.long().cumsum(-1) - ends.long())


def document_positions(doc_ids: torch.Tensor, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(B, N) int64 positions that restart at 0 where the document id changes, for ``doc_ids`` (B, N): each
    packed document sees the positions it would have on its own.  ``valid`` (B, N) bool, False at padding: only
    real tokens count (a padding token takes its document's next position, or 0)."""
    b, n = doc_ids.shape
    ones = torch.ones(b, n, dtype=torch.long, device=doc_ids.device)
    v = ones if valid is None else valid.to(device=doc_ids.device, dtype=torch.long).expand(b, n)
    count = v.cumsum(-1)  # real tokens up to and including t
    start = torch.ones(b, n, dtype=torch.bool, device=doc_ids.device)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    before = torch.where(start, count - v, torch.zeros_like(count)).cummax(-1).values  # counted before the doc
    return (count - before - 1).clamp_min(0)
