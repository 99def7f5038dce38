# Two commands: `make demo` and `make test`. Both create .venv on first use.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The pinned OPA compiles policies to Wasm (the broker's engine) and runs the Rego unit tests.
OPA_VERSION := v1.22.4
OPA := $(BIN)/opa
# Offline validation of deploy/: kustomize renders, kubeconform checks against JSON schemas the
# tests generate from the Kubernetes OpenAPI document (k8s.io/kubernetes module, Go proxy).
KUSTOMIZE_VERSION := v5.7.1
KUBECONFORM_VERSION := v0.7.0
KUBERNETES_VERSION := v1.34.4
FAKE_GCS_VERSION := v1.56.1
FAKE_GCS := $(BIN)/fake-gcs-server
# An independent DPoP implementation (panva's dpop, Node) makes proofs for tests/unit/test_dpop.py
DPOP_INTEROP := tests/interop/dpop/node_modules/.installed
# The stock CoCo guest's reading of KBS answers on its own crates (kbs-types 0.18, RustCrypto;
# tests/kbs_conformance, pinned by its Cargo.lock): fetched from crates.io by cargo and built into
# build/ in both serde_json map orders (tests/support/kbs_harness.py), so pytest finds it built.
KBS_HARNESS := build/kbs-conformance/kbs-conformance-preserve-order
KUSTOMIZE := $(BIN)/kustomize
KUBECONFORM := $(BIN)/kubeconform
K8S_OPENAPI := $(VENV)/k8s-openapi-$(KUBERNETES_VERSION).json
# Debian packages the tests need (installed by `make test` when missing).
SOFTHSM := /usr/lib/softhsm/libsofthsm2.so
REDIS := /usr/bin/redis-server
# Debian's Chromium and its driver: the console's browser test (tests/integration/test_console_browser.py).
CHROMEDRIVER := /usr/bin/chromedriver
# promtool (Debian's prometheus package; its daemon is not started) checks deploy/prometheus/alerts.yml
# and runs its alert unit tests (tests/integration/test_deploy_monitoring.py).
PROMTOOL := /usr/bin/promtool

.PHONY: demo test lint typecheck pytest policy-test bench soak clean postgresql deploy-tools deploy-check image image-lock

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[server,gcs,dev]'
	@touch $(STAMP)

# The workspace is kept (build/demo): the demo ends with its console's URL and auditor token.
demo: $(STAMP) $(OPA)
	rm -rf build/demo
	$(BIN)/broker demo --workdir build/demo

test: $(STAMP) $(OPA) $(SOFTHSM) $(REDIS) $(CHROMEDRIVER) $(PROMTOOL) $(FAKE_GCS) $(DPOP_INTEROP) $(KBS_HARNESS) postgresql deploy-tools lint typecheck policy-test pytest

# The layer contract (docs/architecture.md) is part of lint: an import up the layers fails here.
lint: $(STAMP)
	$(BIN)/ruff format --check broker tests bench deploy
	$(BIN)/ruff check broker tests bench deploy
	$(BIN)/vulture
	$(BIN)/pytest -q -p no:cacheprovider tests/unit/test_layers.py

# mypy --strict over broker/ and tests/ (pyproject.toml [tool.mypy]).
typecheck: $(STAMP)
	$(BIN)/mypy

# SoftHSM2 (PKCS#11 tests) comes from Debian; CI and developers run as root here.
$(SOFTHSM):
	command -v apt-get >/dev/null && (apt-get update -qq && apt-get install -y -qq softhsm2) \
	  || (echo "install SoftHSM2 (package softhsm2) for the PKCS#11 tests" >&2; exit 1)

# redis-server (shared nonce store tests) comes from Debian too; the tests start their own.
$(REDIS):
	command -v apt-get >/dev/null && (apt-get update -qq && apt-get install -y -qq redis-server) \
	  || (echo "install redis-server for the shared nonce store tests" >&2; exit 1)

# Chromium and chromium-driver (the console's browser test) come from Debian too: no browser
# download; Selenium is given both paths.
$(CHROMEDRIVER):
	command -v apt-get >/dev/null && (apt-get update -qq && apt-get install -y -qq chromium chromium-driver) \
	  || (echo "install chromium and chromium-driver for the console's browser test" >&2; exit 1)

$(PROMTOOL):
	command -v apt-get >/dev/null && (apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus) \
	  || (echo "install prometheus (for promtool) to check the alerting rules" >&2; exit 1)

# PostgreSQL server binaries (shared nonce store tests): usually present; else from Debian.
postgresql:
	@command -v postgres >/dev/null || ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 \
	  || (command -v apt-get >/dev/null && apt-get update -qq && apt-get install -y -qq postgresql) \
	  || (echo "install PostgreSQL (package postgresql) for the shared nonce store tests" >&2; exit 1)

$(OPA): | $(STAMP)
	GOBIN=$(abspath $(BIN)) GOFLAGS=-mod=mod go install github.com/open-policy-agent/opa@$(OPA_VERSION)

# A Cloud Storage emulator for the runner SDK's gs:// source (the tests start it on loopback).
$(DPOP_INTEROP): tests/interop/dpop/package-lock.json
	cd tests/interop/dpop && npm ci --no-audit --no-fund --silent && touch node_modules/.installed

$(KBS_HARNESS): tests/kbs_conformance/Cargo.toml tests/kbs_conformance/Cargo.lock tests/kbs_conformance/src/main.rs tests/support/kbs_harness.py | $(STAMP)
	$(BIN)/python -m tests.support.kbs_harness

$(FAKE_GCS): | $(STAMP)
	GOBIN=$(abspath $(BIN)) GOFLAGS=-mod=mod go install github.com/fsouza/fake-gcs-server@$(FAKE_GCS_VERSION)

deploy-tools: $(KUSTOMIZE) $(KUBECONFORM) $(K8S_OPENAPI)

# Offline validation of the Kubernetes manifests (docs/deploy.md): render each overlay and check
# every object against the schemas generated from Kubernetes' own OpenAPI document.
K8S_SCHEMAS := $(VENV)/k8s-schemas-$(KUBERNETES_VERSION)
deploy-check: deploy-tools
	@test -d $(K8S_SCHEMAS) || $(BIN)/python -m tests.k8s_schemas $(K8S_OPENAPI) $(K8S_SCHEMAS)
	for overlay in base overlays/production; do \
	  $(KUSTOMIZE) build --load-restrictor LoadRestrictionsNone deploy/k8s/$$overlay \
	  | $(KUBECONFORM) -strict -summary -schema-location '$(K8S_SCHEMAS)/{{ .ResourceKind }}{{ .KindSuffix }}.json' - \
	  || exit 1; \
	done

$(KUSTOMIZE): | $(STAMP)
	GOBIN=$(abspath $(BIN)) GOFLAGS=-mod=mod go install sigs.k8s.io/kustomize/kustomize/v5@$(KUSTOMIZE_VERSION)

$(KUBECONFORM): | $(STAMP)
	GOBIN=$(abspath $(BIN)) GOFLAGS=-mod=mod go install github.com/yannh/kubeconform/cmd/kubeconform@$(KUBECONFORM_VERSION)

$(K8S_OPENAPI): | $(STAMP)
	cp "$$(go mod download -json k8s.io/kubernetes@$(KUBERNETES_VERSION) | $(BIN)/python -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')/api/openapi-spec/swagger.json" $@

policy-test: $(STAMP) $(OPA)
	$(BIN)/broker policy test policies --opa $(OPA)

# Three workers on two cores: much of the suite waits on broker processes, OPA and disks.
PYTEST_WORKERS ?= 3
pytest: $(STAMP) $(OPA) $(SOFTHSM) $(REDIS) $(CHROMEDRIVER) $(PROMTOOL) $(FAKE_GCS) $(DPOP_INTEROP) $(KBS_HARNESS) postgresql deploy-tools
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist worksteal

bench: $(STAMP) $(OPA) $(FAKE_GCS)
	$(BIN)/python bench/release_bench.py
	$(BIN)/python bench/attest_bench.py
	$(BIN)/python bench/attested_bench.py
	$(BIN)/python bench/policy_bench.py
	$(BIN)/python bench/audit_bench.py
	$(BIN)/python bench/weights_bench.py
	$(BIN)/python bench/sources_bench.py
	$(BIN)/python bench/identity_bench.py
	$(BIN)/python bench/console_bench.py
	$(BIN)/python bench/kbs_bench.py

# Not part of `make test`: a 20 s max run, then 2 minutes at 70 % of it (0 errors, RSS < +10 %).
soak: $(STAMP) $(OPA)
	$(BIN)/python bench/load_bench.py --connections 32 --duration 20 --soak 120 --fraction 0.7

# The broker's OCI image for Confidential Space, reproducibly and without a container daemon
# (docs/deploy.md, "Rebuilding the image and checking its digest"): writes build/image/ (OCI
# layout), build/image.spdx.json (SBOM) and prints the manifest digest. Pinned inputs:
# deploy/image/*.lock, OPA_VERSION, IMAGE_GO_TOOLCHAIN; deploy/confidential-space/broker/image.json.
# Needs apt-get, dpkg-deb, go, chroot (root, or unprivileged user namespaces).
IMAGE_GO_TOOLCHAIN := go1.26.8
IMAGE_TOOLS := build/image-tools
image: $(IMAGE_TOOLS)/.installed
	$(IMAGE_TOOLS)/bin/python -m deploy.image.build --opa-version $(OPA_VERSION) --go-toolchain $(IMAGE_GO_TOOLCHAIN)

# Maintainers: refresh deploy/image/{debian,python,tools}.lock (python.lock takes the versions of .venv).
image-lock: $(IMAGE_TOOLS)/.installed $(STAMP)
	$(IMAGE_TOOLS)/bin/python -m deploy.image.lock --constraints-from $(BIN)/python

$(IMAGE_TOOLS)/.installed: deploy/image/tools.lock
	@test -x $(IMAGE_TOOLS)/bin/python || $(PY) -m venv $(IMAGE_TOOLS)
	$(IMAGE_TOOLS)/bin/python -m pip install --quiet --require-hashes --no-deps -r deploy/image/tools.lock
	@touch $@

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
