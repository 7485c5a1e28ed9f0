# Zattera: `make up` starts the whole single-machine cluster, `make test` runs lint, types and tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: up test lint typecheck pytest bench chaos proto clean install system-packages

# Debian packages the data plane and runtimes use (one line per feature, so additions merge cleanly).
SYSTEM_PACKAGES :=
SYSTEM_PACKAGES += docker-compose docker-registry  # compose.yaml run for real on the tests' daemon (tests/e2e/test_compose_stack.py); a local registry for the pull-credentials test (tests/agent/test_registry_auth.py); issue 20
SYSTEM_PACKAGES += iproute2  # ip netns: the cross-node private-networking test (tests/agent/test_network_netns.py); issue 24
SYSTEM_PACKAGES += wireguard-go wireguard-tools  # the agent's encrypted mesh between machines when the kernel has no WireGuard (services/agent/mesh.py)
SYSTEM_PACKAGES += tcpdump  # tests/multinode: a capture on a machine's veth shows WireGuard and never an app's payload
SYSTEM_PACKAGES += nodejs npm  # builds of Node apps (npm ci, npm run build) and running them (npm start); issue 27
SYSTEM_PACKAGES += pebble  # ACME test CA (pebble, pebble-challtestsrv) for the certificate tests
SYSTEM_PACKAGES += docker.io busybox-static  # the docker runtime (issue 20): its tests start their own dockerd; busybox is their base image
SYSTEM_PACKAGES += chromium  # the web console's browser tests (Playwright drives the system browser)
SYSTEM_PACKAGES += haproxy  # the ingress data plane (issue 18: services/proxy --engine haproxy)
SYSTEM_PACKAGES += bubblewrap  # the process runtime's app sandbox (issue 43: services/agent/sandbox.py; setpriv and nsenter come with util-linux)
SYSTEM_PACKAGES += iptables  # the network fence keeping sandboxed apps off the control plane's ports (services/agent/firewall.py)
SYSTEM_PACKAGES += postgresql pgbackrest redis-server  # managed databases (issue 36: shared/addons/): PostgreSQL 15, its continuous backup and PITR, Redis 7

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

system-packages:
	@deploy/system-packages.sh $(SYSTEM_PACKAGES)

up: $(STAMP) system-packages
	$(VENV)/bin/zattera up

test: lint typecheck pytest

lint: $(STAMP)
	$(PY) -m ruff check shared services cli tests benchmarks

typecheck: $(STAMP)
	$(PY) -m mypy shared services cli

pytest: $(STAMP) system-packages
	$(PY) -m pytest

bench: $(STAMP) system-packages
	$(PY) -m benchmarks.run

chaos: $(STAMP)
	$(PY) -m pytest -m chaos tests/chaos tests/orchestrator/test_failover.py tests/multinode tests/upgrade tests/e2e/test_compose_stack.py -q

proto: $(STAMP)
	PYTHON=$(PY) proto/generate.sh

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache build *.egg-info
