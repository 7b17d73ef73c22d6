# The two commands of the README: `make demo` and `make test`. Both set up .venv themselves.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PACKAGES := core transport collectives testing nn ddp pipeline elastic launch gpu nccl torch
STAMP := $(VENV)/.installed
# What the demo runs: numpy, numba and ml_dtypes underneath, and tqdm for its progress bar (no
# torch, MPI, CUDA, NCCL or test tools); `make test` adds the rest to the same .venv.
DEMO_PACKAGES := core transport collectives launch nn ddp pipeline
DEMO_STAMP := $(VENV)/.demo-installed
# A second NCCL release for tests/nccl/test_versions.py: the oldest the nccl extras allow.
NCCL_OLDEST := 2.18.3

.PHONY: demo test chaos torch-suite bench lint clean

$(STAMP): Makefile pyproject.toml $(foreach p,$(PACKAGES),packages/$(p)/pyproject.toml)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q 'pip>=25.1'
	$(BIN)/python -m pip install -q $(foreach p,$(PACKAGES),-e packages/$(p)[test]) \
		-e packages/transport[test,mpi] -e packages/launch[test,bench] --group dev
	$(BIN)/python -m pip install -q --no-deps --upgrade --target $(VENV)/nccl-versions/$(NCCL_OLDEST) \
		nvidia-nccl-cu12==$(NCCL_OLDEST)
	touch $@

$(DEMO_STAMP): Makefile $(foreach p,$(DEMO_PACKAGES),packages/$(p)/pyproject.toml)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q 'pip>=25.1'
	$(BIN)/python -m pip install -q $(foreach p,$(DEMO_PACKAGES),-e packages/$(p)) tqdm
	touch $@

demo: $(DEMO_STAMP)
	$(BIN)/ferrodist warm
	$(BIN)/ferrodist run -n 2 examples/all_reduce_ranks.py
	$(BIN)/ferrodist run -n 2 examples/train_ddp.py
	$(BIN)/ferrodist run -n 4 examples/train_pipeline.py

test: $(STAMP)
	$(BIN)/python tools/check_layers.py
	$(BIN)/ferrodist warm
	FERRODIST_REQUIRE_MPI=1 FERRODIST_REQUIRE_NCCL_VERSIONS=1 PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q

# The long chaos run: 500 random schedules of collectives under random faults, and 500 elastic
# trainings under faults (make test runs 24 and 12).
chaos: $(STAMP)
	FERRODIST_CHAOS_SCHEDULES=$${FERRODIST_CHAOS_SCHEDULES:-500} \
	FERRODIST_ELASTIC_SCHEDULES=$${FERRODIST_ELASTIC_SCHEDULES:-500} PATH="$(CURDIR)/$(BIN):$$PATH" \
		$(BIN)/python -m pytest -q -s tests/integration/test_chaos.py tests/integration/test_elastic_chaos.py

# torch's own distributed suite on every transport at 2, 3 and 4 ranks, and on Gloo for the
# lists of what it passes (make test runs shm at 4 ranks and tcp at 2).
torch-suite: $(STAMP)
	FERRODIST_TORCH_SUITE=all FERRODIST_TORCH_SUITE_GLOO=1 PATH="$(CURDIR)/$(BIN):$$PATH" \
		$(BIN)/python -m pytest -q tests/torch/test_torch_suite.py

bench: $(STAMP)
	mkdir -p .benchmarks
	$(BIN)/python -m pytest bench -q --benchmark-only --benchmark-columns=median,iqr,rounds --benchmark-json=.benchmarks/kernels.json
	$(BIN)/python tools/bench_ratios.py .benchmarks/kernels.json
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/ferrodist bench -n 2 --backends shm,tcp,mpi --compare --startup --rounds 3 --passes 2 \
		--json .benchmarks/collectives.json --plot .benchmarks/collectives.png

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .benchmarks .hypothesis
