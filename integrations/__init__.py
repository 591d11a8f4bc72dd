"""vLLM client and OpenAI-compatible proxy, LMCache/vLLM connector glue, LangChain and LlamaIndex adapters."""
