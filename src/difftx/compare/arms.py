"""The arms of a study: a model (attention kind x norm placement) under an optimiser.

An arm is written ``MODEL:OPTIMIZER`` (``dnt:msgdw``); its id, used for
directories and JSON keys, is ``MODEL-OPTIMIZER`` (``dnt-msgdw``).  Models are
defined once here as changes to one *base* config, the study's preset, and every
model is built from the base's Transformer form with :meth:`ModelConfig.twin`,
so DIFF gets half the heads of the same size and parameter counts stay matched
(the report prints them).  DNT is the paper's L-DNT / V-DNT norm placement
(InputNorm, PreNorm before attention, QK-norm, MidNorms) with RMSNorm.  Every
arm keeps the base's initialisation, so arms differ only in what they name: the
DNT paper's baselines and DNT models share theirs (Xavier, Table 5; truncated
Xavier, Table 4), and the ``gpt2-*`` presets carry it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import NORM_PRESETS, ModelConfig
from ..errors import ConfigError

OPTIMIZER_LABELS = {"adamw": "AdamW", "msgdw": "mSGDW", "sgd": "SGD", "muon": "Muon"}


@dataclass(frozen=True)
class Model:
    label: str
    attention: str
    fields: dict = field(default_factory=dict)   # ModelConfig changes applied after the twin


_DNT = {"norms": "dnt", "norm": "rms"}

MODELS = {
    "lm": {
        "transformer": Model("Transformer (S1)", "softmax", {"norms": "S1"}),
        "diff": Model("DIFF", "diff", {"norms": "S1"}),
        "diff2": Model("DIFF V2", "diff2", {"norms": "S1"}),
        "dnt": Model("DNT", "softmax", _DNT),
        "diff-dnt": Model("DIFF inside DNT", "diff", _DNT),
        "diff2-dnt": Model("DIFF V2 inside DNT", "diff2", _DNT),
        **{s: Model(f"Transformer ({s})", "softmax", {"norms": s}) for s in ("S2", "S3", "S4", "S5")},
    },
    "vision": {
        "vit": Model("ViT", "softmax", {}),
        "diff-vit": Model("DIFF-ViT", "diff", {}),
        "vdnt": Model("V-DNT", "softmax", _DNT),
        "diff-vdnt": Model("DIFF inside V-DNT", "diff", _DNT),
    },
}

DEFAULT_ARMS = {
    "lm": ("transformer:adamw", "diff:adamw", "transformer:msgdw", "dnt:adamw", "dnt:msgdw", "diff-dnt:adamw"),
    "vision": ("vit:adamw", "diff-vit:adamw", "vit:msgdw", "vdnt:adamw", "vdnt:msgdw"),
}
# the roles the report's questions need, per domain: (baseline, diff, dnt, diff inside dnt)
ROLES = {"lm": ("transformer", "diff", "dnt", "diff-dnt"), "vision": ("vit", "diff-vit", "vdnt", "diff-vdnt")}


@dataclass(frozen=True)
class Arm:
    model: str
    optimizer: str
    domain: str = "lm"

    @property
    def id(self) -> str:
        return f"{self.model}-{self.optimizer}"

    @property
    def spec(self) -> str:
        return f"{self.model}:{self.optimizer}"

    @property
    def label(self) -> str:
        return f"{MODELS[self.domain][self.model].label} · {OPTIMIZER_LABELS.get(self.optimizer, self.optimizer)}"

    def model_config(self, base: ModelConfig) -> ModelConfig:
        """This arm's model: the base's Transformer form, twinned to the arm's attention, then its fields."""
        m = MODELS[self.domain][self.model]
        return base.twin("softmax").twin(m.attention).replace(**m.fields)


def parse_arms(spec, domain: str = "lm") -> list[Arm]:
    """``"transformer:adamw,diff:adamw"`` (or a list of such strings) -> arms; a bad entry is one clear error."""
    from ..optim import OPTIMIZERS

    if domain not in MODELS:
        raise ConfigError("domain", f"must be one of {', '.join(MODELS)}; got {domain!r}")
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    arms, seen = [], set()
    for item in (s.strip() for s in items):
        if not item:
            continue
        model, _, opt = item.partition(":")
        opt = opt or "adamw"
        if model not in MODELS[domain]:
            raise ConfigError("arms", f"unknown {domain} model {model!r} in {item!r}; one of "
                                      f"{', '.join(MODELS[domain])} (written MODEL:OPTIMIZER, e.g. dnt:msgdw)")
        if opt not in OPTIMIZERS:
            raise ConfigError("arms", f"unknown optimizer {opt!r} in {item!r}; one of {', '.join(OPTIMIZERS)}")
        arm = Arm(model, opt, domain)
        if arm.id in seen:
            raise ConfigError("arms", f"arm {item!r} is listed twice")
        seen.add(arm.id)
        arms.append(arm)
    if not arms:
        raise ConfigError("arms", "no arms given; e.g. --arms transformer:adamw,diff:adamw")
    return arms


def check_norms_known() -> None:  # pragma: no cover - a guard for future edits of NORM_PRESETS
    for models in MODELS.values():
        for m in models.values():
            assert m.fields.get("norms", "S1") in NORM_PRESETS
