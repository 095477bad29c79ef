"""Evaluation doors of hf_loopcache, kept outside the importable core (the library never imports `lm_eval`).

This package will hold the lm-eval model registration (`hf_loopcache` model for `lm_eval`) and task configurations
(GSM8K, MATH500, RULER, LongBench) with paired-bootstrap comparisons; it is built in the [eval] issue.
"""

__all__: list[str] = []
