"""The decoder LM: causality, cache equals full forward, padding, norm placement, backends, save/load."""

from __future__ import annotations

import pytest
import torch

import difftx
import difftx.accounting
from difftx import ModelConfig, build_model
from difftx.nn.cache import KVCache
from difftx.nn.norms import LayerNorm, RMSNorm

KINDS = ["softmax", "diff", "diff2"]


def tiny(attention="softmax", **kw):
    base = dict(d_model=32, n_layers=2, n_heads=4, vocab_size=61, max_seq_len=64)
    if attention == "diff":
        base.update(n_heads=2)
    base.update(kw)
    return ModelConfig(attention=attention, **base)


@pytest.mark.parametrize("attention", KINDS)
@pytest.mark.parametrize("norms", ["S1", "dnt", "post"])
def test_causality(attention, norms):
    torch.manual_seed(0)
    model = build_model(tiny(attention, norms=norms)).eval()
    x = torch.randint(0, 61, (2, 12))
    t = 5
    y = x.clone()
    y[:, t] = (y[:, t] + 7) % 61
    with torch.no_grad():
        a, b = model(x).logits, model(y).logits
    assert torch.equal(a[:, :t], b[:, :t]), "a change at t leaked into earlier positions"
    assert (a[:, t:] - b[:, t:]).abs().amax(-1).min() > 0, "a change at t must change every later position"


@pytest.mark.parametrize("attention", KINDS)
@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_incremental_decoding_equals_full_forward(attention, positions):
    torch.manual_seed(0)
    model = build_model(tiny(attention, positions=positions, n_kv_heads=1 if attention == "diff" else 2)).eval()
    x = torch.randint(0, 61, (3, 20))
    with torch.no_grad():
        full = model(x).logits
        cache = model.new_cache(3, 20)
        parts = [model(x[:, :7], cache=cache).logits]          # prefill
        for t in range(7, 13):                                   # one token at a time
            parts.append(model(x[:, t:t + 1], cache=cache).logits)
        parts.append(model(x[:, 13:], cache=cache).logits)      # a chunk into a non-empty cache
        inc = torch.cat(parts, dim=1)
    assert (inc - full).abs().max() < 1e-5


@pytest.mark.parametrize("attention", KINDS)
def test_a_cache_in_another_dtype_than_the_model_computes_is_refused(attention):
    """The attention paths read the cache's buffers as K and V: a cache made for another dtype is refused at its
    first write (one ValueError naming both dtypes), and one made for the model's dtype decodes."""
    model = build_model(tiny(attention)).eval()
    x = torch.randint(0, 61, (1, 6))
    with torch.no_grad():
        for dtype in (torch.bfloat16, torch.float64):
            with pytest.raises(ValueError, match=f"cache made for {dtype}.*computes K/V in torch.float32"):
                model(x, cache=model.new_cache(1, 8, dtype=dtype))
        cache = model.new_cache(1, 8, dtype=torch.float32)
        model(x[:, :5], cache=cache)
        assert (model(x[:, 5:], cache=cache).logits - model(x).logits[:, 5:]).abs().max() < 1e-5


@pytest.mark.parametrize("attention", KINDS)
def test_left_padding_matches_unpadded(attention):
    """A left-padded row gives the logits of the same row without padding (positions skip the pads)."""
    torch.manual_seed(0)
    model = build_model(tiny(attention)).eval()
    row = torch.randint(1, 61, (1, 9))
    padded = torch.cat((torch.zeros(1, 4, dtype=torch.long), row), dim=1)
    mask = torch.cat((torch.zeros(1, 4), torch.ones(1, 9)), dim=1)
    with torch.no_grad():
        ref = model(row).logits
        out = model(padded, attention_mask=mask).logits[:, 4:]
        assert (out - ref).abs().max() < 1e-5
        # and incrementally through the cache
        cache = model.new_cache(1, 20)
        first = model(padded, attention_mask=mask, cache=cache).logits[:, 4:]
        nxt = torch.tensor([[5]])
        step = model(nxt, cache=cache).logits
        ref_step = model(torch.cat((row, nxt), dim=1)).logits[:, -1:]
    assert (first - ref).abs().max() < 1e-5
    assert (step - ref_step).abs().max() < 1e-5


@pytest.mark.parametrize("attention", KINDS)
def test_backends_agree_at_model_level(attention):
    torch.manual_seed(0)
    model = build_model(tiny(attention, n_kv_heads=1 if attention == "diff" else 2)).eval()
    x = torch.randint(0, 61, (2, 10))
    mask = torch.ones(2, 10)
    mask[1, :3] = 0
    outs = {}
    with torch.no_grad():
        for backend in ["eager", "sdpa", "flex"]:
            model.set_attention_backend(backend)
            outs[backend] = model(x, attention_mask=mask).logits
    for backend, out in outs.items():
        assert (out[mask.bool()] - outs["eager"][mask.bool()]).abs().max() < 2e-5, backend


def test_diff_kv_cache_bytes_equal_transformer():
    base = tiny("softmax", n_kv_heads=2)
    diff = base.twin("diff")
    x = torch.randint(0, 61, (2, 10))
    sizes = {}
    for cfg in (base, diff):
        model = build_model(cfg).eval()
        cache = model.new_cache(2, 16)
        with torch.no_grad():
            model(x, cache=cache)
        sizes[cfg.attention] = cache.bytes()
    assert sizes["diff"] == sizes["softmax"]
    assert difftx.accounting.kv_cache_bytes_per_token(diff) == difftx.accounting.kv_cache_bytes_per_token(base)



def _decode(model, cache, prompt, mask=None, steps=4):
    """Prefill ``prompt`` into ``cache``, then greedy steps: the logits of every forward, concatenated."""
    out = [model(prompt, attention_mask=mask, cache=cache).logits[:, -1:]]
    step_mask = None if mask is None else torch.ones(prompt.shape[0], 1, dtype=mask.dtype)
    for _ in range(steps):
        nxt = out[-1].argmax(-1)
        if step_mask is not None:
            mask = torch.cat((mask, step_mask), dim=1)
        out.append(model(nxt, attention_mask=None if mask is None else step_mask, cache=cache).logits)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("attention", KINDS)
def test_a_reset_cache_decodes_as_a_fresh_one_in_its_own_buffers(attention):
    """KVCache.reset: a cache used for a left-padded batch (padding, per-row positions, a longer fill) then reset
    gives bitwise the logits of a fresh cache for the next prompt, and keeps its buffers (no reallocation)."""
    torch.manual_seed(0)
    model = build_model(tiny(attention)).eval()
    first = torch.randint(0, 61, (2, 9))
    pad = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1] * 9])
    prompt = torch.randint(0, 61, (2, 5))
    with torch.no_grad():
        cache = model.new_cache(2, 20)
        _decode(model, cache, first, pad, steps=6)
        buffers = [t.data_ptr() for t in cache.k + cache.v]
        cache.reset()
        assert cache.length == 0 and cache.bytes() > 0
        again = _decode(model, cache, prompt)
        fresh = _decode(model, model.new_cache(2, 20), prompt)
    assert torch.equal(again, fresh)
    assert [t.data_ptr() for t in cache.k + cache.v] == buffers


@pytest.mark.parametrize("attention", KINDS)
def test_a_reset_cache_drops_the_autograd_history_of_earlier_prompts(attention):
    """Decoding with autograd on (no torch.no_grad) writes K/V with a history into the cache's buffers; reset()
    kept it: each reuse chained the next prompt's graph (and its saved activations) to every earlier one, so a
    server or notebook reusing one cache grew without bound (+0.9 MB per prompt at d_model 64).  After reset the
    buffers, the same tensors, hold no history, as a fresh cache's."""
    torch.manual_seed(0)
    model = build_model(tiny(attention)).eval()
    prompt = torch.randint(0, 61, (2, 5))
    cache = model.new_cache(2, 20)
    model(prompt, cache=cache)
    assert cache.k[0].grad_fn is not None  # the premise: the buffers were written with a history
    nodes = _graph_size(cache.k[0])
    buffers = list(cache.k + cache.v)
    for _ in range(3):
        cache.reset()
        assert all(t.grad_fn is None for t in cache.k + cache.v)
        assert all(a is b for a, b in zip(cache.k + cache.v, buffers))  # the same tensors
        model(prompt, cache=cache)
        assert _graph_size(cache.k[0]) == nodes  # this prompt's graph alone, as in a fresh cache


@pytest.mark.parametrize("reset_inside_first", [False, True])
@pytest.mark.parametrize("made_inside", [True, False])
def test_a_cache_filled_under_inference_mode_is_reset_and_reused_outside_it(made_inside, reset_inside_first):
    """A cache written under torch.inference_mode() (its buffers inference tensors; made there too, or not) then
    reset and reused outside it: reset() raised torch's "Inplace update to inference tensor outside
    InferenceMode"; now it behaves as a fresh cache (bitwise the same logits).  ``reset_inside_first``: the
    generation loop reset it under inference mode too (its buffers then kept for reuse) before the reset outside."""
    torch.manual_seed(0)
    model = build_model(tiny("softmax")).eval()
    prompt, other = torch.randint(0, 61, (2, 5)), torch.randint(0, 61, (2, 7))
    if made_inside:
        with torch.inference_mode():
            cache = model.new_cache(2, 20)
    else:
        cache = model.new_cache(2, 20)
    with torch.inference_mode():
        model(prompt, cache=cache)
        if reset_inside_first:
            cache.reset()
    with torch.no_grad():
        cache.reset()
        got = model(other, cache=cache).logits
        step = model(other[:, -1:], cache=cache).logits
        fresh = model.new_cache(2, 20)
        want = model(other, cache=fresh).logits
        want_step = model(other[:, -1:], cache=fresh).logits
    assert torch.equal(got, want) and torch.equal(step, want_step)


def _graph_size(t: torch.Tensor) -> int:
    """The autograd nodes reachable from ``t``."""
    seen, todo = set(), [t.grad_fn]
    while todo:
        f = todo.pop()
        if f is not None and f not in seen:
            seen.add(f)
            todo.extend(g for g, _ in f.next_functions)
    return len(seen)


def test_a_reset_cache_takes_another_models_keys_as_a_fresh_one():
    """After reset, K/V of another layout (here DIFF after softmax: V of 2 heads of 16, not 4 of 8) get buffers of
    their shape, as in a fresh cache, instead of being written into the old ones; a layer left unwritten (a model of
    fewer layers) holds no buffer, as in a fresh cache."""
    torch.manual_seed(0)
    soft, diff = build_model(tiny("softmax")).eval(), build_model(tiny("diff", n_layers=1)).eval()
    prompt = torch.randint(0, 61, (2, 5))
    with torch.no_grad():
        cache = soft.new_cache(2, 20)
        _decode(soft, cache, prompt)
        cache.reset()
        again = _decode(diff, cache, prompt)
        fresh_cache = KVCache(2, 2, 20)
        fresh = _decode(diff, fresh_cache, prompt)
    assert torch.equal(again, fresh)
    assert cache.bytes() == fresh_cache.bytes() and cache.k[1] is None and cache.v[1] is None


EXPECTED_NORMS = {
    "S1": {"attn_norm", "ffn_norm"},
    "S2": {"attn_norm", "ffn_norm", "attn.q_norm", "attn.k_norm"},
    "S3": {"attn_norm", "ffn_norm", "attn.q_norm", "attn.k_norm"},
    "S4": {"attn_norm", "ffn_norm", "attn.q_norm", "attn.k_norm", "attn_mid_norm", "ffn_mid_norm"},
    "S5": {"attn_norm", "attn.q_norm", "attn.k_norm", "attn_mid_norm", "ffn_mid_norm"},
    "post": {"attn_post_norm", "ffn_post_norm"},
}


@pytest.mark.parametrize("norms", list(EXPECTED_NORMS))
@pytest.mark.parametrize("attention", ["softmax", "diff"])
def test_norm_placement_structure(norms, attention):
    model = build_model(tiny(attention, norms=norms))
    block_norms = {n for n, m in model.layers[0].named_modules() if isinstance(m, (RMSNorm, LayerNorm))}
    block_norms.discard("attn.head_norm")  # DIFF's per-head norm is part of the attention, not a placement
    assert block_norms == EXPECTED_NORMS[norms]
    assert (model.input_norm is not None) == (norms in ("S3", "S4", "S5"))
    assert (model.final_norm is not None) == (norms != "post")


def test_norm_behaviour_mid_input_and_qk():
    """MidNorm output has unit RMS before the residual add; so does InputNorm's; QK-norm's per head."""
    torch.manual_seed(0)
    model = build_model(tiny("diff", norms="dnt", d_model=64)).eval()
    with torch.no_grad():
        model.embed.weight.normal_(0, 1)  # so eps (1e-5) is negligible against the mean square
    seen = {}

    def grab(name):
        def hook(_m, inp, out):
            seen[name] = (inp[0].detach(), out.detach())
        return hook

    model.input_norm.register_forward_hook(grab("input"))
    model.layers[1].attn_mid_norm.register_forward_hook(grab("mid_attn"))
    model.layers[1].ffn_mid_norm.register_forward_hook(grab("mid_ffn"))
    model.layers[0].attn.q_norm.register_forward_hook(grab("q"))
    with torch.no_grad():
        model(torch.randint(0, 61, (2, 10)) * 3 % 61)
    eps = model.config.norm_eps
    for name in ("input", "mid_attn", "mid_ffn", "q"):
        inp, out = seen[name]
        rms = out.pow(2).mean(-1).sqrt()
        ms_in = inp.pow(2).mean(-1)
        expected = (ms_in / (ms_in + eps)).sqrt()  # unit RMS up to the eps in the denominator
        assert torch.allclose(rms, expected, atol=1e-5), name
    assert seen["q"][1].shape[-1] == model.config.head_dim  # per component head


@pytest.mark.parametrize("weight", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_equation_and_eps(weight, dtype):
    """LayerNorm (norm="layer"): (x - mean) / sqrt(biased var + eps) * weight + bias over the last dim, in fp32
    and returned in the input's dtype; the model's norm_eps reaches every one of its norms.  eps 0.1 against a
    variance of 0.09, so a wrong eps shows."""
    torch.manual_seed(0)
    norm = LayerNorm(16, eps=0.1, weight=weight)
    if weight:
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.normal_()
    x = (torch.randn(3, 5, 16) * 0.3 + 0.7).to(dtype)
    xd = x.double()
    ref = (xd - xd.mean(-1, keepdim=True)) / torch.sqrt(xd.var(-1, unbiased=False, keepdim=True) + 0.1)
    if weight:
        ref = ref * norm.weight.double() + norm.bias.double()
    out = norm(x)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    model = build_model(tiny("diff", norm="layer", norm_eps=0.1))
    eps = {m.eps for m in model.modules() if isinstance(m, LayerNorm)}
    assert eps == {0.1}


@pytest.mark.parametrize("ffn", ["gelu", "relu", "swiglu"])
def test_ffn_equations(ffn):
    """The FFNs in float64 against their formulas: GELU (exact, erf: GPT-2, ViT) or ReLU between w_up and w_down
    (biases included), SwiGLU's silu(x W_gate) * x W_up before w_down."""
    import math

    from difftx.nn.ffn import make_ffn

    torch.manual_seed(0)
    cfg = tiny("softmax", ffn=ffn, bias=ffn != "swiglu")
    f = make_ffn(cfg).double()
    x = torch.randn(2, 5, cfg.d_model, dtype=torch.float64) * 2

    def lin(m, t):
        return t @ m.weight.T + (0 if m.bias is None else m.bias)

    with torch.no_grad():
        if ffn == "swiglu":
            g = lin(f.w_gate, x)
            h = g / (1 + torch.exp(-g)) * lin(f.w_up, x)
        else:
            u = lin(f.w_up, x)
            h = 0.5 * u * (1 + torch.special.erf(u / math.sqrt(2))) if ffn == "gelu" else u.clamp_min(0)
        torch.testing.assert_close(f(x), lin(f.w_down, h), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dim", [8, 7])
def test_sinusoidal_positions_are_vaswanis(dim):
    """positions="sinusoidal": PE(p, 2i) = sin(p / 10000^(2i/d)), PE(p, 2i+1) = cos(p / 10000^(2i/d)), written out
    entry by entry, and the model adds exactly that table to its token embeddings."""
    import math

    from difftx.nn.rope import sinusoidal_table

    table = sinusoidal_table(50, dim)
    want = torch.tensor([[(math.sin if c % 2 == 0 else math.cos)(p / 10000 ** ((c - c % 2) / dim)) for c in range(dim)]
                         for p in range(50)])
    torch.testing.assert_close(table, want, rtol=0, atol=1e-6)
    model = build_model(tiny("softmax", positions="sinusoidal", norms="S1")).eval()
    seen = {}
    model.layers[0].register_forward_pre_hook(lambda m, args: seen.update(x=args[0]))
    ids = torch.randint(0, 61, (2, 9))
    with torch.no_grad():
        model(ids)
    torch.testing.assert_close(seen["x"], model.embed.weight[ids] + sinusoidal_table(9, 32))


def test_layer_norm_and_bias_variants_build_and_train_step():
    cfg = tiny("softmax", norm="layer", ffn="relu", bias=True, positions="sinusoidal", init="xavier", norms="post")
    model = build_model(cfg)
    x = torch.randint(0, 61, (2, 8))
    out = model(x, targets=x)
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_loss_reductions_and_ignore_index():
    model = build_model(tiny("diff"))
    x = torch.randint(0, 61, (2, 8))
    y = x.clone()
    y[0, :3] = -100
    mean = model(x, targets=y).loss
    out = model(x, targets=y, loss_reduction="sum")
    assert int(out.n_targets) == 13
    assert torch.allclose(out.loss / 13, mean)


@pytest.mark.parametrize("attention", KINDS)
def test_save_and_load_roundtrip(tmp_path, attention):
    model = build_model(tiny(attention, tie_embeddings=attention == "diff")).eval()
    difftx.save_model(model, tmp_path / "m")
    loaded = difftx.load_model(tmp_path / "m")
    x = torch.randint(0, 61, (2, 8))
    with torch.no_grad():
        assert torch.equal(model(x).logits, loaded(x).logits)
    assert loaded.config == model.config


def test_load_errors_name_the_problem(tmp_path):
    from difftx import CheckpointError

    with pytest.raises(CheckpointError, match="no such file"):
        difftx.load_model(tmp_path / "missing")
    model = build_model(tiny("diff"))
    d = difftx.save_model(model, tmp_path / "m")
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncate
    with pytest.raises(CheckpointError, match="model.safetensors"):
        difftx.load_model(d)
    other = build_model(tiny("diff", d_model=64))
    difftx.save_model(other, tmp_path / "o")
    (tmp_path / "o" / "config.json").write_text((d / "config.json").read_text())
    with pytest.raises(CheckpointError, match="has shape"):
        difftx.load_model(tmp_path / "o")


def test_learned_positions_reject_overlong_input():
    model = build_model(tiny("softmax", positions="learned", max_seq_len=8))
    with pytest.raises(difftx.DifftxError, match="max_seq_len"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_dropout_trains_and_eval_is_deterministic():
    model = build_model(tiny("diff", dropout=0.3))
    x = torch.randint(0, 61, (2, 8))
    model.train()
    a, b = model(x).logits, model(x).logits
    assert not torch.equal(a, b)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x).logits, model(x).logits)


@pytest.mark.parametrize("attention", KINDS)
def test_bf16_autocast_close_to_fp32(attention):
    torch.manual_seed(0)
    model = build_model(tiny(attention, d_model=64)).eval()
    x = torch.randint(0, 61, (2, 16))
    with torch.no_grad():
        ref = model(x, targets=x).loss
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x, targets=x)
    assert out.logits.dtype == torch.bfloat16
    assert abs(float(out.loss) - float(ref)) < 0.02 * float(ref)
    # backward works under autocast and lambda's gradient stays fp32
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x, targets=x).loss.backward()
    if attention == "diff":
        assert model.layers[0].attn.lambda_q1.grad.dtype == torch.float32


@pytest.mark.parametrize("attention", KINDS)
@pytest.mark.parametrize("norms", ["S1", "dnt"])
def test_prenorms_hand_projections_the_autocast_dtype_without_changing_the_forward(attention, norms, monkeypatch):
    """Under bf16 autocast a PreNorm emits bf16 itself (rounded once in its pass) instead of fp32 that each
    projection casts again: the forward is bitwise what the casts gave, and DIFF V2's attention, which computes
    lambda from its input in fp32, still gets fp32."""
    from difftx.nn.block import Block

    torch.manual_seed(0)
    model = build_model(tiny(attention, d_model=64, norms=norms))
    x = torch.randint(0, 61, (2, 16))
    seen = []
    hook = model.layers[0].attn.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        fast = model(x).logits
        monkeypatch.setattr(Block, "_pre", staticmethod(lambda norm, h, ok=True: h if norm is None else norm(h)))
        plain = model(x).logits
    hook.remove()
    assert seen == [torch.float32 if attention == "diff2" else torch.bfloat16, torch.float32]
    assert torch.equal(fast, plain)


@pytest.mark.parametrize("attention", KINDS)
def test_head_of_features_is_the_forward_pass(attention):
    """``head(features(x))`` is ``forward(x).logits``, padding and cache included (the evaluations rely on it)."""
    model = build_model(tiny(attention)).eval()
    torch.manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0
    with torch.no_grad():
        assert torch.equal(model.head(model.features(ids, attention_mask=mask)), model(ids, attention_mask=mask).logits)
        c1, c2 = model.new_cache(2, 16), model.new_cache(2, 16)
        model(ids[:, :8], cache=c1), model.features(ids[:, :8], cache=c2)
        assert torch.equal(model.head(model.features(ids[:, 8:], cache=c2)), model(ids[:, 8:], cache=c1).logits)


@pytest.mark.parametrize("attention", KINDS)
@pytest.mark.parametrize("positions", ["learned", "none", "rope"])
def test_a_cache_for_another_batch_size_is_refused(attention, positions):
    """A cache holds one row per sequence: input of another batch size is a ValueError naming both sizes, before
    anything is written; it used to broadcast (one row into a cache of 3: logits for 3 rows, every row's cache
    overwritten with that row's keys)."""
    torch.manual_seed(0)
    model = build_model(tiny(attention, positions=positions)).eval()
    x = torch.randint(0, 61, (3, 10))
    with torch.no_grad():
        for rows, cache_rows in ((1, 3), (3, 1), (3, 2)):
            cache = model.new_cache(cache_rows, 16)
            with pytest.raises(ValueError, match=f"cache made for {cache_rows} sequences.*batch of {rows}"):
                model(x[:rows], cache=cache)
            assert cache.length == 0 and cache.k[0] is None
        cache = model.new_cache(3, 16)
        model(x[:, :8], cache=cache)
        with pytest.raises(ValueError, match="cache made for 3 sequences.*batch of 1"):
            model(x[:1, 8:9], cache=cache)
        assert cache.length == 8
        step = model(x[:, 8:9], cache=cache).logits  # the cache is as it was
    assert (step - model(x[:, :9]).logits[:, -1:]).abs().max() < 1e-5
    direct = KVCache(1, 3, 8)  # an attention module's own writes are checked too
    with pytest.raises(ValueError, match="made for 3 sequences.*layer 1 gave K/V for a batch of 1"):
        direct.update(0, torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8))


@pytest.mark.parametrize("attention", KINDS)
def test_a_filled_cache_refuses_keys_of_another_model_or_dtype(attention):
    """Continuing a filled cache with K/V that do not fit its buffers (another model's: fewer K/V heads; or the
    model moved to another dtype since the prefill) is one ValueError naming the layer and saying to reset the cache,
    with nothing written; the write used to broadcast (one K/V head into the buffers of two: silently wrong logits)
    or cast, then fail inside a kernel.  After reset() the same cache decodes the other model as a fresh one."""
    torch.manual_seed(0)
    model = build_model(tiny(attention, n_kv_heads=2)).eval()
    x = torch.randint(0, 61, (2, 8))
    with torch.no_grad():
        for then in (build_model(tiny(attention, n_kv_heads=1)).eval(),
                     build_model(tiny(attention, n_kv_heads=2)).double().eval()):
            cache = model.new_cache(2, 12)
            model(x[:, :6], cache=cache)
            with pytest.raises(ValueError, match=r"KV cache layer 1 holds K .* do not fit.*call cache\.reset\(\)"):
                then(x[:, 6:7], cache=cache)
            assert cache.length == 6
            cache.reset()
            assert (then(x, cache=cache).logits - then(x).logits).abs().max() < 1e-5


def test_a_cache_of_no_room_is_refused_at_once_and_a_full_one_says_how_to_make_room():
    """KVCache(max_len=-1) failed at the first write with torch's 'negative dimension' (max_len=0: 'KV cache
    full' on any prompt); a full cache said only that it was full."""
    from difftx.nn.cache import KVCache

    for bad in ({"max_len": -1}, {"max_len": 0}, {"batch_size": 0}, {"n_layers": 2.5}, {"max_len": True}):
        kwargs = {"n_layers": 1, "batch_size": 1, "max_len": 8, **bad}
        with pytest.raises(ValueError, match=f"KVCache {next(iter(bad))} must be a positive integer"):
            KVCache(**kwargs)
    cache = KVCache(1, 1, 4)
    k = torch.zeros(1, 2, 3, 8)
    cache.update(0, k, k)
    cache.length = 3
    with pytest.raises(ValueError, match=r"KV cache full: 5 positions needed, room for 4; make the cache with "
                                         r"max_len >= 5 .*or reset\(\) it"):
        cache.update(0, k[:, :, :2], k[:, :, :2])
