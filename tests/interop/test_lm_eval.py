"""The lm-evaluation-harness adapter: request semantics against direct computations.

The numerics are tested with plain request objects (lm-eval not needed); the
tests at the end use the real harness (``Instance``, a local task run end to end,
no downloads) and skip when lm-eval is not installed (it is in the ``eval``
extra, not in ``dev``: it pulls pandas, pyarrow, datasets and nltk).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from difftx.data.tokenizers import ByteTokenizer
from difftx.errors import DifftxError
from difftx.interop import lm_eval as adapter
from difftx.interop.lm_eval import DifftxLM
from .hf_helpers import difftx_model


@pytest.fixture(scope="module")
def lm():
    model = difftx_model(seed=5, attention="diff", n_heads=2, vocab_size=256, max_seq_len=64)
    return DifftxLM(model, ByteTokenizer(), batch_size=3)


def req(*args):
    return SimpleNamespace(args=args)


def direct_logprob(model, ids: list[int], start: int) -> float:
    """sum_{t >= start} log p(ids[t] | ids[:t]) from one forward pass."""
    x = torch.tensor([ids])
    with torch.no_grad():
        logp = F.log_softmax(model(x[:, :-1]).logits.float(), -1)[0]
    return float(sum(logp[t - 1, ids[t]] for t in range(start, len(ids))))


def test_loglikelihood_matches_a_direct_computation(lm):
    pairs = [("The cat", " sat"), ("The cat ", "sat"), ("x", "yz and more"), ("Hello, world", "!")]
    got = lm.loglikelihood([req(c, k) for c, k in pairs])
    for (context, cont), (lp, _) in zip(pairs, got):
        ids = list((context + cont).encode())
        split = len(context.rstrip().encode())  # trailing spaces move to the continuation
        assert abs(lp - direct_logprob(lm.model, ids, split)) < 1e-4
    assert abs(got[0][0] - got[1][0]) < 1e-5


def test_batching_and_order_do_not_change_results(lm):
    requests = [req("a" * n, "bc") for n in (1, 9, 4, 17, 2)]
    single = DifftxLM(lm.model, lm.tokenizer, batch_size=1).loglikelihood(requests)
    batched = lm.loglikelihood(requests)
    assert all(abs(a[0] - b[0]) < 1e-5 and a[1] == b[1] for a, b in zip(single, batched))


def test_is_greedy(lm):
    prompt = list(b"To be or")
    greedy = lm.model.generate(torch.tensor([prompt]), max_new_tokens=5, temperature=0)[0, len(prompt):].tolist()
    other = greedy[:-1] + [(greedy[-1] + 1) % 256]
    (_, yes), (_, no) = lm._score([(prompt, greedy), (prompt, other)])
    assert yes and not no


def test_long_contexts_are_cut_from_the_left(lm):
    short = DifftxLM(lm.model, lm.tokenizer, max_length=8)
    context, cont = "abcdefghijklmnop", "qr"
    ids = list((context + cont).encode())
    (lp, _), = short.loglikelihood([req(context, cont)])
    window = ids[-9:]  # 8 inputs predict the last 8 tokens; the continuation is the last 2
    assert abs(lp - direct_logprob(lm.model, window, len(window) - 2)) < 1e-4


def test_rolling_equals_the_full_sum_when_it_fits(lm):
    text = "All the world's a stage"
    ids = list(text.encode())
    (total,) = lm.loglikelihood_rolling([req(text)])
    assert abs(total - direct_logprob(lm.model, ids, 1)) < 1e-4  # byte tokenizer: no prefix token


@pytest.mark.parametrize("n,max_length", [(1, 4), (5, 4), (23, 4), (24, 8), (30, 7)])
def test_rolling_windows_score_every_token_once(lm, n, max_length):
    short = DifftxLM(lm.model, lm.tokenizer, max_length=max_length, prefix_token_id=0)
    toks = list(range(1, n + 1))
    windows = short.rolling_windows(toks)
    assert [t for _, pred in windows for t in pred] == toks
    for ctx, pred in windows:
        inputs = (ctx + pred)[-(max_length + 1):][:-1]
        assert len(inputs) <= max_length
        full = [0] + toks  # the inputs are the tokens right before each prediction
        end = full.index(pred[-1], 1) if pred else 0
        assert inputs == full[end - len(inputs):end]


def test_rolling_windows_match_the_harness():
    utils = pytest.importorskip("lm_eval.utils")
    model = difftx_model(vocab_size=256)
    for n, L in ((1, 4), (23, 4), (30, 7), (16, 16)):
        toks = list(range(1, n + 1))
        ours = DifftxLM(model, ByteTokenizer(), max_length=L, prefix_token_id=0).rolling_windows(toks)
        theirs = [utils.make_disjoint_window(w) for w in utils.get_rolling_token_windows(toks, 0, L, 1)]
        assert ours == [tuple(w) for w in theirs]


def test_generate_until(lm):
    prompt = "Once upon"
    ids = lm.model.generate(torch.tensor([list(prompt.encode())]), max_new_tokens=12, temperature=0)[0]
    full = ByteTokenizer().decode(ids[len(prompt):].tolist())
    cut = full[3:5] if len(full) > 5 else None
    (text,) = lm.generate_until([req(prompt, {"until": [cut] if cut else [], "max_gen_toks": 12})])
    assert text == (full[:full.index(cut)] if cut else full)


def test_empty_context_needs_a_prefix_token(lm):
    with pytest.raises(DifftxError, match="prefix token"):
        lm.loglikelihood([req("", "abc")])
    with_prefix = DifftxLM(lm.model, lm.tokenizer, prefix_token_id=10)
    (lp, _), = with_prefix.loglikelihood([req("", "abc")])
    assert abs(lp - direct_logprob(lm.model, [10] + list(b"abc"), 1)) < 1e-4


@pytest.mark.parametrize("vocab, prefix", [
    ({"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3}, 1),  # Llama-style: BOS, as the harness's HF model
    ({"[UNK]": 0, "<|endoftext|>": 1, "hello": 2}, 1),  # GPT-2-style: no BOS, EOS
])
def test_rolling_prefix_is_bos_where_the_tokenizer_has_one_else_eos(lm, vocab, prefix):
    tokenizers = pytest.importorskip("tokenizers")
    from difftx.data.tokenizers import HFTokenizer

    tok = HFTokenizer(tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]")))
    assert DifftxLM(lm.model, tok).prefix_token_id == prefix
    assert DifftxLM(lm.model, tok, prefix_token_id=0).prefix_token_id == 0


def test_run_lm_eval_without_the_harness_is_one_clear_error(monkeypatch, lm):
    monkeypatch.setattr(adapter, "HAVE_LM_EVAL", False)
    with pytest.raises(DifftxError, match="pip install"):
        adapter.run_lm_eval(lm.model, ["x"], tokenizer=ByteTokenizer())


# ---------------------------------------------------------------------- with the real harness
TASK_YAML = """task: difftx_local_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def test_harness_instances(lm):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.api.model import LM

    assert isinstance(lm, LM)
    inst = Instance(request_type="loglikelihood", doc={}, arguments=("The cat", " sat"), idx=0)
    assert lm.loglikelihood([inst]) == lm.loglikelihood([req("The cat", " sat")])
    inst = Instance(request_type="generate_until", doc={}, arguments=("Once", {"until": ["\n"], "max_gen_toks": 4}),
                    idx=0)
    assert lm.generate_until([inst]) == lm.generate_until([req("Once", {"until": ["\n"], "max_gen_toks": 4})])


@pytest.mark.slow
def test_a_local_task_end_to_end(tmp_path, lm):
    """run_lm_eval on a task defined here (JSON data on disk, nothing downloaded): accuracy as computed by hand."""
    pytest.importorskip("lm_eval")
    import json

    from lm_eval.tasks import TaskManager

    rows = [{"question": f"{a} plus {b} is", "choices": [f" {a + b}", f" {a + b + 1}"], "answer": 0}
            for a, b in ((1, 2), (3, 4), (2, 2))]
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "task.yaml").write_text(TASK_YAML.format(data=data))
    out = tmp_path / "lm-eval.json"
    result = adapter.run_lm_eval(lm.model, "difftx_local_choice", tokenizer=ByteTokenizer(), out=out,
                                 task_manager=TaskManager(include_path=str(tmp_path)))
    acc = result["results"]["difftx_local_choice"]["acc,none"]
    expected = sum(lp[0] > lp2[0] for lp, lp2 in (
        lm.loglikelihood([req(r["question"], r["choices"][0]), req(r["question"], r["choices"][1])])
        for r in rows)) / len(rows)
    assert acc == pytest.approx(expected)
    assert json.loads(out.read_text())["results"]["difftx_local_choice"]["acc,none"] == acc


def test_a_whitespace_only_context_is_scored_like_an_empty_one(lm):
    """The whitespace moves to the continuation, leaving no context tokens: that was a RuntimeError from
    gather (the continuation had no position to be predicted from); now it is conditioned on the prefix token
    like an empty context, and without one it is the same clear error."""
    with pytest.raises(DifftxError, match="prefix token"):
        lm.loglikelihood([req("  ", "abc")])
    with_prefix = DifftxLM(lm.model, lm.tokenizer, prefix_token_id=10)
    (lp, _), (lp2, _) = with_prefix.loglikelihood([req("  ", "abc"), req("hello", " world")])
    assert abs(lp - direct_logprob(lm.model, [10] + list(b"  abc"), 1)) < 1e-4
    assert abs(lp2 - direct_logprob(lm.model, list(b"hello world"), 5)) < 1e-4


def test_the_tokenizer_of_a_hugging_face_export_is_found(tmp_path):
    """run_lm_eval reads the tokenizer saved with a model: a Hugging Face export keeps difftx's byte / char
    tokenizer as difftx_tokenizer.json (it was 'no tokenizer.json'), and a damaged tokenizer.json is one
    DataError (the fallback re-read it with the tokenizers library and raised its bare Exception)."""
    import difftx
    from difftx.errors import DataError
    from difftx.interop.convert import convert

    model = difftx_model(attention="softmax", n_heads=4, vocab_size=256)
    difftx.save_model(model, tmp_path / "m")
    ByteTokenizer().save(tmp_path / "m")
    convert(tmp_path / "m", tmp_path / "hf", dst_format="hf-difftx")
    assert isinstance(adapter._tokenizer_for(tmp_path / "hf"), ByteTokenizer)
    assert isinstance(adapter._tokenizer_for(tmp_path / "m"), ByteTokenizer)
    (tmp_path / "m" / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 5}}')
    with pytest.raises(DataError, match="tokenizer.json"):
        adapter._tokenizer_for(tmp_path / "m")
