"""Guard rails of the lm-eval door: one response cache and one output folder per configuration (launcher), a
response cache stamped with its configuration (model, also under plain lm_eval), reasoning tasks not cut."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("lm_eval")

from eval_tasks.guards import (  # noqa: E402
    MIN_REASONING_TOKENS,
    RESPONSE_CACHE_STAMP,
    check_generation_length,
    configuration,
    configuration_slug,
    stamp_response_cache,
)
from eval_tasks.launcher import apply_guard_rails  # noqa: E402


def parse(argv, monkeypatch):
    from lm_eval._cli import HarnessCLI

    monkeypatch.setattr(sys, "argv", ["hf-loopcache-eval", *argv])
    return HarnessCLI().parse_args()


def test_configuration_ignores_what_does_not_change_answers():
    a = configuration({"pretrained": "tiny-ouro", "cache": "ripe", "window": 64, "batch_size": 8, "device": "cuda"})
    assert a == {"pretrained": "tiny-ouro", "cache": "ripe", "window": 64}
    assert configuration({"pretrained": "tiny-ouro"})["cache"] == "full"
    slug = configuration_slug({"pretrained": "/models/tiny-ouro/", "cache": "ripe", "window": 64})
    assert slug.startswith("tiny-ouro__ripe__window=64__") and len(slug.split("__")[-1]) == 8
    others = [
        {"pretrained": "tiny-ouro", "cache": "ripe", "window": 32},
        {"pretrained": "tiny-ouro", "cache": "full"},
        {"pretrained": "tiny-huginn", "cache": "ripe", "window": 64},
        {"pretrained": "tiny-ouro", "cache": "ripe", "window": 64, "num_loops": 3},
    ]
    slugs = {configuration_slug(o) for o in others} | {
        configuration_slug({"pretrained": "tiny-ouro", "cache": "ripe", "window": 64})
    }
    assert len(slugs) == 5
    assert configuration_slug({"pretrained": "a/b", "cache": "/plans/my plan"}).startswith("b__my-plan__")


def test_launcher_separates_outputs_and_response_caches(monkeypatch, tmp_path):
    runs = {}
    for extra in ([], ["window=64"]):
        args = parse(
            ["--model_args", ",".join(["pretrained=tiny-ouro,cache=loopkv:kivi4-share", *extra]), "--tasks", "x"]
            + ["--output_path", str(tmp_path / "runs"), "--use_cache", str(tmp_path / "rc")],
            monkeypatch,
        )
        notes = apply_guard_rails(args)
        assert args.model == "hf-loopcache" and notes
        runs[tuple(extra)] = (args.output_path, args.use_cache)
    (out_a, rc_a), (out_b, rc_b) = runs.values()
    assert out_a != out_b and rc_a != rc_b
    assert out_a.startswith(str(tmp_path / "runs")) and rc_a.startswith(str(tmp_path / "rc_"))
    # idempotent: a path that already names the configuration is kept
    args = parse(["--model_args", "pretrained=tiny-ouro,cache=loopkv:kivi4-share", "--output_path", out_a], monkeypatch)
    apply_guard_rails(args)
    assert args.output_path == out_a


def test_launcher_leaves_other_models_alone(monkeypatch, tmp_path):
    args = parse(["--model", "hf", "--model_args", "pretrained=x", "--output_path", str(tmp_path)], monkeypatch)
    assert apply_guard_rails(args) == [] and args.output_path == str(tmp_path)


def test_response_cache_stamp_refuses_another_configuration(tmp_path):
    from sqlitedict import SqliteDict

    path = str(tmp_path / "rc.db")
    ripe = {"pretrained": "tiny-ouro", "cache": "ripe", "window": 64}
    with SqliteDict(path, autocommit=True) as db:
        stamp_response_cache(db, ripe, path)
        db["some-request-hash"] = "an answer"
    with SqliteDict(path) as db:
        assert db[RESPONSE_CACHE_STAMP] == configuration(ripe)
        stamp_response_cache(db, {**ripe, "batch_size": 4}, path)  # same configuration: accepted
        with pytest.raises(ValueError, match=r"holds the answers of another configuration.*give every configuration"):
            stamp_response_cache(db, {**ripe, "cache": "full"}, path)
    unstamped = str(tmp_path / "old.db")
    with SqliteDict(unstamped, autocommit=True) as db:
        db["hash"] = "answer from a run of unknown configuration"
        with pytest.raises(ValueError, match=r"1 answers of an unknown configuration"):
            stamp_response_cache(db, ripe, unstamped)


def test_model_stamps_the_response_cache_under_plain_lm_eval(tmp_path):
    """lm-eval's CachingLM hands the model its database before any request: a second configuration is refused."""
    from lm_eval.api.model import CachingLM

    from eval_tasks.model import LoopCacheLM

    kw = dict(pretrained="tiny-ouro", dtype="float32", device="cpu")
    CachingLM(LoopCacheLM(cache="ripe", window=8, **kw), str(tmp_path / "shared.db"))
    CachingLM(LoopCacheLM(cache="ripe", window=8, **kw), str(tmp_path / "shared.db"))  # same configuration again
    with pytest.raises(ValueError, match=r"another configuration"):
        CachingLM(LoopCacheLM(cache="deepest", **kw), str(tmp_path / "shared.db"))


@pytest.mark.parametrize(
    ("task", "tokens", "refused"),
    [
        ("gsm8k", 256, True),
        ("gsm8k_cot_zeroshot", MIN_REASONING_TOKENS, False),
        ("minerva_math500", 300, True),
        ("hendrycks_math_algebra", 1024, False),
        ("niah_single_1", 128, False),
        (None, 16, False),
    ],
    ids=["gsm8k-256", "gsm8k-at-floor", "math500-300", "math-1024", "ruler-128", "no-task"],
)
def test_generation_length_floor(task, tokens, refused):
    if refused:
        with pytest.raises(ValueError, match=f"{task!r} generates at most {tokens} new tokens"):
            check_generation_length(task, tokens)
        check_generation_length(task, tokens, allow_short=True)
    else:
        check_generation_length(task, tokens)
