"""lm-evaluation-harness adapter: :class:`DifftxLM` and :func:`run_lm_eval`.

``DifftxLM`` implements the harness's ``LM`` interface (``loglikelihood``,
``loglikelihood_rolling``, ``generate_until``) for a difftx model and a difftx
tokenizer.  It subclasses ``lm_eval.api.model.LM`` when lm-eval is installed
(``pip install 'difftx[eval]'``) and works on any request objects with an
``.args`` tuple otherwise, so its numerics are tested without the harness.

Conventions follow the harness's own Hugging Face model:

* ``loglikelihood``: trailing whitespace of the context moves to the
  continuation; context + continuation are encoded together and split; inputs
  longer than the model's context are cut from the left; ``is_greedy`` is
  whether argmax decoding reproduces the continuation.
* ``loglikelihood_rolling``: disjoint windows of ``max_length`` tokens, the first
  conditioned on the prefix token (``prefix_token_id``, else the tokenizer's
  ``bos_id``, else its ``eos_id``, as the harness's Hugging Face model picks it),
  each token scored exactly once.  A tokenizer without
  such a token (byte, char) scores from the second token on, conditioned on the first.
* ``generate_until``: greedy (or sampled, if the task asks) decoding of up to
  ``max_gen_toks`` tokens, cut at the first ``until`` string.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from ..errors import DifftxError

try:  # the harness is optional (the ``eval`` extra)
    from lm_eval.api.model import LM as _LMBase

    HAVE_LM_EVAL = True
except ImportError:  # pragma: no cover - depends on the environment
    _LMBase = object
    HAVE_LM_EVAL = False


def _args(request) -> tuple:
    args = getattr(request, "args", request)
    return args if isinstance(args, tuple) else (args,)


class DifftxLM(_LMBase):
    """A difftx language model as an lm-evaluation-harness ``LM``."""

    def __init__(self, model, tokenizer, batch_size: int = 8, max_length: Optional[int] = None,
                 max_gen_toks: int = 256, prefix_token_id: Optional[int] = None, device: Optional[str] = None):
        if HAVE_LM_EVAL:
            super().__init__()
        if device is not None:
            model = model.to(device)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = int(batch_size)
        self.max_length = int(max_length or model.config.max_seq_len)
        self.max_gen_toks = int(max_gen_toks)
        if prefix_token_id is None:  # the harness's HFLM: BOS when the tokenizer has one, else EOS
            prefix_token_id = getattr(tokenizer, "bos_id", None)
        self.prefix_token_id = prefix_token_id if prefix_token_id is not None else getattr(tokenizer, "eos_id", None)
        self._dev = next(model.parameters()).device

    @property
    def eot_token_id(self) -> Optional[int]:
        return getattr(self.tokenizer, "eos_id", None)

    def tok_encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def tok_decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids))

    # ------------------------------------------------------------------ scoring
    @torch.no_grad()
    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), all greedy) for token pairs; batched, right-padded."""
        out: list[Optional[tuple[float, bool]]] = [None] * len(pairs)
        inputs = []
        for i, (ctx, cont) in enumerate(pairs):
            if not cont:
                out[i] = (0.0, True)
                continue
            if len(cont) > self.max_length:
                raise DifftxError(f"a continuation of {len(cont)} tokens exceeds max_length={self.max_length}")
            seq = (ctx + cont)[-(self.max_length + 1):][:-1]
            inputs.append((i, seq, cont))
        inputs.sort(key=lambda r: -len(r[1]))  # similar lengths share a batch
        for start in range(0, len(inputs), self.batch_size):
            chunk = inputs[start:start + self.batch_size]
            width = max(len(seq) for _, seq, _ in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            for row, (_, seq, _) in enumerate(chunk):
                ids[row, :len(seq)] = torch.tensor(seq)  # right padding: causal, so real positions never see it
            hidden = self.model.features(ids.to(self._dev))  # the LM head runs on the continuations only
            for row, (i, seq, cont) in enumerate(chunk):
                n = len(seq)
                lp = F.log_softmax(self.model.head(hidden[row, n - len(cont):n]).float(), dim=-1)
                target = torch.tensor(cont, device=lp.device)
                out[i] = (float(lp.gather(-1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all()))
        return out  # type: ignore[return-value]

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
        whole = self.tok_encode(context + continuation)
        ctx = self.tok_encode(context)
        return ctx, whole[len(ctx):]

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = []
        for r in requests:
            context, continuation = _args(r)[:2]
            if context == "":
                ctx, cont = [], self.tok_encode(continuation)
            else:
                ctx, cont = self._encode_pair(context, continuation)
            if not ctx and cont:  # "" or a context of whitespace only (it moved to the continuation)
                if self.prefix_token_id is None:
                    raise DifftxError("an empty context needs a prefix token; this tokenizer has no bos_id or eos_id, "
                                      "pass prefix_token_id")
                ctx = [self.prefix_token_id]
            pairs.append((ctx, cont))
        return self._score(pairs)

    def rolling_windows(self, tokens: list[int]) -> list[tuple[list[int], list[int]]]:
        """Disjoint (context, predicted) windows covering ``tokens`` once (the harness's context_len=1)."""
        if self.prefix_token_id is not None:
            prefix, todo = self.prefix_token_id, tokens
        elif tokens:
            prefix, todo = tokens[0], tokens[1:]
        else:
            return []
        L = self.max_length
        if not todo:
            return []
        done = min(L, len(todo))
        windows = [([prefix], todo[:done])]
        while done < len(todo):  # each later window: L inputs ending just before its last prediction
            n = min(len(todo) - done, L)
            end = done + n
            windows.append((todo[end - L - 1:end - n], todo[end - n:end]))
            done = end
        return windows

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        results = []
        for r in requests:
            windows = self.rolling_windows(self.tok_encode(_args(r)[0]))
            results.append(sum(lp for lp, _ in self._score(windows)))
        return results

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for r in requests:
            context, kwargs = (_args(r) + ({},))[:2]
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            do_sample = bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 1.0 if do_sample else 0.0))
            if temperature == 0.0:
                do_sample = False
            ctx = self.tok_encode(context) or ([self.prefix_token_id] if self.prefix_token_id is not None else [])
            if not ctx:
                raise DifftxError("generation from an empty context needs a prefix token; pass prefix_token_id")
            ctx = ctx[-max(1, self.max_length - max_new):]
            ids = torch.tensor([ctx], device=self._dev)
            stops = [self.eot_token_id] if self.eot_token_id is not None else None
            gen = self.model.generate(ids, max_new_tokens=max_new, do_sample=do_sample,
                                      temperature=temperature if do_sample else 1.0,
                                      top_k=kwargs.pop("top_k", None), top_p=kwargs.pop("top_p", None),
                                      stop_tokens=stops)
            new = gen[0, len(ctx):].tolist()
            if stops and stops[0] in new:
                new = new[:new.index(stops[0])]
            text = self.tok_decode(new)
            for s in until:
                if s and s in text:
                    text = text[:text.index(s)]
            out.append(text)
        return out


def _tokenizer_for(path: Path):
    """The tokenizer saved with a model: its ``tokenizer.json`` (a difftx tokenizer, or a Hugging Face one read
    with the ``tokenizers`` library), or the difftx tokenizer a Hugging Face export keeps as
    ``difftx_tokenizer.json`` (byte, char)."""
    from ..data.tokenizers import TOKENIZER_FILE, load_tokenizer
    from .hf_io import DIFFTX_TOKENIZER_IN_HF

    path = Path(path)
    folder = path if path.is_dir() else path.parent  # a model.safetensors path: its directory
    for name in (TOKENIZER_FILE, DIFFTX_TOKENIZER_IN_HF):
        if (folder / name).is_file():
            return load_tokenizer(folder / name)  # a damaged file: one DataError naming it
    raise DifftxError(f"{path}: no tokenizer.json (or {DIFFTX_TOKENIZER_IN_HF}); pass tokenizer=")


def run_lm_eval(model_or_path: Union[str, Path, torch.nn.Module], tasks: Union[str, Sequence[str]], *,
                tokenizer=None, num_fewshot: Optional[int] = None, limit: Optional[float] = None,
                batch_size: int = 8, max_length: Optional[int] = None, max_gen_toks: int = 256,
                device: Optional[str] = None, seed: int = 0, out: Optional[Union[str, Path]] = None,
                **simple_evaluate_kwargs: Any) -> dict:
    """Evaluate a difftx model with lm-evaluation-harness; returns a JSON-serialisable dict.

    ``model_or_path``: a difftx model, or anything ``difftx.load_model`` loads
    (model / run / checkpoint directory, converted Hugging Face directory); its
    tokenizer is read from there unless ``tokenizer`` is given.  ``tasks``: harness
    task names (a list or a comma-separated string); the harness downloads their
    data on first use.  ``out``: also write the result to this JSON file.
    The dict holds ``results`` (task -> metric -> value), ``versions``, ``n-shot``,
    ``config`` (this call's arguments) and ``model`` (the difftx config).
    """
    if not HAVE_LM_EVAL:
        raise DifftxError("lm-evaluation-harness is not installed; pip install 'difftx[eval]' (or lm-eval)")
    import lm_eval

    from ..io import load_model

    if isinstance(tasks, str):
        tasks = [t.strip() for t in tasks.split(",") if t.strip()]
    if not tasks:
        raise DifftxError("no tasks given; pass harness task names, e.g. tasks=['lambada_openai']")
    if isinstance(model_or_path, torch.nn.Module):
        model = model_or_path
        if tokenizer is None:
            raise DifftxError("pass tokenizer= with a model object (or give a model directory)")
    else:
        model = load_model(model_or_path)
        tokenizer = tokenizer or _tokenizer_for(Path(model_or_path))
    lm = DifftxLM(model, tokenizer, batch_size=batch_size, max_length=max_length, max_gen_toks=max_gen_toks,
                  device=device)
    try:
        res = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                                      random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                                      fewshot_random_seed=seed, log_samples=False, **simple_evaluate_kwargs)
    except ConnectionError as e:  # the harness fetches task data from the Hub on first use
        raise DifftxError(f"lm-eval could not download the data of {', '.join(tasks)} ({str(e).splitlines()[0]}); "
                          "run once with network access (the datasets cache keeps it) or pass local task "
                          "YAMLs through task_manager=") from None
    result = {
        "results": res.get("results", {}) if res else {},
        "versions": res.get("versions", {}) if res else {},
        "n-shot": res.get("n-shot", {}) if res else {},
        "config": dict(tasks=list(tasks), num_fewshot=num_fewshot, limit=limit, batch_size=batch_size,
                       max_length=lm.max_length, seed=seed),
        "model": model.config.to_dict(),
    }
    result = json.loads(json.dumps(result, default=str))
    if out is not None:
        from ..io import atomic_write_text

        atomic_write_text(Path(out), json.dumps(result, indent=2))
    return result
