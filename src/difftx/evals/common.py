"""What every evaluation shares: loading, corpora, probes that compose, streaming statistics, output.

* :func:`load_checkpoint` -- model + tokenizer from a run / checkpoint / model directory.
* :func:`corpus_text` -- the one seam for the default corpus (``--data`` wins).
* :func:`attach` -- attach an attention probe *on top of* one already attached
  (so ``with quantized_logits(model, 8): evaluate_attention(...)`` quantizes
  the logits the allocation probe sees).
* :class:`TopK` and :class:`LogHistogram` -- running top-k and a log-spaced
  histogram (a quantile sketch with bounded relative error): state of fixed
  size however many values stream through.
* :func:`write_result` -- ``NAME.json`` with a common envelope (see docs/evals.md).
* :func:`logit_chunks` / :func:`predictions` -- logits a slice of positions at a time, so that
  an evaluation at 16K tokens with a 128K vocabulary never holds all (B, N, V) logits.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

from ..errors import CheckpointError, ConfigError, DataError
from ..nn.probe import AttentionProbe, attach_probe

SCHEMA_VERSION = 1


# ----------------------------------------------------------------------------- loading
def load_checkpoint(path, device: Optional[str] = None, dtype: Optional[torch.dtype] = None,
                    what: str = "this evaluation", tokenizer: bool = True):
    """(model, tokenizer) from a difftx model, checkpoint or training-run directory; model in eval mode.

    A model of another domain (a vision model has no tokenizer) is one CheckpointError saying so.  With
    ``tokenizer=False`` (an evaluation on token ids only, as ``mqar``) the tokenizer is None and need not exist.
    """
    from ..io import load_model

    model = load_model(path, device=device, dtype=dtype)
    model.eval()
    domain = getattr(model.config, "domain", "lm")
    if domain != "lm":
        raise CheckpointError(f"{path}: a {domain} model; {what} needs a language model (a checkpoint of "
                              "'difftx train' without --domain vision)")
    tok = saved_tokenizer(path, what) if tokenizer else None
    vocab = int(model.config.vocab_size)
    if tok is not None and int(getattr(tok, "vocab_size", 0)) > vocab:  # ids the embedding has no row for
        tok = _WithinVocab(tok, vocab)
    return model, tok


def check_token_ids(top: int, vocab: int, why: str = "the data was tokenized for another model") -> None:
    """One DataError where the largest token id ``top`` has no row in a model's embedding of ``vocab`` (the
    embedding would raise IndexError mid-evaluation), saying ``why``."""
    if top >= vocab:
        raise DataError(f"token id {top} is outside the model's vocabulary ({vocab}); {why}")


class _WithinVocab:
    """A tokenizer with more ids than its model's vocabulary (one not saved with this model): its encode refuses
    an id past the vocabulary in one DataError, where the embedding raised IndexError mid-evaluation (niah, icl
    and attention build their prompts with it); everything else is the tokenizer's own."""

    def __init__(self, tok, vocab: int):
        self._tok, self._vocab = tok, vocab

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode(self, text):
        ids = self._tok.encode(text)
        check_token_ids(max((int(i) for i in ids), default=-1), self._vocab,
                        "the checkpoint's tokenizer was not saved with this model")
        return ids


def saved_tokenizer(path, what: str = "this evaluation", optional: bool = False):
    """The tokenizer saved with the model at ``path``: its ``tokenizer.json``, or the ``difftx_tokenizer.json`` a
    Hugging Face export keeps for difftx's byte and char tokenizers; none is one DataError naming ``what`` (None
    when ``optional``).  A damaged file is a DataError either way."""
    from ..data import load_tokenizer
    from ..data.tokenizers import TOKENIZER_FILE

    path = Path(path)
    folder = path.parent if path.is_file() else path  # a model.safetensors path: its directory
    for name in (TOKENIZER_FILE, "difftx_tokenizer.json"):  # the second: interop.hf_io.DIFFTX_TOKENIZER_IN_HF
        if (folder / name).is_file():
            return load_tokenizer(folder / name)  # a damaged file: one DataError naming it
    if optional:
        return None
    raise DataError(f"{folder}: no {TOKENIZER_FILE} beside the model; {what} encodes text with the tokenizer the "
                    "model was trained with (a training run saves it): copy it there or pass the run directory")


def depth_percent(depth: float) -> str:
    """A depth (a fraction, 0..1) as the percentage it was given as: ``int(depth * 100)`` read 0.29 as "28%"
    (0.29 * 100 = 28.999999999999996) and 0.125 as "12%"."""
    return f"{depth * 100:g}%"


def model_device(model) -> torch.device:
    return next(model.parameters()).device


# at most this many logits (B x positions x V) exist at once in an evaluation: 64 MiB in fp32 (the
# cross-entropy's log-softmax doubles it); 512 positions of a 32K vocabulary, a whole window of a small one
LOGIT_BUDGET = 1 << 24


def logit_chunks(model, ids: torch.Tensor, budget: Optional[int] = None, **kwargs):
    """Yield ``(start, logits[:, start:start + k])`` of ``model(ids, **kwargs)``, k positions at a time.

    The backbone runs once (:meth:`~difftx.models.DecoderLM.features`); the LM head runs on slices of at
    most ``budget`` (default :data:`LOGIT_BUDGET`) logits, so peak memory holds one slice, not all B x N x V
    of them (8.6 GB in fp32 for 16K tokens of a 128K vocabulary).  A model without ``features`` (not a difftx DecoderLM) yields its
    whole logits once.
    """
    if not (hasattr(model, "features") and hasattr(model, "head")):
        yield 0, model(ids, **kwargs).logits
        return
    hidden = model.features(ids, **kwargs)
    b, n = hidden.shape[:2]
    step = max(1, (budget or LOGIT_BUDGET) // max(1, b * int(model.config.vocab_size)))
    for start in range(0, n, step):
        yield start, model.head(hidden[:, start:start + step])


def predictions(model, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    """Greedy next-token predictions (B, N) of ``model`` on ``ids``: the argmax of :func:`logit_chunks`."""
    out = torch.empty(ids.shape, dtype=torch.long, device=ids.device)
    for start, logits in logit_chunks(model, ids, **kwargs):
        out[:, start:start + logits.shape[1]] = logits.argmax(-1)
    return out


def require_memory(model, sequences: int, length: int, what: str, fix: str, per_token: int = 16) -> None:
    """InsufficientMemory, one line, when an evaluation's floor cannot fit in the free memory (the rule of the
    training check, :mod:`difftx.train.memory_check`; ``DIFFTX_MEMORY_CHECK=0`` skips it): ``sequences`` inputs of
    ``length`` tokens built at once on the CPU, ``per_token`` bytes a token (int64 ids and targets, or regions),
    and one sequence's float32 residual stream on the model's device.  Without it ``--lengths 10**11`` grew a
    haystack until the machine ran out of memory, or crashed with numpy's ArrayMemoryError traceback."""
    from ..train import memory_check

    if not memory_check.enabled():
        return
    built, hidden = sequences * length * per_token, length * int(model.config.d_model) * 4
    device = model_device(model)
    needs = [("cpu", built + hidden)] if device.type == "cpu" else [("cpu", built), (device, hidden)]
    for where, need in needs:
        memory_check.require_bytes(need, where, what, fix)


def model_summary(model) -> dict:
    cfg = model.config
    return {
        "attention": cfg.attention, "d_model": cfg.d_model, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads,
        "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size, "max_seq_len": cfg.max_seq_len,
        "positions": cfg.positions, "parameters": model.num_parameters(),
    }


def context_limit(model, cap: Optional[int] = None) -> int:
    """The model's trained context, max_seq_len, capped (for LM windows: no extrapolation needed)."""
    n = int(model.config.max_seq_len)
    return min(n, cap) if cap else n


def hard_limit(model) -> Optional[int]:
    """The longest input the model can take at all: max_seq_len for learned/sinusoidal positions, else None."""
    cfg = model.config
    return int(cfg.max_seq_len) if cfg.positions in ("learned", "sinusoidal") else None


def window_length(model, seq_len: Optional[int]) -> int:
    """The windows of the evaluations over text (lm, outliers): ``seq_len`` (an integer >= 1) or the model's context,
    at most 1024.  Past the max_seq_len of learned or sinusoidal positions it is one ConfigError naming --seq-len
    (the model's own error named no flag)."""
    if seq_len is None:
        return context_limit(model, 1024)
    seq_len, hard = check_count("seq_len", seq_len), hard_limit(model)
    if hard is not None and seq_len > hard:
        raise ConfigError("seq_len", f"{seq_len} exceeds max_seq_len={hard} of a model with "
                                     f"{model.config.positions} positions; pass --seq-len up to {hard}")
    return seq_len


def task_context(model, floor: int = 256, cap: int = 1024) -> int:
    """Default context of the retrieval and in-context tasks: max_seq_len, at least ``floor``, at most ``cap``.

    A needle or a demonstration costs tens of byte tokens, so a model trained at
    64 tokens is evaluated at 256 (RoPE extrapolates; the JSON records the
    model's max_seq_len beside the lengths).  Learned or sinusoidal positions
    cannot go past max_seq_len, so there it is the limit.
    """
    n = int(model.config.max_seq_len)
    hard = hard_limit(model)
    return min(n, cap) if hard is not None else min(max(n, floor), cap)


# ----------------------------------------------------------------------------- corpora
VAL_FRACTION = 0.1  # the trainer's deterministic split: the last 10% of the stream is validation


def _builtin_text() -> str:
    """The built-in corpus: this Python's top-level standard-library ``*.py`` files, sorted (about 5 MB)."""
    try:
        from ..data import corpus as corpus_mod  # the training work's reader, when present
    except ImportError:
        corpus_mod = None
    if corpus_mod is not None and hasattr(corpus_mod, "builtin_corpus"):
        return "\n".join(corpus_mod.builtin_corpus().documents())
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    if not files:
        raise DataError("no built-in corpus found (the Python standard library source is missing); pass --data PATH")
    return "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)


def corpus_text(path=None, min_chars: int = 200_000, split: str = "val") -> str:
    """Text to evaluate on (or to fill haystacks with); the one place evaluations get a corpus from.

    ``path``: a UTF-8 text file, read whole (with :mod:`difftx.data.corpus`, also
    a directory, glob or JSONL file, as ``difftx train --data`` takes).  No
    path: the built-in corpus, the trainer's: ``split="val"`` gives its last
    10% (the trainer's validation split), cut to the last ``min_chars``
    characters; ``split="train"`` the first 90%.
    """
    if path is not None:
        if not isinstance(path, (str, os.PathLike)) or not str(path).strip():  # Path("") is the current directory
            raise ConfigError("data", f"must be the path of a text file, got {path!r}")
        p = Path(path)
        if p.is_file() and p.suffix != ".jsonl":
            return read_text_file(p)
        try:
            from ..data.corpus import resolve_corpus
        except ImportError:
            return read_text_file(p)
        corpus = resolve_corpus(str(path))
        text = "\n".join(corpus.documents())  # a newline between files, none between the pieces of one
        for note in corpus.notes:  # files skipped: said once the text is read, as difftx train says it
            print(f"difftx: {note}", file=sys.stderr)
        return text
    text = _builtin_text()
    n_val = int(len(text) * VAL_FRACTION)
    if split == "train":
        return text[:len(text) - n_val]
    return text[len(text) - min(n_val, min_chars):]


def read_text_file(path) -> str:
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: {'a directory, not a text file' if p.is_dir() else 'data file not found'}; pass a "
                        "UTF-8 text file with --data")
    raw = p.read_bytes()
    if not raw.strip():
        raise DataError(f"{p}: data file is empty")
    if b"\x00" in raw[:65536]:
        raise DataError(f"{p}: looks binary (NUL bytes); pass a UTF-8 text file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:  # as difftx train's --data: no silent replacement characters
        raise DataError(f"{p}: not UTF-8 text (bad byte at offset {e.start}); "
                        "convert it to UTF-8 or pass another --data") from None


def encode(tokenizer, text: str, what: str = "text") -> list[int]:
    """tokenizer.encode with an error that says what could not be encoded."""
    try:
        return list(tokenizer.encode(text))
    except DataError as e:
        raise DataError(f"cannot encode the {what} with this checkpoint's tokenizer ({e}); "
                        "pass --data with text the tokenizer covers") from None


# ----------------------------------------------------------------------------- probes
class ChainProbe(AttentionProbe):
    """Two probes as one: logits go through ``first`` then ``second``; both observe."""

    def __init__(self, first: AttentionProbe, second: AttentionProbe):
        self.first, self.second = first, second

    def transform_logits(self, layer, index, logits, mask=None):
        return self.second.transform_logits(layer, index, self.first.transform_logits(layer, index, logits, mask), mask)

    def observe(self, layer, logits, effective, mask):
        self.first.observe(layer, logits, effective, mask)
        self.second.observe(layer, logits, effective, mask)


def current_probe(model) -> Optional[AttentionProbe]:
    mods = model.attention_modules()
    return mods[0].probe if mods else None


@contextlib.contextmanager
def attach(model, probe: AttentionProbe):
    """attach_probe that keeps a probe already attached (it runs first: e.g. a quantizer)."""
    outer = current_probe(model)
    with attach_probe(model, probe if outer is None else ChainProbe(outer, probe)):
        yield probe


def valid_values(t: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """The entries of ``t`` (B, H, Nq, Nk) that the (broadcastable, True = attend) mask keeps, flattened."""
    if mask is None:
        return t.reshape(-1)
    return t[mask.expand_as(t)]


# ----------------------------------------------------------------------------- streaming statistics
class TopK:
    """The k largest values seen so far (state: at most k floats)."""

    def __init__(self, k: int):
        self.k = k
        self.values = torch.empty(0, dtype=torch.float64)

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1)
        if x.numel() == 0:
            return
        top = torch.topk(x, min(self.k, x.numel())).values.to("cpu", torch.float64)
        both = torch.cat((self.values, top))
        self.values = torch.topk(both, min(self.k, both.numel())).values

    def top(self, i: int) -> Optional[float]:
        """The i-th largest value (1-based), None when fewer than i values were seen."""
        return float(self.values[i - 1]) if self.values.numel() >= i else None

    def state_bytes(self) -> int:
        return self.values.numel() * 8


class LogHistogram:
    """Counts of non-negative values in log-spaced bins: quantiles with relative error <= 10**(1/(2*per_decade)) - 1.

    Values below ``10**lo`` are counted in an underflow bin (reported as 0),
    values above ``10**hi`` in an overflow bin (reported as the running max).
    With the defaults (1e-8 .. 1e8, 200 bins per decade) the relative error of
    a quantile is at most 0.58%.
    """

    def __init__(self, lo: float = -8.0, hi: float = 8.0, per_decade: int = 200):
        self.lo, self.hi, self.per_decade = lo, hi, per_decade
        self.n_bins = int(round((hi - lo) * per_decade))
        self.counts = torch.zeros(self.n_bins + 2, dtype=torch.float64)  # [underflow, bins..., overflow]
        self.max = 0.0
        self.n = 0

    @property
    def rel_error(self) -> float:
        return 10 ** (1 / (2 * self.per_decade)) - 1

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1).float()
        if x.numel() == 0:
            return
        self.n += x.numel()
        self.max = max(self.max, float(x.max()))
        # the log clamped first: log10(inf) = inf cast to long wrapped to the underflow bin (an inf counted as 0)
        idx = torch.floor((torch.log10(x.clamp_min(1e-38)).clamp(self.lo - 1, self.hi + 1) - self.lo)
                          * self.per_decade).long() + 1
        idx = idx.clamp(0, self.n_bins + 1)
        self.counts += torch.bincount(idx, minlength=self.n_bins + 2).cpu().double()

    def quantile(self, q: float) -> Optional[float]:
        if self.n == 0:
            return None
        rank = math.floor(q * (self.n - 1))  # 0-based rank of the 'lower' quantile (torch.median's choice)
        cum = torch.cumsum(self.counts, 0)
        b = int(torch.searchsorted(cum, torch.tensor(rank + 1.0, dtype=torch.float64)))
        if b == 0:
            return 0.0
        if b >= self.n_bins + 1:
            return self.max
        centre = 10 ** (self.lo + (b - 1 + 0.5) / self.per_decade)  # geometric centre of the bin
        return min(centre, self.max)

    def median(self) -> Optional[float]:
        return self.quantile(0.5)

    def state_bytes(self) -> int:
        return self.counts.numel() * 8


# ----------------------------------------------------------------------------- batching helpers
def batches(seq: Sequence, size: int) -> Iterable[Sequence]:
    for i in range(0, len(seq), size):
        yield seq[i:i + size]


def map_batch_size(n_heads: int, seq_len: int, budget_elems: int = 1 << 24, cap: int = 64) -> int:
    """Rows per batch so one fp32 attention map (B, H, N, N) stays near ``budget_elems`` elements."""
    return int(max(1, min(cap, budget_elems // max(1, n_heads * seq_len * seq_len))))


def pad_right(seqs: list[list[int]], pad: int = 0) -> torch.Tensor:
    n = max(len(s) for s in seqs)
    return torch.tensor([s + [pad] * (n - len(s)) for s in seqs], dtype=torch.long)


def pad_left(seqs: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and attention mask (1 = token)."""
    n = max(len(s) for s in seqs)
    ids = torch.tensor([[pad] * (n - len(s)) + s for s in seqs], dtype=torch.long)
    mask = torch.tensor([[0] * (n - len(s)) + [1] * len(s) for s in seqs], dtype=torch.long)
    return ids, mask


def parse_range(v, name: str) -> tuple[int, int]:
    """3 -> (3, 3); '1-6' or (1, 6) -> (1, 6)."""
    try:
        if isinstance(v, str):
            parts = v.split("-")
            v = (int(parts[0]), int(parts[-1]))
        elif isinstance(v, int):
            v = (v, v)
        lo, hi = int(v[0]), int(v[1])
    except (ValueError, TypeError, IndexError):
        raise ConfigError(name, f"must be a count or a range lo-hi, got {v!r}") from None
    if not 1 <= lo <= hi:
        raise ConfigError(name, f"must be a count or a range lo-hi with 1 <= lo <= hi, got {v!r}")
    return lo, hi


def check_count(name: str, value, lo: int = 1) -> int:
    """``value`` as an int >= ``lo`` (not a bool, not a float with a fraction), else ConfigError."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise ConfigError(name, f"must be an integer >= {lo}, got {value!r}")
    return int(value)


def check_seed(value, name: str = "seed") -> int:
    """``value`` as an int seed (not a bool, a float or null: --metric-opt seed=null was a TypeError traceback)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(name, f"must be an integer, got {value!r}")
    return int(value)


def check_flag(name: str, value) -> bool:
    """``value`` as a bool: true or false, not a string or a number read as either (generation="no" was true)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigError(name, f"must be true or false, got {value!r}")
    return bool(value)


def check_list(name: str, values, lo: float = 1, hi: float = math.inf, kind=int) -> list:
    """A non-empty list of numbers in [lo, hi] (ints when ``kind`` is int), else ConfigError."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ConfigError(name, f"must be a non-empty list, got {values!r}")
    values = list(values)
    if not values:
        raise ConfigError(name, "must be a non-empty list")
    for v in values:
        ok_type = isinstance(v, (int, np.integer)) if kind is int else isinstance(v, (int, float, np.number))
        if isinstance(v, bool) or not ok_type or not (lo <= v <= hi):
            what = "an integer" if kind is int else "a number"
            raise ConfigError(name, f"every value must be {what} in [{lo:g}, {hi:g}], got {v!r}")
    twice = first_repeat(values)
    if twice is not None:  # a duplicate row or point, scored and counted twice (as the command line's lists refuse)
        raise ConfigError(name, f"{twice!r} given twice; give each value once")
    return [kind(v) for v in values]


def first_repeat(values: Sequence):
    """The first value of ``values`` that an earlier one equals, or None."""
    return next((v for i, v in enumerate(values) if v in values[:i]), None)


DEPTHS_PERCENT_HINT = "--depths on the command line takes percents"


def check_depths(depths) -> list[float]:
    """Answer depths as fractions in [0, 1] (the library's unit; the command line takes percents)."""
    try:
        return check_list("depths", depths, 0.0, 1.0, float)
    except ConfigError as e:
        raise ConfigError(None, f"{e} (depths are fractions of the context, 0..1; {DEPTHS_PERCENT_HINT})") from None


def text_tokens(model, tokenizer, text: Optional[str], data, max_tokens: int, seq_len: Optional[int]):
    """``(tokens, max_tokens, seq_len)`` for an evaluation over windows of ``seq_len`` (default: the model's
    context, at most 1024): ``text``, a text file ``data`` or the built-in validation corpus, tokenized only as far
    as the budget needs (at most ~8 bytes a token for BPE on code).  At least one whole window is read, even when
    ``max_tokens`` is below it."""
    max_tokens = check_count("max_tokens", max_tokens)
    if text is not None and not isinstance(text, str):
        raise ConfigError("text", f"must be the evaluation text itself, got {text!r}")
    seq_len = window_length(model, seq_len)
    chars = (max(max_tokens, seq_len) + 1) * 8
    if text is None:
        text = corpus_text(data, min_chars=chars, split="val")
    return encode(tokenizer, text[:chars + 1], "evaluation text"), max_tokens, seq_len


def check_options(task: str, options: dict, valid: Sequence[str]) -> None:
    """A task's options are among ``valid``, else one ConfigError listing the valid keys."""
    unknown = [k for k in options if k not in valid]
    if unknown:
        raise ConfigError(None, f"the {task} task has no option {unknown[0]!r}; valid options: {', '.join(valid)}")


def rng_for(*key: int) -> np.random.Generator:
    """A numpy Generator that is a pure function of the integers in ``key`` (seed, step, rank, ...), each taken
    mod 2^32: keys meant to give different streams must differ below 2^32 (validation steps start at 2^31)."""
    return np.random.default_rng(np.random.SeedSequence([int(k) & 0xFFFFFFFF for k in key]))


# ----------------------------------------------------------------------------- output
def _clean(obj):
    """JSON-safe: numpy / torch scalars to Python, NaN/inf to None."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return _clean(obj.tolist())
    if isinstance(obj, np.ndarray):
        return _clean(obj.tolist())
    if isinstance(obj, (np.floating, float)):
        f = float(obj)
        return f if math.isfinite(f) else None
    if isinstance(obj, (np.integer,)):
        return int(obj)
    return obj


def envelope(name: str, results: dict, model=None, checkpoint=None, settings: Optional[dict] = None,
             seconds: Optional[float] = None, quant: Optional[dict] = None) -> dict:
    from .. import __version__

    return _clean({
        "eval": name, "schema_version": SCHEMA_VERSION, "difftx_version": __version__,
        "checkpoint": None if checkpoint is None else str(checkpoint),
        "model": None if model is None else model_summary(model),
        "settings": settings or {}, "quant": quant, "seconds": seconds, "results": results,
    })


def result_paths(out_dir, name: str, plot: bool = True) -> list[Path]:
    """The files ``difftx eval NAME`` writes into ``out_dir``: NAME.json (and NAME.png with a plot)."""
    out = Path(out_dir)
    return [out / f"{name}.json"] + ([out / f"{name}.png"] if plot else [])


def claim_out(out_dir, name: str, force: bool = False, plot: bool = True) -> Path:
    """Check ``--out`` before an evaluation runs: a usable directory (created) holding no earlier result of
    ``name`` unless ``force`` (as ``difftx compare`` refuses a directory holding a study)."""
    from ..io import make_out_dir, refuse_old_results

    out = make_out_dir(out_dir, flag="--out")
    # NAME.png too when this run plots nothing: an earlier run's figure would sit beside this run's JSON
    refuse_old_results(out, [p.name for p in result_paths(out, name, plot=True)], force)
    return out


def write_result(out_dir, name: str, doc: dict) -> Path:
    from ..io import atomic_write_text, make_out_dir

    out = make_out_dir(out_dir, flag="--out")
    path = out / f"{name}.json"
    atomic_write_text(path, json.dumps(doc, indent=2, allow_nan=False) + "\n")
    return path


def pyplot():
    """matplotlib.pyplot with a file backend, or None when matplotlib is not installed (plot extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
