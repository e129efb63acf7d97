"""A hand-derived backward pass in NumPy float64: the independent reference for gradients.

* :mod:`.ops`: every primitive's forward and backward (linear, embedding,
  softmax, cross-entropy, LayerNorm with the seed's eq. 34 corrected, RMSNorm,
  ReLU, SwiGLU, attention maps, RoPE).
* :mod:`.seed`: the seed Transformer of ``transformer-gradient-calculation.md``
  end to end, plus the plain SGD update.
* :mod:`.diff`: a DIFF block (lambda re-parameterisation, per-head RMSNorm with
  the (1 - lambda_init) scale, pre-RMSNorm, SwiGLU, RoPE), and the DIFF paper's
  Appendix E gradient formulas written out literally.
* :mod:`.bridge`: difftx modules' weights and gradients in the reference layout.

Tests hold every formula against torch autograd in float64 to relative 1e-8
(``pytest -k reference``).
"""

from . import bridge, diff, ops, seed

__all__ = ["ops", "seed", "diff", "bridge"]
