# Two commands: `make serve` and `make test`. Both set everything up on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CODEX_VERSION := 0.169.0
CODEX_DIR := .codex-npm
CODEX_BIN := $(CODEX_DIR)/node_modules/.bin/codex
HOST ?= 127.0.0.1
PORT ?= 8787
PRESET ?= trusted
APP_SERVER ?= $(abspath $(BIN))/fake-codex app-server

.PHONY: serve test lint typecheck pytest codex bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
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

serve: $(STAMP)
	@echo "Serving on the bundled fake app-server. To front the real Codex instead:"
	@echo "    make serve APP_SERVER='codex app-server'"
	$(BIN)/rest-bridge serve --preset $(PRESET) --host $(HOST) --port $(PORT) --app-server "$(APP_SERVER)"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP) codex
	$(BIN)/pytest

test: lint typecheck pytest

clean:
	rm -rf $(VENV) $(CODEX_DIR) .pytest_cache .mypy_cache .ruff_cache
