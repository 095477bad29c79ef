"""The command line on the shipped fixtures: the README's demo, `info`, and a profile -> plan round trip."""

from __future__ import annotations

import json

from hf_loopcache import CachePlan
from hf_loopcache.cli import main


def test_demo_compares_the_full_cache_with_a_compressed_one(capsys):
    assert main(["demo", "--prompt-tokens", "400", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "tiny-ouro" in out and "the first 400 tokens of a held-out document" in out
    assert "[full] FullLoopCache" in out and "[loopkv:kivi4-share] LoopKVCache" in out
    assert "new tokens equal the full cache's" in out
    rows = {
        line.split()[0]: line.split()
        for line in out.splitlines()
        if line.startswith("  full ") or "  loopkv:kivi4-share " in line
    }
    assert float(rows["loopkv:kivi4-share"][3].rstrip("%")) < 100 == float(rows["full"][3].rstrip("%"))
    for sentence in ("stored: ", "= 60.0 KiB.", "allocated: ", "per history token (the lines above)"):
        assert sentence in out
    assert (
        main(
            [
                "demo",
                "--model",
                "tiny-huginn",
                "--cache",
                "ripe",
                "--window",
                "4",
                "--prompt",
                "In the",
                "--max-new-tokens",
                "2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "[ripe] RIPECache" in out and "[full] FullLoopCache" in out
    assert main(["demo", "--cache", "full", "--prompt", "In the", "--max-new-tokens", "2"]) == 0
    assert capsys.readouterr().out.count("[full]") == 1


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
