"""The command line on the shipped fixtures: the README's demo, `info`, and a profile -> plan round trip."""

from __future__ import annotations

import json

from hf_loopcache import CachePlan
from hf_loopcache.cli import main


def test_demo_reports_formula_and_allocated_bytes(capsys):
    assert main(["demo", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "tiny-ouro" in out and "full-cache formula 60.0 KiB" in out and "allocated" in out
    assert main(["demo", "--model", "tiny-huginn", "--cache", "ripe", "--window", "4", "--max-new-tokens", "4"]) == 0
    assert "RIPECache" in capsys.readouterr().out


def test_info_lists_every_preset(capsys):
    assert main(["info", "--model", "tiny-huginn", "--length", "1024", "--window", "64"]) == 0
    out = capsys.readouterr().out
    for name in ("full", "deepest plane", "RIPE W=64", "KIVI-4", "KIVI-2", "hand-made"):
        assert name in out


def test_profile_then_plan_from_the_command_line(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    args = [
        "profile",
        "--model",
        "tiny-ouro",
        "--num-docs",
        "1",
        "--doc-tokens",
        "96",
        "--prefix",
        "0.5",
        "--sink",
        "4",
        "--window",
        "16",
        "--page-size",
        "16",
        "--device",
        "cpu",
        "--out",
        str(profile),
    ]
    assert main(args) == 0
    data = json.loads(profile.read_text())
    assert data["settings"]["source"]["documents"].startswith("fixture tiny-ouro")
    assert len(data["damage"]) == 24 and data["kl_share"] > 0
    assert main(["plan", "--profile", str(profile), "--damage-budget", "3x", "--out", str(tmp_path / "plan")]) == 0
    plan = CachePlan.from_pretrained(tmp_path / "plan")
    assert plan.metadata["profile"]["documents"] == 1 and plan.page_size == 16
    assert "predicted damage" in capsys.readouterr().out
