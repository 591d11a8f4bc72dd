"""``fork`` / ``join`` over HTTP (``contextkit serve``): parallel agents as ordinary chat completions.

Each worker branch is a chat (the shared prefix as its system message, its prompt as the user's, its
documents as ``documents``) sent with ``contextkit.keep``, all at once; serve keeps each answer's KV under
the response id. ``join`` is a chat whose documents carry each answer as text, under its label, and whose
``contextkit.handles`` name them: serve reads the answers from their kept KV (re-positioned and partly
recomputed per ``reuse``), and an answer it no longer holds from its text (the report's ``handles`` say
which). ``transcripts=True`` also gives the synthesizer what each worker read: its documents and its
prompt, as documents (span KV from serve's store where it has them). Same calls, same ``Answer`` as the
in-process ``fork`` (``contextkit.sdk.local``); the prompt is a chat, not the in-process token layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from contextkit.core.errors import ContextKitError, EmptyInputError
from contextkit.core.policy import ReuseOptions
from contextkit.core.types import Evidence
from contextkit.sdk.session import Client, evidence
from contextkit.sdk.shapes import Answer


@dataclass
class HTTPBranch:
    """One worker: what it read, what it wrote, and the handle its KV is kept under (None: not kept)."""

    index: int
    prompt: str
    documents: tuple[Evidence, ...]
    text: str = ""
    handle: str | None = None
    answer: Answer | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.text.strip())


def fork(client: Client, prefix: str, prompts: Sequence[str], documents: Sequence[Sequence[Any]] = (),
         max_tokens: int = 64, tenant: str | None = None) -> HTTPTeam:
    """Run the workers (one chat each, sent together) and return the team; a worker whose request failed
    has its ``error`` and is left out of the join."""
    if not prompts:
        raise EmptyInputError("fork needs at least one branch prompt")
    docs = list(documents) + [()] * (len(prompts) - len(documents))
    branches = [HTTPBranch(i, p, tuple(evidence(d, f"documents[{i}]") for d in ds))
                for i, (p, ds) in enumerate(zip(prompts, docs))]

    def work(b: HTTPBranch) -> None:
        msgs = [{"role": "system", "content": prefix}, {"role": "user", "content": b.prompt}]
        try:
            b.answer = client.generate(msgs, b.documents, max_tokens=max_tokens, tenant=tenant, keep=True,
                                       ordering="retrieval")
        except ContextKitError as exc:
            b.error = f"{type(exc).__name__}: {exc}"
            return
        b.text, b.handle = b.answer.text, b.answer.report.kept

    with ThreadPoolExecutor(max_workers=min(8, len(branches))) as pool:
        list(pool.map(work, branches))
    return HTTPTeam(client, branches, tenant)


class HTTPTeam:
    """Forked workers over HTTP (``branches``) and the synthesizer that reads their kept KV (``join``) or,
    for comparison, their text (``join_text``)."""

    def __init__(self, client: Client, branches: list[HTTPBranch], tenant: str | None):
        self.client, self.branches, self.tenant = client, branches, tenant

    def documents(self, label: str = "\nNote {i}:", transcripts: bool = False) -> list[Evidence]:
        """The synthesizer's documents: per successful worker (what it read, with ``transcripts``) its answer."""
        out: list[Evidence] = []
        for b in self.branches:
            if not b.ok:
                continue
            n = b.index + 1
            if transcripts:
                out += [Evidence(d.text, id=f"w{n}-d{j}", title=d.title) for j, d in enumerate(b.documents)]
                out.append(Evidence(b.prompt, id=f"w{n}-task", title=f"Task {n}"))
            out.append(Evidence(b.text, id=f"w{n}-note", title=label.format(i=n).strip(" :\n") or None))
        if not out:
            raise EmptyInputError("no worker produced anything to synthesize from")
        return out

    def _join(self, head: str, tail: str, reuse: ReuseOptions | bool, max_tokens: int, label: str,
              transcripts: bool) -> Answer:
        msgs = [{"role": "system", "content": head}, {"role": "user", "content": tail.strip() or "Answer."}]
        handles = [b.handle for b in self.branches if b.ok and b.handle]
        return self.client.generate(msgs, self.documents(label, transcripts), max_tokens=max_tokens,
                                    tenant=self.tenant, reuse=reuse, ordering="retrieval", handles=handles)

    def join(self, head: str, tail: str = "\n\nAnswer:", reuse: ReuseOptions | None = None, max_tokens: int = 64,
             label: str = "\nNote {i}:", transcripts: bool = False) -> Answer:
        """The synthesizer: ``head`` (its system message), each worker's answer (read from its kept KV),
        then ``tail`` (its user message); the report's ``handles`` say which answers came from KV."""
        return self._join(head, tail, reuse or ReuseOptions(), max_tokens, label, transcripts)

    def join_text(self, head: str, tail: str = "\n\nAnswer:", max_tokens: int = 64, label: str = "\nNote {i}:",
                  transcripts: bool = False) -> Answer:
        """The same synthesizer prompt prefilled in full (the baseline; no KV read)."""
        return self._join(head, tail, False, max_tokens, label, transcripts)
