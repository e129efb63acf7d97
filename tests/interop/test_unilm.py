"""Official microsoft/unilm DIFF attention module -> difftx DifferentialAttention, against a reference forward.

The reference below restates the official module's computation (adjacent
component heads, interleaved RoPE on d-wide heads, lambda_init from the 0-based
depth, subln over 2d, x (1 - lambda_init)) independently of difftx's code, for
both GQA pairings the official files use.
"""

from __future__ import annotations

import math

import pytest
import torch

from difftx.errors import CheckpointError
from difftx.interop.unilm import convert_unilm_file, load_attention_modules, load_unilm_attention
from difftx.nn.mask import AttnMask
from difftx.nn.rope import RotaryEmbedding


def official_state(e=64, h=2, hk=2, subln=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = e // h // 2
    sd = {"q_proj.weight": torch.randn(2 * h * d, e, generator=g) * 0.2,
          "k_proj.weight": torch.randn(2 * hk * d, e, generator=g) * 0.2,
          "v_proj.weight": torch.randn(2 * hk * d, e, generator=g) * 0.2,
          "out_proj.weight": torch.randn(e, 2 * h * d, generator=g) * 0.2}
    for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
        sd[name] = torch.randn(d, generator=g) * 0.3
    if subln:
        sd["subln.weight"] = 1 + 0.2 * torch.randn(2 * d, generator=g)
    return sd


def reference_forward(sd, x, depth, naive=False, theta=10000.0):
    """The official module's math, restated: returns (B, N, E)."""
    b, n, e = x.shape
    d = sd["lambda_q1"].shape[0]
    h, hk = sd["q_proj.weight"].shape[0] // (2 * d), sd["k_proj.weight"].shape[0] // (2 * d)
    rep = h // hk
    q = (x @ sd["q_proj.weight"].T).view(b, n, 2 * h, d)
    k = (x @ sd["k_proj.weight"].T).view(b, n, 2 * hk, d)
    v = (x @ sd["v_proj.weight"].T).view(b, n, hk, 2 * d)
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv  # (n, d/2)
    cos, sin = ang.cos().float()[None, :, None], ang.sin().float()[None, :, None]

    def rot(t):  # interleaved: channels (2j, 2j+1) rotate together
        a, c = t[..., 0::2], t[..., 1::2]
        return torch.stack((a * cos - c * sin, a * sin + c * cos), dim=-1).flatten(-2)

    q, k = rot(q), rot(k)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    lam_init = 0.8 - 0.6 * math.exp(-0.3 * depth)
    lam = (torch.exp((sd["lambda_q1"] * sd["lambda_k1"]).sum()) - torch.exp((sd["lambda_q2"] * sd["lambda_k2"]).sum())
           + lam_init)
    heads = []
    for i in range(h):
        if naive:  # repeat_kv over component heads: component c uses key component c // rep
            k1, k2 = k[:, :, (2 * i) // rep], k[:, :, (2 * i + 1) // rep]
        else:
            k1, k2 = k[:, :, 2 * (i // rep)], k[:, :, 2 * (i // rep) + 1]
        maps = []
        for qq, kk in ((q[:, :, 2 * i], k1), (q[:, :, 2 * i + 1], k2)):
            s = (qq @ kk.transpose(1, 2)) / math.sqrt(d)
            maps.append(s.masked_fill(~causal, float("-inf")).softmax(-1))
        o = (maps[0] - lam * maps[1]) @ v[:, :, i // rep]
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5)
        if "subln.weight" in sd:
            o = o * sd["subln.weight"]
        heads.append(o * (1 - lam_init))
    return torch.cat(heads, dim=-1) @ sd["out_proj.weight"].T


def run_difftx(module, x):
    n = x.shape[1]
    rope = RotaryEmbedding(module.head_dim, 10000.0, module.rope_style).cos_sin(torch.arange(n))
    return module(x, rope, AttnMask(causal=True, n_q=n, n_k=n))


@pytest.mark.parametrize("h,hk,subln,naive", [(2, 2, True, False), (2, 2, False, False), (4, 2, True, False),
                                              (4, 2, True, True), (4, 1, False, True)])
@pytest.mark.parametrize("depth", [0, 5])
def test_official_module_matches_reference(h, hk, subln, naive, depth):
    sd = official_state(h=h, hk=hk, subln=subln)
    module, cfg = load_unilm_attention(sd, depth, variant="naive" if naive else "flash")
    assert module.layer == depth + 1 and cfg.head_norm_weight == subln
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (run_difftx(module, x) - reference_forward(sd, x, depth, naive=naive)).abs().max()
    assert float(diff) < 1e-5


def test_the_two_gqa_variants_really_differ():
    sd = official_state(h=4, hk=2)
    x = torch.randn(1, 7, 64)
    with torch.no_grad():
        flash = run_difftx(load_unilm_attention(sd, 0)[0], x)
        naive = reference_forward(sd, x, 0, naive=True)
    assert float((flash - naive).abs().max()) > 1e-3


def test_relaid_module_keeps_the_function():
    sd = official_state(h=4, hk=2)
    x = torch.randn(1, 7, 64)
    module, cfg = load_unilm_attention(sd, 2, pairing="halves", rope_style="half")
    assert (cfg.pairing, cfg.rope_style) == ("halves", "half")
    with torch.no_grad():
        assert float((run_difftx(module, x) - reference_forward(sd, x, 2)).abs().max()) < 1e-5


def test_file_conversion_reads_depth_from_prefixes(tmp_path):
    from safetensors.torch import save_file

    state = {}
    for depth in (0, 3):
        state.update({f"decoder.layers.{depth}.self_attn.{k}": v for k, v in official_state(seed=depth).items()})
    state["decoder.embed_tokens.weight"] = torch.zeros(5, 64)  # other tensors are ignored
    save_file(state, tmp_path / "ckpt.safetensors")
    convert_unilm_file(tmp_path / "ckpt.safetensors", tmp_path / "out")
    modules = load_attention_modules(tmp_path / "out")
    assert sorted(modules) == ["decoder.layers.0.self_attn.", "decoder.layers.3.self_attn."]
    x = torch.randn(1, 5, 64)
    with torch.no_grad():
        out = run_difftx(modules["decoder.layers.3.self_attn."], x)
    assert float((out - reference_forward(official_state(seed=3), x, 3)).abs().max()) < 1e-5


def test_bad_module_errors_name_the_tensor():
    sd = official_state()
    sd["k_proj.weight"] = sd["k_proj.weight"][:-1]
    with pytest.raises(CheckpointError, match="'k_proj.weight' has 63 rows"):
        load_unilm_attention(sd, 0)
    sd = official_state()
    sd["v_proj.weight"] = sd["v_proj.weight"][:32]
    with pytest.raises(CheckpointError, match=r"'v_proj.weight' has shape \(32, 64\)"):
        load_unilm_attention(sd, 0)
    sd = official_state()
    sd["q_proj.bias"] = torch.zeros(64)
    with pytest.raises(CheckpointError, match="unexpected tensor 'q_proj.bias'"):
        load_unilm_attention(sd, 0)
    sd = official_state()
    del sd["lambda_k2"]
    with pytest.raises(CheckpointError, match="'lambda_k2' is missing"):
        load_unilm_attention(sd, 0)


def test_file_conversion_refuses_a_module_tensor_it_cannot_map(tmp_path):
    """A module's tensor the loader does not expect (a bias) fails the file conversion too, not only the loader:
    the converted module would compute another function."""
    from safetensors.torch import save_file

    for extra in ("q_proj.bias", "subln.bias"):
        state = {f"layers.0.attn.{k}": v for k, v in official_state().items()}
        state[f"layers.0.attn.{extra}"] = torch.zeros(64)
        save_file(state, tmp_path / "ckpt.safetensors")
        with pytest.raises(CheckpointError, match=f"unexpected tensor '{extra}'"):
            convert_unilm_file(tmp_path / "ckpt.safetensors", tmp_path / f"out-{extra}")
        assert not (tmp_path / f"out-{extra}").exists()


@pytest.mark.parametrize("key,bad", [("lambda_q1", torch.tensor(1.0)), ("lambda_q1", torch.zeros(0)),
                                     ("q_proj.weight", torch.zeros(64)), ("k_proj.weight", torch.zeros(64, 64, 1))])
def test_a_mis_shaped_lambda_or_projection_is_one_error_naming_file_and_module(tmp_path, key, bad):
    """head_dim comes from lambda_q1 and embed_dim from q_proj: a 0-d / empty lambda or a 1-D weight was an
    IndexError / ZeroDivisionError; now one CheckpointError naming the file, the module and the tensor."""
    from safetensors.torch import save_file

    state = {f"layers.3.attn.{k}": v for k, v in official_state().items()}
    state[f"layers.3.attn.{key}"] = bad
    save_file(state, tmp_path / "ckpt.safetensors")
    with pytest.raises(CheckpointError, match=rf"ckpt\.safetensors \(module 'layers\.3\.attn\.'\): tensor '{key}'"):
        convert_unilm_file(tmp_path / "ckpt.safetensors", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("index", [[1], {"modules": []}, {"modules": {"a.": {}}},
                                   {"modules": {"a.": {"model": 3, "layer": 1}}}])
def test_a_corrupt_attention_json_is_one_error(tmp_path, index):
    """load_attention_modules on a damaged attention.json: one CheckpointError (was TypeError/AttributeError/
    KeyError tracebacks)."""
    import json

    from safetensors.torch import save_file

    save_file({"a.q_proj.weight": torch.zeros(1)}, tmp_path / "attention.safetensors")
    (tmp_path / "attention.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError):
        load_attention_modules(tmp_path)


@pytest.mark.parametrize("extra", ["q_norm.weight", "head_norm.weight"])
def test_file_conversion_refuses_a_module_tensor_outside_the_official_members(tmp_path, extra):
    """A tensor of the module that is none of the official members (a QK-norm gain, or difftx's own head_norm
    when a difftx model.safetensors is given) was dropped without a word and the module converted with another
    function; it is refused like a bias."""
    from safetensors.torch import save_file

    state = {f"layers.0.attn.{k}": v for k, v in official_state().items()}
    state[f"layers.0.attn.{extra}"] = torch.ones(16)
    save_file(state, tmp_path / "ckpt.safetensors")
    with pytest.raises(CheckpointError, match=f"unexpected tensor '{extra}'"):
        convert_unilm_file(tmp_path / "ckpt.safetensors", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_file_conversion_ignores_a_rotary_inv_freq_buffer_in_the_module(tmp_path):
    """Old checkpoints save the rotary table's inv_freq under the attention prefix: not a weight, ignored."""
    from safetensors.torch import save_file

    state = {f"layers.2.self_attn.{k}": v for k, v in official_state(seed=1).items()}
    state["layers.2.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(state, tmp_path / "ckpt.safetensors")
    convert_unilm_file(tmp_path / "ckpt.safetensors", tmp_path / "out")
    assert sorted(load_attention_modules(tmp_path / "out")) == ["layers.2.self_attn."]


def test_a_layer_number_in_the_prefix_gives_the_depth_and_depth_the_other_modules(tmp_path):
    """depth (--depth) went to every module of the file, over the layer numbers of their prefixes: one number for
    several layers, so all but one got another layer's lambda_init, silently.  It now gives the depth of the modules
    whose prefix has no number, and is refused when every module has one."""
    from safetensors.torch import save_file

    from difftx.errors import DifftxError

    state = {f"extra_attn.{k}": v for k, v in official_state(seed=0).items()}  # a prefix without a layer number
    state.update({f"layers.3.self_attn.{k}": v for k, v in official_state(seed=3).items()})
    save_file(state, tmp_path / "ckpt.safetensors")
    convert_unilm_file(tmp_path / "ckpt.safetensors", tmp_path / "out", depth=5)
    modules = load_attention_modules(tmp_path / "out")
    assert {p: m.layer for p, m in modules.items()} == {"extra_attn.": 6, "layers.3.self_attn.": 4}
    x = torch.randn(1, 5, 64)
    with torch.no_grad():
        out = run_difftx(modules["layers.3.self_attn."], x)
    assert float((out - reference_forward(official_state(seed=3), x, 3)).abs().max()) < 1e-5

    state = {f"layers.{i}.self_attn.{k}": v for i in (0, 3) for k, v in official_state(seed=i).items()}
    save_file(state, tmp_path / "layers.safetensors")
    with pytest.raises(DifftxError, match=r"'layers\.0\.self_attn\.' -> 0.*--depth is for a module whose prefix has"):
        convert_unilm_file(tmp_path / "layers.safetensors", tmp_path / "out2", depth=0)
    assert not (tmp_path / "out2").exists()
