"""Subcommands of `kvarn`: one module each, with `register(subparsers)` setting `func`."""
