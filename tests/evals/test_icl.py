"""In-context classification: solvable synthetic tasks, arrangements, constrained decoding against a reference."""

import json
from collections import Counter

import pytest
import torch

from difftx.data import ByteTokenizer
from difftx.errors import DataError
from difftx.evals.icl import (LabelTrie, PromptBuilder, arrange, balanced_demos, constrained_classify, evaluate_icl,
                              jsonl_task, synthetic_task)
from evals_helpers import tiny_model

TOK = ByteTokenizer()


@pytest.mark.parametrize("classes", [6, 50, 150])
def test_synthetic_task_is_solvable_from_demonstrations(classes):
    t = synthetic_task(classes, n_train_per_class=4, n_test=40)
    assert len(set(t.labels)) == classes and len(t.train) == 4 * classes
    assert t.labels == synthetic_task(classes, n_train_per_class=4, n_test=40).labels  # fixed by its seed
    # a word -> label lookup learnt from the training examples classifies every test input
    votes: dict = {}
    for ex in t.train:
        for w in ex.text.split():
            votes.setdefault(w, Counter())[ex.label] += 1
    keyword = {w: c.most_common(1)[0][0] for w, c in votes.items() if len(c) == 1}
    for ex in t.test:
        guess = Counter(keyword[w] for w in ex.text.split() if w in keyword)
        assert guess.most_common(1)[0][0] == ex.label


def test_demonstrations_balanced_and_arrangements():
    t = synthetic_task(6, n_train_per_class=8)
    demos = balanced_demos(t, 14, seed=0)
    counts = Counter(d.label for d in demos)
    assert len(counts) == 6 and max(counts.values()) - min(counts.values()) <= 1
    assert balanced_demos(t, 14, seed=0) == demos
    for s in range(3):
        r = arrange(demos, "random", s)
        assert sorted(map(id, r)) == sorted(map(id, demos))
        a = arrange(demos[:12], "alternating", s)
        labels = [d.label for d in a]
        assert len(set(labels[:6])) == 6 and len(set(labels[6:])) == 6 and labels[:6] == labels[6:]
    assert arrange(demos, "random", 0) != arrange(demos, "random", 1)


def _reference_decode(model, prompt, trie):
    """Greedy trie decoding with full recomputation (no cache) -- the independent reference."""
    node, seq = trie.root, list(prompt)
    while len(node["labels"]) > 1:
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0, -1]
        allowed = list(node["children"])
        best = allowed[int(logits[allowed].argmax())]
        node, seq = node["children"][best], seq + [best]
    return next(iter(node["labels"]))


@pytest.mark.parametrize("kind", ["softmax", "diff"])
def test_constrained_decoding_with_shared_prefix_matches_reference(kind):
    model = tiny_model(kind)
    t = synthetic_task(6, n_train_per_class=4, n_test=10)
    pb = PromptBuilder(TOK, t)
    prefix = [x for ex in t.train[:5] for x in pb.demo(ex)]
    queries = [pb.query(ex) for ex in t.test]
    got = constrained_classify(model, prefix, queries, pb.trie, batch_size=4)
    want = [_reference_decode(model, prefix + q, pb.trie) for q in queries]
    assert got == want
    assert constrained_classify(model, [], [prefix + q for q in queries], pb.trie, batch_size=3) == want


def test_label_trie_rejects_duplicates():
    with pytest.raises(DataError):
        LabelTrie([[1, 2], [1, 2]])


def test_evaluate_icl_statistics(tmp_path):
    model = tiny_model("diff")
    r = evaluate_icl(model, TOK, tasks=["synthetic-6"], shots=[1, 4, 10_000], seeds=3, test_examples=6, max_len=300)
    t = r["tasks"][0]
    assert [p["shots"] for p in t["curves"]["random"]] == [1, 4] and t["skipped"][0]["shots"] == 10_000
    for pts in t["curves"].values():
        for p in pts:
            assert len(p["accuracies"]) == 3
            assert p["worst"] <= p["mean"] <= p["best"] and p["margin"] == pytest.approx(p["best"] - p["worst"])
    assert 0 <= r["overall_accuracy"] <= 1


def test_jsonl_task(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"text": f"item {i}", "label": ["pos", "neg"][i % 2]}) for i in range(30)))
    t = jsonl_task(f, n_test=6)
    assert t.labels == ["neg", "pos"] and len(t.test) == 6 and len(t.train) == 24
    f.write_text('{"text": "x"}\n')
    with pytest.raises(DataError, match=":1: expected"):
        jsonl_task(f)


def test_non_utf8_jsonl_is_one_line(checkpoint, tmp_path, capsys):
    """A JSONL task file that is not UTF-8 was a UnicodeDecodeError traceback; now a DataError (exit 2, one line)."""
    from difftx.cli import main

    f = tmp_path / "bad.jsonl"
    f.write_bytes(b'{"text": "caf\xe9", "label": "x"}\n')
    with pytest.raises(DataError, match="not UTF-8"):
        jsonl_task(f)
    rc = main(["eval", "icl", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "o"), "--tasks", str(f),
               "--no-plot", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "not UTF-8" in err[0] and err[0].startswith("difftx eval")


def test_a_single_task_or_arrangement_may_be_a_string():
    """tasks='synthetic-6' (as --metric-opt tasks=synthetic-6 passes it) was iterated character by character:
    "'s' is neither synthetic-<classes> nor a JSONL file"; arrangements='random' likewise ("got 'r'")."""
    r = evaluate_icl(tiny_model("diff"), TOK, tasks="synthetic-6", arrangements="random", shots=[1], seeds=1,
                     test_examples=2)
    assert [t["task"] for t in r["tasks"]] == ["synthetic-6"] and list(r["tasks"][0]["curves"]) == ["random"]


def test_max_len_past_learned_positions_is_refused_not_cut():
    """--max-len 1000 on a model whose learned positions end at 256 was silently cut to 256 (as --length of the
    attention evaluation is refused); now one ConfigError naming the limit.  Up to the limit it is read as given."""
    from difftx.errors import ConfigError

    model, tok = tiny_model("diff", positions="learned"), ByteTokenizer()
    with pytest.raises(ConfigError, match=r"max_len: 1000 exceeds max_seq_len=256 .*--max-len up to 256"):
        evaluate_icl(model, tok, shots=[1], seeds=1, test_examples=2, max_len=1000)
    with pytest.raises(ConfigError, match="max_len: must be an integer"):
        evaluate_icl(model, tok, shots=[1], seeds=1, test_examples=2, max_len=200.5)
    r = evaluate_icl(model, tok, shots=[1], seeds=1, test_examples=2, max_len=200)
    assert r["tasks"][0]["max_shots_that_fit"] >= 1


def test_zero_shots_whose_test_input_passes_max_len_are_refused(tmp_path):
    """0 shots always 'fit' (fit >= 0), so --shots 0 ran prompts longer than --max-len (a RoPE model: silently; learned
    positions: the model's own error, naming no flag); now one DataError with the tokens needed and the fix."""
    f = tmp_path / "long.jsonl"
    f.write_text("\n".join(json.dumps({"text": "word " * 20 + str(i), "label": ["pos", "neg"][i % 2]})
                           for i in range(12)))
    need = max(len(TOK.encode(f"Input: {'word ' * 20}{i}\nLabel:")) for i in range(12)) + len(TOK.encode(" pos\n"))
    with pytest.raises(DataError, match=f"take {need} tokens, more than the prompt limit of 50 .*"
                                        f"pass --max-len {need} or more"):
        evaluate_icl(tiny_model("diff"), TOK, tasks=[str(f)], shots=[0], seeds=1, test_examples=4, max_len=50)
    with pytest.raises(DataError, match="positions end at 64"):
        evaluate_icl(tiny_model("diff", positions="learned", max_seq_len=64), TOK, tasks=[str(f)], shots=[0], seeds=1,
                     test_examples=4)
    r = evaluate_icl(tiny_model("diff"), TOK, tasks=[str(f)], shots=[0], seeds=1, test_examples=4, max_len=need)
    assert [p["shots"] for p in r["tasks"][0]["curves"]["random"]] == [0]


@pytest.mark.parametrize("option, value, needle", [
    ("seeds", 10 ** 12, "seeds: at most 10,000 demonstration orders"),  # ran for ever, a forward per order
    ("test_examples", 10 ** 8, "test_examples: at most 100,000 test examples"),  # fit the memory: ran for hours
    ("test_examples", 10 ** 12, "test_examples: at most 100,000 test examples"),  # MemoryError without the check
])
def test_absurd_counts_are_refused_before_anything_is_built(option, value, needle, monkeypatch):
    """--seeds 10**12 ran for ever and --test-examples 10**8 (it passes the memory check) for hours; with
    DIFFTX_MEMORY_CHECK=0 --test-examples 10**12 died with numpy's ArrayMemoryError.  One ConfigError now, naming the
    limit and the flag, before a task is built; the limit itself is accepted."""
    import difftx.evals.icl as icl
    from difftx.errors import ConfigError

    class Started(Exception):
        pass

    def started(*a, **k):
        raise Started

    monkeypatch.setenv("DIFFTX_MEMORY_CHECK", "0")
    monkeypatch.setattr(icl, "resolve_task", started)
    model = tiny_model("diff")
    flag = "--" + option.replace("_", "-")
    with pytest.raises(ConfigError, match=needle + f".*got {value:,}; pass fewer {flag}"):
        evaluate_icl(model, TOK, shots=[1], **{option: value})
    with pytest.raises(Started):  # the limit is no refusal
        evaluate_icl(model, TOK, shots=[1], **{option: 10_000 if option == "seeds" else 100_000})


def test_absurd_counts_on_the_command_line_are_one_line(checkpoint, tmp_path, capsys, monkeypatch):
    """The same through difftx eval: exit 2, one line naming the flag; the earlier result stays."""
    import difftx.evals.icl as icl
    from difftx.cli import main

    monkeypatch.setattr(icl, "resolve_task", lambda *a, **k: pytest.fail("the evaluation started"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "icl.json").write_text("keep me")
    for flag in ("--seeds", "--test-examples"):
        rc = main(["eval", "icl", "--checkpoint", str(checkpoint), "--out", str(out), flag, str(10 ** 12),
                   "--force", "--quiet", "--no-plot"])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith("difftx eval: error:") and flag in err[0], err
        assert "at most" in err[0] and (out / "icl.json").read_text() == "keep me"
