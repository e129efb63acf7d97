"""The papers' training recipes by name: ``difftx train --recipe NAME`` (``--list-recipes``).

A recipe sets a model preset and TrainConfig fields; explicit flags override
it.  Batch sizes are global (``global_batch`` sequences per optimizer step over
all processes); the micro-batch (``--batch-size``) is yours to fit memory, and
gradient accumulation makes up the rest.  Values are from SPEC sections 1 and 4
and the papers' tables; where a paper leaves a value out the choice is written
beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    source: str
    preset: str
    train: dict
    model: dict = field(default_factory=dict)


RECIPES: dict[str, Recipe] = {}


def _add(name: str, description: str, source: str, preset: str, model: dict | None = None, **train) -> None:
    RECIPES[name] = Recipe(name, description, source, preset, dict(train, recipe=name), dict(model or {}))


# ---------------------------------------------------------------- DIFF Transformer
_DIFF_3B = dict(optimizer="adamw", betas=(0.9, 0.95), lr=3.2e-4, min_lr=1.28e-5, schedule="linear", warmup=1000,
                weight_decay=0.1, grad_clip=1.0, seq_len=4096, global_batch=1024, steps=83_447, dtype="bf16",
                tokenizer="bpe", bpe_vocab_size=100_288)
_add("diff-3b", "DIFF 3B: AdamW (0.9, 0.95), 3.2e-4, 1000 warmup, linear decay to 1.28e-5, wd 0.1, "
     "4M-token batches, 350B tokens", "DIFF sec. 3.1 / App. B", "diff-3b", **_DIFF_3B)
_add("transformer-3b", "the Transformer twin of diff-3b, same recipe", "DIFF sec. 3.1 / App. B",
     "transformer-3b", **_DIFF_3B)
# App. C: linear decay, end value not given; we decay to 0.
_DIFF_SCALING = dict(optimizer="adamw", betas=(0.9, 0.98), lr=1.5e-4, min_lr=0.0, schedule="linear", warmup=375,
                     weight_decay=0.05, grad_clip=1.0, seq_len=2048, global_batch=128, steps=40_000, dtype="bf16",
                     tokenizer="bpe", bpe_vocab_size=100_288)
_add("diff-scaling", "DIFF scaling runs 830M-2.8B: AdamW (0.9, 0.98), 1.5e-4, 375 warmup, linear decay, wd 0.05, "
     "0.25M-token batches, 40k steps", "DIFF App. C", "diff-1.4b", **_DIFF_SCALING)
_add("diff-scaling-xl", "DIFF scaling runs 6.8B-13.1B: as diff-scaling with lr 7.5e-5", "DIFF App. C",
     "diff-6.8b", **dict(_DIFF_SCALING, lr=7.5e-5))
# sec. 3.3: "additional 1.5B tokens", other values as sec. 3.1 (4M-token batches: 64 x 65,536), so
# 1.5e9 / 4,194,304 = 358 steps; warmup and the end of the decay are not given (0 and 0 here).
_add("diff-long", "DIFF long-context continuation: 64K tokens, RoPE theta 640,000, lr 8e-5, 1.5B tokens (resume "
     "from a diff-3b checkpoint)", "DIFF sec. 3.3", "diff-3b", model=dict(rope_theta=640_000.0, max_seq_len=65_536),
     **dict(_DIFF_3B, lr=8e-5, min_lr=0.0, seq_len=65_536, global_batch=64, steps=358, warmup=0))

# ---------------------------------------------------------------- DNT, language (Table 5)
_LM = dict(betas=(0.9, 0.95), min_lr=6e-5, schedule="cosine", grad_clip=1.0, seq_len=1024, steps=200_000,
           dtype="bf16", tokenizer="bpe", bpe_vocab_size=50_257)
_ADAMW = dict(optimizer="adamw", weight_decay=0.1, warmup=2000)
_MSGDW = dict(optimizer="msgdw", lr=1.0, weight_decay=1e-4, warmup=0, momentum=0.9)
for size, gpt, ldnt, gpt_lr, batch in [("", "gpt2-124m", "ldnt-small", 6e-4, 480),
                                       ("-large", "gpt2-774m", "ldnt-large", 2.5e-4, 512),
                                       ("-xl", "gpt2-1.4b", "ldnt-xl", 1.5e-4, 512)]:
    _add(f"gpt2{size}-adamw", f"GPT-2 {gpt[5:]} with AdamW {gpt_lr}", "DNT Table 5", gpt,
         **dict(_LM, **_ADAMW, lr=gpt_lr, global_batch=batch))
    _add(f"gpt2{size}-msgdw", f"GPT-2 {gpt[5:]} with mSGDW 1.0, wd 1e-4, no warmup", "DNT Table 5", gpt,
         **dict(_LM, **_MSGDW, global_batch=batch))
    _add(f"dnt{size}-adamw", f"L-DNT ({ldnt}) with AdamW 6e-4", "DNT Table 5", ldnt,
         **dict(_LM, **_ADAMW, lr=6e-4, global_batch=batch))
    _add(f"dnt{size}-msgdw", f"L-DNT ({ldnt}) with mSGDW 1.0, wd 1e-4, no warmup", "DNT Table 5", ldnt,
         **dict(_LM, **_MSGDW, global_batch=batch))

# ---------------------------------------------------------------- DNT, vision (Table 4)
# Augmentation and regularisation are domain options, read by the vision domain.
_VISION_AUG = dict(label_smoothing=0.1, mixup=0.8, cutmix=1.0, randaugment=[9, 0.5], random_erasing=0.0)
_VISION = dict(domain="vision", schedule="cosine", min_lr=1e-8, grad_clip=0.0, global_batch=1024, epochs=150,
               warmup_epochs=60, dtype="bf16")
for arch in ("vit", "vdnt"):
    for size, drop_path, sgd_lr, sgd_wd in [("large", 0.1, 0.5, 2e-4), ("huge", 0.5, 0.1, 1e-3)]:
        aug = dict(_VISION_AUG, stochastic_depth=drop_path)
        tag = "" if size == "large" else "-huge"
        label = f"{'ViT' if arch == 'vit' else 'V-DNT'}-{size.capitalize()}"
        _add(f"{arch}{tag}-adamw", f"{label} with AdamW 1e-3, (0.9, 0.99), wd 0.1", "DNT Table 4",
             f"{arch}-{size}", **dict(_VISION, optimizer="adamw", lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1,
                                      domain_options=aug))
        _add(f"{arch}{tag}-msgdw", f"{label} with mSGDW {sgd_lr}, wd {sgd_wd}", "DNT Table 4", f"{arch}-{size}",
             **dict(_VISION, optimizer="msgdw", lr=sgd_lr, momentum=0.9, weight_decay=sgd_wd, domain_options=aug))

# ---------------------------------------------------------------- CPU
_add("nanogpt-char", "nanoGPT's shakespeare_char CPU recipe: 2000 iters, AdamW 1e-3 (0.9, 0.99), cosine to 1e-4, "
     "100 warmup, wd 0.1, clip 1.0, batch 12 x 64 characters, eval over 200 batches", "nanoGPT README",
     "nanogpt", tokenizer="char", optimizer="adamw", lr=1e-3, min_lr=1e-4, warmup=100, steps=2000,
     betas=(0.9, 0.99), weight_decay=0.1, grad_clip=1.0, batch_size=12, seq_len=64, eval_batches=200,
     eval_every=250)

# the built-in digits (difftx.data.images; docs/vision.md, benchmarks/vision_digits.py): 40 epochs of batch 32,
# 3 warmup epochs, cosine to 1% of the peak; mixup 0.8 / cutmix 1.0 as the DNT paper's ImageNet recipes (the tiny
# models fit the 1259 training digits to a loss of ~1e-4 without mixing; V-DNT seeds 2 and 3: test accuracy 96.7 and
# 96.9% with mixup 0.2, 98.1 and 97.8% with these); no crop or flip (a 1-pixel random crop of an 8x8 digit costs
# accuracy, and digits are not mirror-symmetric).  40 epochs rather than 20: V-DNT seed 0 96.9% at 20 epochs,
# 97.8% at 40 (seed 1: 97.5 -> 98.1%), about 2.5 CPU-minutes
_DIGITS = dict(domain="vision", batch_size=32, epochs=40, warmup_epochs=3, schedule="cosine", grad_clip=1.0,
               dtype="fp32", eval_every=200, log_every=10, diag_every=0, domain_options={"mixup": 0.8, "cutmix": 1.0})
for arch, label in (("vit", "ViT"), ("vdnt", "V-DNT")):
    _add(f"{arch}-tiny-adamw", f"{label} tiny on the built-in digits (CPU, about 2.5 CPU-minutes): AdamW 2e-3, "
         "(0.9, 0.99), wd 0.05, batch 32, 40 epochs, mixup 0.8 / cutmix 1.0", "difftx (CPU)", f"{arch}-tiny",
         **dict(_DIGITS, optimizer="adamw", lr=2e-3, min_lr=2e-5, betas=(0.9, 0.99), weight_decay=0.05))
    _add(f"{arch}-tiny-msgdw", f"{label} tiny on the built-in digits with mSGDW 0.1, momentum 0.9, wd 1e-4",
         "difftx (CPU)", f"{arch}-tiny",
         **dict(_DIGITS, optimizer="msgdw", lr=0.1, min_lr=1e-3, momentum=0.9, weight_decay=1e-4))


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        close = [r for r in RECIPES if name.split("-")[0] in r][:6]
        hint = f"; did you mean {', '.join(close)}?" if close else "; see `difftx train --list-recipes`"
        raise ConfigError("recipe", f"unknown recipe {name!r}{hint}")
    return RECIPES[name]
