# The two commands of the README. Both set everything up first (idempotent).
.PHONY: setup run test lint

setup:
	scripts/setup dev,ray,tensorboard

run: setup
	.venv/bin/loopline train

test:
	scripts/test
lint:
	.venv/bin/ruff check loopline tests && .venv/bin/ruff format --check loopline tests
