"""`hf-loopcache-eval` (also `python -m eval_tasks`): lm-eval's own command line with the `hf-loopcache` model registered
and the guard rails applied. Every lm-eval flag passes through unchanged, except:

- `--model` defaults to `hf-loopcache`;
- with `--model hf-loopcache`:
  - `--output_path DIR` becomes `DIR/<configuration slug>/` (a `.json` file path: `DIR/<slug>/name.json`), so two
    cache configurations of one checkpoint never share a results folder;
  - `--use_cache PATH` becomes `PATH_<configuration slug>`, so lm-eval's response cache never replays one
    configuration's answers for another (the model also stamps and checks the database);
  - `--include_path` defaults to this package's task configs (`eval_tasks.TASKS_DIR`) when they exist.
- GSM8K / MATH generation lengths are checked by the model itself (both doors).

    hf-loopcache-eval --model_args pretrained=tiny-huginn,cache=ripe,window=64 --tasks loopcache_gsm8k \\
        --limit 50 --log_samples --output_path runs/eval
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

from eval_tasks.guards import configuration_slug

__all__ = ["apply_guard_rails", "main"]

MODEL_NAME = "hf-loopcache"
logger = logging.getLogger("hf_loopcache.eval")


def _with_slug_dir(path: str, slug: str) -> str:
    p = Path(path)
    if p.suffix == ".json":
        return path if p.parent.name == slug else str(p.parent / slug / p.name)
    return path if p.name == slug else str(p / slug)


def apply_guard_rails(args: Any) -> list[str]:
    """Rewrite a parsed `lm_eval run` namespace in place; returns one line per change, for the log."""
    notes = []
    if getattr(args, "model", None) is None:
        args.model = MODEL_NAME
        notes.append(f"--model {MODEL_NAME}")
    if args.model != MODEL_NAME:
        return notes
    slug = configuration_slug(args.model_args or {})
    if getattr(args, "output_path", None):
        new = _with_slug_dir(args.output_path, slug)
        if new != args.output_path:
            args.output_path = new
            notes.append(f"--output_path {new} (one folder per configuration)")
    if getattr(args, "use_cache", None) and not args.use_cache.endswith(slug):
        args.use_cache = f"{args.use_cache}_{slug}"
        notes.append(f"--use_cache {args.use_cache} (one response cache per configuration)")
    if getattr(args, "include_path", None) is None:
        import eval_tasks

        tasks_dir = getattr(eval_tasks, "TASKS_DIR", None)
        if tasks_dir is not None and Path(tasks_dir).is_dir():
            args.include_path = str(tasks_dir)
            notes.append(f"--include_path {tasks_dir} (hf_loopcache's task configs)")
    return notes


def main(argv: list[str] | None = None) -> int:
    import lm_eval.models  # noqa: F401  (the built-in models first: the registry must not look empty)
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    import eval_tasks.model  # noqa: F401  (registers `hf-loopcache`)

    setup_logging()
    saved = sys.argv
    sys.argv = [os.path.basename(saved[0]) or "hf-loopcache-eval", *(saved[1:] if argv is None else argv)]
    try:
        parser = HarnessCLI()
        args = parser.parse_args()
        if getattr(args, "command", None) == "run":
            for note in apply_guard_rails(args):
                print(f"[hf-loopcache-eval] {note}", file=sys.stderr, flush=True)
        parser.execute(args)
    finally:
        sys.argv = saved
    return 0
