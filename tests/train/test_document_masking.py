"""difftx train --document-masking: each training window's documents (split after every end-of-text token)
attend only to themselves, in training and validation."""

from __future__ import annotations

import json

import torch

from difftx.models.lm import DecoderLM
from difftx.nn.mask import document_ids

from ._helpers import losses, write_documents


def _args(tmp_path, *extra):
    return ["train", "--data", str(write_documents(tmp_path / "docs.jsonl")), "--tokenizer", "bpe", "--bpe-vocab-size",
            300, "--cache-dir", str(tmp_path / "cache"), "--d-model", 32, "--n-layers", 2, "--n-heads", 2,
            "--seq-len", 64, "--batch-size", 4, "--warmup", 1, "--dtype", "fp32", "--eval-batches", 2, "--eval-every",
            2, "--steps", 4, "--no-progress", "--seed", 7, *extra]


def test_document_masking_passes_each_windows_documents(tmp_path, monkeypatch, capsys):
    from difftx.cli import main
    from difftx.data.tokenizers import load_tokenizer

    seen = []
    forward = DecoderLM.forward

    def spy(self, input_ids, *args, document_ids=None, **kwargs):
        seen.append((input_ids.clone(), document_ids))
        return forward(self, input_ids, *args, document_ids=document_ids, **kwargs)

    monkeypatch.setattr(DecoderLM, "forward", spy)
    assert main([str(a) for a in _args(tmp_path, "--document-masking", "--out", tmp_path / "docs")]) == 0
    assert ", documents masked) ->" in capsys.readouterr().out  # the start line says so
    eos = load_tokenizer(tmp_path / "docs" / "tokenizer.json").eos_id
    assert eos is not None
    # every forward (4 training steps, 2 validations of 2 batches) had the ids of its windows' documents, and the
    # windows did hold several documents
    assert len(seen) == 4 + 2 * 2
    for ids, doc in seen:
        assert doc is not None and torch.equal(doc, document_ids(ids, eos))
    assert max(int(doc[:, -1].max()) for _, doc in seen) >= 2
    seen.clear()
    assert main([str(a) for a in _args(tmp_path, "--out", tmp_path / "plain")]) == 0
    assert all(doc is None for _, doc in seen)
    # the same initial weights and batches, other losses from the first step on
    assert losses(tmp_path / "docs")[0] != losses(tmp_path / "plain")[0]
    # switching it on resume is refused in one line (it changes the training the run continues)
    capsys.readouterr()
    args = _args(tmp_path, "--document-masking", "--steps", 6, "--resume", "auto", "--out", tmp_path / "plain")
    assert main([str(a) for a in args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--document-masking: is False in the run being resumed" in err, err


def test_document_masking_is_part_of_a_run_and_refused_where_there_are_no_documents(tmp_path, capsys):
    from difftx.cli import main

    assert main([str(a) for a in _args(tmp_path, "--document-masking", "--stop-at", 2, "--out", tmp_path / "r")]) == 0
    capsys.readouterr()
    # a resumed run keeps it: switching it would change the training it continues
    assert main([str(a) for a in _args(tmp_path, "--resume", "auto", "--out", tmp_path / "r")]) == 0
    cfg = json.loads((tmp_path / "r" / "config.json").read_text())
    assert cfg["train"]["document_masking"] is True
    capsys.readouterr()
    for extra, message in ((["--task", "mqar"], "the task 'mqar' makes each sequence itself"),
                           (["--domain", "vision"], "an image has no documents")):
        code = main(["train", "--document-masking", *extra, "--steps", "1", "--out", str(tmp_path / "bad")])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and message in err, err
        assert not (tmp_path / "bad").exists()
