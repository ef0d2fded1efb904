"""The command line: thin verbs that parse, call one function and print."""

from bigtune.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
