"""``report.md`` from ``results.json`` alone: the answers first, then every measurement with its spread.

:func:`render` is a pure function of the results dict, so ``report.md`` can be
regenerated (and is tested to be identical) from ``results.json``; every
number in it is a value of ``results.json`` formatted by the helpers below.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from ..io import atomic_write_text


# ----------------------------------------------------------------------------- formatting
def num(x: Optional[float], digits: int = 4) -> str:
    if x is None:
        return "-"
    if x != 0 and (abs(x) >= 10 ** 5 or abs(x) < 10 ** -(digits - 1)):
        return f"{x:.{max(1, digits - 1)}e}"
    return f"{x:.{digits}f}"


def sig(x: Optional[float], digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}g}"


def ms(s: Optional[dict], f=num) -> str:
    """mean ± sd (or the mean alone with one seed); '-' when not measured; 'diverged' when every seed diverged.

    Seeds without a value are named: diverged (their run did) or not measured (a finished run without it)."""
    if s is None:
        return "-"
    missing = s.get("missing") or 0
    div = min(missing, s.get("diverged", missing))  # results.json of older versions: every lost value diverged
    lost = ", ".join([f"{div} diverged"] * bool(div) + [f"{missing - div} not measured"] * bool(missing - div))
    if s["n"] == 0:
        return "diverged" if div and div == missing else f"- ({lost})" if div else "-"
    text = f(s["mean"]) if s["sd"] is None else f"{f(s['mean'])} ± {f(s['sd'])}"
    return text + (f" ({lost})" if missing else "")


def mib(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / 2 ** 20:.2f}"


def ratio(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}x"


def signed(x: Optional[float], f=num) -> str:
    return "-" if x is None else ("+" if x >= 0 else "") + f(x)


def table(head: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] +
                     ["| " + " | ".join(r) + " |" for r in rows])


# ----------------------------------------------------------------------------- sections
def _label(res: dict, arm: str) -> str:
    return res["arms"][arm]["label"]


def _upper_first(text: str) -> str:
    """The answer opening a sentence: str.capitalize would lower the rest ("DNT", "mSGDW")."""
    return text[:1].upper() + text[1:]


def _comparison_line(res: dict, row: dict, what: str, f=num) -> str:
    if not row or row.get("delta") is None and row.get("verdict") is None:
        return f"{what}: not measured"
    return f"{what} {signed(row.get('delta'), f)} ({_spread(row, f)}: {row['verdict']})"


def _spread(row: dict, f=num) -> str:
    """"seed spread S", or "2.5 x seed spread S" where the verdict's bar is a multiple of it (two seeds)."""
    if row.get("spread") is None:
        return "seed spread -"
    factor = row.get("factor", 1.0)
    return f"{factor:g} x seed spread {f(row['spread'])}" if factor != 1.0 else f"seed spread {f(row['spread'])}"


METRIC_NAMES = {"val_loss": "validation loss", "test_acc": "test accuracy", "retrieval": "retrieval accuracy",
                "attention_answer": "attention on the answer", "attention_noise": "attention on the noise",
                "outliers_attention_logits_top1": "top-1 attention-logit magnitude",
                "outliers_hidden_states_top1": "top-1 hidden-state magnitude"}


def answers(res: dict) -> list[str]:
    q, out = res["questions"], []
    quality = "test_acc" if res["domain"] == "vision" else "val_loss"
    if "diff_vs_transformer" in q:
        d = q["diff_vs_transformer"]
        parts = [_comparison_line(res, r, f"{METRIC_NAMES.get(r['metric'], r['metric'])} Δ") for r in d["rows"]]
        out.append(f"**Does DIFF beat the Transformer here? {_upper_first(d['answer'])}.** "
                   f"{_label(res, d['a'])} minus {_label(res, d['b'])}: " + "; ".join(parts) + ".")
    if "dnt_msgdw_matches_adamw" in q:
        d = q["dnt_msgdw_matches_adamw"]
        parts = []
        for model, g in d["gaps"].items():
            parts.append(_comparison_line(res, g, f"{res['arms'][g['msgdw']]['label'].split(' · ')[0]}: "
                                                  f"mSGDW minus AdamW {METRIC_NAMES[quality]}"))
        if res["domain"] == "vision" and "dnt_imagenet_top1_307m" in res["papers"]:
            p = res["papers"]["dnt_imagenet_top1_307m"]
            paper = (f"DNT paper, 307M on ImageNet-1k, top-1 % mSGDW minus AdamW: ViT "
                     f"{p['vit-msgdw'] - p['vit-adamw']:+.1f}, V-DNT {p['vdnt-msgdw'] - p['vdnt-adamw']:+.1f}")
        else:
            p = res["papers"]["dnt_val_loss_124m"]
            paper = (f"DNT paper, 124M on OpenWebText: GPT-2 {p['gpt2-msgdw'] - p['gpt2-adamw']:+.3f}, "
                     f"L-DNT {p['ldnt-msgdw'] - p['ldnt-adamw']:+.3f}")
        out.append(f"**Does DNT let mSGDW match AdamW? {_upper_first(d['answer'])}.** " + "; ".join(parts) +
                   f". ({paper}.)")
    cost = q.get("cost")
    if cost:
        ref = cost["reference"]
        parts = [f"{_label(res, a)} {ratio(c['throughput_ratio'])} the throughput"
                 + (f" ({ratio(c['throughput_cpu_ratio'])} per CPU second)" if c.get("throughput_cpu_ratio") else "")
                 + f" and {ratio(c['memory_ratio'])} the peak step memory" for a, c in cost["arms"].items() if a != ref]
        out.append(f"**At what cost in speed and memory?** Relative to {_label(res, ref)}: " + "; ".join(parts) + ".")
    for key, title in (("diff_inside_dnt_vs_dnt", "DIFF inside DNT vs DNT"),
                       ("diff_inside_dnt_vs_diff", "DIFF inside DNT vs DIFF")):
        if key in q:
            d = q[key]
            parts = [_comparison_line(res, r, f"{METRIC_NAMES.get(r['metric'], r['metric'])} Δ") for r in d["rows"]
                     if r["metric"] in (quality, "retrieval")]
            out.append(f"**{title}** (no paper measured this; answer: {d['answer']}): " + "; ".join(parts) + ".")
    return out


def scale_section(res: dict) -> str:
    s, arms = res["scale"], res["arms"]
    params = sorted({a["params"] for a in arms.values() if a["params"]})
    prange = f"{params[0]:,}" if len(params) == 1 else f"{params[0]:,}-{params[-1]:,}" if params else "-"
    c = s["corpus"]
    if res["domain"] == "vision":
        papers = s["papers"]["dnt"].split("; ")[-1]
        training = (f"{c['steps']} steps x {c['batch_size']} images = {c['steps'] * c['batch_size']:,} images per run",
                    "150 epochs of ImageNet-1k (~190M images)")
    else:
        papers = s["papers"]["diff"].split(";")[0] + "; " + s["papers"]["dnt"].split(";")[0]
        training = (f"{c['steps']} steps x {c['batch_size']} x {c['seq_len']} tokens = {c['tokens_per_run']:,} tokens "
                    "per run" if c.get("tokens_per_run") else f"{c['steps']} steps x {c['batch_size']}",
                    "350B tokens (DIFF 3B); ~100B (DNT)")
    init = f", {s['model']['init']} init" if s["model"].get("init") else ""  # results.json before 2026-11-26: none
    rows = [["models", f"{s['preset']} ({s['model']['n_layers']} layers x {s['model']['d_model']}{init}), {prange} "
                       "parameters", papers],
            ["training" if res["domain"] == "vision" else "corpus training", *training]]
    if "retrieval" in s:
        r = s["retrieval"]
        rows.append(["retrieval training", f"{r['task']}: {r['steps']} steps x {r['batch_size']} x {r['seq_len']} "
                                           f"tokens = {r['tokens_per_run']:,} tokens per run" if r.get("tokens_per_run")
                     else r["task"], "none: DIFF evaluates retrieval after LM pre-training at 4K-64K context"])
    rows.append(["seeds", str(res["study"]["seeds"]), "1 (no spreads reported)"])
    return table(["", "this study", "the papers"], rows)


def arms_section(res: dict) -> str:
    rows = [[a["label"], f"`{a_id}`", a["attention"], a["norms"], f"{a['n_heads']} x {a['head_dim']}",
             f"{a['params']:,}" if a["params"] else "-", f"{a['lr']:g}", a["lr_source"]]
            for a_id, a in res["arms"].items()]
    return table(["arm", "id", "attention", "norms", "heads x dim", "params", "lr", "lr from"], rows)


def quality_section(res: dict) -> str:
    vision = res["domain"] == "vision"
    head = ["arm", "val loss", "min - max", "seeds"] + (["val acc", "test acc"] if vision else [])
    rows = []
    for a_id, c in res["corpus"].items():
        v = c["val_loss"]
        row = [res["arms"][a_id]["label"], ms(v), f"{num(v['min'])} - {num(v['max'])}" if v["n"] else "-",
               str(v["n"])]
        if vision:
            row += [ms(c.get("val_acc")), ms(c.get("test_acc"))]
        rows.append(row)
    return table(head, rows)


def _arm_ms(x: dict, s: Optional[dict], f=num) -> str:
    """``ms`` for an arm's column, which an arm whose every seed diverged has no entry in: said, not '-'."""
    if s is None and x.get("diverged") and x["diverged"] == len(x.get("seeds") or ()):
        return "diverged"
    return ms(s, f)


def retrieval_section(res: dict) -> str:
    r = res["retrieval"]
    head = ["arm"] + r["cells"] + ["overall", "task val loss"]
    rows = [[res["arms"][a]["label"]] + [_arm_ms(x, x["cells"].get(c), lambda v: num(v, 3)) for c in r["cells"]] +
            [ms(x["overall"], lambda v: num(v, 3)), ms(x["val_loss"])] for a, x in r["arms"].items()]
    return table(head, rows)


def attention_section(res: dict) -> str:
    r = res["retrieval"]
    regions = list(dict.fromkeys(k for x in r["arms"].values() for k in x["attention"]))
    rows = [[res["arms"][a]["label"]] + [_arm_ms(x, x["attention"].get(k), lambda v: num(v, 3)) for k in regions]
            for a, x in r["arms"].items()]
    return table(["arm"] + regions, rows)


def outliers_section(res: dict) -> Optional[str]:
    rows = []
    for a, c in res["corpus"].items():
        o = c.get("outliers")
        if not o:
            rows += [[res["arms"][a]["label"]] + ["diverged"] * 6] if c.get("diverged") else []  # not dropped
            continue
        rows.append([res["arms"][a]["label"]] + [ms(o[k][q], sig) for k in ("attention_logits", "hidden_states")
                                                 for q in ("top1", "top10", "median")])
    if not any(c.get("outliers") for c in res["corpus"].values()):
        return None
    return table(["arm", "logit top-1", "logit top-10", "logit median", "hidden top-1", "hidden top-10",
                  "hidden median"], rows)


def tails_section(res: dict, key: str) -> Optional[str]:
    kinds = list(dict.fromkeys(k for c in res["corpus"].values() for k in (c.get("tails") or {}).get(key, {})))
    if not kinds:
        return None
    rows = [[res["arms"][a]["label"]] + [ms(c["tails"][key].get(k), sig) if c.get("tails") else "diverged"
                                         for k in kinds]
            for a, c in res["corpus"].items() if c.get("tails") or c.get("diverged")]  # an arm that diverged: said
    return table(["arm"] + kinds, rows)


def cost_section(res: dict) -> str:
    cost = res["questions"]["cost"]
    unit = next((c["unit"] for c in res["corpus"].values() if c.get("unit")), "tok")
    rows = []
    for a, c in res["corpus"].items():
        k = cost["arms"][a]
        m = c["memory"]
        rows.append([res["arms"][a]["label"], ms(c["throughput"], lambda v: f"{v:,.0f}"), ratio(k["throughput_ratio"]),
                     ms(c.get("throughput_cpu"), lambda v: f"{v:,.0f}"), ratio(k.get("throughput_cpu_ratio")),
                     mib(m["total_bytes"]["mean"]), ratio(k["memory_ratio"]), mib(m["state_bytes"]["mean"]),
                     mib(m["step_bytes"]["mean"]), ms(c["train_cpu_s"], lambda v: f"{v:.1f}")])
    return table(["arm", f"{unit}/s", "x ref", f"{unit}/CPU-s", "x ref", "peak step MiB", "x ref", "params + optimizer MiB",
                  "step peak MiB", "train CPU s"], rows)


def sweep_section(res: dict) -> Optional[str]:
    sw = res.get("lr_sweep")
    if not sw:
        return None
    lrs = sorted({r["lr"] for r in sw["rows"]})
    cell = {(r["arm"], r["lr"]): ("diverged" if r["diverged"] else num(r["val_loss"])) for r in sw["rows"]}
    rows = [[res["arms"][a]["label"]] + [(f"**{cell[(a, lr)]}**" if sw["chosen"].get(a) == lr else cell[(a, lr)])
                                         if (a, lr) in cell else "" for lr in lrs] for a in res["arms"]]
    return table(["arm"] + [f"lr {lr:g}" for lr in lrs], rows)


def verdicts_section(res: dict) -> str:
    rows = []

    def bar(r: dict):  # the size a difference must exceed: the seed spread, times SPREAD_FACTOR at two seeds
        return None if r.get("spread") is None else r.get("factor", 1.0) * r["spread"]

    for name, d in res["questions"].items():
        for r in d.get("rows", []):
            rows.append([name, METRIC_NAMES.get(r["metric"], r["metric"]), f"`{r['a']}`", f"`{r['b']}`",
                         signed(r.get("delta"), lambda v: sig(v, 3)), sig(r.get("spread"), 3), sig(bar(r), 3),
                         r.get("verdict") or "-"])
        for model, g in (d.get("gaps") or {}).items():
            rows.append([name, "mSGDW - AdamW", f"`{g['msgdw']}`", f"`{g['adamw']}`",
                         signed(g.get("delta"), lambda v: sig(v, 3)), sig(g.get("spread"), 3), sig(bar(g), 3),
                         g.get("verdict") or "-"])
    return table(["question", "metric", "a", "b", "a - b", "seed spread", "clear beyond", "verdict (a vs b)"], rows)


# ----------------------------------------------------------------------------- the report
def _jobs_cpu(t: dict) -> str:
    """The jobs' training CPU seconds; a lower bound when some continued after an interruption (their earlier
    processes' time is not recorded), which the line says."""
    n = t.get("jobs_continued") or 0
    if not n:
        return f"{t['jobs_cpu_s']:.0f} s"
    return (f"at least {t['jobs_cpu_s']:.0f} s ({n} job{'s' if n > 1 else ''} continued after an interruption; "
            f"{'their' if n > 1 else 'its'} earlier processes' CPU time is not recorded)")


def render(res: dict, pictures: tuple = ()) -> str:
    """The whole report.  ``pictures``: PNG file names present beside it."""
    pic = lambda name, alt: f"\n![{alt}]({name})\n" if name in pictures else ""  # noqa: E731
    st, t = res["study"], res["timing"]
    vision = res["domain"] == "vision"
    procs = f"{t['workers']} parallel job process{'es' if t['workers'] > 1 else ''}"
    if t.get("threads_per_worker"):
        procs += f", {t['threads_per_worker']} thread(s) each"
    L = [f"# difftx compare: {'vision' if vision else 'language'} study", "",
         f"Command: `{res['command']}`  ",
         f"Wall time: {t['wall_s']:.0f} s ({procs}); training CPU time of all jobs: {_jobs_cpu(t)}"
         + (f"; CPU time of the whole study (all processes): {t['process_cpu_s']:.0f} s" if t.get("process_cpu_s")
            else "") + ".  ",
         "Every number below is in `results.json`; each is the mean ± sample standard deviation over "
         f"{st['seeds']} seeds (seeds {st['seed']}-{st['seed'] + st['seeds'] - 1}). A difference is called clear only "
         "when it exceeds the seed spread (the larger of the two arms' max - min over seeds)"
         + (f", {res['spread_factor']['2']:g} times it with two seeds per arm" if "2" in res.get("spread_factor", {})
            else "") + "; otherwise the report says \"no clear difference\"."
         + (" Two arms of equal performance with normal seed noise are then called different about 5% of the time or "
            "less (with two seeds and the bare spread: 22%)." if "spread_factor" in res else ""),
         "", "## The answers", ""]
    L += [f"- {a}" for a in answers(res)]
    L += ["", "These are measurements at a scale thousands of times below the papers' (next section): they say what "
          "holds *here*, not whether the papers' claims hold at theirs.", "", "## Scale", "", scale_section(res), "",
          "## Arms", "", "Matched parameter counts: DIFF arms are the `ModelConfig.twin` of the Transformer (half the "
          "heads, each of twice the value width); DNT adds norm gains only. Every arm of a seed sees the same batches "
          f"in the same order and the same number of {'images' if vision else 'tokens'}; learning rates as listed "
          "(see the sweep below).", "",
          arms_section(res), "", "## Validation loss" + (" and accuracy" if vision else " on the corpus"), "",
          quality_section(res), pic("loss_curves.png", "loss curves")]
    if res.get("retrieval"):
        r = res["retrieval"]
        if r["task"] == "mqar":
            why = ("Each arm is trained from scratch on the retrieval task with the same budget rules. The task is "
                   "multi-query associative recall (MQAR, Zoology): N key-value pairs (the needles) followed by a "
                   "query for each key, whose value the model must retrieve. At this scale a model trained on the "
                   "corpus does not retrieve, and one trained on the paper's needle-in-a-haystack task does not learn "
                   "it within the budget (docs/compare.md), while MQAR is learnt in part: it measures the same "
                   "ability, retrieving key information among distractors, early. Columns `N<pairs>@<length>`: "
                   "accuracy with N needles, all N queried (R = N), at the training length and at twice it "
                   "(RoPE extrapolation).")
        else:
            why = ("Each arm is trained from scratch on the DIFF paper's multi-needle task (`niah`: N needles in real "
                   "text, R queried) and scored teacher-forced: the exact answer, token by token.")
        L += ["", f"## Retrieval ({r['task']})", "", why, "", retrieval_section(res), pic("retrieval.png", "retrieval")]
        p = res["papers"]["diff_niah_table2"]
        L += ["", "DIFF paper, Table 2 (3B models, 4K context), Transformer / DIFF: " +
              ", ".join(f"{k} {a:.2f} / {b:.2f}" for k, (a, b) in p.items()) + ".", "",
              "## Attention allocation", "",
              f"Share of the effective attention (rows L1-normalised; DIFF: A1 - lambda A2) of the rows that predict "
              f"the answer, by region, averaged over heads and layers ({r['attention_setting']}): `answer` is the "
              "value (the needle's number), `answer_needle` its key, `other_needles` the distractor pairs, `noise` "
              "the filler, `query` the query tokens.", "", attention_section(res), pic("attention.png", "attention")]
        p = res["papers"]["diff_attention_table3"]
        L += ["", f"DIFF paper, Table 3: answer {p['answer'][0]} (Transformer) vs {p['answer'][1]} (DIFF); noise "
              f"{p['noise'][0]} vs {p['noise'][1]}."]
    out = outliers_section(res)
    if out:
        p = res["papers"]["diff_outliers_table5"]
        L += ["", "## Activation outliers", "", "Largest and median magnitudes of the attention logits (before the "
              "softmax, both maps for DIFF) and of the hidden states, over the corpus models on "
              f"{st['outlier_tokens']:,} validation tokens.", "", out, "",
              f"DIFF paper, Table 5 (3B, 0.4M tokens), top-1 Transformer / DIFF: attention logits "
              f"{p['attention_logits_top1'][0]} / {p['attention_logits_top1'][1]}, hidden states "
              f"{p['hidden_states_top1'][0]} / {p['hidden_states_top1'][1]}."]
    q = tails_section(res, "entries_q99_9_over_q50")
    if q:
        L += ["", "## Gradient heavy tails", "", f"At the trained weights, {st['tail_batches']} fresh training batches "
              "(`difftx.analysis.tail_study.measure`). Entries: q99.9/q50 of |g| of the mean gradient, per matrix "
              "kind (a Gaussian gives 4.9; larger is heavier-tailed; DNT Fig. 1). Noise: the Mohammadi alpha of the "
              "mini-batch gradient noise (2 = Gaussian; lower is heavier; Simsekli et al. 2019).", "",
              "|g| entries, q99.9/q50:", "", q, "", "Gradient noise, alpha:", "",
              tails_section(res, "noise_alpha"), pic("grad_hist.png", "gradient histograms")]
    L += ["", "## Speed and memory", "", "Throughput: the median of each run's per-step rate after its first 10% of "
          "steps (wall clock: parallel jobs and anything else on the machine share it), and per CPU second (the "
          "run's tokens over its CPU time, evaluations included: independent of the machine's load, CPU only). Peak step memory: parameters and optimizer "
          f"state plus the high-water mark of one training step at the run's batch "
          f"({res['corpus'][next(iter(res['corpus']))].get('memory_method') or '-'}).", "", cost_section(res),
          pic("cost.png", "cost"), "", res["papers"]["diff_throughput_table7"] + "; " +
          res["papers"]["dnt_memory_table2"] + "."]
    sw = sweep_section(res)
    if sw:
        seed = res["lr_sweep"]["seed"]
        reused = (f" The chosen run is the arm's seed-{seed} run: that seed's validation loss above is the best of the "
                  "grid on the same data, so a swept arm's mean is biased in its favour (the other seeds' are not; "
                  "compare arms swept alike)." if not vision else "")
        L += ["", "## Learning-rate sweep", "", f"Final validation loss of each arm at each learning rate (corpus, "
              f"seed {seed}); bold: the lr the study used." + reused, "", sw, pic("lr_sweep.png", "lr sweep")]
    L += ["", "## Every comparison", "", verdicts_section(res), "", "## Reproduce", "",
          f"    {res['command']}", "", "Rerunning with the same seeds reproduces every number here except the timings "
          "(throughput, CPU and wall time), which depend on the machine and its load, given the same torch version "
          "and threads per job (some CPU kernels reduce in a thread-dependent order: another --threads can change "
          "the 5th digit).", ""]
    return "\n".join(L)


def write_outputs(res: dict, out) -> list[str]:
    """``results.json``, the PNGs (when matplotlib is installed) and ``report.md``; returns the names written."""
    from ..analysis.common import json_safe
    from .plots import write_plots

    out = Path(out)
    atomic_write_text(out / "results.json", json.dumps(json_safe(res), indent=1))
    res = json.loads((out / "results.json").read_text(encoding="utf-8"))  # the report sees exactly the JSON
    pictures = write_plots(res, out)
    atomic_write_text(out / "report.md", render(res, tuple(pictures)))
    return ["results.json", "report.md", *pictures]
