"""Framework adapters over the SDK: LangChain (``langchain``) and LlamaIndex (``llamaindex``), with the
helper both share (``adapter``). Each imports its framework on first use."""
