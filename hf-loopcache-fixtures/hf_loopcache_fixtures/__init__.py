"""Data of hf_loopcache's shipped fixtures; load them with `hf_loopcache.load_fixture("tiny-ouro")`.

`DATA_DIR` holds one folder per fixture (`tiny-ouro/`, `tiny-huginn/`: weights, config, model card), the shared
tokenizer (`tokenizer/`) and the held-out documents (`heldout.jsonl.gz`).
"""

from pathlib import Path

__all__ = ["DATA_DIR", "__version__"]

__version__ = "0.1.0"
DATA_DIR: Path = Path(__file__).resolve().parent
