"""Where the task configs in `eval_tasks/configs/` get their documents: local files when given, else the Hub.

lm-eval calls a task's `custom_dataset` with the task metadata (`--model_args` merged with `--metadata`) and the
task's `dataset_kwargs` as keywords, and expects `{split: datasets.Dataset}`. The loaders here read

- `data_dir` (a keyword, i.e. `--metadata '{"data_dir": "/path"}'`), else the environment variable
  `HF_LOOPCACHE_DATA`: a folder laid out as `gsm8k/{test,train}.jsonl` (GSM8K's official files, fields `question`,
  `answer`), `math500/test.jsonl` (the official MATH-500 split, fields `problem`, `solution`, `answer`, `subject`,
  `level`, `unique_id`) and `longbench/<name>.jsonl` (a copy of THUDM's LongBench `data.zip`, one file per task);
- without either, the Hub datasets upstream lm-eval reads (`openai/gsm8k` `main`, `HuggingFaceH4/MATH-500`,
  `Xnhyacinth/LongBench`), through `datasets.load_dataset` (needs network or a filled Hugging Face cache).

The records are the Hub's (same fields, same order), so prompts, document hashes and scores do not depend on where
the documents came from.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["DATA_ENV", "data_dir", "load_gsm8k", "load_longbench", "load_math500", "read_jsonl"]

DATA_ENV = "HF_LOOPCACHE_DATA"


def data_dir(kwargs: dict[str, Any]) -> Path | None:
    """The local data folder named by `data_dir` in `kwargs` or by `HF_LOOPCACHE_DATA`, or None (use the Hub)."""
    value = kwargs.get("data_dir") or os.environ.get(DATA_ENV)
    if not value:
        return None
    folder = Path(str(value)).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"`data_dir` (or ${DATA_ENV}) must be an existing folder, got {str(value)!r}")
    return folder


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing (expected under `data_dir`; see eval_tasks/data.py for the layout)")
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _datasets(splits: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    import datasets

    return {name: datasets.Dataset.from_list(rows) for name, rows in splits.items()}


def _hub(path: str, name: str | None, **kwargs: Any) -> dict[str, Any]:
    import datasets

    return dict(datasets.load_dataset(path, name, **kwargs))


def load_gsm8k(**kwargs: Any) -> dict[str, Any]:
    """GSM8K `test` and `train` (the few-shot pool of `loopcache_gsm8k`): `<data_dir>/gsm8k/{test,train}.jsonl`, else
    the Hub's `openai/gsm8k` (`main`)."""
    folder = data_dir(kwargs)
    if folder is None:
        return _hub("openai/gsm8k", "main")
    return _datasets({split: read_jsonl(folder / "gsm8k" / f"{split}.jsonl") for split in ("test", "train")})


def load_math500(**kwargs: Any) -> dict[str, Any]:
    """MATH-500 `test`: `<data_dir>/math500/test.jsonl`, else the Hub's `HuggingFaceH4/MATH-500`."""
    folder = data_dir(kwargs)
    if folder is None:
        return _hub("HuggingFaceH4/MATH-500", "default")
    return _datasets({"test": read_jsonl(folder / "math500" / "test.jsonl")})


def load_longbench(longbench_task: str | None = None, **kwargs: Any) -> dict[str, Any]:
    """LongBench task `longbench_task` (a file name of THUDM's `data.zip`, e.g. `hotpotqa`, `passage_retrieval_en_e`)
    as lm-eval's LongBench configs read it: `<data_dir>/longbench/<task>.jsonl` with THUDM's `input` field renamed
    `question` (what the Hub mirror `Xnhyacinth/LongBench` that upstream lm-eval reads holds), else that mirror."""
    if not longbench_task:
        raise ValueError("`longbench_task` (a dataset_kwargs entry of the task config) is required, got none")
    folder = data_dir(kwargs)
    if folder is None:
        hub = _hub("Xnhyacinth/LongBench", longbench_task)
        return {"test": hub["test"]}
    rows = read_jsonl(folder / "longbench" / f"{longbench_task}.jsonl")
    for i, row in enumerate(rows):
        if "question" not in row:
            if "input" not in row:
                raise ValueError(
                    f"{folder / 'longbench' / f'{longbench_task}.jsonl'} row {i} has neither `input` (THUDM's schema) "
                    f"nor `question`; fields: {sorted(row)}"
                )
            row["question"] = row.pop("input")
    return _datasets({"test": rows})
