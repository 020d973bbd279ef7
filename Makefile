# Each target builds the environment it needs in .venv (Python 3.11 and the package index only), installing
# exact versions with hashes from requirements/*.lock. Run `make lock` after changing a dependency in
# pyproject.toml (which keeps lower bounds only, so users can still install the library unpinned).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# torch==2.13.0 is the CPU wheel; where this machine keeps it on disk, the lock takes its hash from there.
WHEELS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels)
LOCK := $(BIN)/uv pip compile pyproject.toml --generate-hashes --python-version 3.11 \
        --python-platform x86_64-manylinux_2_28 $(WHEELS) --quiet

.PHONY: demo test typecheck lint fuzz fuzz-live lock clean web

$(BIN)/python:
	$(PY) -m venv $(VENV)

# One stamp per lock: `make demo` needs the demo set, `make test` the dev set (a superset, same versions).
$(VENV)/.%-installed: requirements/%.lock pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --require-hashes --no-deps -r $<
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $@

demo: $(VENV)/.demo-installed
	$(BIN)/peerloom demo --profile default --out peerloom-demo

# The browser peer (web/, spec/browser.md): installed from its lock file and bundled into web/dist, which the
# node's HTTP edge serves at /train and tests/web tests. Without npm the browser tests skip, saying why.
NPM := $(shell command -v npm 2>/dev/null)

web:
	cd web && npm ci --no-audit --no-fund && npm run typecheck && npm run build

# Bytecode caches are written (some shells export PYTHONDONTWRITEBYTECODE=1): without them every pytest worker
# rewrites and compiles the ~540 test and package modules again (collection 18 s instead of 7), and every node
# process a test starts compiles peerloom from source. __pycache__/ is ignored by git.
unexport PYTHONDONTWRITEBYTECODE

# The suite runs on TEST_WORKERS pytest-xdist workers; then, alone, the tests marked `serial` (each asserts a
# wall-clock bound that another test's load beside it could break; tests/serial_lock.py).
TEST_WORKERS ?= 2

test: $(VENV)/.dev-installed $(if $(NPM),web)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not serial"
	$(BIN)/python -m pytest -q -m serial
	$(BIN)/ruff check .
	$(TYPECHECK)

# mypy ([tool.mypy] in pyproject.toml: strict on core/ and adapters/host.py) on the package as it installs. mypy
# does not read [tool.setuptools] package-dir, so the recipe links the top-level folders into one `peerloom` tree
# under .typecheck/ (with mypy's cache) and checks it from there; errors name peerloom/core/... for core/....
define TYPECHECK
rm -rf .typecheck/peerloom && mkdir -p .typecheck/peerloom
ln -s $(CURDIR)/peerloom/*.py $(CURDIR)/core $(CURDIR)/adapters $(CURDIR)/backends $(CURDIR)/sim .typecheck/peerloom/
cd .typecheck && $(abspath $(BIN))/python -m mypy --config-file $(CURDIR)/pyproject.toml --cache-dir cache -p peerloom
endef

typecheck: $(VENV)/.dev-installed
	$(TYPECHECK)

# Long Hypothesis run over every decoder fuzz test (by hand; not part of CI);
# the example count is the "fuzz" profile in tests/conftest.py.
FUZZ_TESTS := tests/adapters/test_transport_fuzz.py tests/core/test_encoding.py tests/core/test_messages.py tests/core/test_objects.py

fuzz: $(VENV)/.dev-installed
	HYPOTHESIS_PROFILE=fuzz $(BIN)/python -m pytest -q -p no:cacheprovider $(FUZZ_TESTS)

# Every attack of tests/live_attacks.py for a minute against a live fleet, then the identity flood and the
# resource-exhaustion attacks (spec/transport.md §13-14) for a minute each (by hand; CI runs the short forms in
# tests/e2e). Prints one JSON line per attack, then the flood's measurements and pytest's summary.
fuzz-live: $(VENV)/.dev-installed
	$(BIN)/python -m tests.live_attacks --seconds 60 --dir peerloom-fuzz-live
	$(BIN)/python -m tests.e2e.test_identity_flood_live 12000
	PEERLOOM_LIVE_ATTACK_S=60 $(BIN)/python -m pytest -q -p no:cacheprovider tests/e2e/test_exhaustion_live.py \
		tests/e2e/test_relay_flood_live.py tests/e2e/test_fair_serving_live.py

# Refresh every lock from pyproject.toml: dev first, then each smaller set constrained to dev's versions.
lock: $(VENV)/.dev-installed
	$(LOCK) --extra dev -o requirements/dev.lock
	for set in node torch demo hf auth dp; do $(LOCK) --extra $$set -c requirements/dev.lock -o requirements/$$set.lock; done

clean:
	rm -rf web/node_modules web/dist $(VENV) peerloom-demo peerloom-fuzz-live .pytest_cache .hypothesis .typecheck
