"""Integrations of the kvarn cache with serving engines (vLLM: `kvarn.integrations.vllm`)."""
