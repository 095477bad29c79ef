"""`hf-loopcache demo --cache` takes `build_cache`'s grammar: names, `loopkv:<preset>`, plan folders; `--window` only
when given, and refused by a spec that does not take it."""

from __future__ import annotations

import re

import pytest

from hf_loopcache import CachePlan, load_fixture
from hf_loopcache.cli import main


@pytest.mark.parametrize(
    ("args", "shown"),
    [
        (["--cache", "loopkv:kivi4-share"], "LoopKVCache"),
        (["--cache", "ripe"], "RIPECache"),
        (["--cache", "deepest"], "DeepestPlaneCache"),
    ],
    ids=["loopkv-preset", "ripe-default-window", "deepest"],
)
def test_demo_takes_the_cache_grammar(args, shown, capsys):
    assert main(["demo", "--max-new-tokens", "3", *args]) == 0
    assert shown in capsys.readouterr().out


def test_demo_reads_a_plan_folder(tmp_path, capsys):
    model, _ = load_fixture("tiny-ouro")
    CachePlan.ripe(model.loop_layout, window=8).save_pretrained(tmp_path)
    assert main(["demo", "--max-new-tokens", "3", "--cache", str(tmp_path)]) == 0
    assert "LoopKVCache" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cache", "full", "--window", "8"], "does not take option\\(s\\) window"),
        (["--cache", "kivi4"], "must be full, ripe, deepest, loopkv:<preset>"),
    ],
    ids=["full-with-window", "old-bare-preset"],
)
def test_demo_refuses_what_the_spec_does_not_take(args, message, capsys):
    """The ValueError reaches the user: raised, or printed with a non-zero exit status (the CLI's error handling)."""
    try:
        status = main(["demo", "--max-new-tokens", "3", *args])
    except ValueError as err:
        text = str(err)
    except SystemExit as err:
        status, text = err.code, ""
    else:
        text = ""
    if not text:
        assert status not in (0, None)
        captured = capsys.readouterr()
        text = captured.err + captured.out
    assert re.search(message, text), text
