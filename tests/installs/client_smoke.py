"""Run by a light install's interpreter (the client extra, plus langchain-core and llama-index-core):
the SDK and both adapters call a contextkit proxy over HTTP. Prints one JSON object of what each saw;
``tests/light/test_light_installs.py`` asserts on it. Usage: python client_smoke.py PROXY_URL EXAMPLE_JSON
"""

import json
import sys
from pathlib import Path

ENGINE = ("torch", "transformers", "vllm", "lmcache")


def engine_modules() -> list[str]:
    return [m for m in ENGINE if m in sys.modules]


def orders(one, two) -> dict:
    return {"first": list(one["order"]), "second": list(two["order"]), "reordered": two["reordered"],
            "path": one["path"], "cached_tokens": two["cached_tokens"]}


def main(url: str, example: str) -> dict:
    ex = json.loads(Path(example).read_text())
    question = ex["question"]
    docs = [{"id": f"d{i}", "title": d.get("title") or f"doc {i}", "text": d["text"]}
            for i, d in enumerate(ex["documents"])]
    import contextkit
    from contextkit.core.errors import ConfigError

    out: dict = {}
    client = contextkit.connect(url)
    one, two = (client.generate(question, documents=ds, max_tokens=4, tenant="light-sdk") for ds in (docs, docs[::-1]))
    out["sdk"] = {**orders(one.report.as_dict(), two.report.as_dict()), "text": one.text}
    try:
        contextkit.connect()
        out["connect_local"] = "no error"
    except ConfigError as exc:
        out["connect_local"] = str(exc)
    # fork/join over HTTP: workers are chats (the proxy answers them from vLLM and keeps nothing yet)
    team = client.fork("You are a research worker.", ["Say hello."], max_tokens=8, tenant="light-sdk")
    out["fork"] = {"errors": [b.error for b in team.branches], "kept": [b.handle for b in team.branches]}
    out["engine_after_sdk"] = engine_modules()

    from langchain_core.documents import Document

    from contextkit.integrations.frameworks.langchain import ChatContextKit

    llm = ChatContextKit(base_url=url, max_tokens=4, tenant="light-lc")
    lc = [Document(page_content=d["text"], id=d["id"], metadata={"title": d["title"]}) for d in docs]
    a, b = llm.invoke(question, documents=lc), llm.invoke(question, documents=lc[::-1])
    out["langchain"] = orders(a.response_metadata["contextkit"], b.response_metadata["contextkit"])

    from llama_index.core.schema import NodeWithScore, TextNode

    from contextkit.integrations.frameworks.llamaindex import ContextKitLLM

    li = ContextKitLLM(base_url=url, max_tokens=4, tenant="light-li")
    nodes = [NodeWithScore(node=TextNode(text=d["text"], id_=d["id"], metadata={"title": d["title"]}), score=1.0)
             for d in docs]
    c, d = li.complete(question, documents=nodes), li.complete(question, documents=nodes[::-1])
    out["llamaindex"] = orders(c.additional_kwargs["contextkit"], d.additional_kwargs["contextkit"])
    out["engine_after_adapters"] = engine_modules()
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
