"""Gradient analysis: a hand-derived reference backward pass, gradient flow and heavy tails.

* :mod:`difftx.analysis.reference`: NumPy float64 forward + hand-written backward
  of the seed Transformer and of a DIFF block, checked against autograd.
* :mod:`difftx.analysis.flow`: per-layer, per-group gradient norms of matched
  DIFF and Transformer models (DIFF paper, Appendix E).
* :mod:`difftx.analysis.tails`: heavy-tail estimators (Hill, Mohammadi/Simsekli
  alpha, quantile ratios, kurtosis, log-binned histograms).
* :mod:`difftx.analysis.tail_study`: |g| entry distributions and gradient-noise
  tail indices across norm settings and optimisers (DNT Fig. 1).

Nothing here imports matplotlib at import time; :mod:`difftx.analysis.plots` does so lazily.
"""
