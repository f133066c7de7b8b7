# Two entry points for people: `make run` and `make test` (see README).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test lint installer

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/vlm-readout-app

# Two workers, each test file whole in one (--dist loadfile): the suite in half the time on two cores.
test: $(STAMP)
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest -q -n 2 --dist loadfile

lint: $(STAMP)
	$(PY) -m pip install --quiet ruff && $(VENV)/bin/ruff check core app tests bench

installer: $(STAMP)
	$(PY) -m pip install --quiet 'pyinstaller>=6,<7'
	$(PY) installer/build.py
