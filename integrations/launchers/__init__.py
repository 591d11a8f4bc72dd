"""Starting the real parts as child processes, for tests, benches and tools: a process group with its
log and health wait (``process``), vLLM (``vllm_server``), ``contextkit proxy`` and ``contextkit serve``
(``servers``), Redis and lmcache_server (``services``). Nothing in the product imports these."""
