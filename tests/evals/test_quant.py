"""Attention-logit quantization: the absmax grid, 16 bits equal to none, composition with other probes."""

import pytest
import torch

from difftx.data import ByteTokenizer
from difftx.evals.common import attach
from difftx.evals.lm import evaluate_lm
from difftx.evals.quant import LogitQuantizer, absmax_quantize, evaluate_quant, quantized_logits
from difftx.nn.probe import AttentionProbe
from evals_helpers import tiny_model


@pytest.mark.parametrize("bits", [4, 6, 8, 16])
@pytest.mark.parametrize("granularity", ["head", "row", "tensor"])
@pytest.mark.parametrize("causal", [False, True])
def test_absmax_grid(bits, granularity, causal):
    x = torch.randn(2, 3, 5, 7) * 4
    q = absmax_quantize(x, bits, granularity, causal=causal)
    qmax = 2 ** (bits - 1) - 1

    def scales_of(t):  # the absmax each entry's row is scaled by, (B|1, H|1, 5, 1)
        rows = t.abs().amax(dim=-1, keepdim=True)
        if granularity == "row":
            return rows
        if granularity == "tensor":
            rows = rows.amax(dim=(0, 1), keepdim=True)
        if not causal:
            return rows.amax(dim=-2, keepdim=True).expand_as(rows)
        return torch.stack([rows[..., : i + 1, :].amax(dim=-2) for i in range(rows.shape[-2])], dim=-2)

    amax = scales_of(x)
    scale = amax / qmax
    levels = q / scale
    assert torch.allclose(levels, levels.round(), atol=1e-3)  # on the integer grid
    assert (levels.abs() <= qmax + 1e-3).all()
    assert ((q - x).abs() <= scale / 2 + 1e-6).all()  # round to nearest
    assert torch.allclose(scales_of(q), amax)  # the absmax survives exactly


@pytest.mark.parametrize("granularity", ["head", "row", "tensor"])
def test_quantized_logits_stay_causal_and_ignore_left_padding(granularity):
    """No prediction depends on a later token, and left padding (whatever its ids) changes no real position's
    logits: before, a map's scale covered later rows and padded keys."""
    model = tiny_model("diff")
    with torch.no_grad():
        for m in model.attention_modules():
            m.q_proj.weight.mul_(30.0)  # logits of size ~10: 4 bits is coarse
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(1, 256, (1, 30), generator=gen)
    with quantized_logits(model, 4, granularity), torch.no_grad():
        full = model(x).logits
        assert (model(x[:, :20]).logits - full[:, :20]).abs().max() < 1e-4
        for pad_id in (0, 7):
            padded = torch.cat((torch.full((1, 10), pad_id), x), dim=1)
            mask = torch.cat((torch.zeros(1, 10), torch.ones(1, 30)), dim=1)
            assert (model(padded, attention_mask=mask).logits[:, 10:] - full).abs().max() < 1e-4
    with torch.no_grad():
        assert (model(x).logits - full).abs().max() > 1e-2  # 4 bits did change the logits


@pytest.mark.parametrize("kind", ["softmax", "diff"])
def test_left_padding_after_a_cached_prefix_sets_no_scale(kind):
    """ICL's queries are left-padded after the demonstrations' KV cache: a padding query row may attend to the
    cached prefix, and its logits there set the head scale of the real rows after it, so a query's quantized
    logits changed with the longest query in its batch (--batch-size).  Padding rows now set no scale."""
    from difftx.evals.common import pad_left
    from difftx.evals.icl import _repeat_cache

    model = tiny_model(kind)
    with torch.no_grad():
        for m in model.attention_modules():
            m.q_proj.weight.mul_(30.0)
        model.embed.weight[0].mul_(20.0)  # the padding id's queries: large logits against the prefix
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(1, 256, (1, 30), generator=gen)
    short, long = (torch.randint(1, 256, (n,), generator=gen).tolist() for n in (6, 14))
    with quantized_logits(model, 4, "head"), torch.no_grad():
        cache = model.new_cache(1, 60)
        model.features(prefix, cache=cache)
        alone = model(torch.tensor([short]), cache=_repeat_cache(cache, 1, lambda b: model.new_cache(b, 60))).logits
        ids, mask = pad_left([short, long])
        both = model(ids, attention_mask=mask, cache=_repeat_cache(cache, 2, lambda b: model.new_cache(b, 60))).logits
    assert (both[:1, -len(short):] - alone).abs().max() < 1e-4


def test_masked_entries_do_not_set_the_scale():
    x = torch.tensor([[[[1.0, 100.0], [1.0, 0.5]]]])  # the 100 sits above the diagonal (a future key)
    valid = torch.tensor([[True, False], [True, True]])
    q = absmax_quantize(x, 4, "head", valid)
    assert q[0, 0, 0, 0] == 1.0 and q[0, 0, 1, 1] == pytest.approx(3 / 7)  # scale 1/7, not 100/7


@pytest.mark.parametrize("kind", ["softmax", "diff", "diff2"])
def test_16_bits_equals_none_and_4_bits_does_not(kind):
    """Stated tolerance: at 16 bits each logit moves by <= max|logit| / 65534, so the model's output logits stay
    within 1e-4 of the unquantized ones (measured ~1e-5) and the loss within 1e-4; 4 bits moves them > 1e-2."""
    model = tiny_model(kind)
    with torch.no_grad():
        for m in model.attention_modules():
            m.q_proj.weight.mul_(30.0)  # attention logits of size ~10 so that coarse grids matter
    tokens = torch.randint(0, 256, (4 * 64 + 1,), generator=torch.Generator().manual_seed(0))
    x = tokens[:256].view(4, 64)
    with torch.no_grad():
        base_logits = model(x).logits
        base = evaluate_lm(model, tokens, seq_len=64, max_tokens=256)["loss"]
        with quantized_logits(model, 16):
            q16_logits = model(x).logits
            q16 = evaluate_lm(model, tokens, seq_len=64, max_tokens=256)["loss"]
        with quantized_logits(model, 4):
            q4_logits = model(x).logits
    assert (q16_logits - base_logits).abs().max() < 1e-4
    assert abs(q16 - base) < 1e-4
    assert (q4_logits - base_logits).abs().max() > 1e-2
    assert all(m.probe is None for m in model.attention_modules())  # nothing left attached


class Record(AttentionProbe):
    def __init__(self):
        self.logits = []

    def observe(self, layer, logits, effective, mask):
        self.logits += logits


def test_probes_inside_see_quantized_logits():
    model = tiny_model("diff")
    rec = Record()
    with quantized_logits(model, 4, "head"), attach(model, rec), torch.no_grad():
        model(torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0)))
    assert len(rec.logits) == 2 * 2  # 2 layers x 2 maps
    for lg in rec.logits:
        rows = lg.masked_fill(~torch.ones(16, 16, dtype=torch.bool).tril(), 0)[0, 0]
        assert max(len(torch.unique(r)) for r in rows) <= 2 ** 4 - 1  # at most 15 levels in a row
        assert len(torch.unique(rows[-1])) > 3  # and quantized, not flattened


def test_quantizer_rejects_bad_settings():
    with pytest.raises(ValueError):
        LogitQuantizer(1)
    with pytest.raises(ValueError):
        LogitQuantizer(8, "block")


@pytest.mark.parametrize("granularity", ["block", "HEAD", None])
def test_evaluate_quant_checks_its_granularity_before_running_the_baseline(granularity, monkeypatch):
    """A bad granularity was found only at the first quantized row, after the unquantized metric had run in full
    (minutes on a real model), and the error named quant_granularity, not the argument.  Now refused first."""
    import difftx.evals.quant as quant
    from difftx.errors import ConfigError

    runs = []
    monkeypatch.setattr(quant, "_metric_fn", lambda metric: lambda model, tok, **o: runs.append(o) or ("m", 1.0, True))
    with pytest.raises(ConfigError, match=r"^granularity: must be one of \('head', 'row', 'tensor'\)"):
        evaluate_quant(tiny_model("softmax"), ByteTokenizer(), bits=[8], granularity=granularity, metric="lm")
    assert runs == []
    r = evaluate_quant(tiny_model("softmax"), ByteTokenizer(), bits=[8], granularity="row", metric="lm")
    assert [x["bits"] for x in r["rows"]] == [None, 8] and len(runs) == 2 and r["granularity"] == "row"


def test_evaluate_quant_rows():
    model = tiny_model("softmax")
    r = evaluate_quant(model, ByteTokenizer(), bits=[16, 4], metric="lm",
                       metric_options={"text": "hello world. " * 60, "max_tokens": 128, "seq_len": 64})
    assert [x["bits"] for x in r["rows"]] == [None, 16, 4]
    assert r["rows"][0]["delta"] == 0.0 and abs(r["rows"][1]["delta"]) < 1e-4


def test_evaluate_quant_with_another_evaluation_as_metric():
    r = evaluate_quant(tiny_model("diff"), ByteTokenizer(), bits=[8], metric="mqar",
                       metric_options={"lengths": [32], "pairs": [4], "samples": 4})
    assert r["metric"] == "mqar_accuracy" and r["higher_is_better"] is True
    assert [x["bits"] for x in r["rows"]] == [None, 8] and all(0 <= x["value"] <= 1 for x in r["rows"])


@pytest.mark.parametrize("metric, opt, message", [
    ("niah", "lengths=128,256", "lengths"),        # not JSON: a string; was ValueError: invalid literal for int()
    ("niah", "samples=0", "samples"),              # was a quant.json with every value null
    ("niah", "depths=[50]", "depths"),             # percents: was silently depth 100% recorded as 50.0
    ("lm", "seq_len=abc", "seq_len"),              # was ValueError traceback
    ("lm", "max_tokens=1e3", "max_tokens"),        # a float: was TypeError traceback (slice indices)
    ("mqar", "samples=0", "samples"),              # was ValueError: not enough values to unpack
    ("mqar", "pairs=[]", "pairs"),                 # was IndexError traceback
    ("icl", "seeds=0", "seeds"),                   # was ZeroDivisionError traceback
    ("icl", "test_examples=0", "test_examples"),   # was ValueError: max() arg is an empty sequence
    ("icl", "shots=[-1]", "shots"),                # was pool[:-1]: every demonstration but one, past max_len
])
def test_bad_metric_options_are_one_line(metric, opt, message, checkpoint, tmp_path, capsys):
    from difftx.cli import main

    rc = main(["eval", "quant", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "o"), "--bits", "8",
               "--metric", metric, "--metric-opt", opt, "--no-plot", "--quiet",
               *(["--data", str(checkpoint / "haystack.txt")] if metric in ("lm", "niah") else [])])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("difftx eval") and message in err[0]
    assert not (tmp_path / "o" / "quant.json").exists()


@pytest.mark.parametrize("metric, opt, flags, message", [
    ("lm", "data=0", [], "data: must be the path"),             # was TypeError traceback (Path(0))
    ("lm", 'data=""', [], "data: must be the path"),            # was the current directory read as the corpus
    ("lm", "text=0", [], "text: must be the evaluation text"),  # was TypeError traceback (slicing an int)
    ("niah", "grid=0", [], "grid: must be cells"),              # was TypeError: 'int' object is not iterable
    ("niah", "grid=[1]", [], "grid: must be cells"),            # was TypeError: cannot unpack
    ("niah", "seed=null", [], "seed: must be an integer"),      # was TypeError traceback in rng_for
    ("niah", 'generation="no"', [], "generation: must be true or false"),  # was read as true
    ("niah", 'digits="x"', [], "digits: must be an integer"),   # was ValueError traceback
    ("niah", "template=[]", [], "template"),                    # was TypeError: unhashable type: 'list'
    ("mqar", 'seed="x"', [], "seed: must be an integer"),       # was ValueError traceback
    ("mqar", "random_non_queries=1", [], "random_non_queries: must be true or false"),
    ("icl", "seed=1e308", [], "seed: must be an integer"),      # was OverflowError traceback
    ("icl", "arrangements=1", [], "arrangements: must be a name or a list"),  # was TypeError traceback
    ("lm", "model=0", [], "--metric-opt: model is --checkpoint's own"),      # was TypeError: multiple values
    ("icl", "tokenizer=0", [], "--metric-opt: tokenizer is --checkpoint's own"),
    # the same setting given twice: the --metric-opt value silently won over the option
    ("mqar", "seed=4", ["--seed", "3"], "seed= and --seed both set"),
    ("lm", "max_tokens=100", ["--max-tokens", "256"], "max_tokens= and --max-tokens both set"),
    ("lm", "data=null", ["--data", "{haystack}"], "data= and --data both set"),
    ("lm", 'text="hello world"', ["--data", "{haystack}"], "text= and --data both set"),
    ("icl", "batch_size=2", ["--batch-size", "4"], "batch_size= and --batch-size both set"),
])
def test_metric_options_of_the_wrong_type_or_set_twice_are_one_line(metric, opt, flags, message, checkpoint,
                                                                      tmp_path, capsys):
    from difftx.cli import main

    flags = [f.replace("{haystack}", str(checkpoint / "haystack.txt")) for f in flags]
    out = tmp_path / "o"
    rc = main(["eval", "quant", "--checkpoint", str(checkpoint), "--out", str(out), "--bits", "8", "--metric", metric,
               "--metric-opt", opt, *flags, "--no-plot", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("difftx eval: error:") and message in err[0], err
    assert not out.exists()


@pytest.mark.parametrize("metric, opts, message", [
    ("icl", ["shots=[1,1]", "seeds=1", "test_examples=2"], "shots: 1 given twice"),
    ("icl", ['arrangements=["random","random"]', "shots=[1]", "seeds=1", "test_examples=2"],
     "arrangements: 'random' given twice"),
    ("icl", ['tasks=["synthetic-6","synthetic-6"]', "shots=[1]", "seeds=1", "test_examples=2"],
     "tasks: 'synthetic-6' given twice"),
    ("mqar", ["lengths=[32,32]", "pairs=[4]", "samples=1"], "lengths: 32 given twice"),
    ("mqar", ["lengths=[32]", "pairs=[4,2,4]", "samples=1"], "pairs: 4 given twice"),
    ("niah", ["depths=[0.5,0.5]", "samples=1"], "depths: 0.5 given twice"),
])
def test_a_value_given_twice_in_a_metric_option_is_one_line(metric, opts, message, checkpoint, tmp_path, capsys):
    """A list option's value given twice through --metric-opt (which the command line's own lists refuse: --shots 2,2)
    was scored twice and counted twice in the metric's value (icl's and mqar's overall accuracy)."""
    from difftx.cli import main

    out = tmp_path / "o"
    argv = ["eval", "quant", "--checkpoint", str(checkpoint), "--out", str(out), "--bits", "8", "--metric", metric]
    for opt in opts:
        argv += ["--metric-opt", opt]
    rc = main([*argv, "--no-plot", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("difftx eval: error:") and message in err[0], err
    assert not out.exists()


@pytest.mark.parametrize("metric, opts, named, unnamed", [
    ("icl", ["seeds=10001"], "pass fewer --metric-opt seeds=N", "--seeds"),
    ("icl", ["test_examples=100000000"], "--metric-opt test_examples=N", "--test-examples"),
    ("mqar", ["lengths=[8]", "pairs=[4]"], "--metric-opt lengths=[...]", "--pairs"),
])
def test_a_metric_error_names_its_fix_as_a_metric_opt(metric, opts, named, unnamed, checkpoint, tmp_path, capsys):
    """'eval quant --metric icl --metric-opt seeds=10001' said "pass fewer --seeds", a flag 'eval quant' does not
    have: the flags of the metric's own evaluation are spelt as the --metric-opt that sets them."""
    from difftx.cli import main

    rc = main(["eval", "quant", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "o"), "--bits", "8",
               "--metric", metric, *[a for o in opts for a in ("--metric-opt", o)], "--no-plot", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and named in err[0], err
    assert f"{unnamed} " not in err[0] + " " and f"{unnamed}," not in err[0], err
    assert not (tmp_path / "o" / "quant.json").exists()


def test_a_depths_metric_opt_error_does_not_say_it_takes_percents(checkpoint, tmp_path, capsys):
    """'eval quant --metric niah --metric-opt depths=[50]' said "--metric-opt depths=[...] on the command line takes
    percents" (eval niah's --depths hint, respelt as a --metric-opt): it takes fractions, as the library does."""
    from difftx.cli import main

    rc = main(["eval", "quant", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "o"), "--bits", "8",
               "--metric", "niah", "--metric-opt", "depths=[50]", "--data", str(checkpoint / "haystack.txt"),
               "--no-plot", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "fractions of the context, 0..1" in err[0], err
    assert "percent" not in err[0], err
