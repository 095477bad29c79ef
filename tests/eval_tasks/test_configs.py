"""`eval_tasks/configs`: the configs keep upstream lm-eval's prompts and metrics, and read local files when given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval_tasks import TASKS_DIR

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.tasks._yaml_loader import load_yaml  # noqa: E402

UPSTREAM = Path(lm_eval.__file__).parent / "tasks"
# keys our configs change on purpose: the name, the tag, and where the documents come from
SOURCE_KEYS = {"task", "tag", "custom_dataset", "dataset_kwargs"}


def _normalize(value):
    """Function references as dotted paths: `resolve_func=False` gives `<yaml dir>/<reference>`, i.e. upstream's
    file-relative `utils.f` becomes `.../lm_eval/tasks/<folder>/utils.f` and our dotted reference
    `.../configs/<folder>/lm_eval.tasks.<folder>.utils.f`."""
    if isinstance(value, dict):
        return {k: _normalize(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_normalize(v) for v in value]
    if isinstance(value, str) and value.startswith("/"):
        if str(TASKS_DIR) in value:
            return Path(value).name
        return "lm_eval" + value.split("/lm_eval", 1)[1].replace("/", ".")
    return value


def _config(path: Path) -> dict:
    def unresolved(cfg):
        return {k: v for k, v in cfg.items() if k not in SOURCE_KEYS}

    cfg = load_yaml(path, resolve_func=False, recursive=True)
    return _normalize(unresolved(cfg))


def _function_tags(path: Path) -> list[str]:
    return [line.split("!function ", 1)[1].strip() for line in path.read_text().splitlines() if "!function " in line]


@pytest.mark.parametrize(
    "ours,upstream",
    [
        ("gsm8k/gsm8k.yaml", "gsm8k/gsm8k.yaml"),
        ("gsm8k/gsm8k_cot.yaml", "gsm8k/gsm8k-cot.yaml"),
        ("gsm8k/gsm8k_cot_zeroshot.yaml", "gsm8k/gsm8k-cot-zeroshot.yaml"),
        ("math500/minerva_math500.yaml", "minerva_math/minerva_math500.yaml"),
        ("longbench/hotpotqa.yaml", "longbench/hotpotqa.yaml"),
        ("longbench/passage_retrieval_en_e.yaml", "longbench/passage_retrieval_en_e.yaml"),
        ("longbench/lcc.yaml", "longbench/lcc.yaml"),
    ],
    ids=lambda p: p.split("/")[-1].removesuffix(".yaml"),
)
def test_upstream_prompts_filters_and_metrics_are_kept(ours, upstream):
    """Everything but the name, tag and data source equals upstream's merged config (includes resolved)."""
    assert _config(TASKS_DIR / ours) == _config(UPSTREAM / upstream)


def test_every_longbench_config_matches_upstream():
    names = sorted(p.name for p in (UPSTREAM / "longbench").glob("*.yaml") if not p.name.startswith("_"))
    assert sorted(p.name for p in (TASKS_DIR / "longbench").glob("*.yaml")) == names
    for name in names:
        assert _config(TASKS_DIR / "longbench" / name) == _config(UPSTREAM / "longbench" / name), name


@pytest.mark.parametrize("task", ["niah_single_1", "niah_multikey_2", "ruler_vt", "ruler_cwe", "ruler_fwe"])
def test_ruler_configs_keep_upstream_prompt_and_generation(task):
    from eval_tasks.ruler import LENGTHS

    ours = _config(TASKS_DIR / "ruler" / f"{task}.yaml")
    upstream = _config(UPSTREAM / "ruler" / f"{task.removeprefix('ruler_')}.yaml")
    for key in ("doc_to_text", "doc_to_target", "gen_prefix", "target_delimiter", "generation_kwargs", "output_type"):
        assert ours[key] == upstream[key], key
    upstream_metrics = [m["metric"] for m in upstream["metric_list"]]
    assert [m["metric"] for m in ours["metric_list"]] == [str(n) for n in LENGTHS]
    assert set(upstream_metrics) <= {str(n) for n in LENGTHS}
    assert {m["aggregation"] for m in ours["metric_list"]} == {m["aggregation"] for m in upstream["metric_list"]}


def test_generated_configs_are_up_to_date():
    from eval_tasks._generate_configs import generated

    files = generated()
    for rel, text in files.items():
        assert (TASKS_DIR / rel).read_text(encoding="utf-8") == text, (
            f"{rel}: run python -m eval_tasks._generate_configs"
        )
    on_disk = {
        str(p.relative_to(TASKS_DIR)) for sub in ("ruler", "synth", "longbench") for p in (TASKS_DIR / sub).glob("*")
    }
    assert on_disk == set(files)


def test_function_references_import():
    """Every `!function` of every config names an importable function (dotted paths, no file-relative ones)."""
    import importlib

    pytest.importorskip("math_verify")
    pytest.importorskip("jieba")
    pytest.importorskip("fuzzywuzzy")
    pytest.importorskip("rouge")
    seen = set()
    for path in sorted(TASKS_DIR.rglob("*.yaml")):
        seen.update(_function_tags(path))
    for ref in sorted(seen):
        module, name = ref.rsplit(".", 1)
        assert callable(getattr(importlib.import_module(module), name)), ref
    assert {"eval_tasks.data.load_gsm8k", "eval_tasks.ruler.load_ruler", "eval_tasks.ruler.load_synth"} <= seen


def test_task_names_are_unique_and_prefixed():
    names = [load_yaml(p, resolve_func=False, recursive=False)["task"] for p in sorted(TASKS_DIR.rglob("*.yaml"))]
    assert len(names) == len(set(names))
    assert all(n.startswith("loopcache_") for n in names)


# ------------------------------------------------------------------------------------------------ data loaders
GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 5 more. How many apples does he have?", "answer": "3 + 5 = 8\n#### 8"},
    {"question": "A box holds 12 pens. How many pens are in 2 boxes?", "answer": "12 * 2 = 24\n#### 24"},
]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_gsm8k_and_math500_read_local_files(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    from eval_tasks.data import DATA_ENV, load_gsm8k, load_math500

    write_jsonl(tmp_path / "gsm8k" / "test.jsonl", GSM8K_ROWS)
    write_jsonl(tmp_path / "gsm8k" / "train.jsonl", GSM8K_ROWS[::-1])
    math_row = {"problem": "What is $1+1$?", "solution": "$\\boxed{2}$", "answer": "2", "subject": "Algebra",
                "level": 1, "unique_id": "test/algebra/1.json"}  # fmt: skip
    write_jsonl(tmp_path / "math500" / "test.jsonl", [math_row])
    splits = load_gsm8k(data_dir=str(tmp_path), pretrained="tiny-ouro", cache="ripe")  # model_args ride along
    assert set(splits) == {"test", "train"} and splits["test"][1] == GSM8K_ROWS[1]
    assert splits["train"][0] == GSM8K_ROWS[1]
    assert load_math500(data_dir=str(tmp_path))["test"][0] == math_row
    monkeypatch.setenv(DATA_ENV, str(tmp_path))
    assert load_gsm8k()["test"].num_rows == 2
    with pytest.raises(FileNotFoundError, match="`data_dir`"):
        load_gsm8k(data_dir=str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="math500"):
        load_math500(data_dir=str(tmp_path / "gsm8k"))


def test_longbench_reads_thudm_schema(tmp_path):
    pytest.importorskip("datasets")
    from eval_tasks.data import load_longbench

    row = {"input": "Which city?", "context": "Passage 1: Paris is in France.", "answers": ["Paris"], "length": 6,
           "dataset": "hotpotqa", "language": "en", "all_classes": None, "_id": "abc"}  # fmt: skip
    write_jsonl(tmp_path / "longbench" / "hotpotqa.jsonl", [row])
    got = load_longbench("hotpotqa", data_dir=str(tmp_path))["test"][0]
    assert got["question"] == "Which city?" and "input" not in got and got["answers"] == ["Paris"]
    write_jsonl(tmp_path / "longbench" / "bad.jsonl", [{"context": "x"}])
    with pytest.raises(ValueError, match="neither `input`"):
        load_longbench("bad", data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="`longbench_task`"):
        load_longbench(None, data_dir=str(tmp_path))
