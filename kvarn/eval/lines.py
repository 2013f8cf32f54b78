"""`kvarn eval lines`: line retrieval (LongChat style, docs/SPEC.md §6), static and cumulative.

A query is a document of L lines "line i: REGISTER_CONTENT is <CODE>", CODE 10 random characters of
[A-Z0-9], followed by the question for the code of one random line (wrapped in the model's chat template
when it has one). The prompt is prefilled in blocks of `--block` tokens, then `--new-tokens` tokens are
generated greedily (stopping at EOS). The answer is correct when its last 10-character alphanumeric token
equals the code (exact match). Also counted: answers identical to the reference's answer (a measure
that stays informative when the model itself cannot solve the task).

    reference   the prompt on a DynamicCache (full precision); its answers give the reference accuracy
    cumulative  the prompt through the method's KVarNCache, each block storing its own K/V
    static      the same, but each block stores the reference K/V of that block (set_store_override), so
                the cache holds the quantized reference prompt; generated tokens store their own K/V

Documents and questions come from `random.Random(f"{seed}-{L}-{q}")`: the same seed gives the same queries.
"""

from __future__ import annotations

import argparse
import random
import re
from pathlib import Path

import torch

from kvarn.eval.engine import MODES, RunSpec
from kvarn.eval.forward import forward_block, inference, newest_kv, override_store, quantized_cache, reference_cache
from kvarn.eval.options import add_common_arguments, int_list, parse_methods, positive_int, result_header, setup
from kvarn.eval.progress import progress
from kvarn.eval.pseudo_decode import parse_modes
from kvarn.eval.results import markdown_table, publish

COMMAND = "lines"
HELP = "line retrieval accuracy (random 10-char codes), static and cumulative"
DEFAULT_METHODS = "rtn,kvarn-k2v2-g128"
ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
CODE = re.compile(r"(?<![A-Za-z0-9])[A-Za-z0-9]{10}(?![A-Za-z0-9])")
INTRO = ("Below is a record of lines I want you to remember. Each line begins with 'line <line index>' and "
         "contains a '<REGISTER_CONTENT>' at the end of the line. For each line index, memorize its "
         "corresponding <REGISTER_CONTENT>. At the end of the record, I will ask you to retrieve the "
         "corresponding <REGISTER_CONTENT> of a certain line index. Now the record starts:\n\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, methods=DEFAULT_METHODS, command=COMMAND)
    parser.add_argument("--lines", type=int_list, default=[20, 40], help="line counts L (default: 20,40)")
    parser.add_argument("--queries", type=positive_int, default=10, help="queries per L (default: 10)")
    parser.add_argument("--new-tokens", type=positive_int, default=32, help="generated tokens (default: 32)")
    parser.add_argument("--block", type=positive_int, default=64, help="prefill block (default: 64)")
    parser.add_argument("--mode", default="static,cumulative", help="static, cumulative or both (default: both)")


def make_query(n_lines: int, seed: int, index: int) -> tuple[str, str]:
    """(prompt text, expected code) of query `index` with `n_lines` lines."""
    rng = random.Random(f"{seed}-{n_lines}-{index}")
    codes = ["".join(rng.choice(ALPHABET) for _ in range(10)) for _ in range(n_lines)]
    asked = rng.randrange(n_lines)
    body = "".join(f"line {i + 1}: REGISTER_CONTENT is <{c}>\n" for i, c in enumerate(codes))
    question = (f"\nNow the record is over. Tell me what is the <REGISTER_CONTENT> in line {asked + 1}? "
                "I need the answer.")
    return INTRO + body + question, codes[asked]


def prompt_text(tok, text: str) -> str:
    """The text `encode_prompt` tokenizes: the chat template (user turn, generation prompt) when the tokenizer has one,
    else the text."""
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return text


def encode_prompt(tok, text: str) -> torch.Tensor:
    """[1, P] ids of `prompt_text` (special tokens come from the template, if any)."""
    if getattr(tok, "chat_template", None):
        return tok(prompt_text(tok, text), return_tensors="pt", add_special_tokens=False).input_ids
    return tok(text, return_tensors="pt").input_ids


def score(answer: str, code: str) -> bool:
    """Exact match of the last 10-character alphanumeric token of the answer."""
    found = CODE.findall(answer)
    return bool(found) and found[-1] == code


def prefill(model, ids: torch.Tensor, cache, block: int, static_kv: list | None = None,
            keep_kv: list | None = None) -> torch.Tensor:
    """Feed ids [1, P] in blocks; static_kv[j] overrides what block j stores; keep_kv collects each block's
    K/V (reference). Returns the logits of the last position [V]."""
    logits = None
    for j, start in enumerate(range(0, ids.shape[1], block)):
        x = ids[:, start:start + block]
        if static_kv is not None:
            override_store(cache, static_kv[j])
        logits = forward_block(model, x, cache)[0, -1]
        if keep_kv is not None:
            keep_kv.append([(k.clone(), v.clone()) for k, v in newest_kv(cache, x.shape[1])])
    return logits


def greedy(model, logits: torch.Tensor, cache, new_tokens: int, eos: set[int]) -> list[int]:
    """Greedy continuation from the last prompt logits [V], one token per step on `cache`."""
    out = []
    for _ in range(new_tokens):
        nxt = int(logits.argmax())
        out.append(nxt)
        if nxt in eos or len(out) == new_tokens:
            break
        logits = forward_block(model, torch.tensor([[nxt]], device=logits.device), cache)[0, -1]
    return out


def eos_ids(model, tok) -> set[int]:
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = ids if isinstance(ids, list) else [ids]
    return {i for i in [*ids, tok.eos_token_id] if i is not None}


def run_query(model, tok, ids: torch.Tensor, specs: list[RunSpec], block: int, new_tokens: int,
              sink: int | None) -> dict[str, str]:
    """Answers of the reference and of every spec ('method/mode') to one prompt."""
    eos = eos_ids(model, tok)
    ref_cache, ref_kv = reference_cache(model), []
    logits = prefill(model, ids, ref_cache, block, keep_kv=ref_kv)
    answers = {"reference": tok.decode(greedy(model, logits, ref_cache, new_tokens, eos), skip_special_tokens=True)}
    for s in specs:
        cache = quantized_cache(model, s.preset, sink)
        logits = prefill(model, ids, cache, block, static_kv=ref_kv if s.mode == "static" else None)
        answers[s.label] = tok.decode(greedy(model, logits, cache, new_tokens, eos), skip_special_tokens=True)
    return answers


def evaluate(model, tok, specs: list[RunSpec], line_counts: list[int], queries: int, block: int, new_tokens: int,
             seed: int, sink: int | None) -> dict:
    ctx = getattr(model.config, "max_position_embeddings", None)
    labels = ["reference", *[s.label for s in specs]]
    results, examples, prompt_tokens = [], [], {}
    with inference(model):
        for n_lines in line_counts:
            correct, same = dict.fromkeys(labels, 0), dict.fromkeys(labels, 0)
            lengths = []
            for q in progress(range(queries), desc=f"{COMMAND} L={n_lines}", unit="query"):
                text, code = make_query(n_lines, seed, q)
                ids = encode_prompt(tok, text)
                if ctx is not None and ids.shape[1] + new_tokens > ctx:
                    raise ValueError(f"{n_lines} lines take {ids.shape[1]} tokens, beyond the model's context {ctx}")
                lengths.append(ids.shape[1])
                answers = run_query(model, tok, ids, specs, block, new_tokens, sink)
                for label, a in answers.items():
                    correct[label] += score(a, code)
                    same[label] += a == answers["reference"]
                if q == 0:
                    examples.append({"lines": n_lines, "code": code, "answers": answers})
            prompt_tokens[str(n_lines)] = sum(lengths) / len(lengths)
            for label in labels:
                method, _, mode = label.partition("/")
                results.append({"method": method, "mode": mode or "reference", "lines": n_lines, "queries": queries,
                                "correct": correct[label], "accuracy": correct[label] / queries,
                                "same_as_reference": same[label]})
    return {"results": results, "prompt_tokens": prompt_tokens, "examples": examples}


def write_plots(result: dict, out: Path) -> list[Path]:
    from kvarn.eval import plots

    return [plots.accuracy_vs_lines(result, out / "lines.png")]


def summary_markdown(result: dict) -> str:
    ls = sorted({r["lines"] for r in result["results"]})
    acc = {(r["method"], r["mode"], r["lines"]): r for r in result["results"]}
    keys = list(dict.fromkeys((r["method"], r["mode"]) for r in result["results"]))
    rows = [[m, mode, *[f"{acc[(m, mode, n)]['correct']}/{acc[(m, mode, n)]['queries']} "
                        f"({acc[(m, mode, n)]['same_as_reference']})" for n in ls]] for m, mode in keys]
    head = ["method", "mode", *[f"L={n} (~{result['prompt_tokens'][str(n)]:.0f} tok)" for n in ls]]
    return (f"## Line retrieval ({result['model']}, {result['new_tokens']} new tokens, prefill blocks of "
            f"{result['block']})\n\ncorrect/queries: exact match of the last 10-character alphanumeric token of the "
            "greedy answer; in parentheses: answers identical to the reference's. reference: unquantized cache."
            "\n\n" + markdown_table(head, rows))


def run(args: argparse.Namespace) -> int:
    setup(args)
    presets, modes = parse_methods(args.methods), parse_modes(args.mode)
    from kvarn.models import load_model

    model, tok = load_model(args.model)
    specs = [RunSpec(p.name, p, m) for p in presets for m in modes if m in MODES]
    result = {**result_header(args, COMMAND), "new_tokens": args.new_tokens, "block": args.block, "seed": args.seed,
              **evaluate(model, tok, specs, args.lines, args.queries, args.block, args.new_tokens, args.seed,
                         args.sink)}
    out = Path(args.out)
    write_plots(result, out)
    publish(result, out / "lines.json", out, summary_markdown(result))
    return 0
