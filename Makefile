# ppring: `make test` and `make demo` on a fresh machine. Everything lands in .venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ppring-installed
# The CPU build of torch lies on this machine's disk; installing it first stops the project's
# plain `torch` requirement from pulling a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
PIP := $(BIN)/python -m pip --disable-pip-version-check --quiet

.PHONY: setup test test-asan test-long lint demo soak bench-codec bench-ring bench-serve bench-step clean

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

# The kernel tests with the kernels built under AddressSanitizer and UBSan (PPRING_SANITIZE=1,
# a test-only build; any report fails the run). libasan goes first into the interpreter, and
# libstdc++ with it, so that ASan finds the C++ runtime torch throws its errors through.
# Its own cache folder: a sanitized build never lands where a stage would load it.
ASAN_TESTS := tests/stages/test_native.py tests/stages/test_native_bounds.py \
	tests/stages/test_fused_layer.py tests/stages/test_cpu_decode.py tests/stages/test_grid.py \
	tests/stages/test_grid_a8.py tests/stages/test_grid_bf16.py tests/stages/test_native_heads.py \
	tests/stages/test_amx.py tests/stages/test_prefill_attention.py \
	tests/stages/test_attention_window.py tests/stages/test_gguf_matrix.py \
	tests/stages/test_gguf.py::test_a_k_quant_model_runs_its_codes_fused_as_call_by_call \
	tests/stages/test_kv_int8.py
# Of the families' tests, the two that run every family's layers fused and call by call (the
# whole file, most of it transformers' reference, doubled this run).
ASAN_FAMILY_TESTS := \
	tests/stages/test_families.py::test_prefill_batch_then_decodes_match_transformers \
	tests/stages/test_families.py::test_kept_decode_steps_equal_the_general_path_bit_for_bit
test-asan: setup
	PPRING_SANITIZE=1 PPRING_CACHE=$(CURDIR)/$(VENV)/asan-cache \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
	LD_PRELOAD="$$($(CC) -print-file-name=libasan.so) $$($(CC) -print-file-name=libstdc++.so)" \
		$(BIN)/pytest -p no:xdist -p no:cacheprovider --capture=sys -q $(ASAN_TESTS) \
		$(ASAN_FAMILY_TESTS)

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
