"""The main job (`kvarn demo`): FP16 vs quantized caches on one long greedy answer.

1. FP16 reference: greedy generation of `new_tokens` tokens (EOS suppressed so the answer is long), with
   its logits at every step.
2. Each quantized method: the prompt is prefilled into its cache, then the FP16 answer is fed back one
   token per forward (teacher forcing, `kvarn.decoding.follow_reference`). This is the exact work of decoding with that
   cache, so its tokens/s is the decode speed; the first position whose argmax differs from the FP16
   token is where free greedy generation with that cache would first diverge; the share of matching
   argmaxes is the top-1 agreement; KL(p_fp16 || p_method) is taken at every position.
3. KV bytes really held by the cache at the end vs what an fp16 cache would hold.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from kvarn.decoding import DEFAULT_PROMPT, MethodResult, chat_prompt, follow_reference, greedy_reference
from kvarn.eval.provenance import provenance
from kvarn.generation import prepare_model
from kvarn.presets import DEFAULT_PRESET, get_preset

# the paper's preset, the default a user gets (kvarn.DEFAULT_PRESET) and 4-bit keys, beside FP16 and two ablations
DEFAULT_METHODS = ("fp16", "rtn", "hadamard", "kvarn-k2v2-g128", DEFAULT_PRESET, "kvarn-k4v2-g128")


def run_demo(model_name: str = "default", methods: tuple[str, ...] = DEFAULT_METHODS, new_tokens: int = 1024,
             prompt: str = DEFAULT_PROMPT, sink: int | None = None, attention: str = "packed") -> dict:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from kvarn.models import load_model

    for m in methods:
        get_preset(m)  # validate every name before the long work
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2, got {new_tokens}")
    model, tok = load_model(model_name)
    prepare_model(model, attention)
    ids = chat_prompt(tok, prompt)
    results: list[MethodResult] = []
    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*cols) as progress:
        task = progress.add_task(f"{'fp16 generate':>18}", total=new_tokens + 1)
        ref_tokens, ref_logits, dt, cache = greedy_reference(model, tok, ids, new_tokens,
                                                             lambda: progress.advance(task))
        b = cache.nbytes()
        for method in methods:
            if method == "fp16":
                results.append(MethodResult("fp16", b.bits_per_element, b.total, cache.fp16_nbytes(),
                                            new_tokens / dt, None, 1.0, 0.0, 0.0, [0.0] * new_tokens))
                continue
            task = progress.add_task(f"{method:>18}", total=new_tokens - 1)
            results.append(follow_reference(model, method, ids, ref_tokens, ref_logits, sink,
                                            lambda _, task=task: progress.advance(task)))
    return {
        "provenance": provenance(model=model_name, methods=list(methods), new_tokens=new_tokens, sink=sink,
                                 attention=attention, prompt=prompt, prompt_tokens=ids.shape[1]),
        "answer_fp16": tok.decode(ref_tokens, skip_special_tokens=True),
        "results": [asdict(r) for r in results],
    }


def table_rows(report: dict) -> list[list[str]]:
    rows = []
    for r in report["results"]:
        fd = "never" if r["first_divergence"] is None else str(r["first_divergence"])
        rows.append([r["method"], f"{r['bits_per_element']:.3f}", f"{r['kv_bytes'] / 2**20:.2f}",
                     f"{r['kv_bytes_fp16'] / max(r['kv_bytes'], 1):.2f}x", f"{r['tokens_per_s']:.1f}", fd,
                     f"{100 * r['top1_agreement']:.1f}%", f"{r['mean_kl']:.4f}", f"{r['kl_last_256']:.4f}"])
    return rows


HEADERS = ["method", "bits/elem", "KV MiB", "vs fp16", "tok/s", "first diff", "top-1 agree", "mean KL",
           "KL last 256"]


def markdown(report: dict, plot_name: str | None = None) -> str:
    p = report["provenance"]
    lines = ["# kvarn demo", "",
             f"Model `{p['config']['model']}`, {p['config']['new_tokens']} new tokens (greedy FP16 answer, then "
             f"teacher-forced through each cache), prompt of {p['config']['prompt_tokens']} tokens, attention "
             f"`{p['config']['attention']}`. Machine: {p['machine']}; torch {p['torch']}, transformers "
             f"{p['transformers']}, kvarn {p['kvarn']} ({p['git']}), {p['date']}.", "",
             "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(report)]
    lines += ["", "KV MiB: bytes really held at the end (packed codes + scales + full-precision sink/tail); "
              "vs fp16: how many times smaller than an fp16 cache of the same tokens. first diff: index in "
              "the answer of the first token whose argmax differs from FP16 (where greedy decoding diverges). "
              "The `fp16` row is the unquantized reference: its cache holds the model's own dtype (a float32 "
              "model on the CPU holds 32 bits/elem there, so its 'vs fp16' is below 1)."]
    if plot_name:
        lines += ["", f"![KL vs position]({plot_name})"]
    lines += ["", "## FP16 answer (first 1,200 characters)", "", "```", report["answer_fp16"][:1200], "```", ""]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in report["results"]:
        if r["method"] == "fp16":
            continue
        kl = torch.tensor(r["kl"])
        w = min(32, len(kl))
        smooth = torch.nn.functional.avg_pool1d(kl[None, None], w, 1).flatten()
        ax.plot(torch.arange(len(smooth)) + w // 2, smooth.clamp_min(1e-6), label=f"{r['method']} "
                f"({r['bits_per_element']:.2f} b)")
    ax.set_yscale("log")
    ax.set_xlabel("position in the generated answer")
    ax.set_ylabel("KL(p_fp16 || p_method), rolling mean of 32")
    ax.set_title("Divergence from FP16 along a long greedy answer")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
