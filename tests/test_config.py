"""ModelConfig validation, derived fields, twins and presets."""

from __future__ import annotations

import pytest

from difftx import ConfigError, ModelConfig
from difftx.accounting import count_parameters, flops_per_token, kv_cache_bytes_per_token
from difftx.presets import PRESETS


@pytest.mark.parametrize("kwargs,field", [
    (dict(attention="diff", d_model=100, n_heads=3), "d_model"),        # 100 % (2*3) != 0
    (dict(attention="softmax", d_model=100, n_heads=3), "d_model"),
    (dict(d_model=384, n_heads=6, n_kv_heads=4), "n_kv_heads"),
    (dict(d_model=-8), "d_model"),
    (dict(n_layers=0), "n_layers"),
    (dict(vocab_size=-1), "vocab_size"),
    (dict(head_dim=-4), "head_dim"),
    (dict(attention="linear"), "attention"),
    (dict(norms="S9"), "norms"),
    (dict(norm="batch"), "norm"),
    (dict(ffn="moe"), "ffn"),
    (dict(positions="alibi"), "positions"),
    (dict(pairing="random"), "pairing"),
    (dict(rope_style="yarn"), "rope_style"),
    (dict(dropout=1.5), "dropout"),
    (dict(lambda_init="warm"), "lambda_init"),
    (dict(attention="diff2", pairing="halves"), "pairing"),
    (dict(domain="vision", image_size=30, patch_size=4), "patch_size"),
    (dict(domain="vision", tie_embeddings=True), "tie_embeddings"),  # was built untied, the flag ignored
    (dict(head_dim=5), "head_dim"),  # odd head dim cannot rotate
    (dict(tie_embeddings="no"), "tie_embeddings"),  # a string is not a flag (and "no" is truthy)
    (dict(bias=1), "bias"),
    (dict(head_norm="false"), "head_norm"),
    (dict(head_norm_weight=None), "head_norm_weight"),
    (dict(lambda_std=float("nan")), "lambda_std"),
    (dict(lambda_std=float("inf")), "lambda_std"),
    (dict(lambda_init="nan"), "lambda_init"),
    (dict(lambda_init=float("-inf")), "lambda_init"),
    (dict(norms=["S1"]), "norms"),  # unhashable: still one ConfigError naming the field
    (dict(attention=["diff"]), "attention"),
    (dict(preset=5), "preset"),
])
def test_invalid_configs_name_the_field(kwargs, field):
    with pytest.raises(ConfigError) as info:
        ModelConfig(**kwargs)
    assert info.value.field == field
    assert str(info.value).startswith(field)
    assert "\n" not in str(info.value)


def test_unknown_preset_and_field():
    with pytest.raises(ConfigError, match="preset"):
        ModelConfig.from_preset("diff-999b")
    with pytest.raises(ConfigError, match="n_layer"):
        ModelConfig.from_dict({"n_layer": 3})


def test_derived_fields():
    cfg = ModelConfig(attention="diff", d_model=256, n_heads=4)
    assert cfg.head_dim == 32  # d_model / (2 h)
    assert cfg.n_kv_heads == 4
    assert cfg.ffn_dim == 704  # 8/3 * 256 = 682.7 rounded up to a multiple of 64
    soft = ModelConfig(attention="softmax", d_model=256, n_heads=8)
    assert soft.head_dim == 32
    assert ModelConfig(ffn="gelu", d_model=128).ffn_dim == 512
    # replace re-derives what depends on a changed field, keeps explicit ones
    assert cfg.replace(d_model=512).head_dim == 64
    assert cfg.replace(d_model=512, head_dim=16).head_dim == 16


def test_replace_with_a_field_at_its_current_value_keeps_the_derived_ones():
    """replace(attention=<its own kind>) (from_preset(name, attention=...) of a preset of that kind, difftx info
    DIR --set attention=...) re-derived head_dim and n_kv_heads: a GQA model with its own head_dim became
    another model (4 K/V heads of 16 instead of 2 of 8, 2x the attention parameters)."""
    cfg = ModelConfig(d_model=64, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=100)
    assert cfg.replace(attention="softmax") == cfg
    assert cfg.replace(n_heads=4, d_model=64, ffn="swiglu") == cfg
    diff = ModelConfig(attention="diff", d_model=64, n_heads=2, n_kv_heads=1, head_dim=8)
    assert diff.replace(attention="diff") == diff
    assert cfg.replace(attention="diff").head_dim == 8  # a changed kind still re-derives (64 / (2 * 4))
    assert cfg.replace(n_heads=2).n_kv_heads == 2


def test_qkv_bias_follows_bias_unless_given():
    """qkv_bias (Qwen2's biases on q, k and v alone) defaults to bias, and replace(bias=...) carries it along; given,
    it puts biases on the three projections and nowhere else (the parameter count says so, in every kind)."""
    import difftx

    assert ModelConfig().qkv_bias is False and ModelConfig(bias=True).qkv_bias is True
    qwen2 = ModelConfig(d_model=64, n_heads=4, n_kv_heads=2, qkv_bias=True)
    assert qwen2.bias is False and qwen2.replace(n_layers=3).qkv_bias is True
    assert qwen2.replace(bias=True).qkv_bias is True and qwen2.replace(bias=True).replace(bias=False).qkv_bias is False
    assert ModelConfig.from_dict({k: v for k, v in qwen2.to_dict().items() if k != "qkv_bias"}).qkv_bias is False
    with pytest.raises(ConfigError, match="qkv_bias: must be true or false"):
        ModelConfig(qkv_bias="yes")
    for kind in ("softmax", "diff", "diff2"):
        cfg = qwen2.twin(kind)
        assert cfg.qkv_bias and not cfg.bias
        model = difftx.build_model(cfg)
        biases = sorted(name.split(".")[-2] for name, _ in model.named_parameters() if name.endswith(".bias"))
        assert biases == sorted(["q_proj", "k_proj", "v_proj"] * cfg.n_layers), kind
        q, kv = cfg.n_q_components * cfg.head_dim, cfg.n_kv_components * cfg.head_dim  # V as wide as K in each kind
        extra = cfg.n_layers * (q + 2 * kv)
        assert count_parameters(cfg) == count_parameters(cfg.replace(qkv_bias=False)) + extra, kind


def test_roundtrip_dict():
    cfg = ModelConfig.from_preset("small", attention="diff", norms="dnt")
    again = ModelConfig.from_dict(cfg.to_dict())
    assert again == cfg


@pytest.mark.parametrize("name,flags", [
    ("S1", {"pre_norm_attn", "pre_norm_ffn", "final_norm"}),
    ("S2", {"pre_norm_attn", "pre_norm_ffn", "final_norm", "qk_norm"}),
    ("S3", {"pre_norm_attn", "pre_norm_ffn", "final_norm", "qk_norm", "input_norm"}),
    ("S4", {"pre_norm_attn", "pre_norm_ffn", "final_norm", "qk_norm", "input_norm", "mid_norm_attn",
            "mid_norm_ffn"}),
    ("S5", {"pre_norm_attn", "final_norm", "qk_norm", "input_norm", "mid_norm_attn", "mid_norm_ffn"}),
    ("dnt", {"pre_norm_attn", "final_norm", "qk_norm", "input_norm", "mid_norm_attn", "mid_norm_ffn"}),
    ("post", {"post_norm"}),
])
def test_norm_presets_match_spec(name, flags):
    cfg = ModelConfig(norms=name)
    on = {k for k, v in cfg.norm_placement.items() if v}
    assert on == flags
    # an explicit flag overrides the preset
    assert ModelConfig(norms=name, final_norm=False).final_norm is False


def test_twins_are_matched():
    base = ModelConfig.from_preset("small")
    diff = base.twin("diff")
    assert (diff.n_heads, diff.head_dim, diff.n_kv_heads) == (base.n_heads // 2, base.head_dim, base.n_kv_heads // 2)
    assert diff.twin("softmax") == base.replace()
    p_base, p_diff = count_parameters(base), count_parameters(diff)
    assert abs(p_diff - p_base) / p_base < 1e-3
    v2 = base.twin("diff2")
    assert abs(count_parameters(v2) - p_base) / p_base < 2e-3
    assert v2.ffn_dim % 8 == 0  # a GEMM-friendly width (the exact match, 1235, runs 1.5x slower on the CPU)
    assert ModelConfig.from_preset("small", attention="diff") == diff.replace(preset="small")


@pytest.mark.parametrize("preset", ["nano", "nanogpt", "tiny", "small", "gpt2-124m", "transformer-1.4b"])
def test_diff2_twin_ffn_is_a_multiple_of_8_only_within_tolerance(preset, monkeypatch):
    """The V2 twin's FFN: the multiple of 8 nearest the exact match if that keeps parameters within 0.2%,
    else the exact width (tiny models, where one step of 8 is a large share)."""
    import difftx.config as config_mod

    base = ModelConfig.from_preset(preset)
    v2 = base.twin("diff2")
    with monkeypatch.context() as m:
        m.setattr(config_mod, "GEMM_MULTIPLE", 1)
        exact = base.twin("diff2").ffn_dim
    pb = count_parameters(base)
    assert abs(v2.ffn_dim - exact) < 8 and abs(count_parameters(v2) - pb) / pb <= 2e-3
    if v2.ffn_dim % 8:  # kept exact: both neighbouring multiples of 8 miss the tolerance
        assert v2.ffn_dim == exact
        for w in (exact - exact % 8, exact - exact % 8 + 8):
            assert abs(count_parameters(v2.replace(ffn_dim=w)) - pb) / pb > 2e-3


@pytest.mark.parametrize("preset", ["transformer-1.4b", "transformer-830m", "small"])
def test_twins_of_a_diff2_config_match_its_parameters(preset):
    """A V2 twin's own twins are matched to it (within the 0.2% its FFN width is chosen by): the softmax twin of
    transformer-1.4b's V2 twin had the default FFN 5504 instead of a width near the preset's 5461 (0.42% more
    parameters than the V2 model); its round trip keeps the V2 model; a default-width baseline comes back as is."""
    base = ModelConfig.from_preset(preset)
    v2 = base.twin("diff2")
    back, diff = v2.twin("softmax"), v2.twin("diff")
    p2 = count_parameters(v2)
    assert abs(count_parameters(back) - p2) / p2 <= 2e-3 and abs(count_parameters(diff) - p2) / p2 <= 2e-3
    assert back.twin("diff2") == v2.replace()
    assert abs(back.ffn_dim - base.ffn_dim) < 8
    if base.ffn_dim == base.replace(ffn_dim=None).ffn_dim:
        assert back == base.replace()


@pytest.mark.parametrize("size", ["830m", "1.4b", "2.8b", "3b", "6.8b", "13b"])
def test_diff_presets_and_twins_match_parameters(size):
    diff = ModelConfig.from_preset(f"diff-{size}")
    twin = ModelConfig.from_preset(f"transformer-{size}")
    assert twin.n_heads == 2 * diff.n_heads and twin.head_dim == diff.head_dim
    pd, pt = count_parameters(diff), count_parameters(twin)
    assert abs(pd - pt) / pt < 1e-3
    # the paper's sizes: 12 L d^2 + V d (SwiGLU 8/3 d, tied embeddings) within 0.2%
    approx = 12 * diff.n_layers * diff.d_model ** 2 + diff.vocab_size * diff.d_model
    assert abs(pd - approx) / approx < 2e-3
    assert kv_cache_bytes_per_token(diff) == kv_cache_bytes_per_token(twin)
    # "the same parameter count and FLOPs": (A1 - lambda A2) V is the twin's attention FLOPs, the rest identical
    assert flops_per_token(diff, 2048) == flops_per_token(twin, 2048)


@pytest.mark.parametrize("base,dnt", [("gpt2-124m", "ldnt-small"), ("gpt2-774m", "ldnt-large"), ("gpt2-1.4b", "ldnt-xl"),
                                      ("vit-large", "vdnt-large"), ("vit-huge", "vdnt-huge")])
def test_dnt_paper_baselines_differ_from_dnt_only_in_the_norms(base, dnt):
    """DNT Tables 4 and 5 give the baselines and the DNT models one column of settings each, init included
    (Xavier for GPT-2 and L-DNT, truncated Xavier for ViT and V-DNT): the presets differ only in the norms."""
    a, b = ModelConfig.from_preset(base).to_dict(), ModelConfig.from_preset(dnt).to_dict()
    differ = {k for k in a if a[k] != b[k]} - {"preset"}
    assert differ == {"norms", "norm", "input_norm", "pre_norm_ffn", "qk_norm", "mid_norm_attn", "mid_norm_ffn"}


def test_every_preset_builds_on_meta():
    for name in PRESETS:
        cfg = ModelConfig.from_preset(name)
        assert count_parameters(cfg) > 0


def test_known_parameter_counts():
    # GPT-2 124M (nanoGPT, vocab padded to 50304, tied, no biases): 123.59M as nanoGPT reports 124M
    assert abs(count_parameters(ModelConfig.from_preset("gpt2-124m")) - 124.0e6) / 124e6 < 0.01
    # ViT-L/16: ~304M; V-DNT-Large (307M in the paper's count)
    assert abs(count_parameters(ModelConfig.from_preset("vit-large")) - 304e6) / 304e6 < 0.02
    small = count_parameters(ModelConfig.from_preset("small"))
    assert 20e6 < small < 30e6


def test_flops_per_token_by_hand():
    """2 x matmul weights + 2 x context x (QK^T + PV widths) x layers; causal context seq / 2 (odd lengths not
    rounded down); a vision model's tokens are its patches, plus the CLS token when it pools by it."""
    from difftx.accounting import matmul_parameters

    cfg = ModelConfig(attention="diff", d_model=64, n_layers=2, n_heads=2, vocab_size=100)  # d = 16
    attn = lambda ctx: 2 * ctx * (2 * 2 * 16 + 2 * 2 * 16) * 2  # noqa: E731  qk 2hd, pv h(2d), 2 layers
    assert flops_per_token(cfg, 33, causal=True) == int(2 * matmul_parameters(cfg) + attn(16.5))
    assert flops_per_token(cfg, 33, causal=True, training=True) == int(3 * (2 * matmul_parameters(cfg) + attn(16.5)))
    for pooling, tokens in (("cls", 65), ("mean", 64)):
        v = ModelConfig(domain="vision", image_size=32, patch_size=4, d_model=64, n_layers=2, n_heads=4,
                        pooling=pooling)
        assert flops_per_token(v) == flops_per_token(v, tokens)


@pytest.mark.parametrize("overrides", [dict(d_model=256), dict(ffn="gelu"), dict(d_model=384, n_layers=2)])
def test_preset_twin_with_other_overrides_is_matched_to_the_overridden_preset(overrides, tmp_path):
    """from_preset("small", attention="diff2", d_model=256) (difftx train --attention diff2 --d-model 256)
    twinned the 512-wide preset, then re-derived the FFN for d_model 256 at the baseline's full width: 8% more
    parameters than from_preset("small", d_model=256).  The twin is now the overridden preset's."""
    base = ModelConfig.from_preset("small", **overrides)
    p = count_parameters(base)
    for kind in ("diff", "diff2"):
        twin = ModelConfig.from_preset("small", attention=kind, **overrides)
        assert twin == base.twin(kind)
        assert abs(count_parameters(twin) - p) / p <= 2e-3, kind
    # fields in the twin's own terms still apply to the twin: 2 DIFF K/V groups of the 4 DIFF heads
    assert ModelConfig.from_preset("small", attention="diff", n_kv_heads=2, **overrides).n_kv_heads == 2
    # difftx info CONFIG.json --set attention=diff2 --set d_model=...: the same twin
    from difftx.cli.info import resolve_config

    path = tmp_path / "small.json"
    path.write_text(ModelConfig.from_preset("small").to_json())
    assert resolve_config(str(path), dict(overrides, attention="diff2")) == base.twin("diff2")
