"""generate(): greedy, sampling filters, stop tokens, batched left padding, cache vs no cache."""

from __future__ import annotations

import pytest
import torch

from difftx import DifftxError, ModelConfig, build_model
from difftx.models.generation import sample_next


def model_for(attention):
    torch.manual_seed(0)
    cfg = ModelConfig(attention=attention, d_model=32, n_layers=2, n_heads=2 if attention == "diff" else 4,
                      vocab_size=53, max_seq_len=64)
    return build_model(cfg).eval()


@pytest.mark.parametrize("attention", ["softmax", "diff", "diff2"])
def test_greedy_cache_equals_no_cache_and_argmax(attention):
    model = model_for(attention)
    x = torch.randint(0, 53, (2, 6))
    a = model.generate(x, max_new_tokens=8, temperature=0)
    b = model.generate(x, max_new_tokens=8, temperature=0, use_cache=False)
    assert torch.equal(a, b)
    assert a.shape == (2, 14) and torch.equal(a[:, :6], x)
    # each generated token is the argmax of a full forward over its prefix
    with torch.no_grad():
        for t in range(6, 14):
            assert torch.equal(model(a[:, :t]).logits[:, -1].argmax(-1), a[:, t])


@pytest.mark.parametrize("attention", ["softmax", "diff", "diff2"])
def test_batched_left_padding_equals_single_rows(attention):
    model = model_for(attention)
    rows = [torch.randint(1, 53, (n,)) for n in (3, 7, 5)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    batched = model.generate(ids, max_new_tokens=6, temperature=0, attention_mask=mask)
    for i, r in enumerate(rows):
        single = model.generate(r[None], max_new_tokens=6, temperature=0)
        assert torch.equal(batched[i, width:], single[0, len(r):])


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("attention", ["softmax", "diff", "diff2"])
def test_batched_right_padding_equals_single_rows(attention, use_cache):
    """Right-padded prompts: each row continues from its own last token (not from the padding after it), its new
    tokens following its padding, which the cache and positions skip: the tokens of the row generated alone."""
    model = model_for(attention)
    torch.manual_seed(1)
    rows = [torch.randint(1, 53, (n,)) for n in (3, 7, 5, 1)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(4, width, dtype=torch.long)
    mask = torch.zeros(4, width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
        mask[i, :len(r)] = 1
    batched = model.generate(ids, max_new_tokens=6, temperature=0, attention_mask=mask, use_cache=use_cache)
    for i, r in enumerate(rows):
        single = model.generate(r[None], max_new_tokens=6, temperature=0)
        assert torch.equal(batched[i, width:], single[0, len(r):]), i


def test_sampling_filters():
    logits = torch.tensor([[0.0, 5.0, 4.9, -1.0, 3.0]])
    g = torch.Generator().manual_seed(0)
    # top_k=1 and tiny top_p are greedy
    assert all(int(sample_next(logits, 1.0, top_k=1, generator=g)) == 1 for _ in range(20))
    assert all(int(sample_next(logits, 1.0, top_p=0.01, generator=g)) == 1 for _ in range(20))
    # top_k=2 only ever yields the two largest
    draws = {int(sample_next(logits, 1.0, top_k=2, generator=g)) for _ in range(200)}
    assert draws == {1, 2}
    # top_p=0.9: the smallest prefix of sorted tokens whose mass reaches 0.9: {1, 2}
    probs = torch.softmax(logits, -1)[0]
    assert float(probs[1] + probs[2]) > 0.9
    draws = {int(sample_next(logits, 1.0, top_p=0.9, generator=g)) for _ in range(300)}
    assert draws == {1, 2}
    # high temperature spreads the mass
    draws = {int(sample_next(logits, 100.0, generator=g)) for _ in range(500)}
    assert draws == {0, 1, 2, 3, 4}
    # a prefix whose mass is exactly top_p is enough (dyadic probabilities: no rounding), and top_p=0 is greedy
    dyadic = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))
    assert {int(sample_next(dyadic, 1.0, top_p=0.5, generator=g)) for _ in range(200)} == {0}
    assert {int(sample_next(dyadic, 1.0, top_p=0.75, generator=g)) for _ in range(200)} == {0, 1}
    assert {int(sample_next(logits, 1.0, top_p=0.0, generator=g)) for _ in range(50)} == {1}


@pytest.mark.parametrize("top_p", [-0.1, 1.5])
def test_top_p_out_of_range_is_an_error(top_p):
    with pytest.raises(DifftxError, match="top_p must be in"):
        model_for("softmax").generate(torch.zeros(1, 2, dtype=torch.long), 2, top_p=top_p)


def test_stop_tokens_as_a_tensor_or_one_int():
    model = model_for("softmax")
    x = torch.randint(0, 53, (1, 4), generator=torch.Generator().manual_seed(0))
    stop = int(model.generate(x, max_new_tokens=4, temperature=0)[0, 5])
    want = model.generate(x, max_new_tokens=4, temperature=0, stop_tokens=[stop], pad_token_id=-1)
    for given in (torch.tensor([stop]), stop):
        assert torch.equal(model.generate(x, max_new_tokens=4, temperature=0, stop_tokens=given, pad_token_id=-1),
                           want)


def test_sampling_is_reproducible_with_a_generator():
    model = model_for("diff")
    x = torch.randint(0, 53, (2, 4))
    a = model.generate(x, 10, temperature=0.8, top_k=20, generator=torch.Generator().manual_seed(3))
    b = model.generate(x, 10, temperature=0.8, top_k=20, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


def test_stop_tokens_finish_rows():
    model = model_for("softmax")
    x = torch.randint(0, 53, (2, 4))
    free = model.generate(x, max_new_tokens=10, temperature=0)
    stop = int(free[0, 6])  # the third generated token of row 0
    out = model.generate(x, max_new_tokens=10, temperature=0, stop_tokens=[stop], pad_token_id=-1)
    gen0 = out[0, 4:].tolist()
    first = gen0.index(stop)
    assert all(t == -1 for t in gen0[first + 1:])
    if stop not in free[1, 4:].tolist():
        assert torch.equal(out[1, 4:], free[1, 4:out.shape[1]])


def test_generation_respects_learned_position_limit():
    cfg = ModelConfig(d_model=32, n_layers=1, n_heads=4, vocab_size=11, max_seq_len=8, positions="learned")
    model = build_model(cfg)
    with pytest.raises(DifftxError, match="max_seq_len"):
        model.generate(torch.zeros(1, 5, dtype=torch.long), max_new_tokens=5)
    # the last new token is never fed back: 5 + 4 tokens need 8 positions
    assert model.generate(torch.zeros(1, 5, dtype=torch.long), max_new_tokens=4).shape == (1, 9)


def test_generate_restores_training_mode():
    model = model_for("diff").train()
    model.generate(torch.zeros(1, 2, dtype=torch.long), 2)
    assert model.training


@pytest.mark.parametrize("use_cache", [True, False])
def test_pad_token_outside_the_vocabulary_while_other_rows_continue(use_cache):
    """pad_token_id -1 (or >= vocab_size) only fills the output of a finished row: the model never reads it (it was
    the embedding's IndexError as soon as one row stopped before another)."""
    model = model_for("diff")
    x = torch.randint(0, 53, (2, 4), generator=torch.Generator().manual_seed(0))
    free = model.generate(x, max_new_tokens=8, temperature=0)
    stop = next(t for t in free[0, 4:8].tolist() if t not in free[1, 4:].tolist())
    first = free[0, 4:].tolist().index(stop)
    for pad in (-1, 53):
        out = model.generate(x, max_new_tokens=8, temperature=0, stop_tokens=[stop], pad_token_id=pad,
                             use_cache=use_cache)
        assert out.shape == free.shape
        assert torch.equal(out[1], free[1])
        assert torch.equal(out[0, :5 + first], free[0, :5 + first]) and (out[0, 5 + first:] == pad).all()


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": float("nan")}, "temperature must be"),
    ({"temperature": float("nan"), "do_sample": True}, "temperature must be"),
    ({"temperature": -0.5}, "temperature must be"),
    ({"temperature": -0.5, "do_sample": True}, "temperature must be"),
    ({"top_k": -1}, "top_k must be"),
    ({"max_new_tokens": -1}, "max_new_tokens must be"),
])
def test_invalid_sampling_arguments_are_errors(kwargs, match):
    """A NaN or negative temperature was silently greedy (or multinomial's NaN traceback), a negative top_k silently
    no filter, a negative max_new_tokens silently the prompt back."""
    kwargs = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(DifftxError, match=match):
        model_for("softmax").generate(torch.zeros(1, 2, dtype=torch.long), **kwargs)


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_row_of_padding_only_is_an_error(use_cache):
    """An attention_mask row of zeros is an empty prompt (alone it is refused): it was continued from a padding
    token, silently."""
    ids = torch.tensor([[0, 0, 0], [5, 6, 7]])
    mask = torch.tensor([[0, 0, 0], [1, 1, 1]])
    with pytest.raises(DifftxError, match=r"row\(s\) \[0\] have no tokens"):
        model_for("diff").generate(ids, 2, temperature=0, attention_mask=mask, use_cache=use_cache)
