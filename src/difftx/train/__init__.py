"""Training: configs, the papers' recipes, the loop, checkpoints and distributed wrapping.

    from difftx.train import TrainConfig, resolve_configs, train
    tcfg, mcfg = resolve_configs(train={"data": "input.txt", "steps": 200}, model={"attention": "diff"})
    summary = train(tcfg, mcfg, out="runs/demo")
"""

from .config import TrainConfig
from .domain import Domain, LMDomain, register_domain
from .recipes import RECIPES, get_recipe
from .run import resolve_configs, train
from .trainer import Trainer, TrainingDiverged

__all__ = ["TrainConfig", "Domain", "LMDomain", "register_domain", "RECIPES", "get_recipe", "resolve_configs",
           "train", "Trainer", "TrainingDiverged"]
