"""ModelConfig: one dataclass whose fields are independent switches.

The attention kind (``softmax`` / ``diff`` / ``diff2``), the normalisation
placement (``S1``..``S5``, ``dnt`` or individual flags), the sizes and the
domain (``lm`` / ``vision``) never depend on each other's code paths: every
combination builds.  The config is validated once, in ``__post_init__``; an
invalid value raises :class:`~difftx.errors.ConfigError` naming the field.

Formulas that other modules need (lambda_init per layer, default head and FFN
sizes, the placement presets) live here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

from .errors import ConfigError

ATTENTION_KINDS = ("softmax", "diff", "diff2")
DOMAINS = ("lm", "vision")
NORM_TYPES = ("rms", "layer")
FFN_KINDS = ("swiglu", "gelu", "relu")
POSITION_KINDS = ("rope", "learned", "sinusoidal", "none")
INIT_KINDS = ("normal", "xavier", "truncated_xavier")
PAIRINGS = ("adjacent", "halves")
ROPE_STYLES = ("half", "interleaved")
POOLINGS = ("cls", "mean")
BACKENDS = ("auto", "eager", "sdpa", "flex")

NORM_FLAGS = (
    "input_norm",
    "pre_norm_attn",
    "pre_norm_ffn",
    "qk_norm",
    "mid_norm_attn",
    "mid_norm_ffn",
    "post_norm",
    "final_norm",
)

# DNT paper section 4 / SPEC section 4.  final_norm (a norm before the LM head or
# classifier) is kept on in every setting: the papers' code bases (nanoGPT, timm)
# have it and the DNT figure is silent about it.
_S1 = dict(pre_norm_attn=True, pre_norm_ffn=True, final_norm=True)
NORM_PRESETS: dict[str, dict[str, bool]] = {
    "S1": dict(_S1),
    "S2": dict(_S1, qk_norm=True),
    "S3": dict(_S1, qk_norm=True, input_norm=True),
    "S4": dict(_S1, qk_norm=True, input_norm=True, mid_norm_attn=True, mid_norm_ffn=True),
    "S5": dict(
        input_norm=True, pre_norm_attn=True, qk_norm=True, mid_norm_attn=True, mid_norm_ffn=True, final_norm=True
    ),
    # the original Transformer (and the gradient-calculation seed): LayerNorm after each residual add
    "post": dict(post_norm=True),
}
NORM_PRESETS["dnt"] = dict(NORM_PRESETS["S5"])
NORM_PRESETS["pre"] = dict(NORM_PRESETS["S1"])


def lambda_init_for_layer(layer: int, lambda_init: Union[str, float] = "schedule") -> float:
    """lambda_init of DIFF layer ``layer`` (1-based), SPEC section 1.

    ``schedule``: 0.8 - 0.6 * exp(-0.3 * (layer - 1)), so layer 1 gets 0.2.
    A number: that constant for every layer (the paper's 0.8 / 0.5 ablations).
    """
    if layer < 1:
        raise ValueError(f"layer index is 1-based, got {layer}")
    if isinstance(lambda_init, str):
        if lambda_init != "schedule":
            raise ConfigError("lambda_init", f"must be 'schedule' or a number, got {lambda_init!r}")
        return 0.8 - 0.6 * math.exp(-0.3 * (layer - 1))
    return float(lambda_init)


# overrides given with an attention kind that are in that kind's own terms (its K/V heads, head and FFN widths, its
# pairing): from_preset / difftx info apply them to the twin, every other override to the model it is twinned from
TWIN_OWN_FIELDS = ("n_kv_heads", "head_dim", "ffn_dim", "pairing")

GEMM_MULTIPLE = 8  # FFN widths of DIFF V2 twins: a multiple of this where the parameter count allows
TWIN_TOLERANCE = 2e-3  # ... within this fraction of the baseline's parameters


def _round_up(x: float, multiple: int) -> int:
    return int(multiple * math.ceil(x / multiple))


def known_fields(cls, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` unchanged if every key is a field of the dataclass ``cls``; else one ConfigError naming the first unknown."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(unknown[0], f"unknown {cls.__name__} field; known fields: {', '.join(sorted(known))}")
    return data


@dataclass
class ModelConfig:
    """Architecture of a difftx model.  Every field has a default; see README "Config".

    Heads.  ``n_heads`` counts the heads of the attention kind at hand:

    * ``softmax``: ordinary heads, each with q/k/v of width ``head_dim`` (d).
    * ``diff``: *differential* heads.  Each has two d-wide queries and keys
      (Q1, Q2, K1, K2) and one 2d-wide value, so a DIFF model with h heads has
      the parameters and FLOPs of a Transformer with 2h heads of dim d
      (SPEC section 1).  ``head_dim`` is d, the width of *one* component.
    * ``diff2``: Differential Transformer V2.  h output heads computed from 2h
      query heads over unchanged K/V heads of width d; lambda = sigmoid(W x) per
      token and head; no per-head norm.  Paired query heads (2i, 2i+1) share a
      GQA group.

    ``n_kv_heads`` (GQA) counts K/V heads the same way (for ``diff``: K/V groups,
    each holding K1, K2 of width d and a 2d-wide V).  ``None`` means no GQA.
    """

    attention: str = "softmax"
    domain: str = "lm"

    # sizes
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    head_dim: Optional[int] = None
    n_kv_heads: Optional[int] = None
    ffn_dim: Optional[int] = None
    ffn_multiple_of: int = 64
    vocab_size: int = 256
    max_seq_len: int = 1024

    # differential attention (``diff``)
    lambda_init: Union[str, float] = "schedule"
    lambda_std: float = 0.1
    head_norm: bool = True
    head_norm_weight: bool = True
    head_norm_eps: float = 1e-5  # the official code uses 1e-5; transformers' DiffLlama uses rms_norm_eps

    # conventions real checkpoints disagree on
    pairing: str = "adjacent"
    rope_style: str = "half"
    rope_theta: float = 10000.0

    # normalisation placement: a preset name, then individual flags override it
    norms: str = "S1"
    input_norm: Optional[bool] = None
    pre_norm_attn: Optional[bool] = None
    pre_norm_ffn: Optional[bool] = None
    qk_norm: Optional[bool] = None
    mid_norm_attn: Optional[bool] = None
    mid_norm_ffn: Optional[bool] = None
    post_norm: Optional[bool] = None
    final_norm: Optional[bool] = None
    norm: str = "rms"
    norm_eps: float = 1e-5

    # the rest of the block
    ffn: str = "swiglu"
    positions: str = "rope"
    tie_embeddings: bool = False
    bias: bool = False
    qkv_bias: Optional[bool] = None  # biases on the query / key / value projections (Qwen2's); None: as ``bias``
    init: str = "normal"
    init_std: float = 0.02
    dropout: float = 0.0
    attn_backend: str = "auto"
    sliding_window: Optional[int] = None  # each query sees itself and the window - 1 tokens before it; None: all
    # under a sliding window, the layers (1-based) that attend over the whole context instead (local / global
    # layers, as Gemma's or a Qwen's max_window_layers); None: every layer uses the window
    full_attention_layers: Optional[tuple] = None

    # vision domain
    image_size: int = 32
    patch_size: int = 4
    in_channels: int = 3
    num_classes: int = 10
    pooling: str = "cls"

    # bookkeeping: the preset this config came from, if any (informational)
    preset: Optional[str] = None

    def __post_init__(self) -> None:
        self._validate_and_resolve()

    # ------------------------------------------------------------------ validation
    def _validate_and_resolve(self) -> None:
        def choice(name: str, options: tuple) -> None:
            value = getattr(self, name)
            if not isinstance(value, str) or value not in options:
                raise ConfigError(name, f"must be one of {', '.join(options)}; got {value!r}")

        def positive(name: str, allow_none: bool = False) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(name, f"must be a positive integer; got {value!r}")

        choice("attention", ATTENTION_KINDS)
        choice("domain", DOMAINS)
        choice("norm", NORM_TYPES)
        choice("ffn", FFN_KINDS)
        choice("positions", POSITION_KINDS)
        choice("init", INIT_KINDS)
        choice("pairing", PAIRINGS)
        choice("rope_style", ROPE_STYLES)
        choice("pooling", POOLINGS)
        choice("attn_backend", BACKENDS)
        for name in ("d_model", "n_layers", "n_heads", "vocab_size", "max_seq_len", "ffn_multiple_of"):
            positive(name)
        for name in ("head_dim", "n_kv_heads", "ffn_dim", "sliding_window"):
            positive(name, allow_none=True)
        for name in ("norm_eps", "head_norm_eps", "init_std", "rope_theta"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 or not math.isfinite(v):
                raise ConfigError(name, f"must be a positive number; got {v!r}")
        for name in ("head_norm", "head_norm_weight", "tie_embeddings", "bias"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"must be true or false; got {getattr(self, name)!r}")
        if self.qkv_bias is None:
            self.qkv_bias = self.bias
        elif not isinstance(self.qkv_bias, bool):
            raise ConfigError("qkv_bias", f"must be true or false (or null: as 'bias'); got {self.qkv_bias!r}")
        if self.preset is not None and not isinstance(self.preset, str):
            raise ConfigError("preset", f"is the name of the preset a config came from (a string); got "
                                        f"{self.preset!r}: pick a preset by name (--preset NAME), not with --set")
        if isinstance(self.lambda_std, bool) or not isinstance(self.lambda_std, (int, float)) \
                or not (self.lambda_std >= 0 and math.isfinite(self.lambda_std)):
            raise ConfigError("lambda_std", f"must be a finite number >= 0; got {self.lambda_std!r}")
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            raise ConfigError("dropout", f"must be in [0, 1); got {self.dropout!r}")
        if isinstance(self.lambda_init, str):
            if self.lambda_init != "schedule":
                try:
                    self.lambda_init = float(self.lambda_init)
                except ValueError:
                    raise ConfigError(
                        "lambda_init", f"must be 'schedule' or a number; got {self.lambda_init!r}"
                    ) from None
        elif isinstance(self.lambda_init, bool) or not isinstance(self.lambda_init, (int, float)):
            raise ConfigError("lambda_init", f"must be 'schedule' or a number; got {self.lambda_init!r}")
        if not isinstance(self.lambda_init, str) and not math.isfinite(self.lambda_init):
            raise ConfigError("lambda_init", f"must be 'schedule' or a finite number; got {self.lambda_init!r}")

        # heads
        a = self.attention
        components = 2 * self.n_heads if a == "diff" else self.n_heads
        if self.head_dim is None:
            if self.d_model % components:
                need = "2 * n_heads" if a == "diff" else "n_heads"
                raise ConfigError(
                    "d_model",
                    f"{self.d_model} is not divisible by {need} = {components} for attention={a!r}; "
                    f"change d_model or n_heads, or set head_dim",
                )
            self.head_dim = self.d_model // components
        if self.positions == "rope" and self.head_dim % 2:
            raise ConfigError("head_dim", f"must be even for rotary positions; got {self.head_dim}")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                "n_kv_heads", f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})"
            )
        if a == "diff2" and self.pairing != "adjacent":
            raise ConfigError(
                "pairing",
                "diff2 pairs query heads (2i, 2i+1) inside one GQA group; only pairing='adjacent' is valid",
            )

        # FFN
        if self.ffn_dim is None:
            raw = 8 * self.d_model / 3 if self.ffn == "swiglu" else 4 * self.d_model
            self.ffn_dim = _round_up(raw, self.ffn_multiple_of)

        # norms: preset, then explicit flags override
        if not isinstance(self.norms, str) or self.norms not in NORM_PRESETS:
            raise ConfigError("norms", f"unknown placement preset {self.norms!r}; one of {', '.join(NORM_PRESETS)}")
        preset = NORM_PRESETS[self.norms]
        for flag in NORM_FLAGS:
            value = getattr(self, flag)
            if value is None:
                setattr(self, flag, bool(preset.get(flag, False)))
            elif not isinstance(value, bool):
                raise ConfigError(flag, f"must be true or false; got {value!r}")

        # layers that skip the sliding window
        full = self.full_attention_layers
        if full is not None:
            if isinstance(full, (str, bytes)) or not isinstance(full, (list, tuple)) \
                    or any(isinstance(i, bool) or not isinstance(i, int) for i in full):
                raise ConfigError("full_attention_layers", f"must be a list of 1-based layer numbers (e.g. [4, 8]); "
                                                           f"got {full!r}")
            layers = tuple(sorted(set(full)))
            if len(layers) != len(full):
                raise ConfigError("full_attention_layers", f"lists a layer twice; got {list(full)}")
            if layers and (layers[0] < 1 or layers[-1] > self.n_layers):
                raise ConfigError("full_attention_layers", f"layer numbers run from 1 to n_layers = {self.n_layers}; "
                                                           f"got {list(full)}")
            if layers and self.sliding_window is None:
                raise ConfigError("full_attention_layers", "names the layers that attend over the whole context "
                                  "under a sliding window, and sliding_window is null: set sliding_window, or drop "
                                  "full_attention_layers")
            if len(layers) == self.n_layers:
                raise ConfigError("full_attention_layers", f"lists all {self.n_layers} layers, so no layer uses the "
                                  "sliding window: drop sliding_window and full_attention_layers (or list fewer "
                                  "layers)")
            self.full_attention_layers = layers or None

        # domain
        if self.domain == "vision":
            positive("image_size")
            positive("patch_size")
            positive("in_channels")
            positive("num_classes")
            if self.image_size % self.patch_size:
                raise ConfigError(
                    "patch_size",
                    f"image_size {self.image_size} is not divisible by patch_size {self.patch_size}; "
                    "pick a patch size that divides the image size",
                )
            if self.sliding_window is not None:  # else accepted and ignored: a ViT attends bidirectionally
                raise ConfigError("sliding_window", "is a causal language model's local attention; a vision model "
                                                    "attends over every patch: drop it")
            if self.tie_embeddings:  # else accepted and ignored: the classifier has nothing to be tied to
                raise ConfigError(
                    "tie_embeddings",
                    "a vision model has no token embedding to tie its classifier to; set tie_embeddings=false",
                )

    # ------------------------------------------------------------------ derived facts
    @property
    def n_q_components(self) -> int:
        """Number of d-wide query heads that are projected (2h for diff and diff2)."""
        return 2 * self.n_heads if self.attention in ("diff", "diff2") else self.n_heads

    @property
    def n_kv_components(self) -> int:
        """Number of d-wide key heads (and value heads of width d) in the KV cache."""
        return 2 * self.n_kv_heads if self.attention == "diff" else self.n_kv_heads

    @property
    def attn_inner_dim(self) -> int:
        """Width of the attention output before the output projection."""
        if self.attention == "diff":
            return 2 * self.n_heads * self.head_dim
        return self.n_heads * self.head_dim

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def norm_placement(self) -> dict[str, bool]:
        return {flag: bool(getattr(self, flag)) for flag in NORM_FLAGS}

    def layer_window(self, layer: int) -> Optional[int]:
        """The sliding window of 1-based layer ``layer``: ``sliding_window``, or None (the whole context) when
        there is none or the layer is one of ``full_attention_layers``."""
        if self.sliding_window is None or layer in (self.full_attention_layers or ()):
            return None
        return self.sliding_window

    @property
    def uniform_window(self) -> Optional[int]:
        """The sliding window when every layer uses it (then a KV cache may drop the keys no later token sees),
        else None."""
        return None if self.full_attention_layers else self.sliding_window

    def lambda_init_for(self, layer: int) -> float:
        """lambda_init of 1-based layer ``layer`` under this config."""
        return lambda_init_for_layer(layer, self.lambda_init)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), indent=kw.pop("indent", 2), **kw)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        return cls(**known_fields(cls, data))

    def replace(self, **changes) -> "ModelConfig":
        """A copy with ``changes`` applied and re-validated.

        Derived fields (head_dim, n_kv_heads, ffn_dim, qkv_bias) are re-derived unless given,
        when the fields they derive from change value: a field given its current
        value changes nothing (``replace(attention="softmax")`` of a softmax GQA model
        keeps its K/V heads and head_dim).  The norm flags follow ``norms`` whenever
        it is given (a study's arm names its whole placement); ``sliding_window=None`` drops
        ``full_attention_layers`` too.
        """
        base = self.to_dict()
        derived_from = {
            "head_dim": ("d_model", "n_heads", "attention"),
            "n_kv_heads": ("n_heads", "attention"),
            "ffn_dim": ("d_model", "ffn", "ffn_multiple_of"),
            "qkv_bias": ("bias",),
        }
        for derived, sources in derived_from.items():
            if derived not in changes and any(s in changes and changes[s] != base[s] for s in sources):
                base[derived] = None
        if changes.get("sliding_window", base["sliding_window"]) is None and "full_attention_layers" not in changes:
            base["full_attention_layers"] = None  # no window: no layer to except from it
        if "norms" in changes:
            for flag in NORM_FLAGS:
                if flag not in changes:
                    base[flag] = None
        base.update(changes)
        return ModelConfig.from_dict(base)

    def twin(self, attention: str, match_params: bool = True) -> "ModelConfig":
        """The matched-size config of another attention kind (SPEC section 1).

        softmax with 2h heads <-> diff with h heads (same head_dim, same parameters
        up to lambda and norm vectors).  diff2 keeps the baseline's head count and
        K/V heads; its extra query projection and lambda projection are paid for by
        a smaller FFN when ``match_params`` (so compare arms stay matched): the nearest
        multiple of 8 to the exact width when that stays within 0.2% of the baseline's
        parameters (GEMMs run up to 1.5x slower on odd widths: ``small``'s exact 1235 ran at
        62 GFLOP/s against 85-91 for 1232-1248, fp32 on an AVX2 CPU), else the exact width.
        """
        if attention not in ATTENTION_KINDS:
            raise ConfigError("attention", f"must be one of {', '.join(ATTENTION_KINDS)}; got {attention!r}")
        if attention == self.attention:
            return self.replace()
        # express self as its softmax baseline first
        heads, kv = self.n_heads, self.n_kv_heads
        if self.attention == "diff":
            heads, kv = 2 * heads, 2 * kv
        ffn_dim = self.ffn_dim
        if self.attention == "diff2" and match_params:
            ffn_dim = None  # the baseline default, if that is the baseline this V2 twin comes from (below)
        base = self.replace(attention="softmax", n_heads=heads, n_kv_heads=kv, head_dim=self.head_dim,
                            ffn_dim=ffn_dim, pairing="adjacent" if self.attention == "diff2" else self.pairing)
        if ffn_dim is None and base.twin("diff2").ffn_dim != self.ffn_dim:
            # a baseline of another FFN width (a preset's explicit one, e.g. transformer-1.4b's 5461): the width
            # whose parameters match this V2 model's, its extra query rows and lambda projection given back
            mats = 3 if self.ffn == "swiglu" else 2
            unit = mats * self.d_model + (mats - 1 if self.bias else 0)
            extra = self.n_heads * self.head_dim * (self.d_model + int(self.qkv_bias)) + self.d_model * self.n_heads
            base = base.replace(ffn_dim=self.ffn_dim + int(round(extra / unit)))
        if attention == "softmax":
            return base
        if attention == "diff":
            if heads % 2 or kv % 2:
                raise ConfigError(
                    "n_heads", f"a diff twin needs an even number of baseline heads and KV heads; got {heads}/{kv}"
                )
            return base.replace(attention="diff", n_heads=heads // 2, n_kv_heads=kv // 2, head_dim=base.head_dim,
                                ffn_dim=base.ffn_dim)
        # diff2
        cfg = base.replace(attention="diff2", pairing="adjacent", head_dim=base.head_dim, n_heads=heads,
                           n_kv_heads=kv, ffn_dim=base.ffn_dim)
        if match_params:
            extra = cfg.d_model * cfg.n_heads * cfg.head_dim + cfg.d_model * cfg.n_heads  # q2 rows + lambda_proj
            per_unit = (3 if cfg.ffn == "swiglu" else 2) * cfg.d_model + (0 if cfg.ffn == "swiglu" or not cfg.bias else 1)
            exact = max(1, cfg.ffn_dim - int(round(extra / per_unit)))
            from .accounting import count_parameters

            # V2 minus its baseline, per layer: the extra query rows and lambda_proj, less the FFN's shrink
            # (exactly: each FFN unit is 3 (SwiGLU) or 2 weight rows of d_model, plus its biases).
            q_rows = cfg.n_heads * cfg.head_dim
            mats = 3 if cfg.ffn == "swiglu" else 2  # weight rows of d_model per FFN unit
            unit = mats * cfg.d_model + (mats - 1 if cfg.bias else 0)  # + the biases inside the FFN
            target = count_parameters(base)

            def off(width: int) -> int:
                return cfg.n_layers * (q_rows * (cfg.d_model + int(cfg.qkv_bias)) + cfg.d_model * cfg.n_heads
                                       - (base.ffn_dim - width) * unit)

            lo = exact - exact % GEMM_MULTIPLE
            choices = [w for w in sorted((lo, lo + GEMM_MULTIPLE), key=lambda w: abs(w - exact)) if w > 0]
            fits = [w for w in choices if abs(off(w)) <= TWIN_TOLERANCE * target]
            cfg = cfg.replace(ffn_dim=fits[0] if fits else exact)
        return cfg

    # ------------------------------------------------------------------ presets
    @classmethod
    def from_preset(cls, name: str, **overrides) -> "ModelConfig":
        """A named preset (``difftx info --list``) with field overrides.

        Overriding ``attention`` alone converts the preset to its matched twin
        (e.g. ``from_preset("small", attention="diff")`` halves the heads), so
        parameter counts stay comparable; give ``n_heads`` too to opt out.  The
        twin is that of the preset with the other overrides (``d_model=256``: a
        DIFF V2 FFN shrunk for that width), except those given in the twin's own
        terms (:data:`TWIN_OWN_FIELDS`), applied to it.
        """
        from .presets import PRESETS

        if name not in PRESETS:
            close = [p for p in PRESETS if name.split("-")[0] in p][:5]
            hint = f"; did you mean {', '.join(close)}?" if close else "; see `difftx info --list`"
            raise ConfigError("preset", f"unknown preset {name!r}{hint}")
        cfg = cls.from_dict(dict(PRESETS[name].fields, preset=name))
        given = "attention" in overrides  # attention=None is given (and refused), not "the preset's"
        attention = overrides.pop("attention", None)
        if given and attention != cfg.attention and isinstance(attention, str) and "n_heads" not in overrides:
            cfg, overrides = cfg.twin_with(attention, overrides)
        elif given:
            overrides["attention"] = attention
        return cfg.replace(**overrides) if overrides else cfg

    def twin_with(self, attention: str, overrides: dict) -> "tuple[ModelConfig, dict]":
        """(the matched ``attention`` twin of this config with ``overrides`` applied, the overrides still to apply
        to it): those in the twin's own terms (:data:`TWIN_OWN_FIELDS`).  The others go in first, so the twin
        is matched to the overridden model: twinning first and then changing ``d_model`` (or ``ffn``) re-derived
        a DIFF V2 twin's FFN at the baseline's full width (``small`` at d_model 256: 8% more parameters)."""
        first = {k: v for k, v in overrides.items() if k not in TWIN_OWN_FIELDS}
        rest = {k: v for k, v in overrides.items() if k in TWIN_OWN_FIELDS}
        return (self.replace(**first) if first else self).twin(attention), rest
