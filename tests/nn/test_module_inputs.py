"""The attention modules and the LM as drop-in modules: inputs they cannot use are refused with a message that
names the problem (not a wrong result or an error deep inside), and a hooked or swapped-in per-head norm runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from difftx import ModelConfig, build_model
from difftx.nn.attention import make_attention
from difftx.nn.mask import AttnMask
from difftx.nn.rope import RotaryEmbedding

KINDS = ["softmax", "diff", "diff2"]


def _attn(kind, **kw):
    torch.manual_seed(0)
    cfg = ModelConfig(attention=kind, d_model=32, n_layers=2, n_heads=2, vocab_size=50, **kw)
    return make_attention(cfg, 1), cfg


def _rope(cfg, n):
    return RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_style).cos_sin(torch.arange(n))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_a_mask_for_another_length_is_refused(kind, backend):
    attn, cfg = _attn(kind, attn_backend=backend)
    x = torch.randn(2, 5, 32)
    for mask in (AttnMask(causal=False, n_q=3, n_k=3), AttnMask(causal=True, n_q=5, n_k=7, q_start=2)):
        with pytest.raises(ValueError, match="does not describe this input"):
            attn(x, _rope(cfg, 5), mask)
    with pytest.raises(TypeError, match="AttnMask"):
        attn(x, _rope(cfg, 5), None)
    with pytest.raises(ValueError, match=r"\(batch >= 1, tokens, d_model=32\)"):
        attn(torch.randn(5, 32), _rope(cfg, 5), AttnMask(causal=True, n_q=5, n_k=5))
    assert attn(x, _rope(cfg, 5), AttnMask(causal=True, n_q=5, n_k=5)).shape == x.shape


@pytest.mark.parametrize("kind", KINDS)
def test_a_rope_table_for_another_shape_is_refused(kind):
    attn, cfg = _attn(kind)
    x, mask = torch.randn(2, 5, 32), AttnMask(causal=True, n_q=5, n_k=5)
    half = cfg.head_dim // 2
    other_dim = RotaryEmbedding(cfg.head_dim * 2).cos_sin(torch.arange(5))
    for rope in (_rope(cfg, 7), _rope(cfg, 3), other_dim, _rope(cfg, 5)[0], (torch.zeros(3, 1, 5, half),) * 2):
        with pytest.raises(ValueError, match=rf"rope must be \(cos, sin\), each \(batch or 1, 1, tokens=5, "
                                             rf"head_dim/2={half}\)"):  # was: a broadcasting error in RoPE
            attn(x, rope, mask)
    positions = torch.arange(5).expand(2, 5)  # per-sequence positions: (B, 1, N, d/2)
    rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_style).cos_sin(positions)
    torch.testing.assert_close(attn(x, rope, mask), attn(x, _rope(cfg, 5), mask))


@pytest.mark.parametrize("kind", KINDS)
def test_rope_tables_missing_or_unused_are_refused(kind):
    """A module built with positions='rope' called with rope=None ran with no positions at all, and one built
    without RoPE ignored the tables it was given: both silently computed something else."""
    x, mask = torch.randn(2, 5, 32), AttnMask(causal=True, n_q=5, n_k=5)
    attn, cfg = _attn(kind)
    with pytest.raises(ValueError, match=r"positions='rope', so rope=\(cos, sin\) is required"):
        attn(x, None, mask)
    plain, _ = _attn(kind, positions="none")
    with pytest.raises(ValueError, match="module built without RoPE"):
        plain(x, _rope(cfg, 5), mask)
    assert plain(x, None, mask).shape == x.shape


def test_rotary_embedding_arguments_are_checked():
    for bad in (7, 0, -4, 8.0, True):
        with pytest.raises(ValueError, match="even head_dim"):
            RotaryEmbedding(bad)
    for theta in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="positive finite theta"):  # was: NaN angles
            RotaryEmbedding(8, theta)
    with pytest.raises(ValueError, match="'half' or 'interleaved'"):
        RotaryEmbedding(8, style="neox")


@pytest.mark.parametrize("kind", KINDS)
def test_the_layer_index_is_checked(kind):
    cfg = ModelConfig(attention=kind, d_model=32, n_layers=2, n_heads=2, vocab_size=50)
    for layer in (0, -1, 1.5, True, "2"):  # was: softmax and diff2 took 0 and -1, diff took 1.5 and True
        with pytest.raises(ValueError, match="layer is the 1-based layer index"):
            make_attention(cfg, layer)
    assert make_attention(cfg, 2).layer == 2


def test_mask_fields_are_checked():
    with pytest.raises(ValueError, match="use .bool"):
        AttnMask(causal=True, n_q=4, n_k=4, key_valid=torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"key_valid must be a bool tensor \(B, n_k=4\)"):
        AttnMask(causal=True, n_q=4, n_k=4, key_valid=torch.ones(2, 5, dtype=torch.bool))
    for n_q, n_k, q_start in ((0, 0, 0), (4, 3, 0), (2, 4, 3)):
        with pytest.raises(ValueError, match="n_q"):
            AttnMask(causal=True, n_q=n_q, n_k=n_k, q_start=q_start)
    attn, cfg = _attn("diff")
    mask = AttnMask(causal=True, n_q=4, n_k=4, key_valid=torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="3 rows for a batch of 2"):
        attn(torch.randn(2, 4, 32), _rope(cfg, 4), mask)


@pytest.mark.parametrize("fields, needle", [
    (dict(causal="yes", n_q=4, n_k=4), "causal must be True or False"),  # was accepted as truthy
    (dict(causal=1, n_q=4, n_k=4), "causal must be True or False"),
    (dict(causal=True, n_q=4.0, n_k=4), "n_q must be an integer"),  # was a TypeError from torch.arange
    (dict(causal=True, n_q=4, n_k=4.5), "n_k must be an integer"),
    (dict(causal=True, n_q=1, n_k=4, q_start=3.0), "q_start must be an integer"),
    (dict(causal=False, n_q=True, n_k=1), "n_q must be an integer"),
])
def test_mask_field_types_are_checked_when_built(fields, needle):
    with pytest.raises(ValueError, match=needle):
        AttnMask(**fields)


def test_lm_inputs_are_checked():
    model = build_model(ModelConfig(attention="diff", d_model=32, n_layers=1, n_heads=2, vocab_size=50))
    ids = torch.randint(0, 50, (2, 5))
    for bad in (ids[0], ids[:0], ids[:, :0], ids.float()):
        with pytest.raises(ValueError, match="input_ids must be integer token ids"):
            model(bad)
    with pytest.raises(ValueError, match=r"attention_mask must have input_ids' shape \(2, 5\)"):
        model(ids, attention_mask=torch.ones(2, 4, dtype=torch.long))
    assert model(ids, attention_mask=torch.ones(2, 5, dtype=torch.long)).logits.shape == (2, 5, 50)


class _Halve(nn.Module):
    """A user's per-head norm: no .weight, its own formula."""

    def forward(self, x):
        return x * 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_hooked_or_swapped_head_norm_runs(dtype):
    attn, cfg = _attn("diff")
    attn = attn.to(dtype)
    x, rope, mask = torch.randn(2, 6, 32, dtype=dtype), _rope(cfg, 6), AttnMask(causal=True, n_q=6, n_k=6)
    base = attn(x, rope, mask)
    seen = []
    handle = attn.head_norm.register_forward_hook(lambda m, i, o: seen.append(o.shape) or torch.zeros_like(o))
    with torch.no_grad():
        zeroed = attn(x, rope, mask)
    handle.remove()
    assert seen == [(2, 6, 2, 2 * cfg.head_dim)]
    torch.testing.assert_close(zeroed, attn.out_proj.bias.expand_as(zeroed) if attn.out_proj.bias is not None
                               else torch.zeros_like(zeroed))
    torch.testing.assert_close(attn(x, rope, mask), base)  # hook gone: the fused norm again
    # a hook that changes nothing takes the called-as-it-is path: the same output, (1 - lambda_init) included
    handle = attn.head_norm.register_forward_hook(lambda m, i, o: None)
    with torch.no_grad():
        tol = 0.0 if dtype == torch.float32 else 0.02  # bf16: the norm's output rounded before the gain
        torch.testing.assert_close(attn(x, rope, mask), base.detach(), rtol=tol or 1.3e-6,
                                   atol=tol * float(base.abs().max()) or 1e-5)
    handle.remove()
    attn.head_norm = _Halve()
    with torch.no_grad():
        o = attn(x, rope, mask)
        attn.out_proj, captured = nn.Identity(), None
        captured = attn(x, rope, mask)
    assert o.shape == base.shape
    # the swapped norm's output times (1 - lambda_init) reached out_proj: against the same module with an identity
    # norm, whose output is the heads' unnormalised attention (times 1 - lambda_init as well), it is half as large
    attn.head_norm = nn.Identity()
    with torch.no_grad():
        raw = attn(x, rope, mask)
        attn.head_norm = _Halve()
    assert captured.abs().max() > 0
    torch.testing.assert_close(captured, 0.5 * raw)
    assert attn.lambda_init != 0


def test_hf_missing_keys_get_difftx_init(tmp_path):
    pytest.importorskip("transformers")
    from safetensors.torch import save_file
    from tests.conftest import load_owned
    from transformers import AutoModelForCausalLM

    from difftx.interop.hf import DifftxForCausalLM

    torch.manual_seed(0)
    cfg = ModelConfig(attention="diff", n_heads=2, d_model=64, n_layers=2, vocab_size=97)
    model = build_model(cfg)
    DifftxForCausalLM.from_difftx(model).save_pretrained(tmp_path)
    sd = load_owned(tmp_path / "model.safetensors")
    gone = [k for k in sd if k.endswith(("layers.0.attn.lambda_q1", "layers.0.attn.q_proj.weight",
                                         "layers.0.attn.head_norm.weight", "layers.1.ffn.w_down.weight"))]
    assert len(gone) == 4
    for k in gone:
        del sd[k]
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    m = AutoModelForCausalLM.from_pretrained(tmp_path).model
    a = m.layers[0].attn
    assert torch.equal(a.head_norm.weight, torch.ones_like(a.head_norm.weight))
    for t, std in ((a.lambda_q1, cfg.lambda_std), (a.q_proj.weight, cfg.init_std),
                   (m.layers[1].ffn.w_down.weight, cfg.init_std / (2 * cfg.n_layers) ** 0.5)):
        t = t.detach()
        assert torch.isfinite(t).all() and abs(float(t.std()) / std - 1) < 0.35, (float(t.std()), std)
    loaded = dict(m.named_parameters())
    for k, v in model.state_dict().items():  # everything the checkpoint held is as saved
        if not any(g.endswith(k) for g in gone):
            assert torch.equal(loaded[k], v), k


@pytest.mark.parametrize("kind", KINDS)
def test_a_model_built_on_meta_runs_its_forward_for_shapes(kind):
    """Shape tracing on the meta device (torch.is_autocast_enabled raises for it)."""
    model = build_model(ModelConfig(attention=kind, d_model=64, n_layers=2, n_heads=2, vocab_size=97),
                        device="meta")
    x = torch.randint(0, 97, (2, 9), device="meta")
    out = model(x, targets=x)
    assert out.logits.shape == (2, 9, 97) and out.logits.device.type == "meta" and out.loss.shape == ()


@pytest.mark.parametrize("kind", KINDS)
def test_a_module_that_has_decoded_pickles_and_copies(kind):
    """DIFF's decoding lambda memo (a weak reference to the cache) is not part of the module's state:
    ``torch.save(model)`` / pickle / deepcopy after generation work, and the copy decodes as the original."""
    import copy
    import io
    import pickle

    from difftx.nn.cache import KVCache

    attn, cfg = _attn(kind)
    attn.eval()
    x = torch.randn(2, 4, 32)
    cache = KVCache(2, 2, 8)
    with torch.no_grad():
        attn(x[:, :3], _rope(cfg, 3), AttnMask(causal=True, n_q=3, n_k=3), cache)
        cache.advance(3)
        step = (x[:, 3:], RotaryEmbedding(cfg.head_dim).cos_sin(torch.arange(3, 4)),
                AttnMask(causal=True, n_q=1, n_k=4, q_start=3))
        want = attn(*step, cache)
    buf = io.BytesIO()
    torch.save(attn, buf)
    for clone in (pickle.loads(pickle.dumps(attn)), copy.deepcopy(attn),
                  torch.load(io.BytesIO(buf.getvalue()), weights_only=False)):
        c2 = copy.deepcopy(cache)
        c2.length = 3
        with torch.no_grad():
            torch.testing.assert_close(clone(*step, c2), want, rtol=0, atol=0)


@pytest.mark.parametrize("weight", [True, False])
@pytest.mark.parametrize("grad", [False, True])
def test_rms_norm_refuses_a_0_dim_input(weight, grad):
    """A scalar input was an IndexError (tuple index out of range) from inside the norm."""
    from difftx.nn.norms import RMSNorm

    with pytest.raises(ValueError, match="0-dim"):
        RMSNorm(1, weight=weight)(torch.tensor(2.0, requires_grad=grad))


@pytest.mark.parametrize("shape", [(2, 3, 31), (2, 3, 33), (300, 300)])
@pytest.mark.parametrize("grad", [False, True])
def test_rms_norm_refuses_an_input_of_another_width(shape, grad):
    """The native norm kernels read x's last dim of weights per row: a wrong-width input is refused (it read
    past the weight, silently, where torch's F.rms_norm raises), also by the residual-adding norm a Block runs."""
    from difftx.nn.fused import add_rms_norm
    from difftx.nn.norms import RMSNorm

    norm = RMSNorm(32)
    with pytest.raises(ValueError, match="last dim"):
        norm(torch.randn(shape, requires_grad=grad))
    big = (3000,) + shape[-1:]  # above the decoding size: the fused pass
    for x in (torch.randn(shape), torch.randn(big)):
        with pytest.raises(ValueError, match="last dim"):
            add_rms_norm(x, torch.randn_like(x, requires_grad=grad), norm.weight, 1e-5, torch.float32)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_training_after_an_inference_mode_forward(kind, dtype, monkeypatch):
    """The fused attention's per-thread scratch buffers outlive a call: made under torch.inference_mode (an
    evaluation), they must still be writable by the next training forward."""
    from difftx.nn import fused
    from difftx.nn.block import Block

    fused.release_scratch()
    monkeypatch.setattr(fused, "_ZEROS", {})
    _, cfg = _attn(kind)
    block = Block(cfg, 1).to(dtype)
    rope = RotaryEmbedding(cfg.head_dim).cos_sin(torch.arange(7), dtype)
    x = torch.randn(2, 7, 32, dtype=dtype)
    with torch.inference_mode():
        want = block(x, rope, AttnMask(causal=True, n_q=7, n_k=7))
    xg = x.clone().requires_grad_()
    y = block(xg, rope, AttnMask(causal=True, n_q=7, n_k=7))
    y.sum().backward()
    torch.testing.assert_close(y.detach(), want)
    with torch.inference_mode():  # and back
        torch.testing.assert_close(block(x, rope, AttnMask(causal=True, n_q=7, n_k=7)), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_hooked_or_swapped_diff2_lambda_proj_runs(dtype):
    """DIFF V2's lambda projection is called as a module when hooked or swapped (a LoRA-style wrapper), as the
    per-head norm and the LM head are: its forward hook fires, a hook's replacement output is used, and a wrapper's
    output reaches lambda (it used to be bypassed: F.linear on lambda_proj.weight, hooks and wrappers ignored)."""
    attn, cfg = _attn("diff2")
    attn = attn.to(dtype)
    x, rope, mask = torch.randn(2, 6, 32, dtype=dtype), _rope(cfg, 6), AttnMask(causal=True, n_q=6, n_k=6)
    with torch.no_grad():
        base = attn(x, rope, mask)
        seen = []
        handle = attn.lambda_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
        tol = 0.02 if dtype == torch.bfloat16 else 0.0  # bf16: the hooked layer computes in its own dtype
        torch.testing.assert_close(attn(x, rope, mask), base, rtol=tol or 1.3e-6,
                                   atol=tol * float(base.abs().max()) or 1e-5)
        handle.remove()
        assert seen == [(2, 6, cfg.n_heads)]
        handle = attn.lambda_proj.register_forward_hook(lambda m, i, o: torch.full_like(o, -1e4))  # lambda = 0
        zeroed = attn(x, rope, mask)
        handle.remove()
        assert float(attn.last_lambda) == 0.0

        class Wrapped(nn.Module):  # a LoRA-style wrapper whose extra term pushes lambda to 0
            def __init__(self, base):
                super().__init__()
                self.base = base

            def forward(self, z):
                return self.base(z) - 1e4

        attn.lambda_proj = Wrapped(attn.lambda_proj)
        torch.testing.assert_close(attn(x, rope, mask), zeroed)
    assert not torch.allclose(zeroed, base)
