"""Skills (compile, retrieve, splice, errata) and parallel-agent synthesis over branch KV. No HTTP."""
