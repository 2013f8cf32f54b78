"""The speed targets of issues 10 and 19, checked against a bench result: met, missed, or not measured in this run."""

from __future__ import annotations

from kvarn.presets import DEFAULT_PRESET, get_preset

TARGET_CONTEXT = 8192
K2V2 = "kvarn-k2v2-g128"
AUTO = "kvarn-auto-k2v2-g128"


def _verdict(name: str, value: float | None, bound: float, at_most: bool, where: str) -> dict:
    met = None if value is None else (value <= bound if at_most else value >= bound)
    return {"target": name, "where": where, "value": value, "bound": f"{'<=' if at_most else '>='} {bound:g}",
            "status": "not measured" if met is None else ("met" if met else "missed")}


def _attention(res: dict) -> list[dict]:
    out = []
    for case in res.get("cases", []):
        if case["context"] != TARGET_CONTEXT:
            continue
        where = f"{case['shape']} B={case['batch']} T={case['context']}"
        row = next((r for r in case["kvarn"] if r["preset"] == K2V2), None)
        if row is None:
            continue
        out.append(_verdict("decode attention time / SDPA dense fp32", row["ratio_vs_sdpa_fp32"], 0.5, True, where))
        out.append(_verdict("decode attention time / SDPA dense bf16", row["ratio_vs_sdpa_bf16"], 1.0, True, where))
    if not out:
        out.append(_verdict("decode attention time / SDPA dense fp32", None, 0.5, True, f"T={TARGET_CONTEXT}"))
    return out


def _e2e(res: dict) -> list[dict]:
    by = {(r["cache"], c["context"]): r for c in res.get("contexts", []) for r in c["rows"]}
    out = []
    for preset in dict.fromkeys([K2V2, get_preset(DEFAULT_PRESET).name]):
        for ctx, key, bound, label in ((TARGET_CONTEXT, "vs_dynamic", 1.3, "tokens/s / DynamicCache"),
                                       (1024, "vs_dynamic", 0.95, "tokens/s / DynamicCache"),
                                       (TARGET_CONTEXT, "vs_quanto", 1.3, "tokens/s / quanto 2-bit QuantizedCache")):
            row = by.get((preset, ctx))
            out.append(_verdict(label, row.get(key) if row else None, bound, False, f"{preset} T={ctx}"))
    return out


def _store(res: dict) -> list[dict]:
    rows = {r["preset"]: r for r in res.get("rows", [])}
    return [_verdict("store time / decode time of its tile (%)", rows[p]["store_pct_of_decode"] if p in rows else None,
                     bound, True, p) for p, bound in ((K2V2, 0.2), (AUTO, 0.4))]


K4V2 = "kvarn-k4v2-g128"
MEM_BUDGET = 212 * 2**20  # issue 19: 32 requests of 2,048 + 256 tokens, a KV budget holding about 4 of stock's


def _vllm(res: dict) -> list[dict]:
    """Issue 19: equal batch (8 x (512 + 128)) k2v2, the default and k4v2 >= 1.0x stock tokens/s; memory-bound
    (32 x (2,048 + 256) in 212 MiB, 424 MiB for float32 engines: as many of stock's sequences) k2v2 >= 2.0x stock
    requests/s."""
    from kvarn.bench.vllm import mem_budget_scale

    out = []
    budget = int(MEM_BUDGET * mem_budget_scale(res.get("dtype", "bfloat16")))
    for run in res.get("runs", []):
        rows = {r["engine"]: r for r in run["rows"]}
        if run["kind"] == "equal" and (run["requests"], run["prompt_tokens"], run["new_tokens"]) == (8, 512, 128):
            for p in dict.fromkeys([K2V2, get_preset(DEFAULT_PRESET).name, K4V2]):
                out.append(_verdict("vLLM generated tokens/s / stock", rows[p]["tokens_per_s_vs_stock"] if p in rows
                                    else None, 1.0, False, f"{p}, 8 x (512 + 128)"))
        if run["kind"] == "memory" and run["kv_bytes"] == budget and (run["requests"], run["prompt_tokens"]) == (
                32, 2048):
            out.append(_verdict("vLLM requests/s / stock, memory-bound", rows[K2V2]["requests_per_s_vs_stock"]
                                if K2V2 in rows else None, 2.0, False,
                                f"{K2V2}, 32 x (2048 + 256), {budget // 2**20} MiB"))
    return out


def check_targets(result: dict) -> list[dict]:
    """Every target of issue 10 for the sections present in `result` (a `kvarn bench` JSON)."""
    s = result.get("sections", {})
    out = []
    if "attention" in s:
        out += _attention(s["attention"])
    if "e2e" in s:
        out += _e2e(s["e2e"])
    if "store" in s:
        out += _store(s["store"])
    if "vllm" in s:
        out += _vllm(s["vllm"])
    return out
