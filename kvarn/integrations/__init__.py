"""kvarn inside inference engines: transformers (`kvarn.integrations.transformers`: `KVarNCache`; `serialize`:
save/load it) and vLLM (`kvarn.integrations.vllm`: the plugin)."""
