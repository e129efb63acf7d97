"""Multi-needle retrieval (DIFF paper section 3.4, Table 2, Fig. 5) and the ``niah`` training task.

A sample is a haystack of real text with N needles "The special magic number
for CITY is: NUMBER." inserted at sentence boundaries, followed by R queries:

    <haystack ... needle ... needle ...>
    The special magic number for CITY_1 is: NUMBER_1
    The special magic number for CITY_2 is: NUMBER_2

The first query's needle (the *answer needle*) sits at the requested depth
(0% = before the first haystack token, 100% = after the last); the other
needles, queries included, at random boundaries.  ``length`` is the whole
sequence in tokens, queries and answers included; the haystack fills what the
needles and queries leave.  Pieces are tokenized separately and concatenated,
so every span is known exactly (the attention evaluation uses them).  Each
piece starts with the whitespace before it (" The river ... day 3.", " The
special magic number for CITY is:" + " NUMBER" + "."), as a GPT-2-style BPE
gives a word its leading space: the concatenation is then the encoding of the
whole text, and the needle's number has the answer's tokens.

Scoring, per query:

* teacher-forced exact match: every answer token is the argmax given the true
  prefix (earlier queries see earlier answers) -- measurable on tiny models;
* generation: greedy decoding from the prompt up to the query; correct when the
  number appears in the generated text (the paper's protocol).

A sample's accuracy is the mean over its R queries; a cell (N, R, length,
depth) averages S samples.  Results: the N x R table (Table 2, averaged over
depths and lengths) and one depth x length heat map per N x R (Fig. 5).

The training task (``difftx train --task niah``) draws the same samples with a
random depth, targets on the answer tokens only (``loss_on="all"`` for every
token), as a pure function of (seed, step, rank, row).
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..data.tasks import register_task
from ..errors import ConfigError, DataError
from .common import (batches, check_count, check_depths, check_flag, check_list, check_options, check_seed,
                     corpus_text, encode, hard_limit, map_batch_size, model_device, pad_left, pad_right, parse_range,
                     predictions, require_memory, rng_for, task_context)

CITIES = (
    "Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Cairo", "Delhi", "Madrid", "Berlin", "Rome", "Vienna", "Prague",
    "Dublin", "Lisbon", "Athens", "Warsaw", "Nairobi", "Seoul", "Hanoi", "Manila", "Jakarta", "Bangkok", "Sydney",
    "Toronto", "Chicago", "Boston", "Denver", "Houston", "Havana", "Bogota", "Quito", "Santiago", "Caracas",
    "Montevideo", "Kyiv", "Riga", "Vilnius", "Tallinn", "Helsinki", "Stockholm", "Copenhagen", "Amsterdam",
    "Brussels", "Zurich", "Geneva", "Milan", "Naples", "Porto", "Seville", "Valencia", "Marseille", "Lyon",
    "Munich", "Hamburg", "Istanbul", "Ankara", "Tehran", "Baghdad", "Karachi", "Mumbai", "Chennai", "Dhaka",
    "Shanghai", "Beijing", "Osaka", "Kyoto", "Busan", "Taipei", "Singapore", "Perth", "Auckland", "Accra",
    "Dakar", "Kinshasa", "Casablanca", "Tunis", "Algiers", "Addis Ababa", "Rio de Janeiro", "Buenos Aires",
    "Mexico City", "Los Angeles", "San Francisco", "New York", "Cape Town", "Kuala Lumpur", "Hong Kong",
)
TEMPLATES = {
    "paper": "The special magic number for {city} is: {number}.",  # the DIFF paper / LWM protocol
    "short": "{city}: {number}.",  # for small contexts on byte tokenizers
}
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
DEFAULT_GRID = ((1, 1), (2, 2), (4, 2), (6, 2))  # Table 2
TASK_OPTIONS = ("needles", "queries", "digits", "template", "data", "text", "loss_on")  # of the training task
# token regions of a sample (used by the attention evaluation)
NOISE, ANSWER, ANSWER_NEEDLE, OTHER_NEEDLE, QUERY = 0, 1, 2, 3, 4
REGION_NAMES = ("noise", "answer", "answer_needle", "other_needles", "query")


def depth_key(depth: float) -> int:
    """A depth as an integer key of :func:`~difftx.evals.common.rng_for` (millionths): samples are drawn from a
    cell's values, not from its positions in the lists asked for, so a cell run alone draws what it drew beside
    others (and its number can be reproduced by asking for that cell)."""
    return int(round(float(depth) * 1_000_000))


def parse_grid(spec) -> list[tuple[int, int]]:
    """'N1R1,N2R2' (or [(1, 1), (2, 2)]) -> [(1, 1), (2, 2)]."""
    if not isinstance(spec, str):  # --metric-opt grid=0 or grid=[1] was a TypeError traceback
        pair = lambda c: isinstance(c, (list, tuple)) and len(c) == 2 and \
            all(isinstance(x, int) and not isinstance(x, bool) for x in c)  # noqa: E731
        if not isinstance(spec, (list, tuple)) or not all(pair(c) for c in spec):
            raise ConfigError("grid", f"must be cells like 'N1R1,N2R2' or [[needles, queries], ...], got {spec!r}")
        spec = ",".join(f"N{n}R{r}" for n, r in spec)  # and checked as the text is
    out = []
    for item in spec.split(","):
        m = re.fullmatch(r"\s*N(\d+)\s*R(\d+)\s*", item, flags=re.I)
        if not m:
            raise ConfigError("grid", f"cell {item!r} is not of the form N<needles>R<queries>, e.g. N4R2")
        n, r = int(m.group(1)), int(m.group(2))
        if not 1 <= r <= n:
            raise ConfigError("grid", f"cell {item!r}: need 1 <= R <= N")
        if n > len(CITIES):
            raise ConfigError("grid", f"cell {item!r}: at most {len(CITIES)} needles")
        if (n, r) in out:  # a duplicate row of the table, scored twice (as --depths 50,50 is refused)
            raise ConfigError("grid", f"cell {item.strip()!r} given twice; give each cell once")
        out.append((n, r))
    return out


def _template(name_or_text: str) -> str:
    t = TEMPLATES.get(name_or_text, name_or_text) if isinstance(name_or_text, str) else name_or_text
    if not isinstance(t, str) or "{city}" not in t or "{number}" not in t or t.index("{city}") > t.index("{number}"):
        raise ConfigError("template", f"needle template {t!r} needs '{{city}}' before '{{number}}' "
                                      f"(or a name: {', '.join(TEMPLATES)})")
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(t) if f is not None]
    except ValueError as e:  # a lone '{' or '}'
        fields = [f"({e})"]
    if sorted(fields) != ["city", "number"]:
        raise ConfigError("template", f"needle template {t!r} may hold only '{{city}}' and '{{number}}', once each; "
                                      "write a literal brace as '{{' or '}}'")
    return t


class Haystack:
    """A corpus split at sentence boundaries ('.', '!' or '?' before whitespace, or a newline), pre-tokenized.

    A sentence carries the whitespace before it, not after (the first one the text's last, or a space): a
    GPT-2-style BPE encodes '. The' as '.', ' The', so sentences encoded one by one give the text's tokens.
    """

    def __init__(self, text: str, tokenizer, max_chars: int = 1_000_000):
        text = text[:max_chars]
        cuts = [0] + [m.end() for m in re.finditer(r"[.!?]\s+|\n+", text)] + [len(text)]
        sentences, gap = [], ""
        for piece in (text[a:b] for a, b in zip(cuts, cuts[1:])):
            core = piece.rstrip()
            if core:
                sentences.append(gap + core)
                gap = piece[len(core):]
            else:
                gap += piece
        if sentences and not sentences[0][0].isspace():
            sentences[0] = (gap or " ") + sentences[0]  # what precedes it when the haystack wraps around
        self.sentences = [s for s in (encode(tokenizer, p, "haystack text") for p in sentences) if s]
        if not self.sentences:
            raise DataError("the haystack corpus is empty")
        self.space, self.decode = encode(tokenizer, " ", "haystack text"), getattr(tokenizer, "decode", None)

    def take(self, rng, n_tokens: int) -> tuple[list[int], list[int]]:
        """``n_tokens`` tokens of whole sentences from a random sentence on, and the sentence boundaries in them.

        The excess is cut from the front of the first sentence, so the last
        boundary (depth 100%) is a real sentence end; the first is the start.
        A cut sentence starts with a space in place of its first token (unless
        that token starts with whitespace), so a needle before it stays apart.
        """
        i = int(rng.integers(len(self.sentences)))
        ids, ends = [], []
        while len(ids) < n_tokens:
            ids.extend(self.sentences[i % len(self.sentences)])
            ends.append(len(ids))
            i += 1
        cut = len(ids) - n_tokens
        k = len(self.space)
        if cut and 0 < k < n_tokens and not (self.decode and self.decode(ids[cut:cut + 1])[:1].isspace()):
            ids[cut:cut + k] = self.space
        return ids[cut:], [0] + [e - cut for e in ends if e - cut > 0]


@dataclass
class NiahSample:
    ids: list[int]
    regions: list[int]  # one region id per token (NOISE, ANSWER, ...)
    answers: list[tuple[int, int]]  # [start, end) token spans of the R answers at the end
    numbers: list[str]
    cities: list[str]
    depth: float
    needles: int
    meta: dict = field(default_factory=dict)


class NiahBuilder:
    """Builds samples from one haystack for one tokenizer (tokenizes each piece once)."""

    def __init__(self, tokenizer, text: Optional[str] = None, data=None, template: str = "paper", digits: int = 5,
                 split: str = "val"):
        digits = check_count("digits", digits)  # digits=1.5 was read as 1, digits="x" a traceback
        if not 1 <= digits <= 12:
            raise ConfigError("digits", f"must be between 1 and 12, got {digits}")
        self.tok = tokenizer
        self.template = _template(template)
        self.digits = digits
        if text is not None and not isinstance(text, str):
            raise ConfigError("text", f"must be the haystack text itself, got {text!r}")
        self.haystack = Haystack(text if text is not None else corpus_text(data, split=split), tokenizer)
        head = self.template.split("{number}")[0]
        self.query_text = head.rstrip()
        self.answer_gap = head[len(self.query_text):]
        self.needle_gap = "" if self.template[0].isspace() else " "  # whitespace leads a needle, as a sentence

    def check_needles(self, needles: int, what: str = "needles") -> None:
        """ConfigError unless ``needles`` needles can get distinct cities and distinct ``digits``-digit numbers."""
        numbers = 10 ** self.digits - (10 ** (self.digits - 1) if self.digits > 1 else 0)
        if needles > len(CITIES):
            raise ConfigError(what, f"{needles} needles need {needles} distinct cities; there are {len(CITIES)}")
        if needles > numbers:
            raise ConfigError(what, f"{needles} needles need {needles} distinct {self.digits}-digit numbers; there are "
                                    f"{numbers} (raise --digits)")

    def _needle(self, city: str, number: str) -> tuple[list[int], list[int]]:
        """Needle tokens and their regions (number tokens marked ANSWER, the rest ANSWER_NEEDLE).

        The number is encoded as the answer is, with the whitespace before it (' 37704': a BPE's ' 37', '7', ...);
        tokens of that whitespace alone (a byte tokenizer's ' ') are not the number's.
        """
        after = self.template.split("{number}")[1]
        pre = encode(self.tok, self.needle_gap + self.query_text.format(city=city), "needle")
        num = encode(self.tok, self.answer_gap + number, "needle number")
        post = encode(self.tok, after.format(city=city).rstrip(), "needle") if after.strip() else []
        lead = self._lead(num)
        return pre + num + post, ([ANSWER_NEEDLE] * (len(pre) + lead) + [ANSWER] * (len(num) - lead)
                                  + [ANSWER_NEEDLE] * len(post))

    def _lead(self, num: list[int]) -> int:
        """How many leading tokens of an encoded ``answer_gap + number`` are the whitespace's alone (a byte
        tokenizer's ' '; none for a BPE's ' 37'): never the whole number."""
        gap = encode(self.tok, self.answer_gap, "needle") if self.answer_gap else []
        return next((i for i, (x, y) in enumerate(zip(num, gap)) if x != y), min(len(num) - 1, len(gap)))

    def min_length(self, needles: int, queries: int) -> int:
        """Tokens the needles and queries of the longest city names need (the haystack gets the rest)."""
        city = max(CITIES, key=lambda c: len(encode(self.tok, c, "city")))
        n = "9" * self.digits
        needle = len(self._needle(city, n)[0])
        qa = len(encode(self.tok, "\n" + self.query_text.format(city=city), "query")) + \
            len(encode(self.tok, self.answer_gap + n, "answer"))
        return needles * needle + queries * qa + 1

    def sample(self, rng, length: int, needles: int, queries: int, depth: Optional[float] = None) -> NiahSample:
        """One sample of exactly ``length`` tokens; ``depth`` None draws it uniformly."""
        self.check_needles(needles)
        cities = [CITIES[i] for i in rng.choice(len(CITIES), size=needles, replace=False)]
        lo = 10 ** (self.digits - 1) if self.digits > 1 else 0
        numbers = [str(int(v)) for v in rng.choice(10 ** self.digits - lo, size=needles, replace=False) + lo]
        pieces = [self._needle(c, n) for c, n in zip(cities, numbers)]
        qa = []
        for c, n in zip(cities[:queries], numbers[:queries]):
            q = encode(self.tok, "\n" + self.query_text.format(city=c), "query")
            qa.append((q, encode(self.tok, self.answer_gap + n, "answer")))
        fixed = sum(len(p[0]) for p in pieces) + sum(len(q) + len(a) for q, a in qa)
        budget = length - fixed
        if budget < 1:
            raise DataError(f"a length of {length} tokens cannot hold {needles} needles and {queries} queries "
                            f"({fixed} tokens); use longer --lengths, fewer needles or --template short")
        hay, bounds = self.haystack.take(rng, budget)
        d = float(rng.random()) if depth is None else float(depth)
        target = d * budget
        answer_at = min(bounds, key=lambda b: (abs(b - target), b))
        others = [b for b in bounds if b != answer_at] or bounds  # the answer needle alone at its depth
        where = [answer_at] + [int(others[j]) for j in rng.integers(len(others), size=needles - 1)]
        inserts: dict[int, list[int]] = {}
        for k in range(needles):
            inserts.setdefault(where[k], []).append(k)
        inserts = {b: [int(k) for k in rng.permutation(ks)] for b, ks in inserts.items()}  # random order at a boundary

        ids, regions, prev = [], [], 0
        for b in sorted(set(bounds) | set(inserts)):
            ids += hay[prev:b]
            regions += [NOISE] * (b - prev)
            prev = b
            for k in inserts.get(b, []):
                p_ids, p_reg = pieces[k]
                ids += p_ids
                regions += p_reg if k == 0 else [OTHER_NEEDLE] * len(p_ids)
        ids += hay[prev:]
        regions += [NOISE] * (len(hay) - prev)
        answers = []
        for q, a in qa:
            ids += q
            regions += [QUERY] * len(q)
            answers.append((len(ids), len(ids) + len(a)))
            ids += a
            regions += [QUERY] * len(a)
        assert len(ids) == length, (len(ids), length)
        return NiahSample(ids, regions, answers, numbers[:queries], cities, d, needles,
                          {"answer_needle_at": answer_at / budget if budget else 0.0,
                           "answer_lead": [self._lead(a) for _, a in qa]})  # whitespace-only tokens of each answer


# ----------------------------------------------------------------------------- scoring
@torch.no_grad()
def score_teacher_forced(model, samples: Sequence[NiahSample], batch_size: int) -> list[tuple[list[bool], list[float]]]:
    """Per sample: per-query exact match and per-query token accuracy of the answers under teacher forcing."""
    device, out = model_device(model), []
    for chunk in batches(list(samples), batch_size):
        ids = pad_right([s.ids for s in chunk]).to(device)
        pred = predictions(model, ids).cpu()
        for i, s in enumerate(chunk):
            em, acc = [], []
            for a, b in s.answers:
                ok = pred[i, a - 1:b - 1] == torch.tensor(s.ids[a:b])
                em.append(bool(ok.all()))
                acc.append(float(ok.float().mean()))
            out.append((em, acc))
    return out


@torch.no_grad()
def score_generation(model, tokenizer, samples: Sequence[NiahSample], batch_size: int,
                     extra_tokens: int = 2) -> list[list[bool]]:
    """Per sample, per query: does the number appear in the greedy continuation of the prompt up to the query."""
    device = model_device(model)
    jobs = [(i, j) for i, s in enumerate(samples) for j in range(len(s.answers))]
    found: dict[tuple[int, int], bool] = {}
    for chunk in batches(jobs, batch_size):
        prompts = [samples[i].ids[:samples[i].answers[j][0]] for i, j in chunk]
        # each query's own budget (its answer's tokens + extra_tokens), not its batch's longest: what a query is
        # scored on must not depend on the other queries in its batch (--batch-size)
        own = [b - a + extra_tokens for i, j in chunk for a, b in [samples[i].answers[j]]]
        hard = hard_limit(model)
        if hard is not None:  # learned positions: each query stays inside max_seq_len from its own prompt
            own = [max(1, min(n, hard - len(p))) for n, p in zip(own, prompts)]
        ids, mask = pad_left(prompts)
        n_new = max(own) if hard is None else max(1, min(max(own), hard - ids.shape[1]))
        out = model.generate(ids.to(device), max_new_tokens=n_new, do_sample=False, attention_mask=mask.to(device))
        for row, (i, j) in enumerate(chunk):
            if own[row] > n_new:  # the batch's longest prompt left it fewer tokens than its own: alone, as batch 1
                alone = torch.tensor([prompts[row]], dtype=torch.long, device=device)
                new = model.generate(alone, max_new_tokens=own[row], do_sample=False,
                                     attention_mask=torch.ones_like(alone))[0, alone.shape[1]:]
            else:
                new = out[row, ids.shape[1]:ids.shape[1] + own[row]]
            found[(i, j)] = samples[i].numbers[j] in tokenizer.decode(new.tolist())
    return [[found[(i, j)] for j in range(len(s.answers))] for i, s in enumerate(samples)]


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def evaluate_niah(model, tokenizer, grid=DEFAULT_GRID, lengths: Optional[Sequence[int]] = None,
                  depths: Sequence[float] = DEPTHS, samples: int = 4, digits: int = 5, template: str = "paper",
                  text: Optional[str] = None, data=None, seed: int = 0, generation: bool = True,
                  batch_size: Optional[int] = None, progress: bool = False) -> dict:
    """Multi-needle retrieval accuracy per (N, R, length, depth) cell, the N x R table and heat maps."""
    grid = parse_grid(grid)
    if not grid:
        raise ConfigError("grid", "must list at least one N x R cell")
    seed, generation = check_seed(seed), check_flag("generation", generation)
    samples = check_count("samples", samples)
    depths = check_depths(depths)
    if batch_size is not None:
        batch_size = check_count("batch_size", batch_size)
    limit, hard = task_context(model), hard_limit(model)
    lengths = sorted(set(check_list("lengths", lengths))) if lengths is not None else sorted({limit // 2, limit})
    builder = NiahBuilder(tokenizer, text=text, data=data, template=template, digits=digits)
    cells, skipped = [], []
    for n, r in grid:  # every cell can be built at all, before any is scored
        builder.check_needles(n, "grid")
    for n, r in grid:
        need = builder.min_length(n, r)
        for length in lengths:
            if hard is not None and length > hard:
                skipped.append({"needles": n, "queries": r, "length": length,
                                "reason": f"longer than max_seq_len={hard} ({model.config.positions} positions)"})
                continue
            if length < need:
                skipped.append({"needles": n, "queries": r, "length": length,
                                "reason": f"needs at least {need} tokens"})
                continue
            n_built = samples * len(depths)
            require_memory(model, n_built, length, f"{n_built:,} sample(s) of {length:,} tokens", "pass shorter "
                           "--lengths, fewer --samples or fewer --depths")
            try:  # min_length is exact for a byte tokenizer; a BPE tokenizes numbers and cities to varying lengths
                built = [[builder.sample(rng_for(seed, n, r, length, depth_key(d), k), length, n, r, d)
                          for k in range(samples)] for d in depths]
            except DataError:
                skipped.append({"needles": n, "queries": r, "length": length,
                                "reason": f"a drawn sample's needles and queries do not fit in {length} tokens "
                                          f"(its numbers or cities tokenize longer than the estimate, {need})"})
                continue
            for d, ss in zip(depths, built):
                cells.append(({"needles": n, "queries": r, "length": length, "depth": float(d)}, ss))
    if not cells:
        fix = f"pass --lengths up to {hard}" if hard is not None and min(lengths) > hard else \
            "pass longer --lengths, a smaller --grid or --template short"  # (not "longer" past max_seq_len)
        raise DataError(f"no N x R cell fits the lengths {lengths} (e.g. {skipped[0]['reason']} for "
                        f"N{skipped[0]['needles']}R{skipped[0]['queries']}); {fix}")
    for cell, ss in cells:
        bs = batch_size or map_batch_size(model.config.n_heads, cell["length"], cap=16)
        tf = score_teacher_forced(model, ss, bs)
        cell["samples"] = len(ss)
        cell["teacher_forced"] = _mean([_mean([float(e) for e in em]) for em, _ in tf])
        cell["token_accuracy"] = _mean([_mean(acc) for _, acc in tf])
        if generation:
            gen = score_generation(model, tokenizer, ss, bs)
            cell["generation"] = _mean([_mean([float(g) for g in row]) for row in gen])
        else:
            cell["generation"] = None
        if progress:
            print(f"  niah N{cell['needles']}R{cell['queries']} len {cell['length']} depth {cell['depth']:.2f}: "
                  f"tf {cell['teacher_forced']:.2f} gen {cell['generation'] if generation else '-'}", flush=True)
    cells = [c for c, _ in cells]
    return summarize(cells, skipped, lengths, list(map(float, depths)))


def summarize(cells: list[dict], skipped: list[dict], lengths: list[int], depths: list[float]) -> dict:
    metrics = ("teacher_forced", "token_accuracy", "generation")
    table, heatmaps = {}, {}
    for key in dict.fromkeys(f"N{c['needles']}R{c['queries']}" for c in cells):
        mine = [c for c in cells if f"N{c['needles']}R{c['queries']}" == key]
        table[key] = {m: _mean([c[m] for c in mine]) for m in metrics}
        lens = [L for L in lengths if any(c["length"] == L for c in mine)]
        heatmaps[key] = {"depths": depths, "lengths": lens}
        for m in metrics:
            heatmaps[key][m] = [[_mean([c[m] for c in mine if c["depth"] == d and c["length"] == L])
                                 for L in lens] for d in depths]
    overall = {m: _mean([c[m] for c in cells]) for m in metrics}
    return {"cells": cells, "table": table, "heatmaps": heatmaps, "overall": overall, "skipped": skipped}


def plot_niah(result: dict, path, metric: str = "teacher_forced") -> Optional[str]:
    """Left: the N x R table as bars; right: the depth x length heat map of the grid's last N x R cell (the
    hardest of the default grid)."""
    from .common import depth_percent, pyplot
    from ..io import atomic_savefig

    plt = pyplot()
    if plt is None:
        return None
    keys = list(result["table"])
    hm_key = keys[-1]
    hm = result["heatmaps"][hm_key]
    grid = [[float("nan") if v is None else v for v in row] for row in hm[metric]]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.4))
    a1.bar(keys, [result["table"][k][metric] or 0.0 for k in keys])
    a1.set_ylim(0, 1)
    a1.set_ylabel(f"accuracy ({metric.replace('_', '-')})")
    a1.set_title("multi-needle retrieval (Table 2)")
    im = a2.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    a2.set_xticks(range(len(hm["lengths"])), [str(x) for x in hm["lengths"]])
    a2.set_yticks(range(len(hm["depths"])), [depth_percent(d) for d in hm["depths"]])
    a2.set_xlabel("context length (tokens)")
    a2.set_ylabel("answer depth")
    a2.set_title(f"{hm_key} by depth and length (Fig. 5)")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if v == v:
                a2.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=a2)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)
    plt.close(fig)
    return str(path)


# ----------------------------------------------------------------------------- training task
class NiahTask:
    """Sampler for ``difftx train --task niah``: (x, y) of shape (B, seq_len), a pure function of (step, rank)."""

    def __init__(self, tokenizer, seq_len: int, seed: int = 0, needles="1-6", queries="1-2", digits: int = 5,
                 template: str = "paper", data=None, text: Optional[str] = None, loss_on: str = "answer",
                 seq_len_flag: str = "--seq-len"):
        # seq_len_flag: the caller's flag for seq_len, named in its errors (difftx compare: --retrieval-seq-len)
        if loss_on not in ("answer", "all"):
            raise ConfigError("loss_on", f"must be 'answer' or 'all', got {loss_on!r}")
        if not seq_len:
            raise ConfigError("seq_len", f"the niah task needs a sequence length ({seq_len_flag})")
        self.seq_len, self.seed, self.loss_on = int(seq_len), int(seed), loss_on
        self.needles, self.queries = parse_range(needles, "needles"), parse_range(queries, "queries")
        # haystacks from the training part of the built-in corpus (the evaluation uses its validation tail)
        self.builder = NiahBuilder(tokenizer, text=text, data=data, template=template, digits=digits, split="train")
        self.builder.check_needles(self.needles[1])
        need = self.builder.min_length(self.needles[1], min(self.queries[1], self.needles[1]))
        if need > self.seq_len + 1:
            raise ConfigError("seq_len", f"{self.seq_len} is too short for {self.needles[1]} needles "
                                         f"(needs {need - 1}); raise {seq_len_flag} to {need - 1}, lower needles"
                                         + (" or template=short" if template != "short" else ""))

    def sample(self, step: int, rank: int, row: int) -> NiahSample:
        rng = rng_for(self.seed, step, rank, row, 0x4E1A)
        n = int(rng.integers(self.needles[0], self.needles[1] + 1))
        r = int(rng.integers(self.queries[0], min(self.queries[1], n) + 1))
        return self.builder.sample(rng, self.seq_len + 1, n, r, depth=None)

    def batch(self, batch_size: int, step: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = [], []
        for row in range(batch_size):
            s = self.sample(step, rank, row)
            ids = torch.tensor(s.ids, dtype=torch.long)
            y = ids[1:].clone()
            if self.loss_on == "answer":
                keep = torch.zeros_like(y, dtype=torch.bool)
                for a, b in s.answers:
                    keep[a - 1:b - 1] = True
                y[~keep] = -100
            xs.append(ids[:-1])
            ys.append(y)
        return torch.stack(xs), torch.stack(ys)


@register_task("niah")
def niah_task(tokenizer, seq_len: int, seed: int = 0, *, seq_len_flag: str = "--seq-len", **options) -> NiahTask:
    """Multi-needle retrieval samples (options: needles, queries, digits, template, data, loss_on).
    ``seq_len_flag``: the caller's flag for ``seq_len``, which its errors name (not a task option)."""
    check_options("niah", options, TASK_OPTIONS)
    return NiahTask(tokenizer, seq_len, seed, seq_len_flag=seq_len_flag, **options)
