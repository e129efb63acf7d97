"""k micro-batches give the update of one k-times larger batch (loss normalised by the step's targets)."""

import pytest
import torch

from difftx import ModelConfig
from difftx.train import Domain, LMDomain, TrainConfig, Trainer
from difftx.train.distributed import World

VOCAB = 50


class PaddedDomain(Domain):
    """8 sequences of lengths 3..16 per step, right-padded per micro-batch (pads and the last position unscored)."""

    count = LMDomain.count

    def __init__(self, cfg, world, wrong_scale=None):
        super().__init__(cfg, world)
        self.wrong_scale = wrong_scale  # set: normalise each micro-batch by its own count (the classic mistake)

    def train_batches(self, step, n_micro):
        g = torch.Generator().manual_seed(step)
        n = self.cfg.batch_size * n_micro
        seqs = [torch.randint(1, VOCAB, (int(torch.randint(3, 17, (1,), generator=g)),), generator=g)
                for _ in range(n)]
        out = []
        for m in range(n_micro):
            part = seqs[m * self.cfg.batch_size:(m + 1) * self.cfg.batch_size]
            width = max(len(s) for s in part)
            x = torch.zeros(len(part), width, dtype=torch.long)
            mask = torch.zeros_like(x)
            y = torch.full_like(x, -100)
            for i, s in enumerate(part):
                x[i, :len(s)], mask[i, :len(s)] = s, 1
                y[i, :len(s) - 1] = s[1:]
            out.append({"input_ids": x, "targets": y, "attention_mask": mask})
        return out

    def loss(self, model, batch):
        total = LMDomain.loss(self, model, batch)
        if self.wrong_scale is not None:
            return total / LMDomain.count(self, batch) * self.wrong_scale
        return total


def _update(tmp_path, batch_size, accum, attention="softmax", loss_chunk=0, **kw):
    cfg = TrainConfig(batch_size=batch_size, grad_accum=accum, optimizer="sgd", momentum=0.0, lr=0.5, warmup=0,
                      schedule="constant", grad_clip=0.0, weight_decay=0.0, dtype="fp32", steps=2, seq_len=16,
                      loss_chunk=loss_chunk)
    mcfg = ModelConfig(attention=attention, d_model=32, n_layers=2, n_heads=2, vocab_size=VOCAB, max_seq_len=16)
    wrong = 9.5 * batch_size if kw.get("wrong") else None  # ~ targets per micro-batch: the same overall scale
    tr = Trainer(mcfg, cfg, PaddedDomain(cfg, World(), wrong), World(), tmp_path, {})
    losses = [tr.train_step()["loss"] for _ in range(2)]
    return losses, {k: v.detach().clone() for k, v in tr.model.state_dict().items()}


@pytest.mark.parametrize("attention", ["softmax", "diff"])
def test_micro_batches_equal_one_big_batch_padded(tmp_path, attention):
    ref_loss, ref = _update(tmp_path, 8, 1, attention)
    for bs, k in [(4, 2), (2, 4), (1, 8)]:
        loss, w = _update(tmp_path, bs, k, attention)
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        for name in ref:
            torch.testing.assert_close(w[name], ref[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{bs}x{k} {name}: {m}")


@pytest.mark.parametrize("attention", ["softmax", "diff"])
def test_the_chunked_loss_gives_the_same_updates(tmp_path, attention):
    """--loss-chunk (7 tokens at a time, padded micro-batches) changes neither the loss nor the update."""
    ref_loss, ref = _update(tmp_path, 8, 1, attention)
    for bs, k in [(8, 1), (4, 2)]:
        loss, w = _update(tmp_path, bs, k, attention, loss_chunk=7)
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        for name in ref:
            torch.testing.assert_close(w[name], ref[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{bs}x{k} {name}: {m}")


def test_per_micro_batch_mean_would_differ(tmp_path):
    """The check above has teeth: averaging each micro-batch separately changes the update."""
    _, ref = _update(tmp_path, 8, 1)
    _, wrong = _update(tmp_path, 2, 4, wrong=True)
    assert max((wrong[k] - ref[k]).abs().max().item() for k in ref) > 1e-4


def test_micro_batches_on_a_corpus(tmp_path, corpus, cache):
    from ._helpers import tiny
    from difftx.train import train

    outs = {}
    for bs, k in [(8, 1), (2, 4)]:
        tcfg, mcfg = tiny(corpus, cache, batch_size=bs, grad_accum=k, optimizer="sgd", momentum=0.0, lr=0.5,
                          grad_clip=0.0, steps=2, eval_every=0)
        train(tcfg, mcfg, tmp_path / f"r{bs}", announce=None)
        import difftx
        outs[bs] = difftx.load_model(tmp_path / f"r{bs}").state_dict()
    for name in outs[8]:
        torch.testing.assert_close(outs[2][name], outs[8][name], rtol=1e-5, atol=1e-6)


def test_grad_accum_is_never_silently_overridden_by_a_global_batch(tmp_path, train_cli, capsys):
    """--grad-accum with a --global-batch that needs another count is refused (it used to be dropped, config.json
    recording the unused value); --grad-accum beats a recipe's global batch; on resume --grad-accum alone is
    checked against the run's sequences per step instead of losing to the saved --global-batch."""
    import json

    from difftx.train import resolve_configs

    bad = tmp_path / "bad"
    assert train_cli("--steps", 2, "--grad-accum", 3, "--global-batch", 8, "--out", bad) == 2
    err = capsys.readouterr().err
    assert "--grad-accum: 3 disagrees" in err and "--global-batch 8" in err and err.count("\n") == 1
    assert not bad.exists()
    tcfg, _ = resolve_configs("gpt2-adamw", train={"grad_accum": 2, "batch_size": 4})
    assert tcfg.global_batch is None and tcfg.accumulation(1) == 2
    out = tmp_path / "run"
    assert train_cli("--steps", 4, "--stop-at", 2, "--eval-every", 0, "--global-batch", 8, "--out", out) == 0
    capsys.readouterr()
    assert train_cli("--steps", 4, "--eval-every", 0, "--out", out, "--resume", "auto", "--grad-accum", 4) == 2
    err = capsys.readouterr().err
    assert "took 8 sequences a step" in err and err.count("\n") == 1
    assert train_cli("--steps", 4, "--eval-every", 0, "--out", out, "--resume", "auto", "--grad-accum", 2) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in rows if "loss" in r] == [128, 256, 384, 512]
