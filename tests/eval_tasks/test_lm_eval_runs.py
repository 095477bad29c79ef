"""The task configs run through `lm_eval.simple_evaluate` on CPU with a shipped fixture and small local files, and
`hf-loopcache compare` reads the output folders lm-eval writes."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("datasets")

from hf_loopcache.compare import compare_runs, load_run  # noqa: E402
from hf_loopcache.fixtures import list_fixtures  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif("tiny-ouro" not in list_fixtures(), reason="tiny-ouro weights not installed"),
]

GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 5 more. How many apples does he have?", "answer": "3 + 5 = 8\n#### 8"},
    {"question": "A box holds 12 pens. How many pens are in 2 boxes?", "answer": "12 * 2 = 24\n#### 24"},
    {"question": "Sam had 10 coins and lost 4. How many coins are left?", "answer": "10 - 4 = 6\n#### 6"},
]


@pytest.fixture(scope="module")
def lm():
    import torch
    from lm_eval.models.huggingface import HFLM

    from hf_loopcache import load_fixture

    torch.set_num_threads(1)
    model, tokenizer = load_fixture("tiny-ouro")
    return HFLM(pretrained=model, tokenizer=tokenizer, batch_size=2, max_length=2048)


def evaluate(lm, tasks, metadata, *, limit, gen_kwargs=None, out=None):
    """`simple_evaluate` with our configs; with `out`, the results and samples are written as `lm_eval
    --output_path out --log_samples` writes them."""
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    from eval_tasks import TASKS_DIR

    tracker = EvaluationTracker(output_path=str(out)) if out is not None else None
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=tasks,
        task_manager=TaskManager(include_path=str(TASKS_DIR), metadata=metadata),
        limit=limit,
        log_samples=True,
        gen_kwargs=gen_kwargs,
        evaluation_tracker=tracker,
    )
    if tracker is not None:
        samples = results.pop("samples")
        tracker.save_results_aggregated(results=results, samples=samples)
        for task in results["configs"]:
            tracker.save_results_samples(task_name=task, samples=samples[task])
        results["samples"] = samples
    return results


@pytest.fixture(scope="module")
def ruler_dir(tmp_path_factory):
    pytest.importorskip("wonderwords")
    pytest.importorskip("nltk")
    from eval_tasks.ruler import build

    out = tmp_path_factory.mktemp("ruler")
    return build(
        out, "tiny-ouro", [512], ruler_tasks=["niah_single_1"], synth_tasks=["niah_single"],
        synth_haystacks=["noise"], num_samples=2,
    )  # fmt: skip


def test_gsm8k_from_local_files(lm, tmp_path):
    for split in ("test", "train"):
        (tmp_path / "gsm8k").mkdir(exist_ok=True)
        (tmp_path / "gsm8k" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS))
    results = evaluate(
        lm, ["loopcache_gsm8k_cot_zeroshot"], {"data_dir": str(tmp_path)}, limit=2, gen_kwargs="max_gen_toks=8"
    )
    samples = results["samples"]["loopcache_gsm8k_cot_zeroshot"]
    # upstream's prompt and both upstream filters
    assert samples[0]["arguments"][0][0] == f"Q: {GSM8K_ROWS[0]['question']}\nA: Let's think step by step."
    assert {s["filter"] for s in samples} == {"strict-match", "flexible-extract"}
    assert set(results["results"]["loopcache_gsm8k_cot_zeroshot"]) >= {
        "exact_match,strict-match",
        "exact_match,flexible-extract",
    }


def test_math500_from_a_local_file(lm, tmp_path):
    pytest.importorskip("math_verify")
    row = {"problem": "What is $2+3$?", "solution": "$2+3=\\boxed{5}$", "answer": "5", "subject": "Algebra",
           "level": 1, "unique_id": "test/algebra/0.json"}  # fmt: skip
    (tmp_path / "math500").mkdir()
    (tmp_path / "math500" / "test.jsonl").write_text(json.dumps(row) + "\n")
    results = evaluate(
        lm, ["loopcache_minerva_math500"], {"data_dir": str(tmp_path)}, limit=1, gen_kwargs="max_gen_toks=4"
    )
    (sample,) = results["samples"]["loopcache_minerva_math500"]
    prompt = sample["arguments"][0][0]
    # upstream's 4 Minerva exemplars, then the problem
    assert prompt.count("Problem:") == 5 and prompt.endswith("Problem:\nWhat is $2+3$?\n\nSolution:")
    assert sample["doc"]["answer"] == "5"
    assert set(results["results"]["loopcache_minerva_math500"]) >= {"exact_match,none", "math_verify,none"}


def test_longbench_from_a_user_copy(lm, tmp_path):
    for module in ("jieba", "fuzzywuzzy", "rouge"):
        pytest.importorskip(module)
    rows = [
        {"input": "Which city is the capital of France?", "context": "Passage 1: Paris is the capital of France.",
         "answers": ["Paris"], "length": 9, "dataset": "hotpotqa", "language": "en", "all_classes": None, "_id": "a"},
        {"input": "Which river flows through Rome?", "context": "Passage 1: The Tiber flows through Rome.",
         "answers": ["Tiber"], "length": 8, "dataset": "hotpotqa", "language": "en", "all_classes": None, "_id": "b"},
    ]  # fmt: skip
    (tmp_path / "longbench").mkdir()
    (tmp_path / "longbench" / "hotpotqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    results = evaluate(
        lm, ["loopcache_longbench_hotpotqa"], {"data_dir": str(tmp_path)}, limit=2, gen_kwargs="max_gen_toks=4"
    )
    samples = results["samples"]["loopcache_longbench_hotpotqa"]
    assert [s["doc"]["question"] for s in samples] == [r["input"] for r in rows]
    assert "Question: Which city is the capital of France?\nAnswer:" in samples[0]["arguments"][0][0]
    assert set(results["results"]["loopcache_longbench_hotpotqa"]) >= {"score,none", "qa_f1_score,none"}


def test_ruler_and_fixture_format_from_built_files(lm, ruler_dir, tmp_path):
    manifest = json.loads((ruler_dir / "manifest.json").read_text())
    assert manifest["lengths"] == [512] and manifest["num_samples"] == 2
    tasks = ["loopcache_ruler_niah_single_1", "loopcache_synth_niah_single_noise"]
    results = evaluate(
        lm, tasks, {"ruler_dir": str(ruler_dir)}, limit=2, gen_kwargs="max_gen_toks=12", out=tmp_path / "a"
    )
    ruler = results["samples"]["loopcache_ruler_niah_single_1"]
    assert len(ruler) == 2 and all(s["doc"]["max_length"] == 512 for s in ruler)
    prompt = ruler[0]["arguments"]["gen_args_0"]["arg_0"]  # as written to samples_*.jsonl
    assert "special magic number" in prompt and prompt.endswith(ruler[0]["doc"]["gen_prefix"])
    assert results["results"]["loopcache_ruler_niah_single_1"]["4096,none"] == -1  # no 4K items built
    synth = results["samples"]["loopcache_synth_niah_single_noise"]
    assert synth[0]["doc"]["input"].startswith("<|endoftext|>Some special magic numbers")
    # the fixture learned this format: with the full (uncompressed) path it retrieves the needle at 512 tokens
    assert results["results"]["loopcache_synth_niah_single_noise"]["512,none"] == 1.0
    assert results["results"]["loopcache_synth_niah_single_noise"]["512_string,none"] == 1.0

    # the same configuration again: compare pairs the items and sees no difference (an A/A test on real runs)
    evaluate(lm, tasks, {"ruler_dir": str(ruler_dir)}, limit=2, gen_kwargs="max_gen_toks=12", out=tmp_path / "b")
    report = compare_runs(load_run(tmp_path / "a"), load_run(tmp_path / "b"), iters=200)
    rows = {(r["task"], r["metric"]): r for r in report["rows"]}
    assert set(rows) == {
        ("loopcache_ruler_niah_single_1", "512"),
        ("loopcache_synth_niah_single_noise", "512"),
        ("loopcache_synth_niah_single_noise", "512_string"),
    }
    for row in rows.values():
        assert row["n"] == 2 and row["delta"] == 0.0 and row["answers_changed"] == 0 and row["p_value"] == 1.0


def test_ruler_build_is_seeded_per_task_and_length(tmp_path):
    pytest.importorskip("wonderwords")
    from eval_tasks.ruler import build

    one = build(tmp_path / "one", "tiny-ouro", [512], ruler_tasks=["niah_single_1"], synth_tasks=[], num_samples=2)
    two = build(
        tmp_path / "two", "tiny-ouro", [512], ruler_tasks=["niah_multikey_3", "niah_single_1"], synth_tasks=[],
        num_samples=3,
    )  # fmt: skip
    rows_one = (one / "ruler" / "niah_single_1.jsonl").read_text().splitlines()
    rows_two = (two / "ruler" / "niah_single_1.jsonl").read_text().splitlines()
    assert len(rows_one) == 2 and rows_two[:2] == rows_one  # independent of the other tasks; a prefix of a larger build
    with pytest.raises(ValueError, match="`lengths`"):
        build(tmp_path / "bad", "tiny-ouro", [1000])
    with pytest.raises(ValueError, match="`ruler_tasks`"):
        build(tmp_path / "bad", "tiny-ouro", [512], ruler_tasks=["ruler_qa_squad"])


def test_ruler_tasks_need_a_built_folder(lm, tmp_path, monkeypatch):
    from eval_tasks.ruler import RULER_DIR_ENV, load_ruler

    monkeypatch.delenv(RULER_DIR_ENV, raising=False)
    with pytest.raises(ValueError, match="ruler_dir"):
        load_ruler("niah_single_1", pretrained="tiny-ouro")
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        load_ruler("niah_single_1", ruler_dir=str(tmp_path))
