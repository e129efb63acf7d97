"""DifftxForCausalLM: every attention kind behind transformers' API, its caches and generate."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache  # noqa: E402

import difftx  # noqa: E402
from difftx.interop.hf import DifftxConfig, DifftxForCausalLM  # noqa: E402
from .hf_helpers import difftx_model, max_diff, tokens  # noqa: E402

KINDS = [
    dict(attention="softmax", n_heads=4, n_kv_heads=2),
    dict(attention="diff", n_heads=2, n_kv_heads=1),                       # GQA DIFF: V of 2d in the cache
    dict(attention="diff", n_heads=2, norms="dnt", pairing="halves"),      # DNT placement
    dict(attention="diff2", n_heads=2, n_kv_heads=1, norms="post", positions="learned", norm="layer"),
]
IDS = ["softmax-gqa", "diff-gqa", "diff-dnt", "diff2-post-learned"]


@pytest.fixture(scope="module", params=KINDS, ids=IDS)
def saved(request, tmp_path_factory):
    model = difftx_model(seed=3, **request.param)
    path = tmp_path_factory.mktemp("hfdx")
    DifftxForCausalLM.from_difftx(model).save_pretrained(path)
    return model, path, AutoModelForCausalLM.from_pretrained(path).eval()


def test_save_and_auto_load(saved):
    model, path, hf = saved
    assert (path / "model.safetensors").is_file()
    assert AutoConfig.from_pretrained(path).model_config == model.config
    assert isinstance(hf, DifftxForCausalLM)
    x = tokens(97)
    with torch.no_grad():
        assert max_diff(hf(x).logits, model(x).logits) == 0.0
    with torch.no_grad():  # difftx.load_model reads the same directory
        assert max_diff(difftx.load_model(path)(x).logits, model(x).logits) == 0.0


def test_loss_is_transformers_shifted_cross_entropy(saved):
    model, path, hf = saved
    x = tokens(97)
    with torch.no_grad():
        loss = hf(x, labels=x).loss
        ref = model(x[:, :-1], targets=x[:, 1:]).loss
    assert abs(float(loss) - float(ref)) < 1e-5


def test_logits_to_keep_runs_the_head_on_the_kept_positions_only(saved, monkeypatch):
    """generate's prefill asks for the last position: the head sees one row per sequence, not all of them."""
    model, path, hf = saved
    x = tokens(97, n=10)
    with torch.no_grad():
        full = model(x).logits
        seen = []
        head = hf.model.head
        monkeypatch.setattr(hf.model, "head", lambda h: seen.append(h.shape[1]) or head(h))
        last = hf(x, logits_to_keep=1, use_cache=False).logits
        some = hf(x, logits_to_keep=torch.tensor([2, 5]), use_cache=False).logits
        with_loss = hf(x, labels=x, logits_to_keep=3, use_cache=False)
    assert seen == [1, 2, 10]  # the loss needs every position
    assert max_diff(last, full[:, -1:]) < 1e-5 and max_diff(some, full[:, [2, 5]]) < 1e-5
    assert max_diff(with_loss.logits, full[:, -3:]) == 0.0  # sliced from the full logits


def test_incremental_decoding_through_a_dynamic_cache(saved):
    model, path, hf = saved
    x = tokens(97, n=12)
    cache = DynamicCache()
    with torch.no_grad():
        full = model(x).logits
        steps = [hf(x[:, :5], past_key_values=cache, use_cache=True).logits]
        for t in range(5, 12):
            steps.append(hf(x[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
    assert cache.get_seq_length() == 12
    assert max_diff(torch.cat(steps, dim=1), full) < 1e-5


def test_cache_under_either_name(saved):
    """transformers >= 5.24 passes the cache as ``cache`` (older: ``past_key_values``); both are read."""
    model, path, hf = saved
    x = tokens(97, n=9)
    with torch.no_grad():
        full = model(x).logits
        for name in ("cache", "past_key_values"):
            cache = DynamicCache()
            hf(x[:, :6], use_cache=True, **{name: cache})
            step = hf(x[:, 6:], use_cache=True, **{name: cache}).logits
            assert cache.get_seq_length() == 9 and max_diff(step, full[:, 6:]) < 1e-5
        with pytest.raises(ValueError, match="not both"):
            hf(x, cache=DynamicCache(), past_key_values=DynamicCache())


@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_generate_matches_difftx_generate(saved, cache_implementation):
    model, path, hf = saved
    x = tokens(97, n=7)
    ours = model.generate(x, max_new_tokens=10, temperature=0)
    theirs = hf.generate(x, max_new_tokens=10, do_sample=False, cache_implementation=cache_implementation)
    assert torch.equal(ours, theirs)
    assert len(set(ours[:, 7:].flatten().tolist())) > 2  # not a degenerate repeat of one token


def test_chunked_prefill_into_a_static_cache(saved):
    """generate(prefill_chunk_size=...) with a static cache allocates the cache up front from the model's
    _get_static_cache_init_shape (transformers >= 5.24), which must be the shape the attention writes: a DIFF
    layer's 2 h_kv component heads of d, not the config's num_key_value_heads."""
    model, path, hf = saved
    x = tokens(97, n=7)
    ours = model.generate(x, max_new_tokens=6, temperature=0)
    for impl in ("static", None):
        theirs = hf.generate(x, max_new_tokens=6, do_sample=False, cache_implementation=impl, prefill_chunk_size=3)
        assert torch.equal(ours, theirs), impl


def test_generate_with_left_padding(saved):
    model, path, hf = saved
    x = tokens(97, n=9)
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    ours = model.generate(x, max_new_tokens=8, temperature=0, attention_mask=mask)
    theirs = hf.generate(x, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, theirs)
    alone = model.generate(x[:1, 3:], max_new_tokens=8, temperature=0)  # padding changes nothing
    assert torch.equal(theirs[0, 3:], alone[0])


def test_config_round_trip_and_standard_fields():
    cfg = difftx.ModelConfig(attention="diff", d_model=64, n_heads=2, n_kv_heads=1, vocab_size=50, lambda_init=0.5)
    hc = DifftxConfig.from_model_config(cfg)
    assert hc.model_config == cfg
    assert (hc.hidden_size, hc.num_hidden_layers, hc.num_attention_heads, hc.num_key_value_heads, hc.head_dim) == \
        (64, cfg.n_layers, 2, 1, 16)
    again = DifftxConfig.from_dict(hc.to_dict())
    assert again.model_config == cfg


def test_token_ids_are_config_fields(tmp_path):
    """bos/eos/pad_token_id read None when unset, as on transformers' own configs (LlamaConfig, DiffLlamaConfig):
    `if model.config.pad_token_id is None: model.config.pad_token_id = tok.eos_token_id` raised AttributeError
    (transformers 5's PreTrainedConfig no longer declares them)."""
    hf = DifftxForCausalLM.from_difftx(difftx_model(attention="diff", n_heads=2))
    assert (hf.config.bos_token_id, hf.config.eos_token_id, hf.config.pad_token_id) == (None, None, None)
    hf.config.pad_token_id = hf.config.eos_token_id = 5
    hf.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert (again.config.bos_token_id, again.config.eos_token_id, again.config.pad_token_id) == (None, 5, 5)


def test_wrapper_shares_weights_with_the_difftx_model():
    model = difftx_model(attention="diff", n_heads=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hf = DifftxForCausalLM.from_difftx(model)
    assert hf.model is model
    assert hf.get_input_embeddings() is model.embed
    for k, v in model.state_dict().items():  # wrapping re-initialises nothing (transformers' post_init)
        assert torch.equal(v, before[k]), k
    hf.resize_token_embeddings(model.config.vocab_size + 3)  # new rows still get difftx's init
    assert hf.get_input_embeddings().weight[-3:].std() > 0
    torch.testing.assert_close(hf.get_input_embeddings().weight[:-3], before["embed.weight"])


def test_hidden_states_attentions_and_tuples():
    model = difftx_model(seed=4, attention="diff", n_heads=2)
    hf = DifftxForCausalLM.from_difftx(model).eval()
    x = tokens(97)
    with torch.no_grad():
        out = hf(x, output_hidden_states=True)
        h = model.embed(x)
        want = [h]
        for block in model.layers:  # the first block's input, each block's output, the last through the final norm
            h = block(h, model.rope.cos_sin(torch.arange(x.shape[1])), difftx.nn.AttnMask(True, x.shape[1], x.shape[1]))
            want.append(h)
        want[-1] = model.final_norm(h)
        assert len(out.hidden_states) == len(model.layers) + 1
        for got, ref in zip(out.hidden_states, want):
            assert max_diff(got, ref) < 1e-5
        assert max_diff(hf(x).logits, out.logits) == 0.0  # the hooks change nothing
        assert not any(b._forward_hooks or b._forward_pre_hooks for b in model.layers)
        tup = hf(x, return_dict=False, use_cache=False)
        assert isinstance(tup, tuple) and max_diff(tup[0], out.logits) == 0.0
        with pytest.raises(ValueError, match="attention maps"):
            hf(x, output_attentions=True)
        gen = hf.generate(x, max_new_tokens=2, do_sample=False, return_dict_in_generate=True,
                          output_hidden_states=True)
        assert all(s is not None for step in gen.hidden_states for s in step)


def test_output_flags_set_in_the_config_are_honoured(tmp_path):
    """from_pretrained(dir, output_hidden_states=True) sets the config's flag, which transformers models follow when
    forward is not told: hidden states come back; config.output_attentions=True is refused as the argument is."""
    model = difftx_model(seed=4, attention="diff", n_heads=2)
    DifftxForCausalLM.from_difftx(model).save_pretrained(tmp_path)
    x = tokens(97)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, output_hidden_states=True).eval()
    with torch.no_grad():
        out = hf(x)
        assert out.hidden_states is not None and len(out.hidden_states) == len(model.layers) + 1
        assert hf(x, output_hidden_states=False).hidden_states is None  # the argument wins over the config
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, output_attentions=True).eval()
    with pytest.raises(ValueError, match="attention maps"):
        hf(x)


@pytest.mark.parametrize("tie", [False, True])
def test_resize_token_embeddings_saves_and_reloads(tmp_path, tie):
    model = difftx_model(seed=5, attention="diff", n_heads=2, tie_embeddings=tie)
    hf = DifftxForCausalLM.from_difftx(model)
    hf.resize_token_embeddings(110)
    x = tokens(110)
    with torch.no_grad():
        logits = hf(x).logits
    assert logits.shape[-1] == 110 and hf.config.vocab_size == 110 and hf.model.config.vocab_size == 110
    hf.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert max_diff(back(x).logits, logits) == 0.0


def test_derived_config_overrides_are_refused(saved):
    _, path, _ = saved
    with pytest.raises(ValueError, match="num_hidden_layers.*derived from config.difftx"):
        AutoModelForCausalLM.from_pretrained(path, num_hidden_layers=1)
    hc = AutoConfig.from_pretrained(path)
    hc.difftx = dict(hc.difftx, n_layers=1)  # edited in place: its derived fields are stale, and the fix is named
    with pytest.raises(ValueError, match=r"build the config anew \(DifftxConfig\(difftx=\.\.\.\)"):
        DifftxForCausalLM(hc)
    assert DifftxForCausalLM(DifftxConfig(difftx=hc.difftx)).config.num_hidden_layers == 1


@pytest.mark.parametrize("attention", ["softmax", "diff", "diff2"])
def test_a_new_wrapper_keeps_the_difftx_init_of_its_seed(attention):
    """DifftxForCausalLM(config) / from_config build the DecoderLM a seed gives (post_init draws nothing more)."""
    cfg = difftx.ModelConfig(attention=attention, d_model=64, n_layers=2, n_heads=2, vocab_size=97)
    torch.manual_seed(7)
    ref = difftx.models.DecoderLM(cfg).state_dict()
    for make in (lambda: DifftxForCausalLM(DifftxConfig.from_model_config(cfg)),
                 lambda: AutoModelForCausalLM.from_config(DifftxConfig.from_model_config(cfg))):
        torch.manual_seed(7)
        got = make().model.state_dict()
        assert got.keys() == ref.keys()
        for k, v in ref.items():
            assert torch.equal(got[k], v), k


def test_a_directory_without_a_difftx_config_is_refused(tmp_path):
    """A Llama directory, or a difftx model directory (not exported with --to hf-difftx), holds no ``difftx``
    object: DifftxForCausalLM / DifftxConfig.from_pretrained refuse it in one line instead of building the
    default ModelConfig and loading whichever of its weights fit."""
    from .hf_helpers import hf_llama
    llama, native = tmp_path / "llama", tmp_path / "native"
    hf_llama().save_pretrained(llama)
    cfg = difftx.ModelConfig(rope_theta=500.0, norms="dnt")  # the default's shapes: every weight would fit
    difftx.save_model(difftx.build_model(cfg), native)
    for path in (llama, native):
        for load in (DifftxConfig.from_pretrained, DifftxForCausalLM.from_pretrained):
            with pytest.raises(difftx.errors.CheckpointError, match="no 'difftx' object"):
                load(path)
    assert DifftxConfig().model_config == difftx.ModelConfig()  # the default config itself is still built


def test_generate_computes_a_diff_lambda_once_per_generation_and_never_a_stale_one(monkeypatch):
    """forward wrapped transformers' cache in a new view each call, and DIFF's lambda memo is keyed on the cache it
    is given: every decoding step of generate missed it and computed lambda again.  Now one view per transformers
    cache: lambda once per layer per generation, and a lambda changed between steps (in place, load_state_dict)
    is read again."""
    from difftx.nn.attention import DifferentialAttention

    model = difftx_model(seed=3, attention="diff", n_heads=2, n_kv_heads=1)
    hf = DifftxForCausalLM.from_difftx(model).eval()
    layers = [blk.attn for blk in model.layers]
    calls, used = [], []
    real_full, real_lambda = DifferentialAttention.lambda_full, DifferentialAttention._lambda
    monkeypatch.setattr(DifferentialAttention, "lambda_full", lambda self: calls.append(self) or real_full(self))

    def spy(self, *args, **kwargs):
        lam = real_lambda(self, *args, **kwargs)
        used.append((self, lam))
        return lam

    monkeypatch.setattr(DifferentialAttention, "_lambda", spy)
    x = tokens(97, n=7)
    ours = model.generate(x, max_new_tokens=6, temperature=0)
    calls.clear()
    assert torch.equal(hf.generate(x, max_new_tokens=6, do_sample=False), ours)
    assert len(calls) == len(layers)  # the prefill's; the 5 decoding steps reuse it

    cache = DynamicCache()
    with torch.no_grad():
        hf(x, past_key_values=cache, use_cache=True)
        hf(x[:, :1], past_key_values=cache, use_cache=True)  # decoding: memoised
        layers[0].lambda_q1.mul_(0.5)  # in place, between two decoding steps
        used.clear()
        hf(x[:, 1:2], past_key_values=cache, use_cache=True)
        assert [a for a, _ in used] == layers and torch.equal(used[0][1], real_full(layers[0]))
        state = hf.state_dict()
        state["model.layers.1.attn.lambda_k2"] = state["model.layers.1.attn.lambda_k2"] + 1.0
        hf.load_state_dict(state)
        used.clear()
        hf(x[:, 2:3], past_key_values=cache, use_cache=True)
    assert torch.equal(used[1][1], real_full(layers[1]))
    assert all(torch.equal(lam, real_full(a)) for a, lam in used)


def test_a_transformers_cache_and_its_tensors_are_freed_without_the_garbage_collector():
    """The view kept on a transformers cache (for DIFF's lambda memo) referred back to it: cache -> view -> cache,
    a cycle that only the garbage collector frees.  A server calling generate kept every finished generation's K/V
    (up to ~40 caches in a loop of generate calls) until a collection reached them; the view now holds its cache
    weakly, so a cache (and its K/V) goes with its last reference, as transformers' own caches do."""
    import gc
    import weakref

    hf = DifftxForCausalLM.from_difftx(difftx_model(seed=3, attention="diff", n_heads=2, n_kv_heads=1)).eval()
    x = tokens(97, n=7)
    gc.collect()
    gc.disable()
    try:
        cache = DynamicCache()
        with torch.no_grad():
            hf(x, past_key_values=cache, use_cache=True)
            step = hf(x[:, :1], past_key_values=cache, use_cache=True)  # the output refers to the cache too
        keys = weakref.ref(cache.layers[0].keys if hasattr(cache, "layers") else cache.key_cache[0])
        gone = weakref.ref(cache)
        del cache, step
        assert gone() is None and keys() is None
        out = hf.generate(x, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
        gone = weakref.ref(getattr(out, "past_key_values", None) or out.cache)
        del out
        assert gone() is None
    finally:
        gc.enable()


def test_a_copied_transformers_cache_decodes_into_itself_not_into_the_original():
    """transformers' prompt reuse: fill a cache once, copy.deepcopy it per continuation.  The view kept on the
    cache (``_difftx_view``) was copied with it, its weak reference still naming the original: the copy's decoding
    steps wrote their K/V into the original cache and read its keys.  A copied cache gets a view of its own; and a
    cache holding a view still pickles."""
    import copy
    import pickle

    hf = DifftxForCausalLM.from_difftx(difftx_model(seed=3, attention="diff2", n_heads=2, n_kv_heads=1)).eval()
    x = tokens(97, n=7)
    with torch.no_grad():
        prompt = DynamicCache()
        hf(x[:, :5], past_key_values=prompt, use_cache=True)
        hf(x[:, 5:6], past_key_values=prompt, use_cache=True)  # a view now kept on prompt
        want = hf(x[:, 6:7], past_key_values=copy.deepcopy(prompt), use_cache=True).logits
        assert prompt.get_seq_length() == 6
        again = copy.deepcopy(prompt)
        got = hf(x[:, 6:7], past_key_values=again, use_cache=True).logits
        assert prompt.get_seq_length() == 6 and again.get_seq_length() == 7
        assert max_diff(got, want) == 0.0 and max_diff(got, hf(x).logits[:, 6:7]) < 1e-5
        shallow = copy.copy(prompt)
        hf(x[:, 6:7], past_key_values=shallow, use_cache=True)
        assert shallow._difftx_view.cache is shallow
    pickle.loads(pickle.dumps(prompt))


@pytest.mark.parametrize("kwargs", [None, {"use_reentrant": True}])
def test_activation_checkpointing_through_transformers(kwargs):
    """transformers' activation_checkpointing_enable (gradient_checkpointing_enable before 5.x's rename), as its
    Trainer calls it: every block recomputed with transformers' checkpoint function, the same loss and gradients
    bit for bit (dropout included, with either checkpoint kind); disabling it restores the plain blocks."""
    import warnings

    model = difftx_model(seed=0, attention="diff", n_heads=2, dropout=0.1)
    hf = DifftxForCausalLM.from_difftx(model).train()
    x = tokens(97, n=40)

    def step():
        hf.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        loss = hf(input_ids=x, labels=x).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in hf.parameters()]

    ref = step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the deprecated name, where it is the one there is
        enable = getattr(hf, "activation_checkpointing_enable", None) or hf.gradient_checkpointing_enable
        disable = getattr(hf, "activation_checkpointing_disable", None) or hf.gradient_checkpointing_disable
        enable(kwargs)
        assert model.activation_checkpointing() == [True] * model.config.n_layers
        assert all(getattr(b, "_gradient_checkpointing_func", None) is not None for b in model.layers)
        loss, grads = step()
        assert torch.equal(loss, ref[0])
        assert all(torch.equal(a, b) for a, b in zip(grads, ref[1]))
        disable()
    assert model.activation_checkpointing() == [False] * model.config.n_layers
    if hasattr(hf, "activation_checkpointing_enable"):  # every_n_layers: transformers 5.2x
        hf.activation_checkpointing_enable(every_n_layers=2)
        assert model.activation_checkpointing() == [i % 2 == 0 for i in range(model.config.n_layers)]
        assert torch.equal(step()[0], ref[0])
        hf.activation_checkpointing_disable()
        assert model.activation_checkpointing() == [False] * model.config.n_layers


def test_packed_sequences_from_transformers_flattening_collator(saved):
    """transformers' DataCollatorWithFlattening packs a batch's examples into one row, position_ids restarting at
    0 for each, no attention_mask: each example then attends only to itself, with labels and loss as if each
    had been its own sequence (the collator's -100 at every example's first label)."""
    from transformers import DataCollatorWithFlattening

    model, _, hf = saved
    lengths = (5, 9, 3, 12)
    examples = [tokens(97, batch=1, n=n, seed=10 + i)[0].tolist() for i, n in enumerate(lengths)]
    batch = DataCollatorWithFlattening()([{"input_ids": e} for e in examples])
    assert "attention_mask" not in batch and batch["position_ids"][0].tolist()[5] == 0
    with torch.no_grad():
        packed = hf(**batch)
        starts = [0, 5, 14, 17]
        total, count = 0.0, 0
        for e, s in zip(examples, starts):
            alone = hf(torch.tensor([e]), labels=torch.tensor([e]))
            assert max_diff(packed.logits[0, s:s + len(e)], alone.logits[0]) < 1e-5
            total, count = total + float(alone.loss) * (len(e) - 1), count + len(e) - 1
        assert float(packed.loss) == pytest.approx(total / count, rel=1e-5)
        # ordinary growing positions change nothing: one document a row
        x = tokens(97)
        assert max_diff(hf(x, position_ids=torch.arange(13)[None].expand(2, 13)).logits, hf(x).logits) == 0.0
    assert packed.past_key_values is None  # a cache of packed rows could not tell their documents apart
