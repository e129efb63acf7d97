"""``difftx compare``: the papers' claims measured at your scale, in one command.

    from difftx.compare import StudyConfig, run_study
    res = run_study(StudyConfig(seeds=2), out="runs/compare")   # results.json's contents
    print(res["questions"]["diff_vs_transformer"]["answer"])

A study (:class:`StudyConfig`) trains every arm (model x optimiser,
:mod:`difftx.compare.arms`) on the corpus and on a retrieval task for several
seeds with the trainer, measures each run (:mod:`~difftx.compare.measure`),
and writes ``results.json``, ``report.md`` and PNGs (:mod:`~difftx.compare.results`,
:mod:`~difftx.compare.report`, :mod:`~difftx.compare.plots`).  See docs/compare.md.
"""

from .arms import DEFAULT_ARMS, MODELS, Arm, parse_arms
from .runner import StudyInterrupted, run_study
from .study import DEFAULT_LRS, StudyConfig

__all__ = ["Arm", "DEFAULT_ARMS", "DEFAULT_LRS", "MODELS", "StudyConfig", "StudyInterrupted", "parse_arms",
           "run_study"]
