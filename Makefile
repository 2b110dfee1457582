# The two commands of the README: `make demo` and `make test` set everything up first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test lint bench-quick clean

$(BIN)/aiokv: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch that this project's machines keep on disk; without the pin
	# pip would fetch a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	# web: the FastAPI and aiohttp examples, which the tests run; metrics: the tests
	# scrape aiokv.metrics' collector.
	$(BIN)/python -m pip install -q -e '.[dev,bench,web,metrics]'
	touch $@

setup: $(BIN)/aiokv

demo: setup
	$(BIN)/aiokv demo

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check aiokv tests benchmarks examples
	$(BIN)/mypy --strict aiokv

bench-quick: setup
	$(BIN)/aiokv bench engine --quick

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
