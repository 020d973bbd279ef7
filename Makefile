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

# Long Hypothesis run over every decoder fuzz test (by hand; not part of CI);
# the example count is the "fuzz" profile in tests/conftest.py.
FUZZ_TESTS := tests/test_transport_fuzz.py tests/test_encoding.py tests/test_messages.py tests/test_objects.py

fuzz: $(BIN)/.installed
	HYPOTHESIS_PROFILE=fuzz $(BIN)/python -m pytest -q -p no:cacheprovider $(FUZZ_TESTS)

clean:
	rm -rf $(VENV) peerloom-demo .pytest_cache .hypothesis
