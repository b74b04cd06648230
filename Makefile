# Quickstart: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch 2.14.1 / torchvision 0.29.1 lie on this machine's disk; torchvision is needed by open_clip (HPSv2.1).
TORCH_PIN ?= torch==2.14.1 torchvision==0.29.1

.PHONY: demo test lint docs bench bench-quality clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

demo: $(VENV)/.installed
	HF_HUB_OFFLINE=1 $(VENV)/bin/trl-jagg demo --output_dir runs/demo

# Two pytest workers (pytest-xdist): the suite's single-process tests keep both CPU cores busy.
test: $(VENV)/.installed
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n 2 tests

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check trl_jagg tests examples docs
	$(VENV)/bin/ruff format --check trl_jagg tests examples docs

docs: $(VENV)/.installed
	$(PY) docs/generate_config_reference.py
	$(PY) docs/make_jagg_figure.py

bench: $(VENV)/.installed
	HF_HUB_OFFLINE=1 $(VENV)/bin/trl-jagg bench --output_dir runs/bench
	HF_HUB_OFFLINE=1 $(VENV)/bin/trl-jagg bench trainer --output_dir runs/bench
	HF_HUB_OFFLINE=1 $(VENV)/bin/trl-jagg bench whole-step --output_dir runs/bench

bench-quality: $(VENV)/.installed
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(VENV)/bin/trl-jagg bench quality --output_dir runs/quality

clean:
	rm -rf runs .pytest_cache
