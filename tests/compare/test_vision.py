"""``difftx compare --domain vision``: a miniature ViT / V-DNT / DIFF-ViT study on the built-in digits (one seed:
the wiring; the statistics over seeds are tested on the language mini-study)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("sklearn")
pytest.importorskip("difftx.train.vision")

from difftx.compare.report import ms, num  # noqa: E402

VISION_MINI = ["--domain", "vision", "--arms", "vit:adamw,diff-vit:adamw,vdnt:adamw,vdnt:msgdw", "--seeds", "1",
               "--set", "n_layers=1", "--set", "d_model=32", "--steps", "8", "--batch-size", "32",
               "--eval-points", "2", "--tail-batches", "2", "--workers", "1", "--no-progress"]


def test_vision_mini_study(cli, tmp_path):
    out = tmp_path / "out"
    p = cli("compare", "--out", out, *VISION_MINI, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["domain"] == "vision" and res["retrieval"] is None
    params = [a["params"] for a in res["arms"].values()]
    assert max(params) / min(params) < 1.01  # DIFF-ViT is the matched twin
    report = (out / "report.md").read_text()
    for arm, c in res["corpus"].items():
        assert c["test_acc"]["n"] == 1 and 0.0 <= c["test_acc"]["mean"] <= 1.0
        section = report[report.index("## Validation loss"):]
        row = next(line for line in section.splitlines() if line.startswith(f"| {res['arms'][arm]['label']} |"))
        assert ms(c["test_acc"]) in row and ms(c["val_loss"]) in row
    q = res["questions"]
    assert q["diff_vs_transformer"]["rows"][0]["metric"] == "test_acc"
    assert "vdnt" in json.dumps(q["dnt_msgdw_matches_adamw"]["gaps"])
    assert (out / "loss_curves.png").is_file() and (out / "grad_hist.png").is_file()
    assert num(c["val_loss"]["mean"]) in report


def test_vision_rejects_tokens(cli, tmp_path):
    p = cli("compare", "--out", tmp_path / "o", "--domain", "vision", "--tokens", "1000")
    assert p.returncode == 2 and "--steps" in p.stderr and len(p.stderr.strip().splitlines()) == 1
