# Two commands for a newcomer: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU wheel of torch lies on local disk; pinning it keeps pip from pulling a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: demo demo-external test venv clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

demo: venv
	$(PY) -m torch_kernelize.demo

# A kernel from outside the project: reproducer -> task -> examples/ candidate -> fill_cache -> triton tier
demo-external: venv
	$(PY) -m torch_kernelize.demo_external

test: venv
	$(PY) -m pytest -n 2 --dist worksteal $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info kernelize_repros
