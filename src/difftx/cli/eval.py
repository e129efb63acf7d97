"""``difftx eval NAME --checkpoint DIR --out DIR``: the papers' evaluations on a checkpoint.

Thin: parses, loads the checkpoint, calls the library function in
:mod:`difftx.evals`, writes ``NAME.json`` (and ``NAME.png`` when matplotlib is
installed) and prints a short summary.  ``--quant-bits B`` runs any evaluation
with its attention logits quantized (``difftx.evals.quant``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
from pathlib import Path

from ..errors import ConfigError, DifftxError

EVALS = {
    "lm": "validation loss, perplexity, cumulative NLL by position, AR-Hit / Others (Fig. 4, Table 6)",
    "niah": "multi-needle retrieval: N x R table and depth x length heat map (Table 2, Fig. 5)",
    "mqar": "Zoology multi-query associative recall over sequence lengths and numbers of pairs",
    "attention": "attention share on the answer vs the noise context, per depth and layer (Table 3)",
    "outliers": "top-k and median of |attention logits| and |hidden states| (Table 5)",
    "quant": "a metric vs attention-logit quantization bits, 16/8/6/4 (Fig. 8)",
    "icl": "many-shot in-context classification and order robustness (Fig. 6, 7, 9)",
    "lm-eval": "lm-evaluation-harness tasks through the difftx adapter (needs the eval extra)",
}


def _list(kind, lo=-math.inf, hi=math.inf):
    """A comma-separated list of ``kind``, every item in [lo, hi]."""
    def parse(text: str):
        try:
            out = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}, got {text!r}")
        if not out:  # ',' or '': an empty list would crash later (or silently mean the default)
            raise argparse.ArgumentTypeError(f"expected a non-empty comma-separated list of {kind.__name__}, "
                                             f"got {text!r}")
        bad = [x for x in out if not lo <= x <= hi] if (lo, hi) != (-math.inf, math.inf) else []
        if bad:
            where = f"at least {lo}" if hi == math.inf else f"between {lo} and {hi}"
            raise argparse.ArgumentTypeError(f"every value must be {where}, got {bad[0]}")
        twice = next((x for i, x in enumerate(out) if x in out[:i]), None)
        if twice is not None:  # a duplicate row or point (and icl's overall accuracy counted its shots twice)
            raise argparse.ArgumentTypeError(f"{twice!r} given twice; give each value once")
        return out
    parse.__name__ = f"{kind.__name__} list"
    return parse


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _number(lo: float, hi: float = math.inf, lo_open: bool = True):
    """A finite float in (lo, hi] (or [lo, hi] when not ``lo_open``): NaN, inf and out-of-range values are refused."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        if not (math.isfinite(v) and (lo < v if lo_open else lo <= v) and v <= hi):
            where = f"{'>' if lo_open else '>='} {lo:g}" if hi == math.inf else \
                f"in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
            raise argparse.ArgumentTypeError(f"expected a finite number {where}, got {text!r}")
        return v
    parse.__name__ = "number"
    return parse


def _force(p) -> None:
    p.add_argument("--force", action="store_true",
                   help="overwrite an earlier result of this evaluation in --out (refused without it)")


def _common(p, corpus: bool = True) -> None:
    p.add_argument("--checkpoint", required=True, help="model, checkpoint or training-run directory")
    p.add_argument("--out", required=True, help="directory for NAME.json (and NAME.png)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed for sampled data (default: 0; lm, outliers and quant's lm metric sample nothing)")
    p.add_argument("--batch-size", type=_positive, default=None, help="sequences per forward (default: by size)")
    p.add_argument("--quant-bits", type=int, default=None,
                   help="run with attention logits quantized to this many bits (absmax, dynamic)")
    p.add_argument("--quant-granularity", choices=["head", "row", "tensor"], default=None,
                   help="what shares one absmax scale when quantizing (default: head)")
    p.add_argument("--no-plot", action="store_true", help="do not write NAME.png")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    _force(p)
    if corpus:
        p.add_argument("--data", default=None,
                       help="UTF-8 text file (default: the tail of the built-in corpus, the trainer's validation split)")


def _niah_like(p) -> None:
    p.add_argument("--digits", type=_positive, default=5, help="digits of each magic number (default: 5)")
    p.add_argument("--template", default="paper",
                   help="needle template: 'paper' (The special magic number for {city} is: {number}.), "
                        "'short' ({city}: {number}.) or your own with {city} and {number}")


def _document_masking(p) -> None:
    p.add_argument("--document-masking", action="store_true",
                   help="each window's documents (ended by the tokenizer's end-of-text token in the text) attend "
                        "only to themselves, as difftx train --document-masking trains")


def _document_eos(args, tok, settings: dict) -> dict:
    """``settings`` with ``document_eos`` (the tokenizer's end-of-text id) under --document-masking."""
    if args.document_masking:
        if tok.eos_id is None:
            raise ConfigError("document_masking", f"needs the documents ended by an end-of-text token, and the "
                                                  f"checkpoint's {tok.kind} tokenizer has none; drop it")
        settings["document_eos"] = tok.eos_id
    return settings


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="run one of the papers' evaluations on a checkpoint",
                       description="Run one of the papers' evaluations on a checkpoint; writes NAME.json "
                                   "(schemas in docs/evals.md) and NAME.png into --out.")
    ev = p.add_subparsers(dest="eval_name", metavar="NAME", parser_class=type(p))
    ev.required = True

    q = ev.add_parser("lm", help=EVALS["lm"], description=EVALS["lm"])
    _common(q)
    q.add_argument("--seq-len", type=_positive, default=None, help="window length (default: max_seq_len, <= 1024)")
    q.add_argument("--max-tokens", type=_positive, default=8192, help="token budget (default: 8192)")
    q.add_argument("--ar-max-freq", type=_positive, default=None,
                   help="AR-Hit only for bigrams seen at most this often in the evaluated text (default: any)")
    _document_masking(q)

    q = ev.add_parser("niah", help=EVALS["niah"], description=EVALS["niah"])
    _common(q)
    _niah_like(q)
    q.add_argument("--grid", default="N1R1,N2R2,N4R2,N6R2", help="N x R cells (default: Table 2's)")
    q.add_argument("--lengths", type=_list(int, lo=1), default=None,
                   help="context lengths in tokens (default: L/2 and L, L = max_seq_len within 256..1024, at most "
                        "max_seq_len for learned or sinusoidal positions; RoPE models may go past max_seq_len)")
    q.add_argument("--depths", type=_list(float), default=[0, 25, 50, 75, 100],
                   help="answer depths in percent (default: 0,25,50,75,100)")
    q.add_argument("--samples", type=_positive, default=4, help="samples per cell (default: 4; the paper: 50)")
    q.add_argument("--no-generation", action="store_true", help="teacher-forced scoring only (faster)")

    q = ev.add_parser("mqar", help=EVALS["mqar"], description=EVALS["mqar"])
    _common(q, corpus=False)
    q.add_argument("--lengths", type=_list(int, lo=1), default=[64, 128, 256],
                   help="sequence lengths (default: 64,128,256)")
    q.add_argument("--pairs", type=_list(int, lo=1), default=[4, 8, 16, 32],
                   help="key-value pairs (default: 4,8,16,32)")
    q.add_argument("--samples", type=_positive, default=16, help="sequences per cell (default: 16)")
    q.add_argument("--vocab", type=_positive, default=None, help="ids used (default: the model's vocabulary)")
    q.add_argument("--power-a", type=_number(0, 10), default=0.01,
                   help="query-gap power law exponent, in (0, 10] (default: 0.01; 1: uniform gaps)")

    q = ev.add_parser("attention", help=EVALS["attention"], description=EVALS["attention"])
    _common(q)
    _niah_like(q)
    q.add_argument("--length", type=_positive, default=None,
                   help="context length (default: max_seq_len within 256..1024; at most max_seq_len for learned or "
                        "sinusoidal positions)")
    q.add_argument("--needles", type=_positive, default=1, help="needles per sample (default: 1)")
    q.add_argument("--depths", type=_list(float), default=[0, 25, 50, 75, 100], help="answer depths in percent")
    q.add_argument("--samples", type=_positive, default=8, help="samples per depth (default: 8)")
    q.add_argument("--normalize", choices=["l1", "rowsum", "positive", "none"], default="l1",
                   help="how an attention row is normalised (default: l1; see docs/evals.md)")

    q = ev.add_parser("outliers", help=EVALS["outliers"], description=EVALS["outliers"])
    _common(q)
    q.add_argument("--seq-len", type=_positive, default=None, help="window length (default: max_seq_len, <= 1024)")
    q.add_argument("--max-tokens", type=_positive, default=8192, help="token budget (default: 8192; paper: 400000)")
    _document_masking(q)

    q = ev.add_parser("quant", help=EVALS["quant"], description=EVALS["quant"])
    _common(q)
    q.add_argument("--bits", type=_list(int, lo=2, hi=32), default=[16, 8, 6, 4],
                   help="bit widths, each 2..32 (default: 16,8,6,4)")
    q.add_argument("--metric", choices=["lm", "niah", "mqar", "icl"], default="lm",
                   help="what to measure at each width (default: lm validation loss)")
    q.add_argument("--max-tokens", type=_positive, default=None,
                   help="token budget of the lm metric (default: 4096)")
    q.add_argument("--metric-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the metric's evaluation (repeatable; values parsed as JSON), e.g. "
                        "--metric-opt template=short --metric-opt 'lengths=[128]'")

    q = ev.add_parser("icl", help=EVALS["icl"], description=EVALS["icl"])
    _common(q, corpus=False)
    q.add_argument("--tasks", type=_list(str), default=["synthetic-6"],
                   help="synthetic-C (C classes, e.g. synthetic-6,synthetic-50,synthetic-150) or JSONL files "
                        "with text/label fields (default: synthetic-6)")
    q.add_argument("--shots", type=_list(int, lo=0), default=None,
                   help="numbers of demonstrations (default: 1,2,4,... up to what fits)")
    q.add_argument("--seeds", type=_positive, default=3, help="demonstration orders per point (default: 3)")
    q.add_argument("--arrangements", type=_list(str), default=["random", "alternating"],
                   help="random and/or alternating (by class)")
    q.add_argument("--test-examples", type=_positive, default=16, help="test inputs per task (default: 16)")
    q.add_argument("--max-len", type=_positive, default=None, 
                   help="prompt length limit (default: max_seq_len within 256..1024; at most max_seq_len for learned "
                        "or sinusoidal positions)")
    q.add_argument("--text-key", default=None, help="JSONL text field (default: text)")
    q.add_argument("--label-key", default=None, help="JSONL label field (default: label)")

    q = ev.add_parser("lm-eval", help=EVALS["lm-eval"], description=EVALS["lm-eval"])
    q.add_argument("--checkpoint", required=True, help="model, checkpoint or training-run directory")
    q.add_argument("--out", required=True, help="directory for lm-eval.json")
    q.add_argument("--tasks", type=_list(str), required=True, help="comma-separated lm-eval task names")
    q.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples per task")
    q.add_argument("--limit", type=_number(0), default=None, help="examples per task (or a fraction)")
    q.add_argument("--batch-size", type=_positive, default=None, help="batch size")
    q.add_argument("--device", default=None, help="cpu, cuda, ...")
    q.add_argument("--seed", type=int, default=None, help="the harness's seeds (default: the adapter's)")
    _force(q)
    p.set_defaults(func=run)


# ----------------------------------------------------------------------------- running
def _say(args, msg: str) -> None:
    if not getattr(args, "quiet", False):
        print(msg, flush=True)


def _depths(values) -> list[float]:
    out = [v / 100.0 for v in values]
    if any(not 0.0 <= d <= 1.0 for d in out):
        raise ConfigError("depths", f"depths are percentages between 0 and 100, got {values}")
    return out


def _run_eval(args, model, tok) -> tuple[dict, dict]:
    """(results, settings) of the chosen evaluation."""
    name, prog = args.eval_name, not args.quiet
    bs = {"batch_size": args.batch_size} if args.batch_size else {}
    seed = 0 if args.seed is None else args.seed
    if name == "lm":
        from ..evals.lm import evaluate_lm_text
        s = _document_eos(args, tok, dict(data=args.data, seq_len=args.seq_len, max_tokens=args.max_tokens,
                                          ar_max_freq=args.ar_max_freq, **bs))
        return evaluate_lm_text(model, tok, progress=prog, **s), s
    if name == "niah":
        from ..evals.niah import evaluate_niah
        s = dict(grid=args.grid, lengths=args.lengths, depths=_depths(args.depths), samples=args.samples,
                 digits=args.digits, template=args.template, data=args.data, seed=seed,
                 generation=not args.no_generation, **bs)
        return evaluate_niah(model, tok, progress=prog, **s), s
    if name == "mqar":
        from ..evals.mqar import evaluate_mqar
        s = dict(lengths=args.lengths, pairs=args.pairs, samples=args.samples, vocab=args.vocab,
                 power_a=args.power_a, seed=seed, **bs)
        return evaluate_mqar(model, progress=prog, **s), s
    if name == "attention":
        from ..evals.attention import evaluate_attention
        s = dict(depths=_depths(args.depths), length=args.length, needles=args.needles, samples=args.samples,
                 digits=args.digits, template=args.template, normalize=args.normalize, data=args.data,
                 seed=seed, **bs)
        return evaluate_attention(model, tok, progress=prog, **s), s
    if name == "outliers":
        from ..evals.outliers import evaluate_outliers_text
        s = _document_eos(args, tok, dict(data=args.data, seq_len=args.seq_len, max_tokens=args.max_tokens, **bs))
        return evaluate_outliers_text(model, tok, progress=prog, **s), s
    if name == "quant":
        from ..evals.quant import evaluate_quant
        from .info import parse_overrides
        opts = {"lm": dict(data=args.data, max_tokens=args.max_tokens or 4096),
                "niah": dict(data=args.data, seed=seed), "mqar": dict(seed=seed), "icl": dict(seed=seed)}[args.metric]
        opts.update(bs)
        opts.update(parse_overrides(args.metric_opt, "--metric-opt"))
        s = dict(bits=args.bits, granularity=args.quant_granularity or "head", metric=args.metric, metric_options=opts)
        try:
            return evaluate_quant(model, tok, progress=prog, **s), s
        except DifftxError as e:
            e.args = (_metric_opt_message(str(e), args, opts),)
            raise
    if name == "icl":
        from ..evals.icl import evaluate_icl
        s = dict(tasks=args.tasks, shots=args.shots, seeds=args.seeds, arrangements=args.arrangements,
                 test_examples=args.test_examples, max_len=args.max_len, seed=seed,
                 text_key="text" if args.text_key is None else args.text_key,
                 label_key="label" if args.label_key is None else args.label_key, **bs)
        return evaluate_icl(model, tok, progress=prog, **s), s
    raise DifftxError(f"unknown evaluation {name!r}")  # pragma: no cover - argparse rejects it first


def _plot(name: str, result: dict, path) -> None:
    mod = importlib.import_module(f"difftx.evals.{name}")
    getattr(mod, f"plot_{name}")(result, path)


def _summary(name: str, r: dict) -> list[str]:
    f = lambda v: "-" if v is None else f"{v:.4g}"  # noqa: E731
    if name == "lm":
        return [f"loss {f(r['loss'])}  ppl {f(r['perplexity'])}  AR-Hit {f(r['ar_hit']['loss'])} "
                f"({r['ar_hit']['fraction']:.1%} of tokens)  Others {f(r['others']['loss'])}  tokens {r['tokens']}"]
    if name == "niah":
        return [f"{k}: teacher-forced {f(v['teacher_forced'])}  generation {f(v['generation'])}"
                for k, v in r["table"].items()] + [f"skipped {len(r['skipped'])} cell(s) that do not fit"] * bool(r["skipped"])
    if name == "mqar":
        return [f"len {c['seq_len']:>5} pairs {c['pairs']:>4}: {c['accuracy']:.3f}" for c in r["cells"]] + \
            [f"overall {r['overall_accuracy']:.3f}"]
    if name == "attention":
        from ..evals.common import depth_percent
        t = r["table"]
        return ["depth   " + " ".join(f"{depth_percent(d):>7}" for d in r["depths"]),
                "answer  " + " ".join(f"{v:7.3f}" for v in t["answer"]),
                "noise   " + " ".join(f"{v:7.3f}" for v in t["noise"])]
    if name == "outliers":
        out = []
        for key in ("attention_logits", "hidden_states"):
            s = r[key]
            out.append(f"{key:17} top1 {f(s['top1'])} top2 {f(s['top2'])} top3 {f(s['top3'])} top10 {f(s['top10'])} "
                       f"top100 {f(s['top100'])} median {f(s['median'])}")
        return out
    if name == "quant":
        return [f"{'none' if x['bits'] is None else str(x['bits']) + '-bit':>7}: {r['metric']} {f(x['value'])}"
                for x in r["rows"]]
    if name == "icl":
        # mean [worst, best] over the orders: the mean need not sit mid-range, so no "mean ± margin/2"
        return [f"{t['task']} {how}: " + "  ".join(f"{p['shots']}-shot {p['mean']:.3f} "
                                                 f"[{p['worst']:.3f}, {p['best']:.3f}]" for p in pts)
                for t in r["tasks"] for how, pts in t["curves"].items()]
    return []


def _run_lm_eval(args) -> int:
    try:
        from ..interop.lm_eval import run_lm_eval
    except ImportError as e:
        raise DifftxError(f"lm-eval is not available ({e}); install it with: pip install 'difftx[eval]'") from None
    from ..evals.common import Timer, claim_out, envelope, write_result

    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ConfigError("--num-fewshot", f"must be 0 or more, got {args.num_fewshot}")
    new = _new_dirs(args.out)
    claim_out(args.out, "lm-eval", force=args.force, plot=False)  # before the harness runs: a bad --out fails fast
    kwargs = {k: v for k, v in dict(num_fewshot=args.num_fewshot, limit=args.limit, batch_size=args.batch_size,
                                    device=args.device, seed=args.seed).items() if v is not None}
    with _unclaim_on_failure(new):
        with Timer() as t:
            try:
                results = run_lm_eval(args.checkpoint, args.tasks, **kwargs)
            except ImportError as e:
                raise DifftxError(f"lm-eval is not available ({e}); install it with: pip install 'difftx[eval]'") \
                    from None
        doc = envelope("lm-eval", results if isinstance(results, dict) else {"results": results},
                       checkpoint=args.checkpoint, settings={"tasks": args.tasks, **kwargs}, seconds=t.seconds)
        print(f"wrote {write_result(args.out, 'lm-eval', doc)}")
    return 0


def _new_dirs(out) -> list:
    """The directories that making ``out`` creates (it and its missing parents), deepest first."""
    path, new = Path(out), []
    while not path.exists() and not path.is_symlink() and path != path.parent:
        new.append(path)
        path = path.parent
    return new


@contextlib.contextmanager
def _unclaim_on_failure(new: list):
    """A refused (or failed) evaluation leaves no output directory behind: the ones ``claim_out`` made for it are
    removed again while they are still empty (an evaluation checks most of its options only once it runs)."""
    try:
        yield
    except BaseException:
        for d in new:
            try:
                d.rmdir()  # only an empty directory; one holding anything (a result, a plot) stays
            except OSError:
                break
        raise


def _check_unread(args) -> None:
    """An option given explicitly that this evaluation would not read is refused, not ignored."""
    if args.quant_granularity is not None and args.quant_bits is None and args.eval_name != "quant":
        raise ConfigError("--quant-granularity", "sets how --quant-bits quantizes; give --quant-bits B too, or "
                                                 "drop it")
    if args.seed is not None and (args.eval_name in ("lm", "outliers") or
                                  (args.eval_name == "quant" and args.metric == "lm")):
        what = "'eval quant --metric lm'" if args.eval_name == "quant" else f"'eval {args.eval_name}'"
        raise ConfigError("--seed", f"{what} reads its text in order and samples nothing, so a seed changes "
                                    "nothing; drop it")
    if args.eval_name == "icl" and all(t.startswith("synthetic-") for t in args.tasks):
        for flag, value in (("--text-key", args.text_key), ("--label-key", args.label_key)):
            if value is not None:
                raise ConfigError(flag, f"names a field of a JSONL task's records, and {','.join(args.tasks)} "
                                        "generates its examples; drop it (or give a JSONL file in --tasks)")
    if args.eval_name == "quant":
        _check_metric_options(args)
    if args.eval_name != "quant" or args.metric == "lm":
        return
    if args.max_tokens is not None:
        raise ConfigError("--max-tokens", f"is the token budget of --metric lm; --metric {args.metric} does not "
                                          "read it (its options go in --metric-opt): drop it")
    if args.data is not None and args.metric != "niah":
        raise ConfigError("--data", f"--metric {args.metric} makes its own data and reads no text file; drop --data "
                                    "(or measure --metric lm or niah)")


# --metric-opt keys that an option of 'eval quant' sets too: (key, dest, flag)
METRIC_OPT_FLAGS = (("data", "data", "--data"), ("text", "data", "--data"),
                    ("max_tokens", "max_tokens", "--max-tokens"), ("seed", "seed", "--seed"),
                    ("batch_size", "batch_size", "--batch-size"))


def _check_metric_options(args) -> None:
    """--metric-opt model=... was a TypeError traceback, and a key an option of its own also sets (--metric-opt
    seed=4 --seed 3) silently overrode that option; both are refused before the checkpoint loads."""
    from .info import parse_overrides

    opts = parse_overrides(args.metric_opt, "--metric-opt")
    for key in ("model", "tokenizer"):
        if key in opts:
            raise ConfigError("--metric-opt", f"{key} is --checkpoint's own, not an option of the {args.metric} "
                                              f"metric; drop {key}=")
    for key, dest, flag in METRIC_OPT_FLAGS:
        if key in opts and getattr(args, dest) is not None:
            raise ConfigError("--metric-opt", f"{key}= and {flag} both set what the {args.metric} metric reads, and "
                                              f"{key}= would silently win; give one of them")


def _metric_opt_message(message: str, args, opts: dict) -> str:
    """``message`` of the metric's error under 'eval quant' with every flag it names that 'eval quant' sets through
    --metric-opt spelt as one: "pass fewer --seeds" was the fix of 'eval icl', and under 'eval quant --metric icl'
    there is no --seeds, only --metric-opt seeds=N."""
    import re

    from ..evals.common import DEPTHS_PERCENT_HINT
    from .info import parse_overrides

    given = parse_overrides(args.metric_opt, "--metric-opt")
    # --metric-opt passes the library's values: its depths are fractions, not the percents of eval niah's --depths
    message = message.replace(DEPTHS_PERCENT_HINT, "--metric-opt passes them as they are")

    def spell(m):
        key = m.group(1).replace("-", "_")
        if key not in given and key in vars(args):  # an option of 'eval quant' itself (--seed, --data, ...)
            return m.group(0)
        value = opts.get(key)
        return f"--metric-opt {key}=" + ("[...]" if isinstance(value, (list, tuple)) else
                                         "TEXT" if isinstance(value, str) else "N")

    return re.sub(r"(?<![\w-])--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)(?![\w=-])", spell, message)


def run(args) -> int:
    if args.eval_name == "lm-eval":
        return _run_lm_eval(args)
    from ..evals.common import Timer, claim_out, envelope, load_checkpoint, read_text_file, write_result
    from ..evals.quant import quantized_logits
    from ..nn import native
    from ..runtime import resolve_device

    if args.eval_name == "quant" and args.quant_bits is not None:
        raise ConfigError("--quant-bits", "'difftx eval quant' sweeps --bits itself; leave --quant-bits out")
    if args.quant_bits is not None and not 2 <= args.quant_bits <= 32:
        raise ConfigError("--quant-bits", f"must be between 2 and 32, got {args.quant_bits}")
    _check_unread(args)
    if getattr(args, "data", None) is not None:
        read_text_file(args.data)  # a bad --data fails before the checkpoint loads
    device = resolve_device(args.device)
    ids_only = args.eval_name == "mqar" or (args.eval_name == "quant" and args.metric == "mqar")  # no text
    model, tok = load_checkpoint(args.checkpoint, device=str(device), what=f"'difftx eval {args.eval_name}'",
                                 tokenizer=not ids_only)
    new = _new_dirs(args.out)
    claim_out(args.out, args.eval_name, force=args.force, plot=not args.no_plot)  # before the evaluation runs
    native.warn_problem(f"difftx eval {args.eval_name}", device)
    _say(args, f"difftx eval {args.eval_name}: {model.config.attention} model, "
               f"{model.num_parameters() / 1e6:.2f}M parameters, on {device}")
    with _unclaim_on_failure(new):
        with Timer() as t, quantized_logits(model, args.quant_bits, args.quant_granularity or "head") as q:
            results, settings = _run_eval(args, model, tok)
        doc = envelope(args.eval_name, results, model=model, checkpoint=args.checkpoint, settings=settings,
                       seconds=round(t.seconds, 3), quant=q.describe() if q is not None else None)
        path = write_result(args.out, args.eval_name, doc)
    for line in _summary(args.eval_name, doc["results"]):
        print(line)
    print(f"wrote {path} ({t.seconds:.1f} s)")
    png = path.with_suffix(".png")
    stale = args.force and png.exists()  # --force --no-plot kept the earlier run's figure beside this run's JSON
    if stale:
        png.unlink()
    if not args.no_plot:
        _plot(args.eval_name, doc["results"], png)
        if png.exists():
            print(f"wrote {png}")
    if stale and not png.exists():
        print(f"removed {png}: the earlier run's figure (--force), which would misstate this result")
    return 0
