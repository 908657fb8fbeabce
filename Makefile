# The two commands of the README's quick start. Both build .venv from scratch when it is
# missing or older than pyproject.toml; nothing else is needed by hand.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench clean

# The editable install finds `kvstack` after the path entries, so a clone directory named
# kvstack in a script's directory would be imported as an empty namespace package; the
# .pth written last puts the checkout on the path, where the real package wins.
$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[dev,bench,serve,kernels,vision]"
	$(BIN)/python -c "import pathlib, site; pathlib.Path(site.getsitepackages()[0], \
	    'kvstack-checkout.pth').write_text('$(CURDIR)\n')"
	touch $@

demo: $(BIN)/.installed
	$(BIN)/kvstack demo

# Two processes, each running whole test files (--dist loadfile): a file's module
# fixtures (a server, a trained model) are built once, and the README's blocks run in
# order in one scratch directory. A test runs torch on one thread (tests/conftest.py), so
# one process leaves the second core idle.
test: $(BIN)/.installed
	$(BIN)/ruff check kvstack tests bench
	$(BIN)/python -m pytest -n 2 --dist loadfile

bench: $(BIN)/.installed
	$(BIN)/python bench/formats.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis build *.egg-info
