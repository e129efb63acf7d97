"""Many-shot in-context classification (DIFF paper section 3.5, Fig. 6) and its order robustness (Fig. 7, 9).

Prompt format (Bertsch et al. 2024), each piece tokenized on its own so a
label's tokens are identical in demonstrations and in scoring:

    Input: <text>\\nLabel: <label>\\n      (k demonstrations)
    Input: <test text>\\nLabel:           -> " <label>\\n" chosen by constrained decoding

Label-constrained scoring (Ratner et al. 2023): greedy decoding restricted to
a trie of the candidate labels' tokens (each ends with a newline, so no label
is a prefix of another); decoding stops as soon as only one label is left.

Tasks: ``synthetic-C`` (C classes; e.g. 6, 50, 150 like TREC, TREC-fine,
Clinic-150) generated here -- each class has a pseudo-word label and three
keywords, an input is two of its class's keywords and two shared filler words
in random order, so the mapping can only be learnt from the demonstrations --
or a user JSONL file with ``text`` and ``label`` fields.

For each number of shots k the same k demonstrations (class-balanced, fixed by
``seed``) are presented in S orders (seeds): ``random`` (shuffled) and
``alternating`` (round robin over the classes, class and within-class order
shuffled).  Per k: mean accuracy (Fig. 6) and best, worst and margin = best -
worst over the orders (Fig. 7, 9).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..errors import ConfigError, DataError
from .common import (batches, check_count, check_list, check_seed, encode, first_repeat, hard_limit, model_device,
                     pad_left, require_memory, rng_for, task_context)

ARRANGEMENTS = ("random", "alternating")
# the most orders per point and test examples per task: each order is a forward per test example, so more ran for
# hours (--seeds 10**12: for ever; --test-examples 10**12 without the memory check: a MemoryError)
MAX_SEEDS, MAX_TEST_EXAMPLES = 10_000, 100_000
_CONS, _VOWELS = "bdfgklmnprstvz", "aeiou"


@dataclass
class Example:
    text: str
    label: str


@dataclass
class ClassificationTask:
    name: str
    labels: list[str]
    train: list[Example]
    test: list[Example]


def _pseudo_words(rng, n: int, syllables: int, taken: set) -> list[str]:
    out = []
    while len(out) < n:
        w = "".join(_CONS[rng.integers(len(_CONS))] + _VOWELS[rng.integers(len(_VOWELS))] for _ in range(syllables))
        if w not in taken:
            taken.add(w)
            out.append(w)
    return out


def synthetic_task(n_classes: int, n_train_per_class: int = 32, n_test: int = 24, seed: int = 1234) -> ClassificationTask:
    """A keyword-to-label task with ``n_classes`` classes (fixed by ``seed``, not by the evaluation seed)."""
    if not 2 <= n_classes <= 1000:
        raise ConfigError("task", f"synthetic tasks need 2..1000 classes, got {n_classes}")
    rng = rng_for(seed, n_classes)
    taken: set = set()
    labels = _pseudo_words(rng, n_classes, 2, taken)
    keywords = [_pseudo_words(rng, 3, 3, taken) for _ in range(n_classes)]
    fillers = _pseudo_words(rng, 12, 2, taken)

    def example(c: int) -> Example:
        words = list(rng.choice(keywords[c], 2, replace=False)) + list(rng.choice(fillers, 2, replace=False))
        return Example(" ".join(str(w) for w in rng.permutation(words)), labels[c])

    train = [example(c) for c in range(n_classes) for _ in range(n_train_per_class)]
    test = [example(int(c)) for c in rng.integers(n_classes, size=n_test)]
    return ClassificationTask(f"synthetic-{n_classes}", labels, train, test)


def jsonl_task(path, n_test: int = 24, text_key: str = "text", label_key: str = "label",
               seed: int = 0) -> ClassificationTask:
    """Examples from a JSONL file ({"text": ..., "label": ...} per line); ``n_test`` of them held out for testing."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: JSONL file not found")
    try:
        content = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{p}: not UTF-8 text (bad byte at offset {e.start}); convert it to UTF-8") from None
    rows = []
    for i, line in enumerate(content.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            rows.append(Example(str(obj[text_key]).replace("\n", " "), str(obj[label_key]).strip()))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise DataError(f"{p}:{i}: expected a JSON object with '{text_key}' and '{label_key}'") from None
    labels = sorted({r.label for r in rows})
    if len(labels) < 2:
        raise DataError(f"{p}: need at least 2 distinct labels, found {len(labels)}")
    if any("\n" in lab or not lab for lab in labels):
        raise DataError(f"{p}: labels must be non-empty single lines")
    if len(rows) <= n_test:
        raise DataError(f"{p}: {len(rows)} examples; need more than --test-examples={n_test}")
    order = rng_for(seed, 0x1C1).permutation(len(rows))
    test = [rows[i] for i in order[:n_test]]
    train = [rows[i] for i in order[n_test:]]
    return ClassificationTask(p.stem, labels, train, test)


def resolve_task(spec: str, n_test: int = 24, **jsonl_options) -> ClassificationTask:
    if spec.startswith("synthetic-"):
        try:
            n = int(spec.split("-", 1)[1])
        except ValueError:
            raise ConfigError("task", f"{spec!r}: expected synthetic-<classes>, e.g. synthetic-6") from None
        return synthetic_task(n, n_test=n_test)
    if spec.endswith(".jsonl") or Path(spec).is_file():
        return jsonl_task(spec, n_test=n_test, **jsonl_options)
    raise ConfigError("task", f"{spec!r} is neither synthetic-<classes> nor a JSONL file")


# ----------------------------------------------------------------------------- prompts and scoring
class LabelTrie:
    """Token trie of the candidate labels; each node knows the labels below it, so decoding can stop early."""

    def __init__(self, label_tokens: list[list[int]]):
        self.root: dict = {"children": {}, "labels": set()}
        for i, toks in enumerate(label_tokens):
            node = self.root
            node["labels"].add(i)
            for t in toks:
                node = node["children"].setdefault(t, {"children": {}, "labels": set()})
                node["labels"].add(i)
        if len({tuple(t) for t in label_tokens}) != len(label_tokens):
            raise DataError("two labels have the same tokens; labels must differ")
        self.depth = max(len(t) for t in label_tokens)


def _repeat_cache(cache, rows: int, new_cache):
    """A cache for ``rows`` sequences that all start with the (single-row) ``cache``'s prefix."""
    out = new_cache(rows)
    for i, (k, v) in enumerate(zip(cache.k, cache.v)):
        if k is not None:
            out.k[i] = k.expand(rows, *k.shape[1:]).clone()
            out.v[i] = v.expand(rows, *v.shape[1:]).clone()
    out.length = cache.length
    out.dropped = cache.dropped
    out.padded = cache.padded
    out.key_valid = cache.key_valid.expand(rows, -1).clone()
    out.next_position = cache.next_position.expand(rows).clone()
    return out


@torch.no_grad()
def constrained_classify(model, prefix: list[int], queries: list[list[int]], trie: LabelTrie,
                         batch_size: int = 16) -> list[int]:
    """Index of the label each ``prefix + query`` continues with, by greedy decoding restricted to the trie.

    The shared prefix (the demonstrations) is run once; its KV cache is copied
    to every query of a batch, and the queries, left-padded, continue from it.
    """
    device, out = model_device(model), []
    max_len = len(prefix) + max(len(q) for q in queries) + trie.depth + 1
    prefix_cache = None
    if prefix:
        prefix_cache = model.new_cache(1, max_len)
        model.features(torch.tensor([prefix], device=device), cache=prefix_cache)  # fills the cache; no logits
    for chunk in batches(queries, batch_size):
        ids, mask = pad_left(chunk)
        if prefix_cache is None:
            cache = model.new_cache(len(chunk), max_len)
        else:
            cache = _repeat_cache(prefix_cache, len(chunk), lambda b: model.new_cache(b, max_len))
        hidden = model.features(ids.to(device), mask.to(device), cache=cache)
        logits = model.head(hidden[:, -1]).float().cpu()  # the last position's logits, not all (B, N, V)
        nodes = [trie.root] * len(chunk)
        for _ in range(trie.depth):
            if all(len(n["labels"]) == 1 for n in nodes):
                break
            nxt = []
            for r, node in enumerate(nodes):
                if len(node["labels"]) == 1:
                    nxt.append(0)
                    continue
                allowed = list(node["children"])
                best = allowed[int(logits[r, allowed].argmax())]
                nodes[r] = node["children"][best]
                nxt.append(best)
            logits = model(torch.tensor(nxt, device=device)[:, None], cache=cache).logits[:, -1].float().cpu()
        out.extend(next(iter(n["labels"])) for n in nodes)
    return out


class PromptBuilder:
    def __init__(self, tokenizer, task: ClassificationTask):
        self.tok, self.task = tokenizer, task
        self.label_ids = {lab: encode(tokenizer, f" {lab}\n", "label") for lab in task.labels}
        self.trie = LabelTrie([self.label_ids[lab] for lab in task.labels])
        self._cache: dict[int, list[int]] = {}

    def query(self, ex: Example) -> list[int]:
        key = id(ex)
        if key not in self._cache:
            self._cache[key] = encode(self.tok, f"Input: {ex.text}\nLabel:", "input text")
        return self._cache[key]

    def demo(self, ex: Example) -> list[int]:
        return self.query(ex) + self.label_ids[ex.label]


def balanced_demos(task: ClassificationTask, k: int, seed: int) -> list[Example]:
    """The first k of a class-balanced pool (round robin over classes, each class shuffled; fixed by seed)."""
    rng = rng_for(seed, 0xDE30)
    by_class = {lab: [] for lab in task.labels}
    for ex in task.train:
        by_class[ex.label].append(ex)
    queues = [[by_class[lab][i] for i in rng.permutation(len(by_class[lab]))] for lab in
              [task.labels[i] for i in rng.permutation(len(task.labels))]]
    pool, depth = [], 0
    while len(pool) < k and any(depth < len(q) for q in queues):
        pool += [q[depth] for q in queues if depth < len(q)]
        depth += 1
    if len(pool) < k:
        raise DataError(f"{task.name}: only {len(pool)} training examples for {k} shots")
    return pool[:k]


def arrange(demos: list[Example], how: str, seed: int) -> list[Example]:
    """``random``: a permutation; ``alternating``: round robin over classes in a permuted class order."""
    rng = rng_for(seed, 0xA22)
    if how == "random":
        return [demos[i] for i in rng.permutation(len(demos))]
    if how != "alternating":
        raise ConfigError("arrangement", f"must be one of {ARRANGEMENTS}, got {how!r}")
    groups: dict[str, list[Example]] = {}
    for ex in demos:
        groups.setdefault(ex.label, []).append(ex)
    keys = [list(groups)[i] for i in rng.permutation(len(groups))]
    queues = [[groups[k][i] for i in rng.permutation(len(groups[k]))] for k in keys]
    out, depth = [], 0
    while len(out) < len(demos):
        out += [q[depth] for q in queues if depth < len(q)]
        depth += 1
    return out


def _stats(accs: list[float]) -> dict:
    m = sum(accs) / len(accs)
    return {"accuracies": accs, "mean": m, "best": max(accs), "worst": min(accs), "margin": max(accs) - min(accs),
            "std": (sum((a - m) ** 2 for a in accs) / len(accs)) ** 0.5}


def evaluate_task(model, tokenizer, task: ClassificationTask, shots: Optional[Sequence[int]] = None,
                  seeds: int = 3, arrangements: Sequence[str] = ARRANGEMENTS, max_len: Optional[int] = None,
                  seed: int = 0, batch_size: int = 16, progress: bool = False) -> dict:
    pb = PromptBuilder(tokenizer, task)
    hard = hard_limit(model)
    if max_len is not None:  # --max-len 1000 on a model with learned positions up to 64 was silently 64
        max_len = check_count("max_len", max_len)
        if hard is not None and max_len > hard:
            raise ConfigError("max_len", f"{max_len} exceeds max_seq_len={hard} of a model with "
                                         f"{model.config.positions} positions; pass --max-len up to {hard}")
    max_len = max_len or task_context(model)
    longest_query = max(len(pb.query(ex)) for ex in task.test)
    need = longest_query + pb.trie.depth
    if need > max_len and 0 in (shots or ()):  # --shots 0 ran past --max-len (learned positions: the model's error)
        fix = f"pass --max-len {need} or more" if hard is None or need <= hard else \
            f"pass shorter test texts (the model's positions end at {hard})"
        raise DataError(f"{task.name}: the longest test input and its label take {need} tokens, more than the "
                        f"prompt limit of {max_len} (--max-len); {fix}")
    pool = balanced_demos(task, len(task.train), seed)
    used, fit = 0, 0
    for ex in pool:  # how many demonstrations fit beside the longest test input and its label
        used += len(pb.demo(ex))
        if used + longest_query + pb.trie.depth > max_len:
            break
        fit += 1
    if shots is None:
        shots = [k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if k <= fit]
        if fit and fit not in shots and fit > 1:
            shots.append(fit)
    shots = [int(k) for k in shots]
    skipped = [{"shots": k, "reason": f"does not fit in {max_len} tokens (at most {fit} shots)"}
               for k in shots if k > fit]
    asked, shots = shots, [k for k in shots if k <= fit]
    if not shots:
        longer = hard is None or max_len < hard  # --max-len can give more room
        if fit:  # --shots 5 where 4 fit was "not even one demonstration fits"
            raise ConfigError("shots", f"{task.name}: at most {fit} demonstration(s) fit in {max_len} tokens beside "
                                       f"the test input, and {min(asked)} were asked for; pass --shots up to {fit}"
                                       + (" or a longer --max-len" if longer else ""))
        raise DataError(f"{task.name}: not even one demonstration fits in {max_len} tokens beside the test input"
                        + ("; pass a longer --max-len" if longer else ""))
    curves = {a: [] for a in arrangements}
    for k in shots:
        demos = pool[:k]
        for how in arrangements:
            accs = []
            for s in range(seeds):
                prefix = [t for ex in arrange(demos, how, seed * 1000 + s) for t in pb.demo(ex)]
                pred = constrained_classify(model, prefix, [pb.query(ex) for ex in task.test], pb.trie, batch_size)
                accs.append(sum(task.labels[p] == ex.label for p, ex in zip(pred, task.test)) / len(task.test))
            curves[how].append({"shots": k, **_stats(accs)})
            if progress:
                st = curves[how][-1]
                print(f"  icl {task.name} {how} {k}-shot: mean {st['mean']:.3f} margin {st['margin']:.3f}", flush=True)
    return {"task": task.name, "classes": len(task.labels), "chance": 1 / len(task.labels),
            "test_examples": len(task.test), "seeds": seeds, "max_shots_that_fit": fit, "curves": curves,
            "skipped": skipped}


def evaluate_icl(model, tokenizer, tasks: Sequence[str] = ("synthetic-6",),
                 shots: Optional[Sequence[int]] = None, seeds: int = 3, arrangements: Sequence[str] = ARRANGEMENTS,
                 test_examples: int = 16, max_len: Optional[int] = None, seed: int = 0, batch_size: int = 16,
                 text_key: str = "text", label_key: str = "label", progress: bool = False) -> dict:
    """Fig. 6 / 7 / 9 numbers for each task; ``overall_accuracy`` is the mean over every (task, order, shots)."""
    if isinstance(tasks, str):
        tasks = [tasks]
    if isinstance(arrangements, str):
        arrangements = [arrangements]
    for name, values in (("tasks", tasks), ("arrangements", arrangements)):  # arrangements=1 was a TypeError
        if not isinstance(values, (list, tuple)) or not all(isinstance(v, str) for v in values):
            raise ConfigError(name, f"must be a name or a list of names, got {values!r}")
        twice = first_repeat(values)
        if twice is not None:  # its points were scored and counted twice in overall_accuracy
            raise ConfigError(name, f"{twice!r} given twice; give each name once")
    seed = check_seed(seed)
    if not tasks:
        raise ConfigError("tasks", "must name at least one task")
    if not arrangements:
        raise ConfigError("arrangements", f"must name at least one of {ARRANGEMENTS}")
    seeds, test_examples = check_count("seeds", seeds), check_count("test_examples", test_examples)
    for name, value, limit, what in (("seeds", seeds, MAX_SEEDS, "demonstration orders per point"),
                                     ("test_examples", test_examples, MAX_TEST_EXAMPLES, "test examples per task")):
        if value > limit:
            raise ConfigError(name, f"at most {limit:,} {what}, got {value:,}; pass fewer --{name.replace('_', '-')}")
    require_memory(model, test_examples, 1, f"{test_examples:,} test examples per task", "pass fewer "
                   "--test-examples", per_token=128)  # an example (its text and object) holds ~175 bytes
    batch_size = check_count("batch_size", batch_size)
    if shots is not None:
        shots = check_list("shots", shots, 0)
    for a in arrangements:
        if a not in ARRANGEMENTS:
            raise ConfigError("arrangement", f"must be one of {ARRANGEMENTS}, got {a!r}")
    results = []
    for spec in tasks:
        task = resolve_task(spec, n_test=test_examples, text_key=text_key, label_key=label_key, seed=seed)
        results.append(evaluate_task(model, tokenizer, task, shots, seeds, arrangements, max_len, seed, batch_size,
                                     progress))
    means = [pt["mean"] for r in results for c in r["curves"].values() for pt in c]
    return {"tasks": results, "overall_accuracy": sum(means) / len(means)}


def plot_icl(result: dict, path) -> Optional[str]:
    from .common import pyplot
    from ..io import atomic_savefig

    plt = pyplot()
    if plt is None:
        return None
    n = len(result["tasks"])
    fig, axes = plt.subplots(1, n, figsize=(4.5 * n, 3.2), squeeze=False)
    for ax, t in zip(axes[0], result["tasks"]):
        for how, pts in t["curves"].items():
            xs = [p["shots"] for p in pts]
            line, = ax.plot(xs, [p["mean"] for p in pts], marker="o", label=f"{how} (mean)")
            ax.fill_between(xs, [p["worst"] for p in pts], [p["best"] for p in pts], alpha=0.2, color=line.get_color())
        ax.axhline(t["chance"], color="grey", ls=":", lw=1, label="chance")
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1)
        ax.set_xlabel("demonstrations")
        ax.set_ylabel("accuracy")
        ax.set_title(f"{t['task']}: mean, best-worst band")
        ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)
    plt.close(fig)
    return str(path)
