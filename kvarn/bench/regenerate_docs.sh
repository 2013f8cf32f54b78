#!/bin/sh
# Regenerate docs/BENCHMARKS.md (its generated block), docs/bench.json and docs/img/bench-*.png with the full
# `kvarn bench` run (about 20 minutes on a 2-core CPU, a third of it HQQ's prefill; use a quiet machine: every
# figure is a ratio measured side by side, but other load still adds noise). The text around the block is kept.
# Replaces benchmarks/decode_speed.py (now `kvarn bench e2e`) and benchmarks/policy_cost.py (`kvarn bench store`).
set -e
cd "$(dirname "$0")/../.."
${PYTHON:-.venv/bin/python} -m kvarn.cli bench all --json docs/bench.json --plots docs/img --markdown docs/BENCHMARKS.md "$@"
