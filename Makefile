# hvd_scale: set up the environment, run the tests, run the demo.
#
#   make setup   build .venv (torch, TensorFlow, Horovod 0.28.1 from source); skipped when up to date
#   make test    the whole test suite, real multi-process Horovod jobs included
#   make demo    a 2-process horovodrun MNIST-1D training run with AdaScale, and its summary
#   make smoke   a 2-process Horovod job without hvd_scale
#   make docs    the documentation site, built strict into site/ (tests/test_docs.py builds it too)
#   make docs-serve  the site served at http://127.0.0.1:8000/ (its search needs a server)
#   make dist    a release's sdist and wheel in dist/, checked with twine (no upload)
#   make clean   remove caches and build leftovers (keeps .venv; `make distclean` removes it too)

SHELL := /bin/bash
VENV := .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.hvd_scale_ready
# Wall-clock limit for the whole test run, in seconds (each test also has its own pytest-timeout).
TEST_TIMEOUT ?= 3600
PYTEST_ARGS ?=

.PHONY: setup test demo smoke docs docs-serve dist clean distclean

setup: $(STAMP)

# Re-run the (idempotent) set-up when the stamp is missing or older than what defines the environment.
$(STAMP): launch/setup_env.sh launch/build_horovod.py launch/horovod_build_fix.py pyproject.toml
	bash launch/setup_env.sh
	touch $@

# HVD_SCALE_REQUIRE_HOROVOD=1: after `setup` Horovod must be there, so tests needing it never skip.
test: setup
	HVD_SCALE_REQUIRE_HOROVOD=1 timeout --kill-after=30 $(TEST_TIMEOUT) \
		$(PYTHON) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS) tests

# The main job: 2 Horovod workers (Gloo) train the MNIST-1D CNN with AdaScale for 1000 baseline steps.
# The example's RESULT lines (JSON for the tests and benchmarks) are left out; its "done:" line stays.
demo: setup
	set -o pipefail; $(VENV)/bin/hvd-scale run -np 2 --gloo --policy adascale -- \
		$(PYTHON) examples/torch_mnist1d.py --budget 1000 --log-every 100 | grep -v '<stdout>:RESULT {'

# The 2-process Horovod smoke job (no hvd_scale): checks the Horovod install alone.
smoke: setup
	$(VENV)/bin/horovodrun --gloo -np 2 -H localhost:2 $(PYTHON) examples/horovod_smoke.py

# The documentation site (mkdocs.yml, docs/): strict, so a broken link or reference fails; offline.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --clean -d site

# The site served on this machine only, rebuilt as docs/ changes; Ctrl-C stops it. Open it here:
# opened from site/'s files (file://) the pages read, but the browser refuses the search its
# index and worker, and the search box stays at "Initializing search".
DOCS_ADDR ?= 127.0.0.1:8000
docs-serve: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --strict -a $(DOCS_ADDR)

# A release (its version: hvd_scale/__init__.py; its entry: docs/changelog.md): the sdist, the
# wheel built from it, and twine's check of both, as a package index would take them.
dist: setup
	rm -rf dist
	$(PYTHON) -m build --outdir dist .
	$(PYTHON) -m twine check --strict dist/*

clean:
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -print0 | xargs -0 rm -rf
	rm -rf build dist site *.egg-info .pytest_cache .hypothesis

distclean: clean
	rm -rf $(VENV)
