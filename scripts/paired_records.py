"""Paired comparison of two methods over task records (`samples.jsonl` of `kvarn eval tasks`, several files merged
by sample): accuracy (McNemar) and the mean difference of the gold log-probability per token, with a bootstrap 95%
interval (`kvarn.eval.tasks.table.compare`, as `kvarn eval tasks` pairs a method with full precision; seed 0).
`--rename OLD=NEW` reads a method of the files under another name; `--rename OLD=NEW@FILE` only in FILE (as given), e.g.
two runs of one method on two machines.

    python scripts/paired_records.py kvarn-b2.5-best kvarn-b2.5 docs/tasks/budget-mk4k-s1.samples.jsonl \
        docs/tasks/budget-mk4k-s1-best.samples.jsonl
    python scripts/paired_records.py --seeds dynamic kvarn-b2.5-qar S0A.jsonl,S0B.jsonl S1.jsonl S2.jsonl
"""

from __future__ import annotations

import argparse
import json

from kvarn.eval.tasks.table import compare


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("files", nargs="+")
    ap.add_argument("--rename", action="append", default=[], metavar="OLD=NEW[@FILE]")
    ap.add_argument("--seeds", action="store_true",
                    help="each FILES argument is one seed's records (comma-separated files merged): samples pair "
                         "within a seed (their keys repeat across seeds) and the figures pool over seeds")
    args = ap.parse_args()
    names: dict[tuple[str, str | None], str] = {}  # (method, file or None for every file) -> name
    for r in args.rename:
        old, new = r.split("=", 1)
        new, _, only = new.partition("@")
        names[old, only or None] = new
    by_method: dict[str, dict[str, dict]] = {args.a: {}, args.b: {}}
    for group, arg in enumerate(args.files):
        for path in arg.split(",") if args.seeds else [arg]:
            with open(path) as f:
                for line in f:
                    r = json.loads(line)
                    key = f"{group}:{r['key']}" if args.seeds else r["key"]
                    m = r["method"]
                    by_method.get(names.get((m, path), names.get((m, None), m)), {})[key] = r
    mine, other = by_method[args.a], by_method[args.b]
    keys = sorted(mine.keys() & other.keys())
    if not keys:
        raise SystemExit(f"no sample has records of both {args.a!r} and {args.b!r}")
    vs = compare(mine, other, keys)
    acc = vs["paired"]
    gold = "no gold log-prob (a run with --no-gold)"
    if vs["delta"] is not None:
        mean, lo, hi = vs["delta"]
        gold = f"gold log-prob/token {mean:+.4f} [{lo:+.4f}, {hi:+.4f}]"
    print(f"{args.a} - {args.b} over {len(keys)} samples: {gold}; correct only {args.a}: {acc['only_a']}, only "
          f"{args.b}: {acc['only_b']} (McNemar p = {acc['mcnemar_p']:.3g})")


if __name__ == "__main__":
    main()
