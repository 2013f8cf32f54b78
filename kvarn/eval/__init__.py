"""Evaluation harness: each analysis is a module exposing `COMMAND`, `add_arguments(parser)` and
`run(args)`; `kvarn eval <COMMAND>` discovers them. Shared pieces live in `common.py`."""
