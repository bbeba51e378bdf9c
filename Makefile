# Two commands matter (see README):
#   make lab    set everything up, then open the workbook in JupyterLab
#   make test   set everything up, then run every test (unit tests + every notebook in quick mode)
# Everything is installed into .venv inside this folder.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PORT   ?= 8888
NB_TIMEOUT ?= 300
# JupyterLab refuses to start as root unless told; containers often run as root.
ROOT_FLAG := $(shell [ "$$(id -u)" = 0 ] && echo --allow-root)

.PHONY: setup compile lab test test-fast lint test-unit test-notebooks test-browser test-floor bench gpu-check coverage-cuda release solutions grade grade-args clean help

help:
	@echo "make lab         set up .venv and open the workbook in JupyterLab"
	@echo "make test        set up .venv and run every test (quick mode)"
	@echo "make test-fast   lint + unit tests (no notebooks, no browser)"
	@echo "make lint        ruff check + ruff format --check over code and notebooks, mypy over helpers/ and tools/{bench,gpucheck}.py"
	@echo "make test-notebooks  every notebook under nbval, quick mode"
	@echo "make test-browser    every chapter in JupyterLab + headless Chromium (installs Debian's chromium)"
	@echo "make test-floor  the oldest supported torch pair in .venv-floor + every notebook + the unit tests, quick (~12 min from scratch; before a release)"
	@echo "make bench       every chapter's measurements headless -> artifacts/bench-*.json + .png (BENCH_ARGS=--quick)"
	@echo "make gpu-check   on a CUDA machine (at most ~24 min): smoke (CUDA-only tests + notebooks, quick), the bench + a reference file (full sizes), every notebook (full where its estimate fits its share, else laptop), the CUDA-only tests"
	@echo "make coverage-cuda  helpers/ line coverage by the unit tests, CUDA-only lines counted apart (COVERAGE_ARGS='--tests tests/test_x.py')"
	@echo "make release     the student release of every chapter (CHAPTER=04 for one) -> release/ (no answers, no key)"
	@echo "make solutions   the instructor's solutions, generated from course/key.py -> SOLUTIONS.md (do not hand out)"
	@echo "make grade SUBMISSIONS=dir   grade submitted notebooks -> grades.csv + a printed table (docs/INSTRUCTORS.md)"
	@echo "make clean       remove .venv, caches and artifacts"

# Re-installs only when the dependency files change, so a second run is quick. pip byte-compiles what it
# installs: keep it so (with PYTHONDONTWRITEBYTECODE=1, as on our CI machines, nothing else would, and every
# process would compile torch's sources again on import).
$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "Python 3.10 or newer is needed; set PYTHON=python3.x")'
	@$(PYTHON) -c 'import shutil, tempfile; f = min(shutil.disk_usage(p).free for p in (".", tempfile.gettempdir())) / 1e9; f < 7 and print(f"warning: {f:.1f} GB free here or in the temporary folder; the install needs about 7 GB (torch and its NVIDIA libraries). If pip stops with \"No space left on device\", free space and run make again.")'
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test,browser,course]'
	@# nbgrader (the course extra) stays out of the reader's JupyterLab; docs/INSTRUCTORS.md says how to turn it on
	$(BIN)/jupyter labextension disable --level=sys_prefix @jupyter/nbgrader >/dev/null
	for e in formgrader assignment_list course_list validate_assignment; do \
		$(BIN)/jupyter server extension disable --sys-prefix nbgrader.server_extensions.$$e >/dev/null 2>&1; done
	@touch $(STAMP)

setup: $(STAMP)

# Rooted at the repository (so chapter links to ../docs open), on loopback only, opening notebooks/.
lab: setup
	@echo "Opening JupyterLab on http://127.0.0.1:$(PORT) (stop it with Ctrl-C). The URL with its token is printed below."
	$(BIN)/jupyter lab --ServerApp.root_dir=. --ServerApp.default_url=/lab/tree/notebooks \
		--ip=127.0.0.1 --port=$(PORT) $(ROOT_FLAG) $(LAB_ARGS)

# Byte-compiles the workbook's own code once: with PYTHONDONTWRITEBYTECODE=1 (as on our CI machines) every kernel,
# worker and subprocess would otherwise compile helpers/ again on import (about 1 s of CPU each; stale files are
# ignored, as Python checks each source's timestamp).
compile: setup
	@$(BIN)/python -m compileall -q helpers tests examples > /dev/null

test: setup compile
	$(MAKE) --no-print-directory lint
	$(MAKE) --no-print-directory test-unit
	$(MAKE) --no-print-directory test-notebooks
	$(MAKE) --no-print-directory test-browser AFTER_NBVAL=1

test-fast: setup compile lint test-unit

# Lint (pyproject.toml: [tool.ruff], [tool.mypy]): ruff checks and format-checks every .py file and notebook;
# mypy type-checks helpers/ (the package ships py.typed) and tools/bench.py, tools/gpucheck.py.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m mypy

# Two pytest-xdist workers, each test file on one worker (module fixtures run once; tests/conftest.py's
# leak check runs per worker). Many tests wait (subprocesses, timeouts, worker start-up) rather than compute.
# UNIT_WORKERS=0: one process.
UNIT_WORKERS ?= 2
test-unit: setup
	WORKBOOK_QUICK=1 $(BIN)/python -m pytest -q -n $(UNIT_WORKERS) --dist loadfile --durations=15 tests -m "not browser"

# Two xdist workers, each notebook whole on one (its kernel keeps its state); NB_WORKERS=0: one process.
NB_WORKERS ?= 2
test-notebooks: setup
	WORKBOOK_QUICK=1 $(BIN)/python -m pytest -q -p no:cacheprovider --durations=0 -n $(NB_WORKERS) --dist loadfile \
		--nbval-lax --nbval-sanitize-with tests/nbval_sanitize.cfg \
		--nbval-cell-timeout=$(NB_TIMEOUT) notebooks templates

# Every chapter in JupyterLab, driven by headless Chromium (installs Debian's chromium if missing).
# AFTER_NBVAL=1 (as `make test` calls it, right after test-notebooks): each chapter opens with the outputs
# of nbval's run and only the cells its live panel needs run again (docs/BROWSER-TESTS.md); alone: Run All.
AFTER_NBVAL ?=
test-browser: setup
	tools/install_browser.sh
	WORKBOOK_QUICK=1 WORKBOOK_BROWSER_AFTER_NBVAL=$(AFTER_NBVAL) $(BIN)/python -m pytest -q -p no:cacheprovider --durations=0 -m browser tests/browser

# How much of helpers/ the unit tests run, and of its CUDA-only lines (the rule: tools/cuda_coverage.py's docstring).
coverage-cuda: setup
	$(BIN)/python tools/cuda_coverage.py $(COVERAGE_ARGS)

# The oldest torch the workbook supports (pyproject.toml's floor), in its own venv: torch + torchvision first, then
# the workbook WITHOUT constraints.txt, as a reader with torch already installed would (pip keeps their torch), then
# every notebook under nbval in quick mode. Not part of `make test` (the install alone takes minutes): run it before
# a release (docs/CONTRIBUTING.md) and whenever a change uses a newer torch API.
FLOOR_VENV        := .venv-floor
FLOOR_TORCH       ?= 2.7.0
FLOOR_TORCHVISION ?= 0.22.0
FLOOR_STAMP       := $(FLOOR_VENV)/.installed-$(FLOOR_TORCH)-$(FLOOR_TORCHVISION)
$(FLOOR_STAMP): pyproject.toml
	@test -x $(FLOOR_VENV)/bin/python || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(FLOOR_VENV)/bin/python -m pip install --quiet torch==$(FLOOR_TORCH) torchvision==$(FLOOR_TORCHVISION)
	$(FLOOR_VENV)/bin/python -m pip install --quiet -e '.[test]'
	$(FLOOR_VENV)/bin/python tools/check_floor.py --torch $(FLOOR_TORCH) --torchvision $(FLOOR_TORCHVISION)
	@touch $(FLOOR_STAMP)

test-floor: $(FLOOR_STAMP)
	@$(FLOOR_VENV)/bin/python -m compileall -q helpers > /dev/null
	WORKBOOK_QUICK=1 $(FLOOR_VENV)/bin/python -m pytest -q -p no:cacheprovider --durations=0 -n $(NB_WORKERS) --dist loadfile --nbval-current-env \
		--nbval-lax --nbval-sanitize-with tests/nbval_sanitize.cfg \
		--nbval-cell-timeout=$(NB_TIMEOUT) notebooks templates
	WORKBOOK_QUICK=1 $(FLOOR_VENV)/bin/python -m pytest -q -p no:cacheprovider -n $(UNIT_WORKERS) --dist loadfile tests -m "not browser"

# Every chapter's measurements, headless (BENCH_ARGS=--quick for a smoke run).
bench: setup
	$(BIN)/python -m tools.bench $(BENCH_ARGS)

# On a machine with a CUDA GPU, each step within its own time limit (docs/GPU-CHECK.md):
# smoke (quick, every notebook + CUDA-only tests), bench (+ a reference file), notebooks (full), unit (CUDA-only).
GPUCHECK_STEPS ?= smoke,bench,notebooks,unit
gpu-check: setup
	$(BIN)/python -m tools.gpucheck --steps $(GPUCHECK_STEPS) $(GPUCHECK_ARGS)

# Courses and workshops (docs/INSTRUCTORS.md): the answer key is course/key.py, outside the installed package.
RELEASE_DIR ?= release
release: setup
	$(BIN)/python -m course.release --out $(RELEASE_DIR) $(if $(CHAPTER),--chapters $(CHAPTER))

solutions: setup
	$(BIN)/python -m course.release --solutions SOLUTIONS.md $(if $(CHAPTER),--chapters $(CHAPTER))

GRADES ?= grades.csv
grade: grade-args setup
	$(BIN)/python -m course.grade $(SUBMISSIONS) --out $(GRADES)

grade-args:  # before setup: a missing folder is said at once, nothing installed first
	@test -n "$(SUBMISSIONS)" || { echo "make grade needs SUBMISSIONS=<folder of submitted notebooks>"; exit 2; }

clean:
	rm -rf $(VENV) $(FLOOR_VENV) .pytest_cache .ruff_cache .mypy_cache artifacts data-cache
