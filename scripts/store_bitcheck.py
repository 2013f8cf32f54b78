"""Bit-identity of a C++ tile-store change on real tiles: feeds a text through `KVarNCache` in chunks of 128 tokens
(the serving protocol: the running query statistics weigh kvarn-auto's choice and query-aware rounding) and saves
every stored tensor (`save_cache`), or compares them with a saved run (`torch.equal` per tensor).

    python scripts/store_bitcheck.py save    [--models M,..] [--presets P,..] [--tokens N] [--file F]
    python scripts/store_bitcheck.py compare [--models M,..] [--presets P,..] [--tokens N] [--file F]

Defaults: the embedded SmolLM2 and Qwen2.5-Coder-0.5B, `kvarn-w2.5`, 1,280 tokens of the default text, FILE
/tmp/kvarn-store-bitcheck.pt. Run with KVARN_KERNEL unset (the store kernel serves every tile here);
tests/kernels/test_cpu_store.py bounds it against the float64 reference, this shows a change kept its outputs to the
bit.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from safetensors.torch import load_file

from kvarn.eval.text import load_tokens
from kvarn.integrations.serialize import save_cache
from kvarn.integrations.transformers import KVarNCache
from kvarn.models import load_model


def stored(model_name: str, preset: str, tokens: int) -> dict[str, torch.Tensor]:
    model, tok = load_model(model_name)
    ids = load_tokens(tok, None, tokens)
    cache = KVarNCache(model.config, preset)
    with torch.no_grad():
        for s in range(0, tokens, 128):
            model(input_ids=ids[:, s:s + 128], past_key_values=cache, use_cache=True)
    with tempfile.TemporaryDirectory() as d:
        save_cache(cache, f"{d}/c.safetensors")
        return load_file(f"{d}/c.safetensors")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=("save", "compare"))
    ap.add_argument("--models", default="default,qwen2.5-coder-0.5b")
    ap.add_argument("--presets", default="kvarn-w2.5")
    ap.add_argument("--tokens", type=int, default=1280)
    ap.add_argument("--file", default="/tmp/kvarn-store-bitcheck.pt")
    a = ap.parse_args()
    torch.manual_seed(0)
    runs = {f"{m}/{p}": stored(m, p, a.tokens) for m in a.models.split(",") for p in a.presets.split(",")}
    if a.mode == "save":
        torch.save(runs, a.file)
        print(f"saved {sum(len(r) for r in runs.values())} tensors of {len(runs)} runs to {a.file}")
        return
    old = torch.load(a.file)
    bad = [f"{run}:{k}" for run, r in runs.items() for k, t in r.items()
           if k not in old[run] or not torch.equal(t, old[run][k])]
    n = sum(len(r) for r in runs.values())
    print(f"{n - len(bad)} of {n} tensors equal" + (": differ " + ", ".join(bad[:20]) if bad else ""))
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
