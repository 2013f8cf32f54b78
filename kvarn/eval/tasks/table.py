"""The per-(task, size, protocol, method) table of a run, computed from its per-sample records.

    accuracy       correct / n, with the Wilson 95% interval
    vs full        paired with full precision ("dynamic") on the same samples: accuracy difference, the discordant
                   counts (method only right / full precision only right) and the exact McNemar p
    agreement      share of samples whose answer is identical to full precision's
    gold log-prob  mean per-token log-probability of the gold answer, teacher forced (bootstrap 95% interval), and
                   its paired difference to full precision (bootstrap 95% interval): continuous, so it separates
                   methods long before pass/fail does
    quantized      mean share of the cached tokens held in quantized key tiles at the end of the sample
"""

from __future__ import annotations

from collections import defaultdict

from kvarn.eval.results import markdown_table
from kvarn.eval.tasks.protocol import FULL_PRECISION
from kvarn.eval.tasks.stats import bootstrap_mean, paired, wilson


def _variant_order(v: str) -> tuple:
    digits = "".join(c for c in v if c.isdigit())
    return (0, int(digits), v) if digits else (1, 0, v)


def summarize(records: list[dict], seed: int = 0) -> list[dict]:
    groups: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in records:
        groups[(r["task"], r["variant"], r["protocol"], r["method"])][r["key"]] = r
    methods = list(dict.fromkeys(r["method"] for r in records))
    tasks = list(dict.fromkeys(r["task"] for r in records))
    order = sorted(groups, key=lambda g: (tasks.index(g[0]), _variant_order(g[1]), g[2], methods.index(g[3])))
    rows = []
    for task, variant, protocol, method in order:
        mine = groups[(task, variant, protocol, method)]
        n, correct = len(mine), sum(r["correct"] for r in mine.values())
        row = {"task": task, "variant": variant, "protocol": protocol, "method": method, "n": n, "correct": correct,
               "accuracy": correct / n, "wilson": list(wilson(correct, n)),
               "score": sum(r["score"] for r in mine.values()) / n,
               "prompt_tokens": sum(r["prompt_tokens"] for r in mine.values()) / n,
               # None under the vllm protocol: the engine's pages are not inspected per sample
               "quantized_share": _mean([r.get("quantized_share_keys") for r in mine.values()]),
               "bits_per_element": _mean([r.get("bits_per_element") for r in mine.values()]),
               "seconds": sum(r["seconds"] for r in mine.values()) / n}
        lps = [r["gold_logprob_per_token"] for r in mine.values() if r["gold_logprob_per_token"] is not None]
        row["gold_logprob"] = list(bootstrap_mean(lps, seed)) if lps else None
        full = groups.get((task, variant, protocol, FULL_PRECISION))
        if full is not None and method != FULL_PRECISION:
            both = [k for k in mine if k in full]
            if both:
                vs = compare(mine, full, both, seed)
                row["vs_full"], row["agreement"], row["gold_logprob_delta"] = vs["paired"], vs["agreement"], vs["delta"]
        rows.append(row)
    return rows


def compare(mine: dict[str, dict], other: dict[str, dict], keys: list[str], seed: int = 0) -> dict:
    """Two methods' records of the same samples (key -> record), paired over `keys` in that order: "paired"
    (accuracy difference, discordant counts, McNemar p), "agreement" (identical answers) and "delta" (mean gold
    log-probability per token of mine minus other, bootstrap 95% interval; None without gold)."""
    deltas = [mine[k]["gold_logprob_per_token"] - other[k]["gold_logprob_per_token"] for k in keys
              if mine[k]["gold_logprob_per_token"] is not None and other[k]["gold_logprob_per_token"] is not None]
    return {"paired": paired([mine[k]["correct"] for k in keys], [other[k]["correct"] for k in keys]),
            "agreement": sum(mine[k]["answer"] == other[k]["answer"] for k in keys) / len(keys),
            "delta": list(bootstrap_mean(deltas, seed)) if deltas else None}


def _mean(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _ci(x: list | None, digits: int = 3) -> str:
    if not x:
        return ""
    return f"{x[0]:.{digits}f} [{x[1]:.{digits}f}, {x[2]:.{digits}f}]"


def summary_markdown(result: dict) -> str:
    rows = []
    for r in result["rows"]:
        vs = r.get("vs_full")
        rows.append([r["task"], r["variant"], r["protocol"], r["method"], f"{r['correct']}/{r['n']}",
                     f"{100 * r['accuracy']:.0f} [{100 * r['wilson'][0]:.0f}, {100 * r['wilson'][1]:.0f}]",
                     f"{100 * vs['difference']:+.0f} ({vs['only_a']}/{vs['only_b']}, p={vs['mcnemar_p']:.3g})"
                     if vs else "", f"{100 * r['agreement']:.0f}%" if "agreement" in r else "",
                     _ci(r["gold_logprob"]), _ci(r.get("gold_logprob_delta")), f"{r['prompt_tokens']:.0f}",
                     "-" if r["quantized_share"] is None else f"{100 * r['quantized_share']:.0f}%",
                     f"{r['seconds']:.1f}"])
    head = ["task", "size", "protocol", "method", "correct", "acc % [Wilson 95%]",
            "vs full: diff pts (only method/only full, McNemar p)", "same answer as full", "gold log-prob/token",
            "gold Δ vs full", "prompt tok", "keys in tiles", "s/sample"]
    return (f"## Task accuracy ({result['model']}, chunks of {result['chunk']} tokens in serving, seed "
            f"{result['seed']})\n\nserving: the prompt prefilled in chunks through the cache, the answer decoded "
            "greedily; generate: model.generate(cache=...). full: DynamicCache. Intervals: Wilson 95% (accuracy), "
            "bootstrap 95% (log-probabilities). keys in tiles: mean share of cached tokens in quantized key tiles at "
            f"the end of a sample.\n\n{markdown_table(head, rows)}")
