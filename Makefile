# The two commands of the README. Both set everything up first (idempotent).
.PHONY: run reproduce test test-heavy test-fast lint mutation

# ARGS: overrides for the default job, e.g. make run ARGS="seed=1 threads=2"
run:
	scripts/setup tensorboard
	.venv/bin/loopline train $(ARGS)

# The default job over seeds 0,1,2 (threads 1) and seed 0 with threads 2, then the table against the targets (docs/background/reproducibility.md)
reproduce:
	scripts/setup tensorboard
	.venv/bin/python scripts/reproduce --out runs/reproduce $(ARGS)

test:
	scripts/test

# The heaviest runs, which `make test` leaves out to keep to its 15 minutes (benchmarks end to end, multi-kill
# recovery runs: the `heavy` mark); CI (.ci/run) runs them after `make test`.
test-heavy:
	scripts/test -m "heavy and not vllm"

# The edit-test loop: the unit-marked tests only (one process: no Ray, sandbox, spawned ranks or whole runs).
# A subset of `make test`, never a replacement for it (docs/guide/contributing.md).
test-fast:
	scripts/test -m "unit and not vllm"

# ruff over everything; mypy over the rooms [tool.mypy] names (pyproject.toml)
lint:
	scripts/setup dev
	.venv/bin/ruff check loopline tests && .venv/bin/ruff format --check loopline tests && .venv/bin/mypy

# Mutation testing of the maths and bookkeeping modules (mutmut, in copies under /tmp): kill rate per module.
# Not part of `make test`: ~25 min on 2 busy cores. `scripts/mutation MODULE...` runs a subset.
mutation:
	scripts/setup dev
	.venv/bin/python scripts/mutation
