"""Named model presets: the papers' sizes, their twins, and small CPU sizes.

Each preset is a plain dict of ModelConfig fields.  Parameter counts are never
written here: ``difftx info`` counts them from the built model (on the meta
device), so what is reported is what the shapes give.

DIFF paper (SPEC section 1): the scaling sizes of Appendix C plus the 3B model
of section 3.1, with vocabulary 100,288 and tied input/output embeddings, which
is the assumption under which the paper's stated sizes (12 L d^2 + V d) come
out.  Each ``transformer-*`` twin doubles the heads at the same head size.

DNT (Table 3): GPT-2 and L-DNT Small / Large / XL, ViT and V-DNT Large / Huge.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    name: str
    group: str
    description: str
    fields: dict


PRESETS: dict[str, Preset] = {}


def _add(name: str, group: str, description: str, **fields) -> None:
    PRESETS[name] = Preset(name, group, description, fields)


# ---------------------------------------------------------------- DIFF paper
_DIFF_COMMON = dict(vocab_size=100288, max_seq_len=2048, ffn="swiglu", norms="S1", norm="rms",
                    positions="rope", tie_embeddings=True)
_DIFF_SIZES = [
    # name, d_model, layers, DIFF heads, head_dim, ffn_dim, max_seq_len, where
    ("830m", 1536, 24, 8, 96, 4096, 2048, "App. C"),
    ("1.4b", 2048, 24, 8, 128, 5461, 2048, "App. C"),
    ("2.8b", 2560, 32, 10, 128, 6826, 2048, "App. C"),
    ("3b", 3072, 28, 12, 128, 8192, 4096, "sec. 3.1 (about 2.8B stated; these shapes give more)"),
    ("6.8b", 4096, 32, 16, 128, 10922, 2048, "App. C"),
    ("13b", 5120, 40, 20, 128, 13653, 2048, "App. C (13.1B)"),
]
for size, d, layers, heads, hd, ffn, seq, where in _DIFF_SIZES:
    common = dict(_DIFF_COMMON, d_model=d, n_layers=layers, head_dim=hd, ffn_dim=ffn, max_seq_len=seq)
    _add(f"diff-{size}", "diff-paper", f"DIFF Transformer {size}, {heads} differential heads ({where})",
         attention="diff", n_heads=heads, **common)
    _add(f"transformer-{size}", "diff-paper", f"Transformer twin of diff-{size}: {2 * heads} heads of {hd}",
         attention="softmax", n_heads=2 * heads, **common)

# ---------------------------------------------------------------- DNT paper (Table 3)
_GPT2 = dict(vocab_size=50304, max_seq_len=1024, ffn="gelu", positions="learned", tie_embeddings=True,
             bias=False, attention="softmax")
_LM_SIZES = [("124m", "small", 768, 12, 12), ("774m", "large", 1280, 36, 20), ("1.4b", "xl", 1536, 48, 24)]
for size, dnt_name, d, layers, heads in _LM_SIZES:
    _add(f"gpt2-{size}", "dnt-paper", f"GPT-2 {size} (nanoGPT layout, pre-LayerNorm, S1; Xavier init, DNT Table 5)",
         d_model=d, n_layers=layers, n_heads=heads, norms="S1", norm="layer", init="xavier", **_GPT2)
    _add(f"ldnt-{dnt_name}", "dnt-paper", f"L-DNT-{dnt_name.upper() if dnt_name == 'xl' else dnt_name.capitalize()} ({size}): DNT norms (S5), Xavier init",
         d_model=d, n_layers=layers, n_heads=heads, norms="dnt", norm="rms", init="xavier", **_GPT2)

_VIT = dict(domain="vision", image_size=224, patch_size=16, in_channels=3, num_classes=1000, pooling="cls",
            ffn="gelu", positions="learned", bias=True, attention="softmax", vocab_size=1, max_seq_len=197)
for size, d, layers, heads in [("large", 1024, 24, 16), ("huge", 1280, 32, 16)]:
    _add(f"vit-{size}", "dnt-paper", f"ViT-{size.capitalize()}/16 at 224px (S1, LayerNorm)",
         d_model=d, n_layers=layers, n_heads=heads, norms="S1", norm="layer", init="truncated_xavier", **_VIT)
    _add(f"vdnt-{size}", "dnt-paper", f"V-DNT-{size.capitalize()}/16 at 224px (DNT norms)",
         d_model=d, n_layers=layers, n_heads=heads, norms="dnt", norm="rms", init="truncated_xavier", **_VIT)

# ---------------------------------------------------------------- CPU sizes
# Transformer baselines; from_preset(name, attention="diff") gives the matched twin.
_add("nano", "cpu", "4 layers x 128 wide, 4 heads, block 64: nanoGPT's CPU recipe shape, LLaMA-style",
     d_model=128, n_layers=4, n_heads=4, max_seq_len=64, vocab_size=256)
_add("nanogpt", "cpu", "nanoGPT's CPU recipe exactly: GELU MLP, LayerNorm, learned positions, tied",
     d_model=128, n_layers=4, n_heads=4, max_seq_len=64, vocab_size=256, ffn="gelu", norm="layer",
     positions="learned", tie_embeddings=True)
_add("tiny", "cpu", "4 layers x 256 wide, 8 heads of 32: quick CPU studies",
     d_model=256, n_layers=4, n_heads=8, max_seq_len=256, vocab_size=256)
_add("small", "cpu", "8 layers x 512 wide, 8 heads of 64 (about 25M parameters): CPU benchmarks",
     d_model=512, n_layers=8, n_heads=8, max_seq_len=512, vocab_size=256)
_VIT_TINY = dict(domain="vision", d_model=128, n_layers=4, n_heads=4, image_size=8, patch_size=2, in_channels=1,
                 num_classes=10, pooling="cls", ffn="gelu", positions="learned", bias=True, vocab_size=1,
                 max_seq_len=17, init="truncated_xavier")
_add("vit-tiny", "cpu", "vision: ViT, 4 layers x 128 wide on 8x8 images, patch 2 (the built-in digits; S1, "
     "LayerNorm, as vit-large)", norms="S1", norm="layer", **_VIT_TINY)
_add("vdnt-tiny", "cpu", "vision: V-DNT, vit-tiny with DNT norms (S5, RMSNorm, as vdnt-large)",
     norms="dnt", norm="rms", **_VIT_TINY)


def preset_names(group: str | None = None) -> list[str]:
    return [p.name for p in PRESETS.values() if group is None or p.group == group]
