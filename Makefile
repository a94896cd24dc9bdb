PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUNTIME_STAMP := $(VENV)/.installed-runtime
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: setup test demo bench lint imports fuzz clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# the runtime dependencies only: what `pip install streamoe` brings
$(RUNTIME_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -qq -e .
	touch $@

# plus the test tools and the peers used as test oracles (mlx-lm, mlx-vlm): `[dev]`
$(DEV_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -qq -e '.[dev]'
	touch $@ $(RUNTIME_STAMP)

setup: $(DEV_STAMP)

# two workers (pytest-xdist): half the suite's time is waiting on subprocesses, servers and the disk, so two
# cores run it in ~0.6 of the serial time; TEST_WORKERS=0 runs it in one process
TEST_WORKERS ?= 2
test: $(DEV_STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n $(TEST_WORKERS)

demo: $(RUNTIME_STAMP)
	$(BIN)/python examples/demo.py

# every bench works in one fresh temporary directory, removed at the end
bench: $(RUNTIME_STAMP)
	scratch=$$(mktemp -d) && trap 'rm -rf "$$scratch"' EXIT && \
	$(BIN)/python -m bench.convert --size small --scratch "$$scratch" && \
	$(BIN)/python -m bench.decode --size small --scratch "$$scratch" && \
	$(BIN)/python -m bench.q3_quality --tokens 768 && \
	$(BIN)/python -m bench.session --model "$$scratch/small-conv" --scratch "$$scratch" --name session-small && \
	$(BIN)/python -m bench.serve --scratch "$$scratch"

lint: $(DEV_STAMP)
	$(BIN)/ruff check .

# every project import resolves statically with jedi (which cannot follow the editable install): bench/results/imports.json
imports: $(DEV_STAMP)
	$(BIN)/python -m bench.check_imports

# every parser fuzzed with 20,000 hostile inputs (hypothesis, a dev tool): bench/results/fuzz.json
fuzz: $(DEV_STAMP)
	$(BIN)/python -m bench.fuzz --examples 20000 --jobs 6

clean:
	rm -rf $(VENV) build *.egg-info
