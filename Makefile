# The project's commands; see README.md. `make run` and `make test` set themselves up.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NOTEBOOK := annotated_transformer.ipynb
# Use the kernel installed in .venv, never one a user may have elsewhere.
export JUPYTER_PATH := $(CURDIR)/$(VENV)/share/jupyter
export PYTHONPATH := $(CURDIR)

.PHONY: setup run test bench html lint sync clean

setup: $(STAMP)

$(STAMP): requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (.venv)" >/dev/null
	touch $(STAMP)

run: setup
	mkdir -p build
	$(PY) -m jupyter nbconvert --to notebook --execute $(NOTEBOOK) --output-dir build \
		--ExecutePreprocessor.timeout=-1 --ExecutePreprocessor.kernel_name=python3
	$(MAKE) html

test: setup
	AT_PRESET=smoke AT_BUILD_DIR=build/smoke $(PY) -m pytest tests $(NOTEBOOK) --nbval-lax --nbval-current-env \
		--nbval-cell-timeout=900 -q

# Benchmarks (see tools/bench.py): writes build/bench.json and prints a table.
bench: setup
	$(PY) tools/bench.py

html: setup
	@test -f build/$(NOTEBOOK) || { echo "build/$(NOTEBOOK) is missing: run 'make run' first"; exit 1; }
	$(PY) tools/export_html.py build/$(NOTEBOOK) build/annotated_transformer.html

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# After editing either file: make the other one match (the newer one wins).
sync: setup
	$(VENV)/bin/jupytext --sync $(NOTEBOOK)

clean:
	rm -rf build .pytest_cache .ruff_cache __pycache__ tests/__pycache__
