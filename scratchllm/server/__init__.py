"""The OpenAI-compatible HTTP server (`scratchllm serve`): app factory, wire format, metrics, SSE."""
