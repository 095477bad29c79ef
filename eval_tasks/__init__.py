"""Evaluation doors of hf_loopcache, kept outside the importable core (the library never imports `lm_eval`).

- `configs/`: lm-eval task configs (`TASKS_DIR`, pass it as `--include_path`). GSM8K (`loopcache_gsm8k`,
  `loopcache_gsm8k_cot`, `loopcache_gsm8k_cot_zeroshot`) and MATH-500 (`loopcache_minerva_math500`) keep upstream
  lm-eval's prompts, filters and metrics and read local files when given (`data.py`); RULER (tag `loopcache_ruler`)
  and the fixtures' own prompt format (tag `loopcache_synth`) read files that `python -m eval_tasks.ruler build`
  writes for one tokenizer and set of lengths (`ruler.py`); LongBench (tag `loopcache_longbench`) reads a copy of
  THUDM's data that the user supplies.
- `synthetic.py`: the seeded RULER-style generator (needle retrieval, multi-key retrieval, variable tracking) that
  trained the shipped fixtures; standard library only.

Importing this package imports nothing heavy; the modules that need `lm_eval` or `datasets` import them inside.
"""

from pathlib import Path

__all__ = ["TASKS_DIR"]

TASKS_DIR = Path(__file__).resolve().parent / "configs"
