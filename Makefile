# The two commands of the README: `make demo` and `make test` set everything up first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Mooncake's client links libibverbs (and its libnl) even over TCP: Debian's packages,
# unpacked here rather than installed system-wide (aiokv.remote.native preloads them).
MOONCAKE_SYS := $(VENV)/lib/mooncake-sys
MOONCAKE_DEBS := libibverbs1 libnl-3-200 libnl-route-3-200

.PHONY: setup demo test lint bench-quick clean

# _queue.c: the editable install builds the copy thread's C extension in place; rebuilt when it changes.
$(BIN)/aiokv: pyproject.toml aiokv/copy/_queue.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch that this project's machines keep on disk; without the pin
	# pip would fetch a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	# web: the FastAPI and aiohttp examples, which the tests run; metrics: the tests
	# scrape aiokv.metrics' collector.
	# remote: Mooncake Store's client and programs, which the remote tier's tests run.
	$(BIN)/python -m pip install -q -e '.[dev,bench,web,metrics,remote]'
	touch $@

# Without root apt-get cannot refresh its lists; a machine whose lists are fresh enough
# still downloads. Where neither works the remote tier's tests skip, saying why.
$(MOONCAKE_SYS)/.done:
	rm -rf $(MOONCAKE_SYS) $(MOONCAKE_SYS).debs && mkdir -p $(MOONCAKE_SYS).debs
	cd $(MOONCAKE_SYS).debs && { apt-get download $(MOONCAKE_DEBS) \
	  || { apt-get update -qq && apt-get download $(MOONCAKE_DEBS); }; }
	for deb in $(MOONCAKE_SYS).debs/*.deb; do dpkg -x "$$deb" $(MOONCAKE_SYS); done
	rm -rf $(MOONCAKE_SYS).debs
	touch $@

setup: $(BIN)/aiokv
	-$(MAKE) --no-print-directory $(MOONCAKE_SYS)/.done

demo: setup
	$(BIN)/aiokv demo

# --dist loadfile: a file's tests share its module fixtures (a Mooncake master, a server).
test: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

lint: setup
	$(BIN)/ruff check aiokv tests benchmarks examples
	$(BIN)/mypy --strict aiokv

bench-quick: setup
	$(BIN)/aiokv bench engine --quick

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
