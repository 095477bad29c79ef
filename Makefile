.PHONY: install test test-gpu checkstyle bench demo

install:
	python -m pip install "torch==2.13.0" -e ./hf-loopcache-fixtures -e ".[dev]"

demo:
	python -m hf_loopcache demo

test:
	python -m pytest -q -n auto

test-gpu:
	python -m pytest -q -m gpu

checkstyle:
	ruff check .
	mypy hf_loopcache

bench:
	python -m benchmarks.run generate
