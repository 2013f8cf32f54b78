"""A bench result as tables (terminal and markdown), plots, and the generated block of docs/BENCHMARKS.md.

One table builder per section returns (title, header, rows); the terminal (rich) and the markdown render the same.
"""

from __future__ import annotations

from pathlib import Path

MB = 1 << 20
BEGIN, END = "<!-- kvarn bench: begin generated -->", "<!-- kvarn bench: end generated -->"

Table = tuple[str, list[str], list[list]]


def _attention(res: dict) -> list[Table]:
    rows = []
    for c in res["cases"]:
        for r in c["kvarn"]:
            rows.append([c["shape"], c["batch"], c["context"], r["preset"], r["kvarn_ms"], c["sdpa_fp32_ms"],
                         c["sdpa_bf16_ms"], r["ratio_vs_sdpa_fp32"], r["ratio_vs_sdpa_bf16"],
                         r["kv_bytes"] / c["dense_fp32_bytes"]])
    head = ["shape", "B", "T", "kvarn preset", "kvarn ms", "SDPA fp32 ms", "SDPA bf16 ms", "kvarn / fp32",
            "kvarn / bf16", "bytes / fp32"]
    title = (f"decode attention, median of {res['rounds']} interleaved rounds ({res['threads']} threads; "
             f"packed path: {res['path']})")
    return [(title, head, rows)]


def _e2e(res: dict) -> list[Table]:
    rows = [[c["context"], r["cache"], r["tokens_per_s"], r["ms_per_token"], r["vs_dynamic"], r["vs_quanto"],
             r["prefill_s"]] for c in res["contexts"] for r in c["rows"]]
    skipped = "; skipped: " + ", ".join(f"{k} ({v})" for k, v in res["skipped"].items()) if res["skipped"] else ""
    title = (f"end-to-end decode, median of {res['steps']} interleaved steps after {res['warmup']} warm-up "
             f"({res['threads']} threads){skipped}")
    return [(title, ["context", "cache", "tokens/s", "ms/token", "vs Dynamic", "vs quanto", "prefill s"], rows)]


def _store(res: dict) -> list[Table]:
    rows = [[r["preset"], r["store_ms"], r["decode_ms_per_token"], r["tile"], r["store_pct_of_decode"],
             f"{r['layers']} x {r['kv_heads']}", r["store_vs_first"]] for r in res["rows"]]
    title = (f"tile store vs the decode of its tile at T={res['context']}, median of {res['rounds']} interleaved "
             f"rounds ({res['threads']} threads)")
    return [(title, ["preset", "store ms (1 tile, all layers)", "decode ms/token", "G", "store % of G decodes",
                     "layers x KV heads", "store vs first"], rows)]


def _memory(res: dict) -> list[Table]:
    rows = [[r["context"], r["cache"], r["kv_bytes"] / MB, r["kv_vs_dynamic"], r["rss_peak"] / MB,
             r["peak_over_model"] / MB] for r in res["rows"]]
    title = f"memory, one process per cache: prefill + {res['steps']} decode steps"
    return [(title, ["context", "cache", "KV MiB held", "KV vs Dynamic", "peak RSS MiB", "peak over model MiB"], rows)]


def _vllm(res: dict) -> list[Table]:
    out = []
    for run in res["runs"]:
        rows = [[r["engine"], r["tokens_per_s"], r["tokens_per_s_vs_stock"], r["requests_per_s"],
                 r["requests_per_s_vs_stock"], r.get("ttft_mean_s"), r.get("tpot_mean_s"), r.get("preemptions"),
                 r["kv_tokens"], r["kv_tokens_vs_stock"], r.get("max_num_seqs"), r["wall_s"]] for r in run["rows"]]
        title = (f"vLLM {res['vllm']} on the CPU, {run['kind']}: {run['requests']} requests x "
                 f"({run['prompt_tokens']} prompt + {run['new_tokens']} greedy tokens), {res['dtype']}, KV budget "
                 f"{run['kv_bytes'] / MB:g} MiB, max_num_seqs={run['max_num_seqs']}"
                 + (f"; the {'lower ' if run['rounds'] % 2 == 0 else ''}median of {run['rounds']} rounds"
                    if run.get("rounds", 1) > 1 else ""))
        out.append((title, ["engine", "tokens/s", "vs stock", "requests/s", "vs stock", "TTFT s", "TPOT s",
                            "preemptions", "KV tokens", "KV vs stock", "seqs at once", "batch s"], rows))
    return out


def _profiles(result: dict) -> list[Table]:
    out = []
    s = result.get("sections", {})
    for c in s.get("attention", {}).get("cases", []):
        for r in c["kvarn"]:
            if r.get("profile"):
                out.append((f"profile: decode attention {r['preset']}, {c['shape']} B={c['batch']} T={c['context']}",
                            ["op", "self ms", "share", "calls"],
                            [[o["op"], o["self_ms"], o["share"], o["calls"]] for o in r["profile"]]))
    for r in s.get("store", {}).get("rows", []):
        if r.get("profile"):
            out.append((f"profile: one tile store of every layer, {r['preset']}", ["op", "self ms", "share", "calls"],
                        [[o["op"], o["self_ms"], o["share"], o["calls"]] for o in r["profile"]]))
    for c in s.get("e2e", {}).get("contexts", []):
        if c.get("profile"):
            p = c["profile"]
            out.append((f"profile: one decode step, {p['cache']} T={c['context']}", ["op", "self ms", "share", "calls"],
                        [[o["op"], o["self_ms"], o["share"], o["calls"]] for o in p["ops"]]))
    return out


def _targets(result: dict) -> list[Table]:
    rows = [[t["target"], t["where"], t["value"], t["bound"], t["status"]] for t in result.get("targets", [])]
    return [("targets (issues 10, 19, 20)", ["target", "where", "measured", "target", "status"], rows)] if rows else []


BUILDERS = {"attention": _attention, "e2e": _e2e, "store": _store, "memory": _memory, "vllm": _vllm}


def tables(result: dict) -> list[Table]:
    out = []
    for name, build in BUILDERS.items():
        if name in result.get("sections", {}):
            out += build(result["sections"][name])
    return out + _targets(result) + _profiles(result)


def print_tables(result: dict) -> None:
    from rich.table import Table as RichTable

    from kvarn.console import console

    for title, head, rows in tables(result):
        if not rows:
            continue
        t = RichTable(title=title)
        for i, h in enumerate(head):
            t.add_column(h, justify="left" if isinstance(rows[0][i], str) else "right")
        for r in rows:
            t.add_row(*["" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v) for v in r])
        console().print(t)


def plots(result: dict, folder: str | Path) -> list[Path]:
    """PNG plots of the sections present; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    s = result.get("sections", {})
    written = []
    if "attention" in s:
        fig, ax = plt.subplots(figsize=(7, 4))
        series: dict[str, list] = {}
        for c in s["attention"]["cases"]:
            for r in c["kvarn"]:
                for key, ref in (("ratio_vs_sdpa_fp32", "fp32"), ("ratio_vs_sdpa_bf16", "bf16")):
                    label = f"{r['preset']} {c['shape']} B={c['batch']} / SDPA {ref}"
                    series.setdefault(label, []).append((c["context"], r[key]))
        for label, pts in series.items():
            pts.sort()
            ax.plot(*zip(*pts), marker="o", label=label, linestyle="-" if "fp32" in label else "--")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="time ratio (lower is faster)",
               title="decode attention: kvarn packed / SDPA dense")
        ax.legend(fontsize=6)
        written.append(_save(fig, folder / "bench-attention.png"))
    if "e2e" in s:
        fig, ax = plt.subplots(figsize=(7, 4))
        series = {}
        for c in s["e2e"]["contexts"]:
            for r in c["rows"]:
                series.setdefault(r["cache"], []).append((c["context"], r["tokens_per_s"]))
        for label, pts in series.items():
            ax.plot(*zip(*sorted(pts)), marker="o", label=label)
        ax.set(xscale="log", xlabel="context (tokens)", ylabel="decode tokens/s", title="end-to-end decode")
        ax.legend(fontsize=7)
        written.append(_save(fig, folder / "bench-e2e.png"))
    mem = [r for r in s.get("vllm", {}).get("runs", []) if r["kind"] == "memory"]
    if mem:
        fig, ax = plt.subplots(figsize=(7, 4))
        series = {}
        for run in mem:
            for r in run["rows"]:
                series.setdefault(r["engine"], []).append((run["kv_bytes"] / MB, r["requests_per_s"]))
        for label, pts in series.items():
            ax.plot(*zip(*sorted(pts)), marker="o", label=label)
        run = mem[0]
        ax.set(xlabel="KV budget (MiB)", ylabel="requests/s", title=f"vLLM, {run['requests']} requests x "
               f"({run['prompt_tokens']} + {run['new_tokens']}) queued: throughput vs KV budget")
        ax.legend(fontsize=7)
        written.append(_save(fig, folder / "bench-vllm-memory.png"))
    if "memory" in s:
        rows = s["memory"]["rows"]
        fig, ax = plt.subplots(figsize=(7, 4))
        labels = [f"{r['cache']}\nT={r['context']}" for r in rows]
        ax.bar(labels, [r["kv_bytes"] / MB for r in rows])
        ax.set(yscale="log", ylabel="KV MiB held", title="KV bytes held per cache")
        ax.tick_params(axis="x", labelsize=6, rotation=45)
        written.append(_save(fig, folder / "bench-memory.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def markdown(result: dict, images: list[Path] | None = None, relative_to: Path | None = None) -> str:
    """The generated block: command, machine, tables, plots, targets, profiles."""
    from kvarn.eval.results import markdown_table

    prov = result["provenance"]
    lines = [f"Command: `{result['command']}`", "",
             f"Machine: {prov['machine']}; torch {prov['torch']}, transformers {prov['transformers']}, "
             f"python {prov['python']}; kvarn {prov['kvarn']} at git {prov['git']}; {prov['date']}; "
             f"wall time {result['wall_s']:.0f} s{' (--quick)' if result['quick'] else ''}.", ""]
    if result.get("note"):
        lines += [f"**{result['note']}**", ""]
    for title, head, rows in tables(result):
        if rows:
            lines += [f"### {title}", "", markdown_table(head, rows)]
    for img in images or []:
        rel = img.relative_to(relative_to) if relative_to else img
        lines += [f"![{img.stem}]({rel.as_posix()})", ""]
    return "\n".join(lines)


def write_markdown(path: str | Path, block: str) -> Path:
    """Replace the generated block of `path` (between the markers), keeping the written text around it."""
    path = Path(path)
    text = path.read_text() if path.exists() else f"# Benchmarks\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        text = text.rstrip() + f"\n\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{BEGIN}\n{block}\n{END}{tail}")
    return path
