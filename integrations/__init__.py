"""What contextkit plugs into, one folder per product:

- ``edge/``: the HTTP edge both servers share (shapes, body parsing, answers, OpenAPI, rate limit, metrics);
- ``proxy/``: the OpenAI-compatible proxy in front of vLLM (routes, upstream pool, span compiles);
- ``serve/``: ``contextkit serve``, the same API on the built-in engine;
- ``vllm_connector/``: the KV connector that runs inside vLLM (and LMCache's CacheBlend settings);
- ``frameworks/``: the LangChain and LlamaIndex adapters over the SDK;
- ``launchers/``: vLLM, Redis and lmcache_server as child processes, for tests and benches.
"""
