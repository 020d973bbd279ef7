# Each target builds the environment it needs in .venv (Python 3.11 and the package index only).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint fuzz clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip -q
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[torch,transports,demo,dev]"
	touch $@

demo: $(BIN)/.installed
	$(BIN)/peerloom demo --profile default --out peerloom-demo

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) peerloom-demo .pytest_cache .hypothesis
