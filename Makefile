# Two commands: `make serve` and `make test`. Both set everything up on a fresh machine.
PYTHON ?= python3
# The interpreter $(PYTHON) names, asked once: the other $(shell ...) calls below run it
# directly rather than through a launcher such as pyenv's shim (about 50 ms of CPU a
# call, paid again for every sub-make and every `make -n` the tests run).
PYTHON_EXE := $(shell $(PYTHON) -c 'import sys; print(sys.executable)')
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The codex releases the project is tested against, and the pinned one `make serve-codex`
# serves: both from bridge/codex_window.py, the one place that names them.
CODEX_VERSIONS := $(shell $(PYTHON_EXE) -m bridge.codex_window)
CODEX_VERSION := $(shell $(PYTHON_EXE) -m bridge.codex_window --pin)
# Each release in a folder of its own, .codex-npm/<version>/; what runs is the native
# binary the package ships for this platform (88 MB and `initialize` after ~48 ms per
# app-server, against 132 MB and ~115 ms through the Node launcher), else the launcher;
# see scenarios/codex_install.py.
CODEX_DIR := .codex-npm
CODEX_BINS := $(foreach version,$(CODEX_VERSIONS),$(CODEX_DIR)/$(version)/node_modules/.bin/codex)
HOST ?= 127.0.0.1
PORT ?= 8787
PRESET ?= trusted
APP_SERVER ?= $(abspath $(BIN))/fake-codex app-server

# Empty: `rest-bridge cluster` starts one replica per core.
REPLICAS ?=

# Python's compiled bytecode is kept, in the venv rather than beside the sources, even
# where the environment says not to write it (PYTHONDONTWRITEBYTECODE): `make test` starts
# hundreds of Python processes (bridges, fakes, pytest runs and their workers), and each
# would compile the project's modules again, about 1.6 CPU-s per pytest start and 0.1 s
# per bridge. A PYTHONPYCACHEPREFIX of your own is kept.
PYTHONPYCACHEPREFIX ?= $(abspath $(VENV))/pycache
export PYTHONPYCACHEPREFIX
unexport PYTHONDONTWRITEBYTECODE

# uv, which installs the venvs: from PyPI, with pip, into a folder of its own (no venv, no
# system install), pinned so that every machine resolves the same way. The interpreter
# itself (sys.executable) runs pip, not a launcher such as pyenv's shim, which after a
# `-m pip` waits for a lock of its own (a minute, then fails, where that lock was left
# behind). uv makes the venvs on that same interpreter.
UV_DIR := .uv
UV := $(UV_DIR)/bin/uv
UV_VERSION := 0.13.9
$(UV):
	PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 \
		$(PYTHON_EXE) -m pip install --quiet --target $(UV_DIR) uv==$(UV_VERSION)

.PHONY: serve serve-codex serve-codex-offline test test-lowest check lint typecheck pytest codex dist nginx prometheus cluster bench reliability clean

# openai-codex (the official SDK, an independent client for tests/fakes/test_sdk_dropin.py)
# goes in with --no-deps: its only other dependency is openai-codex-cli-bin, a 142 MB
# wheel with a real codex binary that the tests never run (they hand the SDK
# `codex_bin=fake-codex`). Its small deps (pydantic, packaging) are in the `test` extra.
# The venvs are made and filled by uv (PyPI's `uv`, bootstrapped above): on a clean
# clone it installs this venv in about 3 CPU-s where pip took about 24 (its cache warm or
# cold alike). uv reads its own settings (UV_DEFAULT_INDEX, UV_INDEX ...), not pip's.
# `--seed` puts pip in the venv: tests/scenarios/test_install_into_a_new_project.py runs
# it. `--compile-bytecode` compiles the dependencies once, here, into PYTHONPYCACHEPREFIX
# (above), as pip did: left to the first import, each of the test run's workers, all
# starting at once, would compile them again.
#
# The project is installed editable as a plain path in a `.pth` file (setuptools'
# `editable_mode=compat`) rather than through the import hook setuptools writes by default,
# which every Python process of the venv imports at start: about 27 M instructions (some
# 10 ms) per process, and `make test` starts some 2,300 of them.
EDITABLE := -C editable_mode=compat
$(STAMP): pyproject.toml $(UV)
	$(UV) venv --quiet --seed --allow-existing --python $(PYTHON_EXE) $(VENV)
	VIRTUAL_ENV=$(VENV) $(UV) pip install --quiet --compile-bytecode $(EDITABLE) -e '.[dev]'
	VIRTUAL_ENV=$(VENV) $(UV) pip install --quiet --compile-bytecode --no-deps openai-codex==0.163.0
	touch $(STAMP)

# What serving needs, and no more: the package and its runtime dependencies (no test or
# lint tools). A venv that has the development install (above) has all of it already.
SERVE_STAMP := $(VENV)/.installed-serve
$(SERVE_STAMP): pyproject.toml $(UV)
	@if [ -f $(STAMP) ] && [ $(STAMP) -nt pyproject.toml ]; then :; else \
		$(UV) venv --quiet --seed --allow-existing --python $(PYTHON_EXE) $(VENV) && \
		VIRTUAL_ENV=$(VENV) $(UV) pip install --quiet $(EDITABLE) -e .; \
	fi
	touch $@

# Every real codex of the window, each installed into an ignored folder of the project.
$(CODEX_DIR)/%/node_modules/.bin/codex:
	@if command -v npm >/dev/null 2>&1; then \
		mkdir -p $(CODEX_DIR)/$* && \
		npm install --prefix $(CODEX_DIR)/$* --no-audit --no-fund --loglevel=error \
			@openai/codex@$*; \
	else \
		echo "npm not found: tests that need the real codex will skip (they fail when CI=true)"; \
	fi

codex: $(CODEX_BINS)

# What `make serve` says first: the fake by default, else the command it was given.
ifeq ($(origin APP_SERVER),file)
SERVE_NOTE := Serving on the bundled fake app-server. To front the real Codex instead: make serve-codex (the pinned release, installed for you), or make serve APP_SERVER='codex app-server' (a codex on your PATH)
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

# Prometheus, which scrapes a bridge and a cluster in tests/reliability/test_prometheus.py:
# Debian's package, installed like nginx (the test skips without it, and fails when CI=true).
# The package's service is not started: the test runs its own Prometheus.
prometheus:
	@if command -v prometheus >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus; \
	else \
		echo "prometheus not found: tests that need it will skip (they fail when CI=true)"; \
	fi

# N replicas (one per core unless REPLICAS=N) behind nginx on loopback; Ctrl-C stops all.
cluster: $(STAMP) nginx
	$(BIN)/rest-bridge cluster $(if $(REPLICAS),--replicas $(REPLICAS)) --preset $(PRESET) --host $(HOST) \
		--port $(PORT) --app-server "$(APP_SERVER)"

# The venv's bin/ first on PATH: an APP_SERVER given as `fake-codex app-server --script F`
# finds the bundled fake as the default command does.
serve: $(SERVE_STAMP)
	@echo "$(SERVE_NOTE)"
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/rest-bridge serve --preset $(PRESET) --host $(HOST) --port $(PORT) --app-server "$(APP_SERVER)"

# `make serve` on the pinned real codex: its native binary, found once it is installed.
# Another release: `make serve-codex CODEX_VERSION=0.171.0` (one outside the window is
# installed too, and `rest-bridge serve` says it was not tested).
serve-codex: $(SERVE_STAMP) $(CODEX_DIR)/$(CODEX_VERSION)/node_modules/.bin/codex
	@set -e; codex="$$($(BIN)/python -m scenarios.codex_install $(CODEX_DIR) $(CODEX_VERSION))"; \
		echo "Serving on the real codex: $$codex app-server"; \
		$(BIN)/rest-bridge serve --preset $(PRESET) --host $(HOST) --port $(PORT) \
			--app-server "$$codex app-server"

# The pinned real codex offline: behind the scripted model endpoint (fakes/model_provider.py,
# MODEL_SCRIPT=FILE for its replies, else it answers "Done."), with no credentials and no
# network, in a CODEX_HOME of its own (a temporary folder, removed at exit).
MODEL_SCRIPT ?=
serve-codex-offline: $(SERVE_STAMP) $(CODEX_DIR)/$(CODEX_VERSION)/node_modules/.bin/codex
	@set -e; codex="$$($(BIN)/python -m scenarios.codex_install $(CODEX_DIR) $(CODEX_VERSION))"; \
		echo "Serving on the real codex, offline, on the scripted model: $$codex app-server"; \
		$(BIN)/python -m fakes.model_provider $(if $(MODEL_SCRIPT),--script $(MODEL_SCRIPT)) \
			--bridge "$$codex" -- --preset $(PRESET) --host $(HOST) --port $(PORT)

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

# All of it, shared out between pytest-xdist's workers: two per core, or JOBS=N. The tests
# wait on the processes they start much of the time (a worker was busy 61% of the run
# with one per core): two per core keep the cores busy. The tests that count the test
# process's own children, descriptors or memory run in one xdist group per kind
# (tests/tiers.py).
# The full-size install runs (marked `full_run`: fresh venvs installed from the index) are
# left to `make reliability`; a cheaper check that the wheel installs stays here.
JOBS ?= $(shell $(PYTHON_EXE) -c 'import os; print(2 * (os.cpu_count() or 1))')
pytest: $(STAMP) codex nginx prometheus
	$(BIN)/pytest -n $(JOBS) --dist loadgroup -m "not full_run"

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
$(LOWEST_VENV)/.installed: pyproject.toml $(UV)
	$(UV) venv --quiet --allow-existing --python $(PYTHON_EXE) $(LOWEST_VENV)
	printf '%s\n' $(LOWEST_PINS) > $(LOWEST_VENV)/constraints.txt
	VIRTUAL_ENV=$(LOWEST_VENV) $(UV) pip install --quiet --compile-bytecode \
		-c $(LOWEST_VENV)/constraints.txt $(EDITABLE) -e '.[test]'
	touch $@

# Left out there: the tests of the codex tooling (the release window, the schema diff:
# npm and the real codex, no aiohttp) and of the CLI's import graph, which no range moves;
# the main run has them. Every test that serves or calls through aiohttp stays. One
# worker per core (LOWEST_JOBS=N), beside the main run's; and without the pytest plugins
# of hypothesis, faker and schemathesis, which no test of tests/bridge uses (0.6 CPU-s
# of imports per pytest process).
LOWEST_JOBS ?= auto
LOWEST_LEAVES_OUT := tests/bridge/test_codex_diff.py tests/bridge/test_codex_window.py \
	tests/bridge/test_cli.py
# Left out there too, test by test: the start-up refusals, a command of the bridge run
# with a bad setting, option or secret file that exits 2 naming it before it serves
# anything (`rest-bridge serve` before it listens, `rest-bridge front-config`, which
# serves nothing). What they run is the bridge's own parsing (and pydantic's, the same
# version in both venvs); aiohttp is imported there, never used. Each costs a Python
# start and its imports (0.4-0.9 CPU-s). Other refusals (test_secrets.py's unusable
# secret files, test_ops.py's bad ops ports, test_method_policy.py's bad rules) run the
# CLI's main in the test process instead (tests/cli_runs.py), and so run here too.
# tests/test_makefile.py holds each to that: no aiohttp, orjson or faker, no fixture,
# an exit status of 2 asserted.
LOWEST_REFUSALS := \
	tests/bridge/test_secrets.py::test_a_secret_file_that_is_a_fifo_stops_serve_instead_of_waiting_for_a_writer \
	tests/bridge/test_replica.py::test_serve_refuses_a_bad_replica_id \
	tests/bridge/test_logs.py::test_a_bad_log_variable_stops_serve_naming_it \
	tests/bridge/test_front.py::test_front_config_refuses_bad_replicas \
	tests/bridge/test_front.py::test_front_config_refuses_what_nginx_would_read_as_more_than_one_word
test-lowest: $(LOWEST_VENV)/.installed codex nginx
	$(LOWEST_VENV)/bin/python -c 'import aiohttp, pydantic; print("lowest: aiohttp", aiohttp.__version__, "pydantic", pydantic.VERSION)'
	$(LOWEST_VENV)/bin/pytest tests/bridge -q -p no:cacheprovider -n $(LOWEST_JOBS) --dist loadgroup \
		-p no:hypothesispytest -p no:faker -p no:schemathesis \
		$(LOWEST_LEAVES_OUT:%=--ignore=%) $(LOWEST_REFUSALS:%=--deselect=%)

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
# row fails (it shows which); the target then fails too. Then the full-size install runs
# (`full_run`: each install form of README.md in a fresh venv), which `make test` leaves out.
RELIABILITY_RESULTS := $(VENV)/reliability-results.json
reliability: $(STAMP)
	RELIABILITY_SOAK=full RELIABILITY_RESULTS=$(RELIABILITY_RESULTS) \
		$(BIN)/pytest tests/reliability -p no:cacheprovider; status=$$?; \
	$(BIN)/pytest -m full_run tests -p no:cacheprovider || status=1; \
	PYTHONPATH=. $(BIN)/python tests/reliability/report.py $(RELIABILITY_RESULTS) docs/RELIABILITY.md \
		&& exit $$status

clean:
	rm -rf $(VENV) $(BUILD_VENV) $(LOWEST_VENV) $(UV_DIR) $(CODEX_DIR) dist build *.egg-info .pytest_cache .mypy_cache .ruff_cache
