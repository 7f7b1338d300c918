# The project's commands; see README.md. `make run`, `make test` and `make lab` set themselves up.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
NOTEBOOK := annotated_transformer.ipynb
# The Chinese edition, built from the English one and locale/zh_CN (`make translations`).
NOTEBOOK_ZH := annotated_transformer.zh-CN.ipynb
# The notebook's kernel: a name of its own, so it is never confused with another python3.
KERNEL := annotated-transformer
# Use the kernel installed in .venv, never one a user may have elsewhere.
export JUPYTER_PATH := $(CURDIR)/$(VENV)/share/jupyter
export PYTHONPATH := $(CURDIR)
# JupyterLab refuses to run as root (as in many containers) unless told it may.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)
# The compatibility environment: the oldest versions we claim (README, "Versions").
COMPAT_VENV := .venv-compat
COMPAT_PINS := altair==5.5.0 pandas==2.2.3 numpy==2.1.3  # replace these three of requirements.txt

# Where pip finds torch. Empty: PyPI, whose Linux x86-64 torch is the CUDA build (gigabytes).
# On a Linux machine without a GPU, `make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu`
# takes the CPU-only build instead (README, "Start here").
TORCH_INDEX ?=
# The tests whose numbers depend on the CPU's kernels, run again under other kernel sets.
NUMERICS_TESTS := -m numerics tests

.PHONY: setup kernel lab lab-zh run run-zh test test-numerics test-compat bench html lint translations sync clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(if $(TORCH_INDEX),$(PY) -m pip install --quiet --index-url $(TORCH_INDEX) "$$(grep '^torch==' requirements.txt)")
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m ipykernel install --sys-prefix --name $(KERNEL) --display-name "Annotated Transformer (.venv)" >/dev/null
	touch $@

# For readers who run their own Jupyter: the same kernel, installed for this user.
kernel: setup
	$(PY) -m ipykernel install --user --name $(KERNEL) --display-name "Annotated Transformer (.venv)"

lab: setup
	$(PY) -m jupyterlab $(NOTEBOOK) $(ALLOW_ROOT)

# The Chinese edition (a target of its own: `make lab LANG=…` would collide with the locale
# variable LANG, which every shell sets).
lab-zh: setup
	$(PY) -m jupyterlab $(NOTEBOOK_ZH) $(ALLOW_ROOT)

run: setup
	$(PY) tools/run_notebook.py $(NOTEBOOK) build/$(NOTEBOOK)
	$(MAKE) --no-print-directory html
	@echo "executed notebook: $(CURDIR)/build/$(NOTEBOOK)"
	@echo "page (offline):    $(CURDIR)/build/annotated_transformer.html"
	@echo "results:           $(CURDIR)/build/results.json"

# The Chinese notebook, run on its own: its printed lines and charts are Chinese. It trains
# only what no run of either edition has trained (translated strings are harmless edits).
run-zh: setup
	$(PY) tools/run_notebook.py $(NOTEBOOK_ZH) build/zh/$(NOTEBOOK_ZH)
	$(PY) tools/export_html.py build/zh/$(NOTEBOOK_ZH) build/annotated_transformer.zh-CN.html
	@echo "中文版 (offline):  $(CURDIR)/build/annotated_transformer.zh-CN.html"

# A worker per core, up to four (pytest-xdist); tests/conftest.py keeps both notebooks and
# the page's tests on one of them, in order. That worker sets the pace (on 2 cores it runs
# for nearly all of `make test`), so more workers would only take memory.
test: setup
	rm -rf build/smoke/data/checkpoints  # every test run trains the code it tests
	AT_PRESET=smoke AT_BUILD_DIR=build/smoke AT_DATA_DIR=build/smoke/data $(PY) -m pytest tests $(NOTEBOOK) $(NOTEBOOK_ZH) --nbval-lax --nbval-current-env \
		--nbval-cell-timeout=900 -q --durations=15 \
		-n auto --maxprocesses=4

# The numerically sensitive tests (marked `numerics`) under each kernel set the machine has,
# each of which rounds differently, as another CPU would; the tests must hold under all of
# them: the machine's own kernels (AVX-512 where it has them); PyTorch's generic kernels;
# MKL's SSE2 code branch for matrix products (MKL_CBWR, which also takes effect on AMD
# CPUs); and a CPU with AVX2 at most, as PyTorch, oneDNN and MKL (which heeds
# MKL_ENABLE_INSTRUCTIONS on Intel CPUs only) would see it. A leg can only choose kernels at
# or below what the CPU has. The tests run on one thread (tests/conftest.py), as a notebook
# kernel does under `make test`; the processes they start set their own thread counts.
test-numerics: setup
	$(PY) -m pytest $(NUMERICS_TESTS) -q
	ATEN_CPU_CAPABILITY=default $(PY) -m pytest $(NUMERICS_TESTS) -q
	MKL_CBWR=COMPATIBLE $(PY) -m pytest $(NUMERICS_TESTS) -q
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
		$(PY) -m pytest $(NUMERICS_TESTS) -q

# The smoke notebook under the oldest versions we support (torch and Python as here).
test-compat: setup
	test -x $(COMPAT_VENV)/bin/python || $(PYTHON) -m venv $(COMPAT_VENV)
	grep -v -E '^(altair|pandas|numpy)==' requirements.txt > $(COMPAT_VENV)/requirements.txt
	$(COMPAT_VENV)/bin/python -m pip install --quiet -r $(COMPAT_VENV)/requirements.txt $(COMPAT_PINS)
	$(COMPAT_VENV)/bin/python -c "import altair, numpy, pandas, sys, torch; print('compat:', \
		'Python', sys.version.split()[0], 'torch', torch.__version__, 'altair', altair.__version__, \
		'pandas', pandas.__version__, 'numpy', numpy.__version__)"
	AT_PRESET=smoke AT_BUILD_DIR=build/compat AT_DATA_DIR=build/compat/data $(COMPAT_VENV)/bin/python -m pytest $(NOTEBOOK) \
		--nbval-lax --nbval-current-env --nbval-cell-timeout=900 -q

# Benchmarks (see tools/bench.py): writes build/bench.json and prints a table.
bench: setup
	$(PY) tools/bench.py

# The pages, each from its own notebook's run: the English one from `make run`; the Chinese one
# from `make run-zh` when that has run since the Chinese notebook last changed (a page built
# from the English run would show English charts and printed lines). `make run` takes 17-31
# minutes on 2 cores and running the Chinese notebook too would add minutes more, so the
# Chinese run is its own command: it loads the model `make run` trained.
html: setup
	@test -f build/$(NOTEBOOK) || { echo "build/$(NOTEBOOK) is missing: run 'make run' first"; exit 1; }
	$(PY) tools/export_html.py build/$(NOTEBOOK) build/annotated_transformer.html
	@if [ build/zh/$(NOTEBOOK_ZH) -nt $(NOTEBOOK_ZH) ]; then \
		$(PY) tools/export_html.py build/zh/$(NOTEBOOK_ZH) build/annotated_transformer.zh-CN.html; \
		echo "中文版 (offline):  $(CURDIR)/build/annotated_transformer.zh-CN.html"; \
	else \
		rm -f build/annotated_transformer.zh-CN.html; \
		echo "中文版网页：运行 make run-zh（它载入 make run 训练好的模型，不再训练）"; \
	fi

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) tools/translations.py check

# After editing the English prose: update the catalogue (msgmerge; needs GNU gettext) and
# rebuild the Chinese notebook; then translate the entries that `make lint` names.
translations: setup
	$(PY) tools/translations.py update

# After editing either file: make the other one match (the newer one wins).
sync: setup
	$(VENV)/bin/jupytext --sync $(NOTEBOOK)

clean:
	rm -rf build .pytest_cache .ruff_cache __pycache__ tests/__pycache__
