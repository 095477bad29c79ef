"""Every command-line mistake ends in one line naming the argument (exit 2), never a traceback (issue #18)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

import hf_loopcache.fixtures as fixtures
from hf_loopcache import CachePlan, __version__
from hf_loopcache.cli import build_parser, main

REPO = Path(__file__).resolve().parents[1]
PROFILE = "PROFILE"  # stands for the `profile` fixture's file in parametrized command lines
RESULTS_PROFILE = REPO / "benchmarks" / "results" / "loopkv_planner_tiny_ouro_profile.json"
needs_fixtures = pytest.mark.skipif(not fixtures.list_fixtures(), reason="hf-loopcache-fixtures is not installed")


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> str:
    """The committed tiny-ouro planner profile re-labelled with today's schema: these tests need a real profile's shape
    and its int4 / int2 damages (the share scores' method does not matter to an argument check)."""
    from hf_loopcache.planner.profile import PROFILE_SCHEMA_VERSION

    data = json.loads(RESULTS_PROFILE.read_text())
    data["schema_version"] = PROFILE_SCHEMA_VERSION
    data.setdefault("settings", {})["share_source"] = "int4"
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    path.write_text(json.dumps(data))
    return str(path)


def _fails(capsys, argv: list[str], option: str, *needles: str, status: int = 2) -> str:
    """Run the CLI; it must exit with `status` and one stderr line `hf-loopcache CMD: error: argument OPTION: ...`."""
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own checks (types, choices)
        code = exit_.code
    err = capsys.readouterr().err
    assert code == status, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"hf-loopcache {argv[0]}: error: argument {option}: "), last
    for needle in needles:
        assert needle in last, last
    return last


@pytest.mark.parametrize(
    "argv, option, needle",
    [
        (["demo", "--dtype", "foo"], "--dtype", "invalid choice: 'foo'"),
        (["demo", "--device", "meta"], "--device", "must be cpu, cuda[:N] or mps"),
        (["demo", "--device", "not a device"], "--device", "must be a torch device"),
        (["demo", "--window", "-3"], "--window", "must be an integer >= 0, got -3"),
        (["demo", "--max-new-tokens", "0"], "--max-new-tokens", "must be an integer >= 1"),
        (["demo", "--prompt", ""], "--prompt", "must not be empty"),
        (["demo", "--model", "./does-not-exist"], "--model", "no such local folder './does-not-exist'"),
        (["info", "--length", "0"], "--length", "must be an integer >= 1, got 0"),
        (["info", "--window", "-3"], "--window", "must be an integer >= 0, got -3"),
        (["profile", "--model", "tiny-ouro", "--num-docs", "0", "--out", "p.json"], "--num-docs", ">= 1, got 0"),
        (["profile", "--model", "tiny-ouro", "--documents", "nope.txt", "--out", "p.json"], "--documents", "no such"),
        (["profile", "--model", "tiny-ouro", "--prefix", "0", "--out", "p.json"], "--prefix", "at least one"),
        (["profile", "--model", "./x", "--out", "p.json"], "--documents", "is required for models other than"),
        (["profile", "--model", "tiny-ouro", "--out", "/no/such/dir/p.json"], "--out", "does not exist"),
        (["plan", "--profile", "nope.json", "--damage-budget", "1x", "--out", "o"], "--profile", "no such file"),
        (["plan", "--profile", PROFILE, "--damage-budget", "x2", "--out", "o"], "--damage-budget", "like 2e-4"),
        (["plan", "--profile", PROFILE, "--damage-budget", "0", "--out", "o"], "--damage-budget", "least damage"),
        (
            ["plan", "--profile", PROFILE, "--damage-budget", "3x", "--storage-budget", "1KiB", "--out", "o"],
            "--storage-budget",
            "below what the final loop alone stores",
        ),
        (
            [
                "plan",
                "--profile",
                PROFILE,
                "--damage-budget",
                "1.01x",
                "--storage-budget",
                "3000",
                "--options",
                "int4",
                "int2",
            ]
            + ["--out", "o"],
            "--storage-budget",
            "below the least any plan",
        ),
        (
            ["plan", "--profile", PROFILE, "--damage-budget", "3x", "--options", "int8", "--out", "o"],
            "--options",
            "",
        ),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_argument_mistakes_end_in_one_line(capsys, tmp_path, monkeypatch, profile, argv, option, needle):
    monkeypatch.chdir(tmp_path)
    _fails(capsys, [profile if a == PROFILE else a for a in argv], option, needle)


def test_cuda_on_a_cpu_build(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    _fails(capsys, ["demo", "--device", "cuda"], "--device", "'cuda' is not available", "use cpu")


def test_damage_budget_error_speaks_in_whole_plan_terms(capsys, tmp_path, profile):
    line = _fails(
        capsys, ["plan", "--profile", profile, "--damage-budget", "0", "--out", str(tmp_path)], "--damage-budget"
    )
    assert "reaches (5.300e-05)" in line  # the least damage of a whole plan,
    assert not re.search(r"(?<![e\d])-\d", line)  # not the knapsack's negative internal remainder (-1.47e-05 before)
    assert not (tmp_path / "loopcache_plan.json").exists()


def test_plan_from_a_plan_file_says_what_it_is(capsys, tmp_path):
    from hf_loopcache.layout import LoopLayout

    layout = LoopLayout.from_dict(json.loads(RESULTS_PROFILE.read_text())["layout"])
    plan_file = CachePlan.full(layout).save_pretrained(tmp_path / "plan")
    _fails(capsys, ["plan", "--profile", plan_file, "--damage-budget", "1x", "--out", "o"], "--profile", "a cache plan")


def test_push_to_hub_offline_writes_nothing(capsys, tmp_path, monkeypatch, profile):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    out = tmp_path / "plan"
    argv = ["plan", "--profile", profile, "--damage-budget", "3x", "--out", str(out), "--push-to-hub", "me/p"]
    _fails(capsys, argv, "--push-to-hub", "cannot be reached (HF_HUB_OFFLINE is set); nothing was written")
    assert not out.exists()


@pytest.mark.parametrize(
    "name, hint", [("tiny-ouor", "did you mean the fixture 'tiny-ouro'?"), ("org/model", "fixtures:")]
)
def test_unknown_model_offline_fails_at_once(capsys, monkeypatch, name, hint):
    import transformers
    from huggingface_hub import constants

    def no_network(*args, **kwargs):
        raise AssertionError("tried the Hub while offline")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_network)
    _fails(capsys, ["demo", "--model", name], "--model", hint, "Hub cannot be reached (HF_HUB_OFFLINE is set)")


def test_local_folder_without_a_model(capsys, tmp_path):
    _fails(capsys, ["info", "--model", str(tmp_path)], "--model", "not a model folder (no config.json")


def test_missing_fixtures_distribution_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr(fixtures, "_HERE", None)
    assert main(["info", "--model", "tiny-ouro"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert "pip install -e ./hf-loopcache-fixtures" in err
    with pytest.raises(fixtures.FixturesNotInstalledError, match="hf-loopcache-fixtures"):
        fixtures.load_fixture("tiny-huginn")
    with pytest.raises(FileNotFoundError):  # the class is a FileNotFoundError
        fixtures.heldout_documents()


@needs_fixtures
def test_profile_longer_than_the_model_refuses_before_starting(capsys, tmp_path):
    argv = [
        "profile",
        "--model",
        "tiny-ouro",
        "--doc-tokens",
        "100000",
        "--device",
        "cpu",
        "--out",
        str(tmp_path / "p"),
    ]
    _fails(capsys, argv, "--doc-tokens", "at most the model's 4096 positions, got 100000")


@needs_fixtures
def test_profile_with_too_few_documents(capsys, tmp_path):
    argv = ["profile", "--model", "tiny-ouro", "--num-docs", "5000", "--device", "cpu", "--out", str(tmp_path / "p")]
    _fails(capsys, argv, "--num-docs", "fewer than --num-docs 5000")


@needs_fixtures
def test_profile_says_what_it_does_counts_arms_like_its_bar_and_no_length_warning(capsys, tmp_path):
    import transformers

    logger = transformers.logging.get_logger("transformers")
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        argv = ["profile", "--model", "tiny-ouro", "--num-docs", "1", "--doc-tokens", "64", "--options", "int2"]
        argv += ["--sink", "4", "--window", "8", "--page-size", "8", "--device", "cpu", "--out", str(tmp_path / "p")]
        assert main(argv) == 0
    finally:
        logger.removeHandler(handler)
    captured = capsys.readouterr()
    assert "profile tiny-ouro: 1 documents of 64 tokens from fixture tiny-ouro held-out documents (32 prefilled" in (
        captured.out
    )
    arms = int(captured.out.split("profiling ")[1].split(" arms")[0])
    assert arms == 24 + 1  # 24 cells x int2, and the KL_share reference
    assert f"{arms}/{arms}" in captured.err  # the progress bar's total
    assert not [r for r in records if "longer than the specified maximum" in r]


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"hf-loopcache {__version__}"


def test_every_option_has_help_and_shows_its_default():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, command in sub.choices.items():
        for action in command._actions:
            if action.dest == "help":
                continue
            assert action.help, f"{name} {action.option_strings} has no help text"
        text = command.format_help()
        assert "(default:" in text, name
