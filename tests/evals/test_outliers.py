"""Outliers: streaming top-k / median against exact values, planted outliers found, memory flat in the budget."""

import pytest
import torch

from difftx.evals.common import LogHistogram, TopK, attach, valid_values
from difftx.evals.outliers import evaluate_outliers
from difftx.nn.probe import AttentionProbe
from evals_helpers import tiny_model


def test_streaming_topk_and_median_match_exact():
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(1000 + 37 * i, generator=g).abs() * (1 + i) for i in range(20)]
    chunks[7][123] = 5000.0  # a planted outlier
    top, hist = TopK(100), LogHistogram()
    for c in chunks:
        top.update(c)
        hist.update(c)
    allv = torch.cat(chunks).double()
    exact = torch.topk(allv, 100).values
    assert top.top(1) == 5000.0
    assert torch.equal(top.values, exact)
    med = float(torch.median(allv))
    assert abs(hist.median() - med) <= hist.rel_error * med
    assert abs(hist.quantile(0.9) - float(torch.quantile(allv, 0.9, interpolation="lower"))) <= 0.006 * hist.quantile(0.9)
    assert hist.n == allv.numel()


def test_histogram_edge_cases():
    h = LogHistogram()
    assert h.median() is None
    h.update(torch.zeros(5))
    h.update(torch.tensor([2.0 ** 40]))
    assert h.median() == 0.0 and h.quantile(1.0) == 2.0 ** 40


def _pass_through_model(kind):
    """Blocks whose outputs equal their inputs (attention and FFN outputs zeroed): hidden states = embeddings."""
    model = tiny_model(kind)
    with torch.no_grad():
        for block in model.layers:
            block.attn.out_proj.weight.zero_()
            block.ffn.w_down.weight.zero_()
    return model


@pytest.mark.parametrize("kind", ["softmax", "diff"])
def test_planted_hidden_state_outlier_is_found(kind):
    model = _pass_through_model(kind)
    with torch.no_grad():
        model.embed.weight[ord("e"), 5] = -1234.5
        model.embed.weight[ord("q"), 9] = 777.25
    tokens = torch.tensor(list(b"the quick brown fox jumps over the lazy dog " * 8))
    r = evaluate_outliers(model, tokens, seq_len=64, max_tokens=256)
    h = r["hidden_states"]
    assert h["top1"] == 1234.5 and h["by_layer"][0]["top1"] == h["by_layer"][1]["top1"] == 1234.5
    # reference: every layer outputs the embeddings of the tokens
    ref = model.embed.weight.detach()[tokens[:256]].abs().double().reshape(-1).repeat(len(model.layers))
    exact = torch.topk(ref, 100).values
    n_e = int((tokens[:256] == ord("e")).sum()) * len(model.layers)
    assert exact[n_e - 1] == 1234.5 and exact[n_e] == 777.25  # both planted values are among the top 100
    for i in (1, 2, 3, 10, 100):
        assert h[f"top{i}"] == pytest.approx(float(exact[i - 1]), rel=1e-6)
    assert h["median"] == pytest.approx(float(torch.median(ref)), rel=h["median_rel_error"])


class CollectAll(AttentionProbe):
    def __init__(self):
        self.values = []

    def observe(self, layer, logits, effective, mask):
        for lg in logits:
            self.values.append(valid_values(lg, mask).abs().double())


@pytest.mark.parametrize("kind", ["softmax", "diff", "diff2"])
def test_logit_statistics_equal_an_exact_reference(kind):
    model = tiny_model(kind)
    with torch.no_grad():
        model.layers[1].attn.q_proj.weight.mul_(40.0)  # make some large logits
    tokens = torch.randint(0, 256, (4 * 48,), generator=torch.Generator().manual_seed(1))
    r = evaluate_outliers(model, tokens, seq_len=48, max_tokens=4 * 48, batch_size=3)
    ref = CollectAll()
    with attach(model, ref), torch.no_grad():
        model(tokens.view(4, 48))
    allv = torch.cat(ref.values)
    n_maps = 2 if kind == "diff" else 1
    heads = model.config.n_heads * (2 if kind == "diff2" else 1)
    assert allv.numel() == r["attention_logits"]["count"] == 4 * (48 * 49 // 2) * heads * n_maps * 2
    exact = torch.topk(allv, 100).values
    s = r["attention_logits"]
    for i in (1, 2, 3, 10, 100):
        assert abs(s[f"top{i}"] - float(exact[i - 1])) <= 1e-5 * float(exact[0])
    med = float(torch.median(allv))
    assert abs(s["median"] - med) <= s["median_rel_error"] * med


def test_memory_is_flat_in_the_token_budget():
    model = tiny_model("diff")
    tokens = torch.randint(0, 256, (64 * 32,), generator=torch.Generator().manual_seed(2))
    small = evaluate_outliers(model, tokens, seq_len=32, max_tokens=64)
    big = evaluate_outliers(model, tokens, seq_len=32, max_tokens=64 * 32)
    assert big["tokens"] == 32 * small["tokens"]
    assert big["state_bytes"] == small["state_bytes"] < 400_000


def test_peak_memory_does_not_grow_with_the_budget():
    """Keeping the values would cost > 40 MB more at the larger budget (8.4M logits + 2.1M hidden entries)."""
    import resource

    model = tiny_model("diff")
    tokens = torch.randint(0, 256, (16384,), generator=torch.Generator().manual_seed(3))
    evaluate_outliers(model, tokens, seq_len=128, max_tokens=2048, batch_size=8)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    r = evaluate_outliers(model, tokens, seq_len=128, max_tokens=16384, batch_size=8)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert r["attention_logits"]["count"] == 16384 * 129 // 2 * 2 * 2 * 2
    assert after - before < 16 * 1024


def test_too_little_text_names_the_fix(checkpoint, tmp_path, capsys):
    """Text shorter than one window said only "need at least 256 tokens for one window; got 11" (lm's says what
    to do); now it names the fix, in one line, exit 2."""
    from difftx.cli import main

    (tmp_path / "short.txt").write_text("hello world")
    capsys.readouterr()
    rc = main(["eval", "outliers", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "o"),
               "--data", str(tmp_path / "short.txt"), "--no-plot", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("difftx eval")
    assert "got 11" in err[0] and "pass more data or a smaller --seq-len" in err[0]


def test_token_ids_past_the_vocabulary_are_one_line(tmp_path, capsys):
    """A tokenizer with more ids than the model's vocabulary (a byte tokenizer beside a vocab-100 model): eval lm
    said so in one line, exit 2; eval outliers crashed with the embedding's IndexError traceback."""
    import difftx
    from difftx.cli import main
    from difftx.data import ByteTokenizer
    from evals_helpers import haystack_text

    ckpt = tmp_path / "ckpt"
    difftx.save_model(tiny_model("diff", vocab_size=100), ckpt)
    ByteTokenizer().save(ckpt)
    (tmp_path / "text.txt").write_text(haystack_text(20))
    capsys.readouterr()
    rc = main(["eval", "outliers", "--checkpoint", str(ckpt), "--out", str(tmp_path / "o"), "--data",
               str(tmp_path / "text.txt"), "--seq-len", "32", "--max-tokens", "64", "--no-plot", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "outside the model's vocabulary (100)" in err[0], err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("metric", ["niah", "icl"])
def test_prompts_past_the_vocabulary_are_one_line(metric, tmp_path, capsys):
    """The same mismatch (a byte tokenizer beside a vocab-100 model) in the evaluations that build their own
    prompts: niah (and attention, on its samples) and icl crashed with the embedding's IndexError traceback."""
    import difftx
    from difftx.cli import main
    from difftx.data import ByteTokenizer

    ckpt = tmp_path / "ckpt"
    difftx.save_model(tiny_model("diff", vocab_size=100), ckpt)
    ByteTokenizer().save(ckpt)
    capsys.readouterr()
    rc = main(["eval", metric, "--checkpoint", str(ckpt), "--out", str(tmp_path / "o"), "--no-plot", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "outside the model's vocabulary (100)" in err[0], err
    assert not (tmp_path / "o").exists()


def test_histogram_counts_inf_as_overflow():
    """An overflowed (inf) activation, as an fp16 model makes: log10(inf) cast to long wrapped to the underflow bin,
    so three infs and two finite values had median 0; it is the largest value, the overflow bin."""
    h = LogHistogram()
    h.update(torch.tensor([float("inf")] * 3 + [1.0, 2.0]))
    assert h.counts[0] == 0 and h.counts[-1] == 3
    assert h.median() == float("inf")


@pytest.mark.parametrize("kind", ["softmax", "diff"])
def test_document_masking_counts_the_logits_of_each_document_alone(kind):
    """document_eos: each window's documents attend only to themselves, so the logits counted are each
    document's own causal triangle, and the hidden states are those of each document run alone (positions from
    0 at every document)."""
    model = tiny_model(kind)
    tokens = torch.randint(1, 256, (2 * 32,), generator=torch.Generator().manual_seed(3))
    eos = [9, 20, 40]  # window 0: documents of 10, 11 and 11 tokens; window 1: 9 (to 40), then 23
    tokens[eos] = 0
    r = evaluate_outliers(model, tokens, seq_len=32, max_tokens=64, document_eos=0)
    plain = evaluate_outliers(model, tokens, seq_len=32, max_tokens=64)
    docs = [tokens[0:10], tokens[10:21], tokens[21:32], tokens[32:41], tokens[41:64]]
    per_token = model.config.n_heads * (2 if kind == "diff" else 1) * model.config.n_layers
    assert r["attention_logits"]["count"] == per_token * sum(len(d) * (len(d) + 1) // 2 for d in docs)
    assert plain["attention_logits"]["count"] == per_token * 2 * 32 * 33 // 2
    alone = [evaluate_outliers(model, d, seq_len=len(d), max_tokens=len(d)) for d in docs]
    top = max(a["hidden_states"]["top1"] for a in alone)
    assert abs(r["hidden_states"]["top1"] - top) <= 1e-5 * top
    assert sum(a["hidden_states"]["count"] for a in alone) == r["hidden_states"]["count"]
