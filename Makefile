# The two commands of the README. Both set everything up first (idempotent).
.PHONY: run test lint

run:
	scripts/setup tensorboard
	.venv/bin/loopline train

test:
	scripts/test

lint:
	.venv/bin/ruff check loopline tests && .venv/bin/ruff format --check loopline tests
