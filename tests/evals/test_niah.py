"""Multi-needle retrieval: the generator's answers, spans and depths; scoring alignment; the training task."""

import re
from types import SimpleNamespace

import pytest
import torch

from difftx.data import ByteTokenizer
from difftx.data.tasks import get_task
from difftx.errors import ConfigError, DataError
from difftx.evals.common import rng_for
from difftx.evals.niah import (ANSWER, ANSWER_NEEDLE, NOISE, OTHER_NEEDLE, QUERY, NiahBuilder, evaluate_niah,
                               parse_grid, score_generation, score_teacher_forced)
from evals_helpers import haystack_text, tiny_model

TOK = ByteTokenizer()
NEEDLE = re.compile(r"The special magic number for ([A-Za-z ]+?) is: (\d+)\.(?=\s|$)")


def builder(**kw):
    return NiahBuilder(TOK, text=haystack_text(), **kw)


@pytest.mark.parametrize("n,r", [(1, 1), (4, 2), (6, 3)])
def test_needles_answers_and_spans(n, r):
    b = builder()
    for k in range(5):
        s = b.sample(rng_for(7, k), 600, n, r, depth=0.5)
        assert len(s.ids) == len(s.regions) == 600
        text = TOK.decode(s.ids)
        found = dict(NEEDLE.findall(text))
        assert len(found) == n and set(found) == set(s.cities)  # every needle inserted once, all cities distinct
        assert len(set(found.values())) == n  # distinct numbers
        # each query asks for one of the needle cities and its answer span holds that city's number
        for (a, e), city, number in zip(s.answers, s.cities[:r], s.numbers):
            assert TOK.decode(s.ids[a:e]) == " " + number
            assert found[city] == number
            assert TOK.decode(s.ids[:a]).endswith(f"The special magic number for {city} is:")
        # the ANSWER region is exactly the first query's number inside its needle
        ans = [i for i, g in enumerate(s.regions) if g == ANSWER]
        assert TOK.decode([s.ids[i] for i in ans]) == s.numbers[0]
        assert ans == list(range(ans[0], ans[-1] + 1))
        # needle regions decode to needles, noise to haystack sentences only
        needle_text = TOK.decode([t for t, g in zip(s.ids, s.regions) if g in (ANSWER, ANSWER_NEEDLE)])
        assert needle_text == f" The special magic number for {s.cities[0]} is: {s.numbers[0]}."  # leading space
        other = TOK.decode([t for t, g in zip(s.ids, s.regions) if g == OTHER_NEEDLE])
        assert len(NEEDLE.findall(other)) == n - 1
        assert "magic" not in TOK.decode([t for t, g in zip(s.ids, s.regions) if g == NOISE])
        assert s.regions[s.answers[0][0] - 1] == QUERY


def test_needles_sit_at_sentence_boundaries():
    b = builder()
    for k in range(10):
        s = b.sample(rng_for(3, k), 500, 5, 1, depth=None)
        text = TOK.decode(s.ids)
        for m in NEEDLE.finditer(text):
            before = text[:m.start()]
            assert before == " " or before.endswith(". ") or before.endswith("\n") or NEEDLE.search(before[-60:])


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_answer_depth(depth):
    b = builder()
    s = b.sample(rng_for(1, int(depth * 100)), 800, 1, 1, depth=depth)
    ans = [i for i, g in enumerate(s.regions) if g == ANSWER]
    hay = [i for i, g in enumerate(s.regions) if g == NOISE]
    before = sum(1 for i in hay if i < ans[0])
    frac = before / len(hay)
    assert abs(frac - depth) < 0.06  # nearest sentence boundary (sentences here are ~35 tokens of ~700)
    if depth == 0.0:
        assert s.regions[0] == ANSWER_NEEDLE
    if depth == 1.0:
        assert before == len(hay)


def test_too_short_and_grid_errors():
    b = builder()
    with pytest.raises(DataError, match="cannot hold"):
        b.sample(rng_for(0), 100, 4, 2, depth=0.0)
    assert parse_grid("N1R1, n4r2") == [(1, 1), (4, 2)]
    with pytest.raises(ValueError, match="1 <= R <= N"):
        parse_grid("N1R2")


class NextTokenOracle(torch.nn.Module):
    """Logits that put all mass on the true next input token (what teacher forcing must count as correct)."""

    def __init__(self, shift: int = 1):
        super().__init__()
        self.shift = shift
        self.config = SimpleNamespace(n_heads=1, vocab_size=256, max_seq_len=4096, positions="rope")
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, ids, **kw):
        nxt = torch.roll(ids, -self.shift, dims=1)
        return SimpleNamespace(logits=torch.nn.functional.one_hot(nxt, 256).float())


class RetrievalOracle(NextTokenOracle):
    """Generates by reading the prompt: finds the needle for the last queried city and emits its number."""

    def generate(self, ids, max_new_tokens, attention_mask=None, **kw):
        rows = []
        for row, m in zip(ids.tolist(), attention_mask.tolist()):
            text = TOK.decode([t for t, v in zip(row, m) if v])
            city = re.findall(r"The special magic number for ([A-Za-z ]+?) is:$", text)[-1]
            number = re.search(rf"The special magic number for {city} is: (\d+)\.", text).group(1)
            new = TOK.encode(" " + number)[:max_new_tokens]
            rows.append(row + new + [0] * (max_new_tokens - len(new)))
        return torch.tensor(rows)


def test_scoring_alignment_with_oracles():
    b = builder()
    samples = [b.sample(rng_for(5, k), 400, 3, 2, depth=0.25 * (k % 5)) for k in range(6)]
    assert all(em == [True, True] for em, _ in score_teacher_forced(NextTokenOracle(1), samples, 4))
    # predicting the current token instead of the next is wrong everywhere in a random number
    assert not any(any(em) for em, _ in score_teacher_forced(NextTokenOracle(0), samples, 4))
    assert all(g == [True, True] for g in score_generation(RetrievalOracle(), TOK, samples, 4))


class LateOracle(RetrievalOracle):
    """Emits three filler tokens before the number: found within its answer + 3 tokens, not + 2."""

    def generate(self, ids, max_new_tokens, attention_mask=None, **kw):
        out = super().generate(ids, max_new_tokens + 3, attention_mask)
        n, filler = ids.shape[1], torch.tensor(TOK.encode("...")).expand(len(ids), 3)
        return torch.cat((ids, filler, out[:, n:]), 1)[:, :n + max_new_tokens]


def test_generation_score_does_not_depend_on_the_batch():
    """A query's generation budget was its batch's longest answer + 2 tokens, so a short answer batched with a long
    one (a BPE's numbers differ in length) was read further, and scored differently, than alone (--batch-size)."""
    short = NiahBuilder(TOK, text=haystack_text(), digits=2).sample(rng_for(4, 0), 300, 1, 1, depth=0.5)
    long = NiahBuilder(TOK, text=haystack_text(), digits=6).sample(rng_for(4, 1), 300, 1, 1, depth=0.5)
    alone = score_generation(LateOracle(), TOK, [short, long], 1)
    assert alone == [[False], [False]]  # an answer + 2 tokens cannot hold "..." + the answer
    assert score_generation(LateOracle(), TOK, [short, long], 2) == alone


def test_evaluate_niah_tiny_model_runs_and_skips_cells_that_do_not_fit():
    r = evaluate_niah(tiny_model("diff"), TOK, grid="N1R1,N4R2", lengths=[128, 256], depths=[0.0, 1.0], samples=2,
                      text=haystack_text())
    assert {(c["needles"], c["length"]) for c in r["cells"]} == {(1, 128), (1, 256)}
    assert [s["needles"] for s in r["skipped"]] == [4, 4]
    assert set(r["table"]) == {"N1R1"}
    hm = r["heatmaps"]["N1R1"]
    assert len(hm["teacher_forced"]) == 2 and len(hm["teacher_forced"][0]) == 2
    assert 0.0 <= r["overall"]["teacher_forced"] <= 1.0


def test_summaries_average_the_cells_of_each_grid_entry_depth_and_length():
    """The N x R table, the heat maps (rows: depths, columns: lengths) and the overall means of hand-set cells, each
    with its own accuracy (a tiny model scores 0 everywhere, so the run above cannot tell them apart)."""
    from difftx.evals.niah import summarize

    def cell(n, length, depth, tf, gen=None):
        return {"needles": n, "queries": 1, "length": length, "depth": depth, "teacher_forced": tf,
                "token_accuracy": tf / 2, "generation": gen}

    cells = [cell(1, 128, 0.0, 0.1), cell(1, 128, 1.0, 0.2), cell(1, 256, 0.0, 0.4), cell(1, 256, 1.0, 0.8),
             cell(2, 256, 0.0, 0.5, 1.0), cell(2, 256, 1.0, 0.7, 0.0)]
    r = summarize(cells, [], [128, 256], [0.0, 1.0])
    approx = lambda v: pytest.approx(v, abs=1e-12)  # noqa: E731
    assert list(r["table"]) == ["N1R1", "N2R1"]
    assert r["table"]["N1R1"] == approx({"teacher_forced": 0.375, "token_accuracy": 0.1875, "generation": None})
    assert r["table"]["N2R1"] == approx({"teacher_forced": 0.6, "token_accuracy": 0.3, "generation": 0.5})
    assert r["heatmaps"]["N1R1"]["lengths"] == [128, 256] and r["heatmaps"]["N2R1"]["lengths"] == [256]
    assert [row == approx(want) for row, want in zip(r["heatmaps"]["N1R1"]["teacher_forced"], [[0.1, 0.4], [0.2, 0.8]])] \
        == [True, True]
    assert r["heatmaps"]["N2R1"]["generation"] == [[1.0], [0.0]]
    assert r["overall"] == approx({"teacher_forced": 2.7 / 6, "token_accuracy": 1.35 / 6, "generation": 0.5})


def test_a_cells_scores_are_means_over_its_samples_and_their_queries(monkeypatch):
    """A cell's teacher-forced exact match and token accuracy: the mean over samples of each sample's mean over its
    R queries (scores set by hand: a tiny model's are all 0)."""
    from difftx.evals import niah

    def scores(model, samples, batch_size):
        assert len(samples) == 2 and all(len(s.answers) == 2 for s in samples)
        return [([True, False], [1.0, 0.5]), ([True, True], [1.0, 0.0])]

    monkeypatch.setattr(niah, "score_teacher_forced", scores)
    r = evaluate_niah(tiny_model("diff"), TOK, grid="N2R2", lengths=[256], depths=[0.5], samples=2,
                      text=haystack_text(), generation=False)
    (c,) = r["cells"]
    assert c["teacher_forced"] == pytest.approx(0.75) and c["token_accuracy"] == pytest.approx(0.625)
    assert c["generation"] is None and c["samples"] == 2


def test_training_task_is_pure_and_targets_only_answers():
    task = get_task("niah")(TOK, 300, seed=3, needles="1-3", queries="1-2", text=haystack_text())
    x, y = task.batch(4, step=11, rank=1)
    x2, y2 = task.batch(4, step=11, rank=1)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(task.batch(4, step=12, rank=1)[0], x)
    assert not torch.equal(task.batch(4, step=11, rank=0)[0], x)
    assert x.shape == y.shape == (4, 300)
    for i in range(4):
        s = task.sample(11, 1, i)
        ids = torch.tensor(s.ids)
        assert torch.equal(x[i], ids[:-1])
        kept = (y[i] != -100).nonzero().flatten().tolist()
        want = [p - 1 for a, e in s.answers for p in range(a, e)]
        assert kept == want
        assert torch.equal(y[i][kept], ids[[p + 1 for p in kept]])


def test_short_context_models_rope_extrapolates_learned_positions_skip():
    rope = tiny_model("softmax", max_seq_len=64)
    r = evaluate_niah(rope, TOK, grid="N1R1", depths=[0.5], samples=1, text=haystack_text(), generation=False)
    assert [c["length"] for c in r["cells"]] == [128, 256]  # trained at 64, evaluated from 256 down
    learned = tiny_model("softmax", max_seq_len=256, positions="learned")
    r = evaluate_niah(learned, TOK, grid="N1R1", lengths=[128, 512], depths=[0.5], samples=1, text=haystack_text(),
                      generation=False)
    assert [c["length"] for c in r["cells"]] == [128]
    assert "max_seq_len=256" in r["skipped"][0]["reason"]


def test_generation_at_max_seq_len_with_learned_positions():
    model = tiny_model("softmax", max_seq_len=200, positions="learned")
    r = evaluate_niah(model, TOK, grid="N1R1", lengths=[200], depths=[1.0], samples=2, text=haystack_text())
    assert r["cells"][0]["generation"] is not None


def test_more_needles_than_cities_or_numbers_is_a_config_error(checkpoint, tmp_path, capsys):
    """Needles need distinct cities and distinct numbers: 11 one-digit needles (10 numbers) or more needles than
    cities was a numpy ValueError traceback from rng.choice, in niah, attention and the training task."""
    from difftx.cli import main
    from difftx.evals.attention import evaluate_attention
    from difftx.evals.niah import CITIES, NiahTask

    model, text = tiny_model("diff"), haystack_text()
    with pytest.raises(ConfigError, match="distinct 1-digit numbers"):
        evaluate_niah(model, TOK, grid="N11R1", lengths=[256], digits=1, template="short", text=text, samples=1,
                      generation=False)
    with pytest.raises(ConfigError, match="distinct cities"):
        evaluate_attention(model, TOK, needles=len(CITIES) + 1, length=4096, template="short", text=text,
                           samples=1, depths=[0.5])
    with pytest.raises(ConfigError, match="distinct 1-digit numbers"):
        NiahTask(TOK, 512, needles="11", digits=1, template="short", text=text)
    rc = main(["eval", "niah", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "o"), "--digits", "1",
               "--grid", "N11R1", "--template", "short", "--lengths", "256", "--samples", "1", "--no-generation",
               "--data", str(checkpoint / "haystack.txt"), "--no-plot", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "distinct 1-digit numbers" in err[0]


class _NinesShort:
    """Bytes, except that digits 0-8 take 3 tokens each: '99999' is 5 tokens, '12345' 15 -- as a BPE tokenizes
    numbers to varying lengths."""

    def encode(self, text):
        out = []
        for ch in text:
            out += [ord(ch), 1, 2] if ch in "012345678" else [ord(ch) % 256]
        return out


def test_a_cell_whose_drawn_numbers_do_not_fit_is_skipped_not_fatal():
    """min_length estimates a needle with the number '99...9'; a tokenizer that tokenizes other numbers longer
    (a BPE does), so at a length just above the estimate a drawn sample may not fit.  That aborted the whole
    evaluation with a DataError; the cell is now listed in ``skipped`` (as documented) and the others run."""
    tok = _NinesShort()
    b = NiahBuilder(tok, text=haystack_text())
    need = b.min_length(1, 1)
    model = tiny_model("diff")
    r = evaluate_niah(model, tok, grid="N1R1", lengths=[need, 256], depths=[0.5], samples=8, text=haystack_text(),
                      generation=False)
    assert [c["length"] for c in r["cells"]] == [256]
    assert [(s["length"], "do not fit" in s["reason"]) for s in r["skipped"]] == [(need, True)]


@pytest.fixture(scope="module")
def gpt2_style_bpe():
    """A byte-level BPE with GPT-2's pre-tokenisation (a word's leading space belongs to it: ' 37', ' The')."""
    pytest.importorskip("tokenizers")
    from difftx.data.tokenizers import train_bpe
    from difftx.evals.niah import CITIES

    text = haystack_text() + " The special magic number for Paris is: 12345. 67890 37704" * 4 + " ".join(CITIES)
    return train_bpe([text], vocab_size=600)


@pytest.mark.parametrize("template", ["paper", "short"])
def test_a_bpe_sample_is_its_text_encoded_whole(gpt2_style_bpe, template):
    """Pieces were encoded with their trailing whitespace ('... is: ' + '37704' + '. '), so a GPT-2-style BPE gave
    the needle ' ', '3', '7', ... where the text has ' 37', '7', ... (the answer after the query), and every sentence
    a lone ' ' token before its 'The'.  From the answer needle on, the sample is now exactly the encoding of its
    text, so each scored answer is the tokens that follow its prompt and the needle holds the same tokens."""
    tok = gpt2_style_bpe
    b = NiahBuilder(tok, text=haystack_text(), template=template)
    for k, depth in enumerate([0.0, 0.5, 1.0]):
        s = b.sample(rng_for(11, k), 420, 3, 2, depth=depth)
        start = s.regions.index(ANSWER_NEEDLE)
        assert tok.encode(tok.decode(s.ids[start:])) == s.ids[start:]
        for (a, e), number in zip(s.answers, s.numbers):
            assert tok.decode(s.ids[a:e]).strip() == number
            assert tok.encode(tok.decode(s.ids[start:e]))[-(e - a):] == s.ids[a:e]
        a, e = s.answers[0]
        assert [t for t, g in zip(s.ids, s.regions) if g == ANSWER] == s.ids[a:e]  # the needle's number = the answer


def test_lengths_all_past_learned_positions_name_the_limit_not_longer_lengths():
    """--lengths 1000 on a model whose learned positions end at 256 said 'pass longer --lengths'; now the fix is
    --lengths up to max_seq_len.  Too short lengths still ask for longer ones."""
    from difftx.errors import DataError

    model, tok = tiny_model("diff", positions="learned"), ByteTokenizer()
    with pytest.raises(DataError, match=r"longer than max_seq_len=256 .*; pass --lengths up to 256$"):
        evaluate_niah(model, tok, lengths=[1000], grid="N1R1", samples=1, text=haystack_text())
    with pytest.raises(DataError, match="pass longer --lengths"):
        evaluate_niah(model, tok, lengths=[40], grid="N1R1", samples=1, text=haystack_text())


def test_generation_score_at_the_learned_position_limit_does_not_depend_on_the_batch():
    """With learned positions a batch's new tokens were capped by its longest prompt, so a short prompt batched
    with one near max_seq_len was read for fewer tokens, and scored differently, than alone."""
    b = NiahBuilder(TOK, text=haystack_text(), digits=5)
    short, long = b.sample(rng_for(6, 0), 200, 1, 1, depth=0.5), b.sample(rng_for(6, 1), 300, 1, 1, depth=0.5)
    oracle = RetrievalOracle()
    oracle.config = SimpleNamespace(n_heads=1, vocab_size=256, positions="learned",
                                    max_seq_len=long.answers[0][0] + 1)  # room for one new token after the long one
    alone = score_generation(oracle, TOK, [short, long], 1)
    assert alone == [[True], [False]]
    assert score_generation(oracle, TOK, [short, long], 2) == alone


def test_niah_task_names_the_flag_its_caller_gives():
    """The too-short message said "raise --seq-len" to every caller: difftx compare's flag is --retrieval-seq-len."""
    with pytest.raises(ConfigError, match="raise --seq-len"):  # difftx train --task niah: its own flag
        get_task("niah")(ByteTokenizer(), 64, 0, template="short", digits=2, needles="1-4")
    with pytest.raises(ConfigError, match="raise --retrieval-seq-len to 118"):
        get_task("niah")(ByteTokenizer(), 64, 0, template="short", digits=2, needles="1-4",
                         seq_len_flag="--retrieval-seq-len")


def test_a_cells_samples_do_not_depend_on_the_other_cells_asked_for(monkeypatch):
    """A cell's samples were drawn from its positions in --grid, --lengths and --depths, so N2R2 at 256 tokens and
    50% depth got other needles and haystacks alone than beside N1R1, 300 tokens or 0% (its number could not be
    reproduced by asking for that cell): they are now a function of (seed, N, R, length, depth, sample)."""
    drawn = []
    sample = NiahBuilder.sample

    def recording(self, rng, length, needles, queries, depth=None):
        s = sample(self, rng, length, needles, queries, depth)
        drawn.append(((needles, queries, length, depth), tuple(s.ids)))
        return s

    monkeypatch.setattr(NiahBuilder, "sample", recording)
    model = tiny_model("softmax")

    def cell(**kw):
        drawn.clear()
        evaluate_niah(model, TOK, samples=2, text=haystack_text(), seed=3, generation=False, **kw)
        return sorted(ids for key, ids in drawn if key == (2, 2, 256, 0.5))

    alone = cell(grid="N2R2", lengths=[256], depths=[0.5])
    assert len(alone) == 2
    assert cell(grid="N1R1,N2R2", lengths=[256, 300], depths=[0.0, 0.5]) == alone
