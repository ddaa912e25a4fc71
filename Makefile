# The two commands of the README: `make demo` and `make test` (and `make test-quick`, the unit tests
# alone). Each sets up .venv on first use.
PY := .venv/bin/python
NPROC ?= 2
CONFIG ?= configs/demo.yaml

.PHONY: setup demo data test test-quick clean

setup:
	@bash scripts/setup_env.sh

data/demo/summary.json: $(CONFIG) | setup
	$(PY) -m pinads_rec.data.synth --config $(CONFIG) --out data/demo --raw

data: data/demo/summary.json

# Generate the demo data, then train on $(NPROC) ranks launched through TorchX (gloo on CPU): the
# README's command as a user types it, venv not activated (.torchxconfig's dist.ddp defaults give
# the ranks OMP_NUM_THREADS=1 and the venv's torchrun).
demo: setup data
	rm -rf runs/demo
	.venv/bin/torchx run -s local_cwd dist.ddp -j 1x$(NPROC) --script pinads_rec/train.py -- --config $(CONFIG)

test: setup
	bash scripts/run_tests.sh $(ARGS)

# The tests not marked slow (pyproject.toml's markers): no second process but DataLoader workers, no
# training to a result, none over ~2 s.
test-quick: setup
	bash scripts/run_tests.sh -m "not slow" $(ARGS)

clean:
	rm -rf data/demo runs
