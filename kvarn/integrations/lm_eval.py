"""lm-evaluation-harness (0.4.x) model "kvarn": transformers' HFLM with every request run through a fresh
`KVarNCache`.

    generate_until  the serving protocol (`kvarn.integrations.serving`): each request's context prefilled in chunks
                    of `chunk` tokens (default 128, the tile), so later chunks read the quantized past, then greedy
                    decoding through the cache until a stop string, EOS or max_gen_toks; batches run row by row
    loglikelihood   context + continuation fed in chunks through the cache, so the continuation is scored against
                    the quantized context (the logits of every position are kept)

Run lm-eval's own CLI with the model registered (offline: local task folders and data files):

    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 python -m kvarn.integrations.lm_eval run --model kvarn \\
        --model_args pretrained=DIR,preset=kvarn-auto-k2v2-g128 --include_path TASKS_DIR --tasks NAME --device cpu

`preset=fp16` (or `preset=dynamic` for transformers' DynamicCache) gives the full-precision reference through the
same code path. lm-eval is not a dependency of kvarn: install it beside kvarn (`pip install 'lm-eval>=0.4,<0.5'`).
"""

from __future__ import annotations

import sys

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from kvarn.integrations.serving import greedy, prefill
from kvarn.integrations.transformers import KVarNCache, cache_kwarg
from kvarn.presets import DEFAULT_PRESET, get_preset

NAME = "kvarn"


@register_model(NAME)
class KVarNLM(HFLM):
    """HFLM whose forward passes and generations run through a fresh `KVarNCache(preset)` per request."""

    def __init__(self, pretrained, preset: str = DEFAULT_PRESET, chunk: int = 128, sink: int | None = None,
                 **kwargs) -> None:
        chunk, sink = int(chunk), None if sink in (None, "", "None") else int(sink)
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        if preset != "dynamic":
            get_preset(preset)  # a clear error before the model loads
        kwargs.setdefault("device", "cpu")
        super().__init__(pretrained=pretrained, **kwargs)
        self.preset, self.chunk, self.sink = preset, chunk, sink

    def new_cache(self):
        if self.preset == "dynamic":
            from transformers import DynamicCache

            return DynamicCache(config=self.model.config)
        return KVarNCache(self.model.config, self.preset, sink=self.sink)

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        if attn_mask is not None or labels is not None:
            raise ValueError("the kvarn lm-eval model runs decoder-only (causal) models")
        cache, parts = self.new_cache(), []
        with torch.no_grad():
            for start in range(0, inps.shape[1], self.chunk):  # right padding: pads come last, read by no real token
                x = inps[:, start:start + self.chunk]
                parts.append(self.model(input_ids=x, use_cache=True, **{cache_kwarg(self.model): cache}).logits)
        return torch.cat(parts, dim=1)

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str],
                        **generation_kwargs) -> torch.Tensor:
        if generation_kwargs.get("do_sample"):
            raise ValueError("the kvarn lm-eval model decodes greedily (do_sample=False)")
        mask = generation_kwargs.get("attention_mask")
        new_tokens = max_length - context.shape[1]
        eos = {self.tokenizer.eos_token_id} - {None}
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        rows = []
        with torch.no_grad():
            for b in range(context.shape[0]):
                ids = context[b:b + 1] if mask is None else context[b:b + 1, mask[b].bool()]  # left pads dropped
                cache = self.new_cache()
                out = greedy(self.model, self.tokenizer, cache, prefill(self.model, ids, cache, self.chunk),
                             new_tokens, eos, tuple(stop or ()))
                rows.append(out + [pad] * (new_tokens - len(out)))
        cont = torch.tensor(rows, dtype=context.dtype, device=context.device).reshape(context.shape[0], -1)
        return torch.cat([context, cont], dim=1)


def main(argv: list[str] | None = None) -> None:
    """lm-eval's CLI with the "kvarn" model registered (this module's import registers it)."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
