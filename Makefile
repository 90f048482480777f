# Two commands: `make serve` and `make test`. Both set everything up on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CODEX_VERSION := 0.169.0
CODEX_DIR := .codex-npm
CODEX_BIN := $(CODEX_DIR)/node_modules/.bin/codex
# What to run: the native binary the package ships for this platform (88 MB and
# `initialize` after ~48 ms per app-server, against 132 MB and ~115 ms through the Node
# launcher above), else the launcher; see scenarios/codex_install.py.
CODEX := $(shell $(PYTHON) -m scenarios.codex_install $(CODEX_DIR) 2>/dev/null || echo $(CODEX_BIN))
HOST ?= 127.0.0.1
PORT ?= 8787
PRESET ?= trusted
APP_SERVER ?= $(abspath $(BIN))/fake-codex app-server

# Empty: `rest-bridge cluster` starts one replica per core.
REPLICAS ?=

.PHONY: serve serve-codex test test-lowest check lint typecheck pytest codex dist nginx cluster bench reliability clean

# openai-codex (the official SDK, an independent client for tests/fakes/test_sdk_dropin.py)
# goes in with --no-deps: its only other dependency is openai-codex-cli-bin, a 142 MB
# wheel with a real codex binary that the tests never run (they hand the SDK
# `codex_bin=fake-codex`). Its small deps (pydantic, packaging) are in the `test` extra.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps openai-codex==0.163.0
	touch $(STAMP)

# The pinned real codex, installed into an ignored folder of the project.
$(CODEX_BIN):
	@if command -v npm >/dev/null 2>&1; then \
		mkdir -p $(CODEX_DIR) && \
		npm install --prefix $(CODEX_DIR) --no-audit --no-fund --loglevel=error \
			@openai/codex@$(CODEX_VERSION); \
	else \
		echo "npm not found: tests that need the real codex will skip (they fail when CI=true)"; \
	fi

codex: $(CODEX_BIN)

# What `make serve` says first: the fake by default, else the command it was given.
ifeq ($(origin APP_SERVER),file)
SERVE_NOTE := Serving on the bundled fake app-server. To front the real Codex instead: make serve-codex
else
SERVE_NOTE := Serving on the app-server command you gave: $(APP_SERVER)
endif

# nginx, the front of `make cluster` and of the cluster tests: Debian's package, installed
# when missing and we are root (the tests skip without it, and fail when CI=true).
nginx:
	@if command -v nginx >/dev/null 2>&1 || test -x /usr/sbin/nginx; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx; \
	else \
		echo "nginx not found: make cluster needs it, and tests that need it will skip (they fail when CI=true)"; \
	fi

# N replicas (one per core unless REPLICAS=N) behind nginx on loopback; Ctrl-C stops all.
cluster: $(STAMP) nginx
	$(BIN)/rest-bridge cluster $(if $(REPLICAS),--replicas $(REPLICAS)) --preset $(PRESET) --host $(HOST) \
		--port $(PORT) --app-server "$(APP_SERVER)"

serve: $(STAMP)
	@echo "$(SERVE_NOTE)"
	$(BIN)/rest-bridge serve --preset $(PRESET) --host $(HOST) --port $(PORT) --app-server "$(APP_SERVER)"

# `make serve` on the pinned real codex: its native binary, found once it is installed
# (CODEX above is read before `make codex` has run on a fresh machine).
serve-codex: $(STAMP) codex
	@set -e; codex="$$($(BIN)/python -m scenarios.codex_install $(CODEX_DIR))"; \
		echo "Serving on the real codex: $$codex app-server"; \
		$(BIN)/rest-bridge serve --preset $(PRESET) --host $(HOST) --port $(PORT) \
			--app-server "$$codex app-server"

# An sdist and a wheel in dist/, for `pip install` elsewhere (README.md, "Install").
# PyPA's `build` runs in a small venv of its own, so this needs neither `make test`'s
# development install nor anything installed in the system's Python.
BUILD_VENV := .venv-build
$(BUILD_VENV)/.installed:
	$(PYTHON) -m venv $(BUILD_VENV)
	$(BUILD_VENV)/bin/pip install --quiet build
	touch $@

dist: $(BUILD_VENV)/.installed
	rm -rf dist
	$(BUILD_VENV)/bin/python -m build --outdir dist .

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# All of it, shared out between pytest-xdist's workers: one per core, or JOBS=N. The tests
# that count the test process's own children, descriptors or memory run in one xdist
# group per kind (tests/tiers.py).
JOBS ?= auto
pytest: $(STAMP) codex nginx
	$(BIN)/pytest -n $(JOBS) --dist loadgroup

# `make test`: the lint, the types, the tests and the bridge's tests on the lowest versions
# (test-lowest), all at once. The test runs wait on child processes much of the time: side
# by side they keep the cores busier than one after the other. Each target's output is
# printed whole when it ends (make's --output-sync), so the runs' lines do not mix.
test:
	@$(MAKE) --no-print-directory -j4 --output-sync=target lint typecheck pytest test-lowest

# The declared ranges held to their floor: the bridge's tests on the lowest aiohttp that
# pyproject.toml allows (and the lowest of the other runtime ranges that still install on
# this Python), in a venv of its own. `make test` runs the newest in .venv beside it.
LOWEST_VENV := .venv-lowest
LOWEST_PINS := aiohttp==3.13.4 orjson==3.10.0 faker==30.0.0
$(LOWEST_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(LOWEST_VENV)
	$(LOWEST_VENV)/bin/pip install --quiet --upgrade pip
	printf '%s\n' $(LOWEST_PINS) > $(LOWEST_VENV)/constraints.txt
	$(LOWEST_VENV)/bin/pip install --quiet -c $(LOWEST_VENV)/constraints.txt -e '.[test]'
	touch $@

test-lowest: $(LOWEST_VENV)/.installed codex nginx
	$(LOWEST_VENV)/bin/python -c 'import aiohttp, pydantic; print("lowest: aiohttp", aiohttp.__version__, "pydantic", pydantic.VERSION)'
	$(LOWEST_VENV)/bin/pytest tests/bridge -q -p no:cacheprovider -n $(JOBS) --dist loadgroup

# The quick tier, after every change: lint, types, and the tests marked `quick`, which
# start no process (nginx -t aside); tests/tiers.py fails one that does.
check: lint typecheck
	$(BIN)/pytest -q -m quick tests

# The benchmark suite (not part of `make test`): rewrites bench/RESULTS.md. wrk, the
# load generator, comes from Debian's packages when it is missing.
# Options: make bench BENCH_ARGS="--only calls,events --repeats 1 --loops uvloop"
bench: $(STAMP)
	@command -v wrk >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq wrk; }
	@$(MAKE) --no-print-directory nginx
	$(BIN)/python -m bench.run $(BENCH_ARGS)

# The reliability suite at full size (10,000 session cycles, 1,000 text turns, 100 fuzz
# examples per operation; about 45 minutes on 2 cores), then docs/RELIABILITY.md from its
# results. `make test` runs the same tests, smaller. The report is written even when a
# row fails (it shows which); the target then fails too.
RELIABILITY_RESULTS := $(VENV)/reliability-results.json
reliability: $(STAMP)
	RELIABILITY_SOAK=full RELIABILITY_RESULTS=$(RELIABILITY_RESULTS) \
		$(BIN)/pytest tests/reliability -p no:cacheprovider; status=$$?; \
	PYTHONPATH=. $(BIN)/python tests/reliability/report.py $(RELIABILITY_RESULTS) docs/RELIABILITY.md \
		&& exit $$status

clean:
	rm -rf $(VENV) $(BUILD_VENV) $(LOWEST_VENV) $(CODEX_DIR) dist build *.egg-info .pytest_cache .mypy_cache .ruff_cache
