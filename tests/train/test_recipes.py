"""Every recipe resolves to valid configs, and carries the papers' numbers (SPEC sections 1 and 4)."""

import pytest

from difftx.errors import ConfigError
from difftx.train import RECIPES, TrainConfig, resolve_configs


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_resolves(name):
    tcfg, mcfg = resolve_configs(name)
    assert tcfg.recipe == name and mcfg.preset == RECIPES[name].preset and tcfg.domain == mcfg.domain


def test_values_from_the_papers():
    t, m = resolve_configs("diff-3b")
    assert (t.lr, t.min_lr, t.warmup, t.schedule, t.betas, t.weight_decay) == (3.2e-4, 1.28e-5, 1000, "linear",
                                                                               (0.9, 0.95), 0.1)
    assert t.global_batch * t.seq_len == 1024 * 4096 and m.attention == "diff" and m.n_heads == 12
    t, _ = resolve_configs("diff-scaling")
    assert (t.lr, t.warmup, t.betas, t.weight_decay, t.steps, t.seq_len) == (1.5e-4, 375, (0.9, 0.98), 0.05, 40_000,
                                                                             2048)
    assert resolve_configs("diff-scaling-xl")[0].lr == 7.5e-5
    t, m = resolve_configs("diff-long")
    assert m.rope_theta == 640_000 and t.lr == 8e-5 and t.seq_len == m.max_seq_len == 65_536
    # DIFF sec. 3.3: "additional 1.5B tokens" at the 3B recipe's 4M-token batches
    assert t.global_batch * t.seq_len == 1024 * 4096
    assert abs(t.steps * t.global_batch * t.seq_len - 1.5e9) <= t.global_batch * t.seq_len
    t, m = resolve_configs("dnt-msgdw")
    assert (t.optimizer, t.lr, t.weight_decay, t.warmup, t.min_lr, t.grad_clip) == ("msgdw", 1.0, 1e-4, 0, 6e-5, 1.0)
    assert m.norms == "dnt" and m.init == "xavier"
    t, m = resolve_configs("gpt2-adamw")
    assert (t.lr, t.warmup, t.global_batch, t.steps, t.betas) == (6e-4, 2000, 480, 200_000, (0.9, 0.95))
    assert resolve_configs("gpt2-large-adamw")[0].lr == 2.5e-4 and resolve_configs("dnt-xl-adamw")[0].lr == 6e-4
    t, m = resolve_configs("vit-huge-msgdw")
    assert (t.lr, t.weight_decay, t.epochs, t.warmup_epochs, t.domain) == (0.1, 1e-3, 150, 60, "vision")
    assert t.domain_options["label_smoothing"] == 0.1 and t.domain_options["stochastic_depth"] == 0.5
    t, m = resolve_configs("nanogpt-char")
    assert (t.lr, t.min_lr, t.warmup, t.steps, t.batch_size, t.seq_len, t.betas) == (1e-3, 1e-4, 100, 2000, 12, 64,
                                                                                     (0.9, 0.99))
    assert m.ffn == "gelu" and m.norm == "layer" and m.positions == "learned"


def test_flags_override_the_recipe_and_attention_gives_the_twin():
    t, m = resolve_configs("nanogpt-char", train={"lr": 5e-4}, model={"attention": "diff"})
    assert t.lr == 5e-4 and t.min_lr == 1e-4 and m.attention == "diff" and m.n_heads == 2


def test_global_batch_sets_accumulation():
    t = TrainConfig(batch_size=4, global_batch=32)
    assert t.accumulation(1) == 8 and t.accumulation(2) == 4
    with pytest.raises(ConfigError, match="global_batch"):
        t.accumulation(3)


def test_bad_values_name_the_field():
    for bad, field in [(dict(lr=0), "lr"), (dict(optimizer="lion"), "optimizer"), (dict(batch_size=0), "batch_size"),
                       (dict(betas=(0.9, 1.5)), "betas"), (dict(min_lr=1.0, lr=0.1), "min_lr"),
                       (dict(dtype="fp8"), "dtype"), (dict(val_fraction=0.95), "val_fraction"),
                       (dict(seed=2 ** 64), "seed"), (dict(seed=-1), "seed"),
                       (dict(optimizer="sgd", nesterov=True, momentum=0.0), "nesterov"),
                       (dict(optimizer="msgdw", nesterov=True, momentum=0.0), "nesterov")]:
        with pytest.raises(ConfigError, match=field):
            TrainConfig(**bad)
    with pytest.raises(ConfigError, match="unknown recipe"):
        resolve_configs("diff-99b")
