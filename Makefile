# ppring: `make test` and `make demo` on a fresh machine. Everything lands in .venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ppring-installed
# The CPU build of torch lies on this machine's disk; installing it first stops the project's
# plain `torch` requirement from pulling a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
PIP := $(BIN)/python -m pip --disable-pip-version-check --quiet

.PHONY: setup test test-long lint demo soak bench-codec bench-ring bench-serve bench-step clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Re-runs only when pyproject.toml changes: a second `make test` installs nothing.
$(STAMP): pyproject.toml | $(BIN)/python
	$(PIP) install "$(TORCH_SPEC)"
	$(PIP) install -e '.[test]'
	touch $@

setup: $(STAMP)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Two workers, a test file each at a time (a module shares one ring among its tests); then the
# tests that assert throughput ratios, alone, so a neighbour's load cannot move their figures.
TEST_WORKERS ?= 2
test: lint
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile -m "not long and not serial"
	$(BIN)/pytest -m "serial and not long" -p no:xdist

# The long variants (marked `long`): e.g. a PP=3 ring of the default model losing a stage
# twice, against transformers. make test runs a short form of each.
test-long: setup
	$(BIN)/ppring prepare-model
	$(BIN)/pytest -m long -s -p no:cacheprovider

# Prepares the default model (once), starts a 2-stage ring, streams one answer, stops it.
demo: setup
	$(BIN)/ppring prepare-model
	$(BIN)/python -m launch.demo

# The full soak: 10,000 requests on a PP=2 ring (make test runs a short form); its figures go
# to bench/results/soak.json.
soak: setup
	$(BIN)/ppring prepare-model
	mkdir -p bench/results
	PPRING_SOAK_REQUESTS=10000 PPRING_SOAK_REPORT=bench/results/soak.json \
		$(BIN)/pytest tests/soak -s -p no:cacheprovider

bench-codec: setup
	$(BIN)/python -m bench.codec

# They write their JSON (and PNG) into bench/results/.
bench-ring: setup
	$(BIN)/ppring bench ring --out bench/results

bench-serve: setup
	$(BIN)/ppring prepare-model
	$(BIN)/ppring bench serve --out bench/results
	$(BIN)/ppring bench serve --workload equal --no-sweep --concurrency 32,64 \
		--hf-dtypes float32 --repeats 3 --out bench/results/equal

bench-step: setup
	$(BIN)/ppring prepare-model
	$(BIN)/ppring bench step --batch-sizes 1,16,32,64 --context 512 --out bench/results

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
