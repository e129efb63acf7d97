"""LM evaluation: AR-Hit classification of constructed sequences, loss against the model's own loss."""

import math

import pytest
import torch

from difftx.evals.lm import ar_hit_mask, evaluate_lm
from evals_helpers import tiny_model


def test_ar_hit_constructed_sequence():
    # tokens:        a b c a b d a b c
    # prediction t predicts w[t+1]; hit iff bigram (w[t], w[t+1]) occurred at some s < t
    w = torch.tensor([[1, 2, 3, 1, 2, 4, 1, 2, 3]])
    hit = ar_hit_mask(w, vocab_size=8)[0].tolist()
    # bigrams at t: (1,2) (2,3) (3,1) (1,2) (2,4) (4,1) (1,2) (2,3)
    assert hit == [False, False, False, True, False, False, True, True]


def test_ar_hit_rows_are_independent_and_overlap_counts():
    w = torch.tensor([[5, 5, 5, 5], [1, 5, 5, 2]])
    hit = ar_hit_mask(w, vocab_size=8)
    # row 0: (5,5) at t=0 first, repeated at t=1 and t=2 (overlapping occurrences count)
    assert hit[0].tolist() == [False, True, True]
    # row 1 must not see row 0's bigrams
    assert hit[1].tolist() == [False, False, False]


def test_loss_matches_model_loss_and_cumulative_ends_at_loss():
    model = tiny_model("softmax")
    torch.manual_seed(1)
    tokens = torch.randint(0, 256, (4 * 32 + 1,))
    r = evaluate_lm(model, tokens, seq_len=32, max_tokens=4 * 32, batch_size=3)
    x = torch.stack([tokens[i * 32:(i + 1) * 32] for i in range(4)])
    y = torch.stack([tokens[i * 32 + 1:(i + 1) * 32 + 1] for i in range(4)])
    with torch.no_grad():
        ref = float(model(x, targets=y).loss)
    assert abs(r["loss"] - ref) < 1e-5
    assert r["tokens"] == 128 and r["windows"] == 4
    assert abs(r["perplexity"] - math.exp(ref)) < 1e-3 * math.exp(ref)
    assert r["by_position"]["position"][-1] == 32
    assert abs(r["by_position"]["cumulative_nll"][-1] - ref) < 1e-5
    # the whole curve: the mean NLL at position t, and of all predictions at positions <= t (Fig. 4)
    with torch.no_grad():
        nll = torch.nn.functional.cross_entropy(model(x).logits.double().transpose(1, 2), y, reduction="none")
    at, cum = nll.mean(0), nll.cumsum(1).sum(0) / (4 * torch.arange(1, 33))
    pos = r["by_position"]["position"]
    assert pos == list(range(1, 33))
    torch.testing.assert_close(torch.tensor(r["by_position"]["nll"], dtype=torch.float64), at, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(r["by_position"]["cumulative_nll"], dtype=torch.float64), cum,
                               rtol=1e-5, atol=1e-5)
    # AR-Hit and Others partition the tokens and the loss
    n_h, n_o = r["ar_hit"]["tokens"], r["others"]["tokens"]
    assert n_h + n_o == 128
    lh = r["ar_hit"]["loss"] or 0.0
    assert abs((lh * n_h + r["others"]["loss"] * n_o) / 128 - ref) < 1e-5


def test_frequency_threshold_moves_frequent_bigrams_to_others():
    model = tiny_model("softmax")
    tokens = torch.tensor([1, 2] * 40 + [3, 4, 5, 3, 4, 5] + [7] * 7)
    base = evaluate_lm(model, tokens, seq_len=len(tokens) - 1, max_tokens=10_000)
    rare = evaluate_lm(model, tokens, seq_len=len(tokens) - 1, max_tokens=10_000, ar_max_freq=2)
    # (3,4) and (4,5) occur twice (rare), (1,2), (2,1) and (7,7) are frequent
    assert rare["ar_hit"]["tokens"] == 2
    assert base["ar_hit"]["tokens"] > rare["ar_hit"]["tokens"]
    assert abs(base["loss"] - rare["loss"]) < 1e-9


def test_logits_in_slices_give_the_same_results(monkeypatch):
    """The LM head runs on slices of positions (never all B x N x V logits); the results do not change."""
    import difftx.evals.common as common

    model = tiny_model("diff")
    torch.manual_seed(2)
    tokens = torch.randint(0, 256, (6 * 40 + 1,))
    whole = evaluate_lm(model, tokens, seq_len=40, max_tokens=6 * 40, batch_size=4)
    sizes = []
    head = model.head

    def counting_head(hidden):
        sizes.append(hidden.shape[0] * hidden.shape[1])
        return head(hidden)

    monkeypatch.setattr(model, "head", counting_head)
    monkeypatch.setattr(common, "LOGIT_BUDGET", 4 * 7 * 256)  # 7 positions of a batch of 4 at a time
    sliced = evaluate_lm(model, tokens, seq_len=40, max_tokens=6 * 40, batch_size=4)
    assert max(sizes) * 256 <= 4 * 7 * 256 and len(sizes) == 6 + 3  # 4 windows: 7 positions a slice; 2: 14
    assert abs(sliced["loss"] - whole["loss"]) < 1e-6
    for a, b in zip(sliced["by_position"]["nll"], whole["by_position"]["nll"]):
        assert abs(a - b) < 1e-5
    assert sliced["ar_hit"]["tokens"] == whole["ar_hit"]["tokens"]
    ids = tokens[:80].view(2, 40)
    with torch.no_grad():
        assert torch.equal(common.predictions(model, ids), model(ids).logits.argmax(-1))


class _FourCharsPerToken:
    """A tokenizer of 4 characters a token (a BPE's ratio on prose), ids in the byte range."""

    def encode(self, text):
        return [ord(text[i]) % 256 for i in range(0, len(text), 4)]


def test_budget_below_one_window_still_reads_text_for_a_window():
    """--max-tokens below the window: one window of seq_len is evaluated, so at least seq_len + 1 tokens of text
    must be read.  Reading only (max_tokens + 1) * 8 characters gave a multi-character-per-token tokenizer too few
    tokens: 'need at least 257 tokens ... pass more data' on a corpus of megabytes."""
    from difftx.evals.lm import evaluate_lm_text
    from difftx.evals.outliers import evaluate_outliers_text

    model = tiny_model("diff", max_seq_len=256)
    text = "The river was near the garden. " * 500
    r = evaluate_lm_text(model, _FourCharsPerToken(), text=text, max_tokens=32)
    assert r["windows"] == 1 and r["tokens"] == 256
    r = evaluate_outliers_text(model, _FourCharsPerToken(), text=text, max_tokens=32, seq_len=128)
    assert r["tokens"] == 128


@pytest.mark.parametrize("name", ["lm", "outliers"])
def test_seq_len_past_learned_positions_names_the_flag(name, tmp_path, capsys):
    """--seq-len 100 on a model whose learned positions end at 64 failed inside the model ('shorten the input or
    raise max_seq_len', naming no flag); now refused before it runs, naming --seq-len and its limit, as icl's
    --max-len and attention's --length are."""
    import difftx
    from difftx.cli import main
    from difftx.data import ByteTokenizer
    from difftx.errors import ConfigError
    from difftx.evals.lm import evaluate_lm
    from difftx.evals.outliers import evaluate_outliers

    model = tiny_model("softmax", positions="learned", max_seq_len=64)
    tokens = torch.randint(0, 256, (400,), generator=torch.Generator().manual_seed(0))
    fn = evaluate_lm if name == "lm" else evaluate_outliers
    with pytest.raises(ConfigError, match=r"seq_len: 100 exceeds max_seq_len=64 .*--seq-len up to 64"):
        fn(model, tokens, seq_len=100, max_tokens=200)
    assert fn(model, tokens, seq_len=64, max_tokens=128)["tokens"] == 128  # up to the limit it runs
    difftx.save_model(model, tmp_path / "ck")
    ByteTokenizer().save(tmp_path / "ck")
    (tmp_path / "t.txt").write_text("The river was near the garden. " * 40)
    capsys.readouterr()
    rc = main(["eval", name, "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "o"), "--seq-len", "100",
               "--data", str(tmp_path / "t.txt"), "--no-plot", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--seq-len up to 64" in err[0] and err[0].startswith("difftx eval")


@pytest.mark.parametrize("kind", ["softmax", "diff"])
def test_document_masking_scores_each_windows_documents_apart(kind):
    """document_eos: each window's documents (ended by that token) attend only to themselves: the loss of the
    model called with the windows' document ids, not the loss without."""
    from difftx.nn import document_ids

    model = tiny_model(kind)
    tokens = torch.randint(1, 256, (4 * 32 + 1,), generator=torch.Generator().manual_seed(2))
    tokens[[5, 40, 41, 70, 100]] = 0  # end-of-text tokens
    r = evaluate_lm(model, tokens, seq_len=32, max_tokens=4 * 32, document_eos=0)
    x = torch.stack([tokens[i * 32:(i + 1) * 32] for i in range(4)])
    y = torch.stack([tokens[i * 32 + 1:(i + 1) * 32 + 1] for i in range(4)])
    with torch.no_grad():
        masked = float(model(x, targets=y, document_ids=document_ids(x, 0)).loss)
        plain = float(model(x, targets=y).loss)
    assert abs(r["loss"] - masked) < 5e-6 and abs(masked - plain) > 1e-4


@pytest.mark.parametrize("name", ["lm", "outliers"])
def test_document_masking_needs_an_end_of_text_token(tmp_path, capsys, name):
    import difftx
    from difftx.cli import main
    from difftx.data import ByteTokenizer

    difftx.save_model(tiny_model("diff"), tmp_path / "ck")
    ByteTokenizer().save(tmp_path / "ck")
    code = main(["eval", name, "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "out"),
                 "--document-masking", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--document-masking: needs the documents ended by an end-of-text" \
        " token, and the checkpoint's byte tokenizer has none" in err, err
    assert not (tmp_path / "out" / f"{name}.json").exists()
