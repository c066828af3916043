# The two commands of the README. Both set everything up first (idempotent).
.PHONY: run test lint mutation

run:
	scripts/setup tensorboard
	.venv/bin/loopline train

test:
	scripts/test

# ruff over everything; mypy over the rooms [tool.mypy] names (pyproject.toml)
lint:
	scripts/setup dev
	.venv/bin/ruff check loopline tests && .venv/bin/ruff format --check loopline tests && .venv/bin/mypy

# Mutation testing of the maths and bookkeeping modules (mutmut, in copies under /tmp): kill rate per module.
# Not part of `make test`: ~25 min on 2 busy cores. `scripts/mutation MODULE...` runs a subset.
mutation:
	scripts/setup dev
	.venv/bin/python scripts/mutation
