"""Checks the benchmarks share on their command lines: counts and sizes must be positive."""

from __future__ import annotations

import argparse


def require_positive(parser: argparse.ArgumentParser, args: argparse.Namespace, *keys: str) -> None:
    """Stop with the parser's usage error naming the first of `keys` (dests) that is not > 0."""
    for key in keys:
        value = getattr(args, key)
        if not value > 0:  # also refuses nan
            need = "at least 1" if isinstance(value, int) else "> 0"
            parser.error(f"--{key.replace('_', '-')} must be {need} (got {value})")
