# Two commands do everything: `make demo` runs the main job, `make test` runs the tests.
# Both build .venv (Python >= 3.12, found by scripts/find-python.sh) when it is missing or
# older than requirements.lock.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean

# Exactly the versions in requirements.lock (scripts/install-venv.sh; re-lock with
# scripts/lock.sh after changing a dependency in pyproject.toml).
$(STAMP): pyproject.toml requirements.lock scripts/install-venv.sh
	scripts/install-venv.sh $(VENV)
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/equarx-serve demo

# pytest's exit code 5 (no tests collected) means a broken set-up: it fails like any other.
# Two pytest-xdist workers, each taking whole test files (their module fixtures and cached
# engines built once), in file-name order: many tests wait on subprocesses or compile on one
# core. Tests of emulated hosts take a machine-wide lock (tests/conftest.py).
PYTEST_PARALLEL := -n 2 --dist loadfile --no-loadscope-reorder
test: $(STAMP)
	@$(PY) -m pytest -q $(PYTEST_PARALLEL); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests: the set-up is broken" >&2; fi; \
	exit $$rc

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
