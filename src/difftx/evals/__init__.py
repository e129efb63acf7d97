"""The papers' evaluations, one module each (``difftx eval NAME``; schemas in docs/evals.md).

* :mod:`.lm` -- loss, perplexity, cumulative NLL by position (Fig. 4), AR-Hit / Others (Table 6)
* :mod:`.niah` -- multi-needle retrieval (Table 2, Fig. 5) and the ``niah`` training task
* :mod:`.mqar` -- Zoology's multi-query associative recall and the ``mqar`` training task
* :mod:`.attention` -- attention allocation to the answer vs the noise (Table 3)
* :mod:`.outliers` -- activation outliers of attention logits and hidden states (Table 5)
* :mod:`.quant` -- attention-logit quantization (Fig. 8), usable under any evaluation
* :mod:`.icl` -- many-shot in-context classification and order robustness (Fig. 6, 7, 9)
* :mod:`.common` -- loading, the corpus seam, composable probes, streaming statistics, output

Nothing is imported here, so ``difftx.data.tasks`` can register the tasks cheaply.
"""
