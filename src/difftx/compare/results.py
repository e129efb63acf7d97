"""From the jobs' measurements to ``results.json``: statistics over seeds, comparisons and the answers.

Every number the report prints is in here.  Per arm and metric the seeds give
a :func:`stat` (mean, sample standard deviation, min, max, the values).  A
comparison of two arms (:func:`compare`) calls a difference *clear* only when
it is larger than the seed spread, the larger of the two arms' ranges over
seeds (max - min), times :data:`SPREAD_FACTOR` at two seeds; otherwise it is
"no clear difference".  With one seed there is no spread and no verdict.  A run
without a value (it diverged, or was not measured) is not dropped as if the arm
had fewer seeds: its arm is the worse one, and the verdict says how many of its
runs it lost.
"""

from __future__ import annotations

import math
import statistics
from typing import Optional

from .arms import ROLES, Arm
from .jobs import Job
from .study import PAPERS_SCALE, StudyConfig

# the papers' own numbers, quoted beside ours
PAPER_NUMBERS = {
    "dnt_val_loss_124m": {"gpt2-adamw": 2.867, "gpt2-msgdw": 2.906, "ldnt-adamw": 2.863, "ldnt-msgdw": 2.849},
    "dnt_imagenet_top1_307m": {"vit-adamw": 81.7, "vit-msgdw": 78.2, "vdnt-adamw": 82.1, "vdnt-msgdw": 81.5},
    "diff_niah_table2": {"N1R1": (1.00, 1.00), "N2R2": (0.85, 0.92), "N4R2": (0.62, 0.84), "N6R2": (0.55, 0.85)},
    "diff_attention_table3": {"answer": ("0.03-0.09", "0.27-0.40"), "noise": ("0.49-0.54", "0.01-0.02")},
    "diff_outliers_table5": {"attention_logits_top1": (318.0, 38.8), "hidden_states_top1": (3608.6, 1688.2)},
    "diff_throughput_table7": "DIFF 0.90-0.94x the Transformer's tokens/s (3B-13B, H100, fwd+bwd)",
    "dnt_memory_table2": "optimizer state of a 1.4B model: AdamW 11.5 GB, mSGDW 5.7 GB",
}


# The bar a difference must clear, in seed spreads, by the seeds per arm: two arms of equal performance with normal
# seed noise are then called different about 5% of the time or less (simulated, 2 x 10^6 pairs: the mean difference
# against the larger of the two ranges exceeds 1x the spread 21.7% of the time at 2 seeds, 2.43x 5%; 4.9% at 1x with 3
# seeds, 1.1% with 4).  At two seeds the bare spread called equal arms different one time in five.
SPREAD_FACTOR = {2: 2.5}


def stat(values: list, diverged: Optional[list] = None) -> Optional[dict]:
    """Mean, sample sd, min, max over the finite values; None values (diverged runs) are counted apart.

    ``diverged``: per value, whether its run diverged.  Given, ``diverged`` counts the missing values of diverged
    runs, so that a value a finished run did not measure (a GPU run's CPU rate) is not reported as a divergence."""
    ok = [v is not None and math.isfinite(float(v)) for v in values]
    vals = [float(v) for v, good in zip(values, ok) if good]
    missing = len(values) - len(vals)
    lost = {} if diverged is None else {"diverged": sum(bool(d) for d, good in zip(diverged, ok) if not good)}
    if not vals:
        return {"mean": None, "sd": None, "min": None, "max": None, "n": 0, "missing": missing, **lost, "values": []}
    return {"mean": statistics.fmean(vals), "sd": statistics.stdev(vals) if len(vals) > 1 else None,
            "min": min(vals), "max": max(vals), "n": len(vals), "missing": missing, **lost, "values": vals}


def compare(a: Optional[dict], b: Optional[dict], higher_is_better: bool) -> Optional[dict]:
    """Arm a against arm b on one metric: the difference of means, the seed spread and the verdict."""
    if a is None or b is None:
        return None
    ma, mb = a.get("missing", 0), b.get("missing", 0)
    if (ma and mb) or (a["n"] == 0 and b["n"] == 0):
        return {"delta": None, "spread": None,
                "verdict": "not comparable (runs of both arms diverged or were not measured)"}
    if ma or mb:  # a diverged run is a result, not a seed to drop: the arm that lost runs is the worse one
        k, n = (ma, ma + a["n"]) if ma else (mb, mb + b["n"])
        delta = a["mean"] - b["mean"] if a["n"] and b["n"] else None
        return {"delta": delta, "spread": None,
                "verdict": f"{'worse' if ma else 'better'} ({k} of {n} runs of {'a' if ma else 'b'} diverged or "
                           "were not measured)"}
    delta = a["mean"] - b["mean"]
    if a["n"] < 2 or b["n"] < 2:
        return {"delta": delta, "spread": None, "verdict": "no verdict (one seed: no spread; use --seeds 2 or more)"}
    spread = max(a["max"] - a["min"], b["max"] - b["min"])
    factor = SPREAD_FACTOR.get(min(a["n"], b["n"]), 1.0)
    if abs(delta) <= factor * spread:
        verdict = "no clear difference"
    else:
        verdict = "better" if (delta > 0) == higher_is_better else "worse"
    return {"delta": delta, "spread": spread, "factor": factor, "verdict": verdict}


# ----------------------------------------------------------------------------- sweep
def choose_lrs(study: StudyConfig, jobs: list[Job], results: dict) -> dict[str, float]:
    """Per arm, the sweep's lr with the lowest final validation loss (diverged runs, and non-finite losses, lose)."""
    best: dict[str, tuple[float, float]] = {}
    for job in jobs:
        r = results[job.key]
        loss = (r.get("final") or {}).get("val_loss")
        # a NaN loss compares False with everything: as a score it would keep (or be kept by) the first lr seen
        ok = loss is not None and math.isfinite(loss) and not r.get("diverged")
        score = loss if ok else math.inf
        if job.arm.id not in best or score < best[job.arm.id][0]:
            best[job.arm.id] = (score, job.lr)
    return {arm: lr for arm, (_, lr) in best.items()}


def sweep_section(study: StudyConfig, jobs: list[Job], results: dict, chosen: dict) -> Optional[dict]:
    if not jobs:
        return None
    rows = [{"arm": j.arm.id, "lr": j.lr, "val_loss": (results[j.key].get("final") or {}).get("val_loss"),
             "diverged": bool(results[j.key].get("diverged"))} for j in jobs]
    return {"grid": study.lr_sweep, "seed": study.seed, "rows": rows, "chosen": chosen}


# ----------------------------------------------------------------------------- per arm
def _get(d: dict, *path):
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def _curve(runs: list[dict]) -> dict:
    """Validation loss by tokens: mean, min, max over seeds at the evaluation points all seeds share."""
    per_seed = [{row[0]: row[1] for row in r["curve"]["val"] if row[1] is not None} for r in runs
                if r.get("curve")]
    steps = sorted(set.intersection(*(set(s) for s in per_seed))) if per_seed else []
    tps = next((r["curve"]["tokens_per_step"] for r in runs if r.get("curve", {}).get("tokens_per_step")), None)
    out = {"steps": steps, "tokens": [round(s * tps) if tps else None for s in steps],
           "mean": [statistics.fmean(s[k] for s in per_seed) for k in steps],
           "min": [min(s[k] for s in per_seed) for k in steps], "max": [max(s[k] for s in per_seed) for k in steps]}
    out["train"] = [r["curve"]["train"] for r in runs if r.get("curve")]
    return out


def _histograms(runs: list[dict]) -> dict:
    """Gradient-entry histograms per matrix kind, averaged over seeds (fractions per log10 bin)."""
    out = {}
    kinds = {k for r in runs for k in (_get(r, "tails", "entries") or {})}
    for kind in sorted(kinds):
        hs = [_get(r, "tails", "entries", kind, "histogram") for r in runs]
        hs = [h for h in hs if h]
        if hs:
            out[kind] = {"log10_edges": hs[0]["log10_edges"],
                         "fraction": [statistics.fmean(h["fraction"][i] for h in hs) for i in range(len(hs[0]["fraction"]))]}
    return out


def _per_cpu_s(run: dict) -> Optional[float]:
    """Tokens (images) per CPU second of the training (evaluations included): unlike the wall-clock rate, it does
    not depend on what else the machine runs.  CPU runs only (a GPU run's CPU time means little).  ``cpu_s`` is the
    last training process's: a job continued after an interruption trained only ``train.steps`` steps in it."""
    tps, cpu = _get(run, "curve", "tokens_per_step"), _get(run, "train", "cpu_s")
    if not tps or not cpu or _get(run, "memory", "method") == "torch.cuda.max_memory_allocated":
        return None
    steps = _get(run, "train", "steps")
    steps = run["job"]["steps"] if steps is None else steps  # job.json of older versions: never resumed, assumed
    return tps * steps / cpu if steps > 0 else None


def _whole_run_cpu_s(run: dict) -> Optional[float]:
    """The training CPU seconds of a run that trained all its steps in one process; None (shown as not measured) for
    a job continued after an interruption, whose earlier processes' time is not recorded (its last process's alone
    read as the run's: 1.1 s for a 39 s run).  A diverged run's time is its arm's loss, counted as such."""
    steps = _get(run, "train", "steps")  # job.json of older versions: never resumed, assumed
    return _get(run, "train", "cpu_s") if steps is None or steps == run["job"]["steps"] else None


def continued_jobs(results: dict) -> int:
    """How many jobs continued after an interruption: their earlier processes' CPU time is not in ``jobs_cpu_s``."""
    return sum(_get(r, "train", "cpu_s") is not None and _whole_run_cpu_s(r) is None for r in results.values())


def corpus_arm(runs: list[dict], domain: str) -> dict:
    flags = [bool(r.get("diverged")) for r in runs]
    s = lambda *path: stat([_get(r, *path) for r in runs], flags)  # noqa: E731
    res = {"seeds": [r["job"]["seed"] for r in runs], "diverged": sum(bool(r.get("diverged")) for r in runs),
           "val_loss": s("final", "val_loss"), "curve": _curve(runs),
           "throughput": s("throughput", "per_s"), "unit": next((_get(r, "throughput", "unit") for r in runs
                                                                if _get(r, "throughput", "unit")), None),
           "train_cpu_s": stat([_whole_run_cpu_s(r) for r in runs], flags),
           "throughput_cpu": stat([_per_cpu_s(r) for r in runs], flags),
           "memory": {k: s("memory", k) for k in ("state_bytes", "step_bytes", "total_bytes")},
           "memory_method": next((_get(r, "memory", "method") for r in runs if _get(r, "memory", "method")), None)}
    if domain == "vision":
        res["val_acc"], res["test_acc"] = s("final", "val_acc"), s("final", "test_acc")
    if any("outliers" in r for r in runs):
        res["outliers"] = {k: {q: s("outliers", k, q) for q in ("top1", "top10", "median")}
                           for k in ("attention_logits", "hidden_states")}
    kinds = [k for k in ("W_q", "W_k", "W_v", "W_o", "W_g", "W_1", "W_2", "all")
             if any(_get(r, "tails", "entries", k) for r in runs)]
    if kinds:
        res["tails"] = {"entries_q99_9_over_q50": {k: s("tails", "entries", k, "q99_9_over_q50") for k in kinds},
                        "entries_hill": {k: s("tails", "entries", k, "hill") for k in kinds},
                        "noise_alpha": {k: s("tails", "noise", k, "alpha_mohammadi") for k in kinds},
                        "histograms": _histograms(runs)}
    lams = [r["lambdas"] for r in runs if r.get("lambdas")]
    if lams:  # per layer, over the seeds that have it (DIFF V2's is None until a forward pass records it)
        per_layer = [[x[i] for x in lams if x[i] is not None] for i in range(len(lams[0]))]
        res["lambdas"] = [statistics.fmean(v) if v else None for v in per_layer]
    return res


def retrieval_arm(runs: list[dict]) -> dict:
    cells = list(dict.fromkeys(c for r in runs for c in (_get(r, "retrieval", "cells") or {})))
    regions = list(dict.fromkeys(k for r in runs for k in (_get(r, "attention", "mean") or {})))
    flags = [bool(r.get("diverged")) for r in runs]
    s = lambda *path: stat([_get(r, *path) for r in runs], flags)  # noqa: E731
    return {"seeds": [r["job"]["seed"] for r in runs], "diverged": sum(flags),
            "val_loss": s("final", "val_loss"),
            "cells": {c: s("retrieval", "cells", c) for c in cells},
            "overall": s("retrieval", "overall"),
            "attention": {k: s("attention", "mean", k) for k in regions},
            "throughput": s("throughput", "per_s"),
            "memory_total_bytes": s("memory", "total_bytes")}


# ----------------------------------------------------------------------------- the questions
def _role_arm(arms: list[Arm], model: str, optimizer: str) -> Optional[str]:
    return next((a.id for a in arms if a.model == model and a.optimizer == optimizer), None)


def _verdict(text: Optional[str]) -> Optional[str]:
    """better / worse / no clear difference (a verdict's reason in brackets dropped), or None."""
    v = text.split(" (")[0] if text else None
    return v if v in ("better", "worse", "no clear difference") else None


def _summary(verdicts: list[Optional[str]]) -> str:
    v = [w for w in map(_verdict, verdicts) if w]
    if not v:  # measured with one seed (no spread, so no verdict), or runs of both arms lost: not "not measured"
        return next((t for t in verdicts if t and t.startswith(("no verdict", "not comparable"))), "not measured")
    if "better" in v and "worse" in v:
        return "mixed"
    if "better" in v:
        return "yes"
    if "worse" in v:
        return "no"
    return "no clear difference"


def questions(study: StudyConfig, corpus: dict, retrieval: Optional[dict]) -> dict:
    arms = study.arm_list()
    base, diff, dnt, diff_dnt = ROLES[study.domain]
    vision = study.domain == "vision"
    quality = ("test_acc", True) if vision else ("val_loss", False)
    q: dict = {}

    def lost(x: dict) -> Optional[dict]:
        """The seeds of a metric an arm has no entry for because every run of it diverged (None: not measured).
        Left out, the comparison vanished, where one diverged run of the same arm made it the worse one."""
        n = len(x.get("seeds") or ())
        return stat([None] * n, [True] * n) if n and x.get("diverged") == n else None

    def metric_rows(a: str, b: str) -> list[dict]:
        rows = [{"metric": quality[0], "a": a, "b": b, **(compare(corpus[a].get(quality[0]), corpus[b].get(quality[0]),
                                                                   quality[1]) or {})}]
        if retrieval and a in retrieval["arms"] and b in retrieval["arms"]:
            ra, rb = retrieval["arms"][a], retrieval["arms"][b]
            rows.append({"metric": "retrieval", "a": a, "b": b, **(compare(ra["overall"], rb["overall"], True) or {})})
            for region, hib in (("answer", True), ("noise", False)):
                sa, sb = ra["attention"].get(region) or lost(ra), rb["attention"].get(region) or lost(rb)
                if (region in ra["attention"] or region in rb["attention"]) and sa and sb:
                    rows.append({"metric": f"attention_{region}", "a": a, "b": b, **(compare(sa, sb, hib) or {})})
        for kind in ("attention_logits", "hidden_states"):
            sa = _get(corpus[a], "outliers", kind, "top1") or lost(corpus[a])
            sb = _get(corpus[b], "outliers", kind, "top1") or lost(corpus[b])
            if ("outliers" in corpus[a] or "outliers" in corpus[b]) and sa and sb:
                rows.append({"metric": f"outliers_{kind}_top1", "a": a, "b": b, **(compare(sa, sb, False) or {})})
        return rows

    primary = {quality[0], "retrieval"}
    for name, model_a, model_b in (("diff_vs_transformer", diff, base), ("diff_inside_dnt_vs_dnt", diff_dnt, dnt),
                                   ("diff_inside_dnt_vs_diff", diff_dnt, diff)):
        a, b = _role_arm(arms, model_a, "adamw"), _role_arm(arms, model_b, "adamw")
        if a and b:
            rows = metric_rows(a, b)
            q[name] = {"a": a, "b": b, "rows": rows,
                       "answer": _summary([r.get("verdict") for r in rows if r["metric"] in primary])}

    # Does DNT let mSGDW match AdamW?  The gap mSGDW - AdamW with the Transformer's norms and with DNT's.
    gaps = {}
    for model in (base, dnt):
        a, m = _role_arm(arms, model, "adamw"), _role_arm(arms, model, "msgdw")
        if a and m:
            row = compare(corpus[m].get(quality[0]), corpus[a].get(quality[0]), quality[1])
            gaps[model] = {"msgdw": m, "adamw": a, **(row or {})}
    if gaps:
        dnt_gap = gaps.get(dnt)
        if dnt_gap is None or dnt_gap.get("verdict") is None:
            answer = "not measured"
        elif _verdict(dnt_gap["verdict"]) in ("better", "no clear difference"):
            base_gap = _verdict((gaps.get(base) or {}).get("verdict"))
            # matching AdamW with the Transformer's norms too is no evidence for DNT: "yes" read as DNT's doing
            answer = "not DNT's doing (mSGDW matches AdamW without DNT too)" \
                if base_gap in ("better", "no clear difference") else "yes"
        elif _verdict(dnt_gap["verdict"]) == "worse":
            answer = "no"
        else:
            answer = dnt_gap["verdict"]
        q["dnt_msgdw_matches_adamw"] = {"gaps": gaps, "answer": answer}

    # cost: throughput and memory of every arm relative to the baseline arm
    ref = _role_arm(arms, base, "adamw") or arms[0].id
    cost = {}
    for a in arms:
        ca, cr = corpus[a.id], corpus[ref]
        tp = ca["throughput"]["mean"] / cr["throughput"]["mean"] if ca["throughput"]["mean"] and \
            cr["throughput"]["mean"] else None
        mem = ca["memory"]["total_bytes"]["mean"] / cr["memory"]["total_bytes"]["mean"] \
            if ca["memory"]["total_bytes"]["mean"] and cr["memory"]["total_bytes"]["mean"] else None
        tc = ca["throughput_cpu"]["mean"] / cr["throughput_cpu"]["mean"] if ca["throughput_cpu"]["mean"] and \
            cr["throughput_cpu"]["mean"] else None
        cost[a.id] = {"throughput_ratio": tp, "throughput_cpu_ratio": tc, "memory_ratio": mem,
                      "throughput": compare(ca["throughput"], cr["throughput"], True) if a.id != ref else None}
    q["cost"] = {"reference": ref, "arms": cost}
    return q


# ----------------------------------------------------------------------------- everything
def build_results(study: StudyConfig, jobs: list[Job], results: dict, sweep: list[Job], sweep_results: dict,
                  lrs: dict, timing: dict, command: str) -> dict:
    from .. import __version__

    arms = study.arm_list()
    by = lambda task, arm: [results[j.key] for j in jobs if j.task == task and j.arm.id == arm]  # noqa: E731
    arm_info = {}
    for a in arms:
        cfg = study.model_config(a, "corpus")
        runs = by("corpus", a.id)
        arm_info[a.id] = {"label": a.label, "model": a.model, "optimizer": a.optimizer, "attention": cfg.attention,
                          "norms": cfg.norms, "n_heads": cfg.n_heads, "head_dim": cfg.head_dim,
                          "params": runs[0].get("params") if runs else None,
                          "lr": lrs.get(a.id, study.lr_for(a)),
                          "lr_source": lr_source(study, a, lrs)}
    corpus = {a.id: corpus_arm(by("corpus", a.id), study.domain) for a in arms}
    retrieval = None
    if "retrieval" in study.tasks():
        r_arms = {a.id: retrieval_arm(by("retrieval", a.id)) for a in arms}
        first = next((results[j.key] for j in jobs if j.task == "retrieval" and "retrieval" in results[j.key]), {})
        retrieval = {"task": study.retrieval, "metric": _get(first, "retrieval", "metric"),
                     "attention_setting": _get(first, "attention", "setting"),
                     "cells": list(dict.fromkeys(c for r in r_arms.values() for c in r["cells"])), "arms": r_arms}
    base = study.base_config()
    scale = {"preset": study.preset, "model": {"d_model": base.d_model, "n_layers": base.n_layers, "init": base.init,
                                               "n_heads_transformer": base.twin("softmax").n_heads},
             "corpus": {"steps": next(j.steps for j in jobs if j.task == "corpus"),
                        "batch_size": study.batch_size, "seq_len": study.seq_len,
                        "tokens_per_run": _tokens(results, jobs, "corpus")},
             "papers": PAPERS_SCALE}
    if retrieval:
        scale["retrieval"] = {"task": study.retrieval, "steps": next(j.steps for j in jobs if j.task == "retrieval"),
                              "batch_size": study.retrieval_batch_size, "seq_len": study.retrieval_seq_len,
                              "tokens_per_run": _tokens(results, jobs, "retrieval"),
                              "options": study.retrieval_options}
    every_run = {**sweep_results, **results}  # the sweep's runs too; its chosen one is a study job, counted once
    return {"difftx_compare": 1, "difftx_version": __version__, "command": command, "domain": study.domain,
            "study": study.to_dict(), "scale": scale, "arms": arm_info, "corpus": corpus, "retrieval": retrieval,
            "questions": questions(study, corpus, retrieval), "lr_sweep": sweep_section(study, sweep, sweep_results, lrs),
            "spread_factor": {str(n): f for n, f in SPREAD_FACTOR.items()},  # the verdicts' bar, for the report
            "papers": PAPER_NUMBERS, "timing": {**timing, "jobs_cpu_s": round(sum(
                (r.get("train") or {}).get("cpu_s", 0.0) for r in every_run.values()), 1),
                "jobs_continued": continued_jobs(every_run)}}


def lr_source(study: StudyConfig, arm: Arm, lrs: dict) -> str:
    """Where an arm's lr came from: the sweep only when its optimiser had a grid (the others ran at their one lr)."""
    if arm.id in lrs and len((study.lr_sweep or {}).get(arm.optimizer, ())) > 0:
        return "--lr-sweep"
    return study.lr_source(arm)


def _tokens(results: dict, jobs: list[Job], task: str) -> Optional[int]:
    for j in jobs:
        if j.task == task:
            curve = results[j.key].get("curve") or {}
            if curve.get("tokens_per_step"):
                return int(round(curve["tokens_per_step"] * j.steps))
    return None
