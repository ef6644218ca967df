# Two commands a newcomer needs: `make run` and `make test`. Both create or refresh
# the virtualenv in .venv from pyproject.toml, so a fresh clone needs nothing else.
PYTHON ?= python3
VENV ?= .venv
TF_EXTRA ?= cpu
# Test processes: a test mostly waits on the processes it started, and a module whose tests
# share a trainer runs on one worker (tests/conftest.py), so more workers than cores keep the
# cores busy: on this 2-core machine, pytest 881 s with two (150% CPU), 823 s with three
# (184%), then (the suite of 2026-12-05) 644 s with three (172%), 577 s with four (188%).
TEST_WORKERS ?= 4
# The promise matrix: each cell starts a whole run, and two at a time fill two cores.
MATRIX_WORKERS ?= 2
# make check's tests are CPU-bound: each xdist worker pays the collection again, so one.
CHECK_WORKERS ?= 0
BIN := $(VENV)/bin
STAMP := $(VENV)/.stagefeed-installed
# scikit-learn (examples/digits.py, pyproject's "examples" extra) lives beside the venv, not in
# it: Keras imports scikit-learn, and SciPy with it, whenever they are installed, about a second
# of CPU in each of the suite's hundreds of TensorFlow processes. tests/test_digits_example.py
# puts this folder on PYTHONPATH. Its dependencies are named since numpy must stay the venv's.
EXAMPLES_DIR := $(VENV)/examples-packages
EXAMPLES_PACKAGES := 'scikit-learn>=1.3' scipy joblib threadpoolctl narwhals cloudpickle
# Hugging Face datasets (the HFRecords tests) beside the venv too, for the same reason: Keras
# imports pandas, which datasets needs, about half a second of CPU in each TensorFlow process.
# tests/helpers/hf_packages.py appends it to sys.path, after the venv's own numpy and pyarrow.
HF_DIR := $(VENV)/hf-packages

.PHONY: run test check lint layers typecheck venv bench clean bytecode
# This machine class runs with PYTHONDONTWRITEBYTECODE=1, so Python never caches the bytecode
# of this checkout's modules and every process the suite starts compiles stagefeed and the test
# helpers again. Compiled once before pytest instead (Python still reads a cache it did not
# write): on test_run, test_run_transport, test_exit_codes and test_signals (-n 3), user CPU
# 74.5 -> 69.7 s and 88.2 -> 72.2 s in two A/B pairs.
SOURCES := common producer consumer bench stagefeed tests examples tools
# The type checker on the public API ([tool.mypy] in pyproject.toml): mypy reads the package
# laid out as it installs, a tree of links made afresh by tools/typecheck_tree.py.
TYPECHECK := $(BIN)/python tools/typecheck_tree.py build/typecheck && $(BIN)/mypy

$(STAMP): pyproject.toml tests/k8s-renderer.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[$(TF_EXTRA),dev]'
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps \
		--ignore-requires-python --require-hashes -r tests/k8s-renderer.txt
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps --upgrade \
		--target $(EXAMPLES_DIR) $(EXAMPLES_PACKAGES)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade \
		--target $(HF_DIR) 'datasets>=2.14'
	touch $(STAMP)

venv: $(STAMP)

bytecode: $(STAMP)
	@$(BIN)/python -m compileall -q -j 0 $(SOURCES) > /dev/null

run: $(STAMP)
	$(BIN)/stagefeed run

test: $(STAMP) bytecode
	$(BIN)/ruff check .
	$(MAKE) --no-print-directory layers
	$(TYPECHECK)
	@start=$$(date +%s); $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup \
		--durations=20 --ignore=tests/matrix; code=$$?; \
		echo "make test: pytest took $$(( $$(date +%s) - start )) s (exit $$code)"; exit $$code

# The inner loop, under two minutes: ruff, the layer map (import-linter), the type checker and
# the fast tests (no process started, no TensorFlow loaded: tests/helpers/fast_tests.py, pytest --fast).
check: $(STAMP) bytecode
	$(BIN)/ruff check .
	$(MAKE) --no-print-directory layers
	$(TYPECHECK)
	$(BIN)/python -m pytest -q -n $(CHECK_WORKERS) --fast --ignore=tests/matrix

lint: $(STAMP)
	$(BIN)/ruff check .

# The layer map of docs/architecture.md: the import-linter contracts in pyproject.toml.
# lint-imports finds a package by walking its folder; stagefeed/'s links to common/, producer/,
# consumer/ and bench/ lay the repository out as the package installs (pyproject's package-dir),
# so it runs from the root, as plain `lint-imports` does.
layers: $(STAMP)
	$(BIN)/lint-imports --no-cache

typecheck: $(STAMP)
	$(TYPECHECK)

bench: $(STAMP)
	$(BIN)/stagefeed bench steps
	$(BIN)/stagefeed bench steps --modes keras
	$(BIN)/stagefeed bench ingest
	$(BIN)/stagefeed bench input

clean:
	rm -rf $(VENV) build *.egg-info

.PHONY: test-matrix
# The promise matrix (docs/guarantees.md, "The promise matrix"): every promise on every path,
# transport and producer speed, with real processes; its own target so that `make test` keeps
# its budget (.ci/run runs both). Cells are independent: spread over the workers as they come.
test-matrix: $(STAMP) bytecode
	@start=$$(date +%s); $(BIN)/python -m pytest -q -n $(MATRIX_WORKERS) --dist load tests/matrix; \
		code=$$?; echo "make test-matrix: pytest took $$(( $$(date +%s) - start )) s (exit $$code)"; \
		exit $$code

.PHONY: test-compose
# docker/compose.yaml under a real Docker engine: images built, `up --scale producer=3` over tcp
# and shared memory, a producer container killed, `down` leaving nothing (tests/compose/run.sh;
# docs/deployment.md). Starts a private engine where none answers and it runs as root; skips,
# saying why, elsewhere. `make test` never needs Docker.
test-compose: $(STAMP)
	bash tests/compose/run.sh $(BIN)/python

.PHONY: fuzz
# Property-based fuzzing of the decoders and the intake, longer than `make test` runs it:
# thousands of examples per property (the Hypothesis profile in tests/test_fuzz_protocol.py).
fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=fuzz $(BIN)/python -m pytest -q tests/test_fuzz_protocol.py tests/test_fuzz_intake.py
