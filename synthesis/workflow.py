"""Multi-stage agent workflows as a small DAG: nodes are generation steps, edges say whose KV feeds whom.

``Workflow(steps)`` checks the graph (networkx): every input names a step, and there is no cycle.
``run`` goes in dependency order (``topological_generations``): the steps of the first generation that
read nothing but the shared prefix run together as branches of one fork (one copy of the prefix's KV,
one batched forward per token); every other step reads its inputs' generated KV, re-positioned after
the prefix with the request's recompute policy (``join``), and decodes its own output, whose KV then
feeds the steps after it (chains and fan-in). A step that fails keeps its error; the steps that need it
are skipped with a reason, the rest still run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import networkx as nx
import torch

from contextkit.core.errors import ConfigError, InputError
from contextkit.core.generation import SamplingParams
from contextkit.core.plan import ReuseReport
from contextkit.core.policy import ReuseOptions
from contextkit.core.sampling import sample
from contextkit.core.tenant import Tenant
from contextkit.spans.key import span_key
from contextkit.spans.store import CompiledSpan
from contextkit.synthesis.parallel import Fork, generated_span, synthesis_plan


class WorkflowError(InputError):
    """A workflow that cannot run as given (a cycle, an input that names no step)."""


@dataclass(frozen=True, slots=True)
class Step:
    """One generation step: its prompt, the steps whose output it reads (in order), its token budget."""

    name: str
    prompt: str
    inputs: tuple[str, ...] = ()
    max_new_tokens: int = 48


@dataclass
class StepResult:
    name: str
    text: str = ""
    token_ids: tuple[int, ...] = ()
    span: CompiledSpan | None = None  # the KV of its output, position-free, for the steps after it
    report: ReuseReport | None = None  # what reading its inputs' KV reused and recomputed
    error: str | None = None
    batched_with: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return self.error is None


class Workflow:
    """A DAG of ``Step`` s (see the module docstring)."""

    def __init__(self, steps: Sequence[Step]):
        names = [s.name for s in steps]
        if len(set(names)) < len(names):
            raise WorkflowError("two steps share a name; give each step its own")
        self.steps = {s.name: s for s in steps}
        self.graph = nx.DiGraph()
        self.graph.add_nodes_from(names)
        for s in steps:
            for dep in s.inputs:
                if dep not in self.steps:
                    raise WorkflowError(f"step {s.name!r} reads {dep!r}, which is not a step of the workflow")
                self.graph.add_edge(dep, s.name)
        try:
            cycle = nx.find_cycle(self.graph)
        except nx.NetworkXNoCycle:
            cycle = None
        if cycle:
            raise WorkflowError("the workflow has a cycle: " + " -> ".join([e[0] for e in cycle] + [cycle[0][0]]))

    def order(self) -> list[list[str]]:
        """Generations in dependency order (the steps of one generation do not depend on each other)."""
        return [sorted(g) for g in nx.topological_generations(self.graph)]

    def run(self, spans, tokenizer, prefix: str, options: ReuseOptions = ReuseOptions(),
            tenant: Tenant | str = "", params: SamplingParams = SamplingParams()) -> dict[str, StepResult]:
        """Run every step; returns each step's result (its text, output KV, reuse report or error)."""
        prefix_ids = tokenizer.encode(prefix, add_special_tokens=True)
        if not prefix_ids:
            raise ConfigError("the workflow needs a shared prefix (instructions every step reads)")
        results: dict[str, StepResult] = {}
        for gen_i, generation in enumerate(self.order()):
            roots = [n for n in generation if not self.steps[n].inputs]
            if roots:
                self._fork(roots, spans, tokenizer, prefix_ids, params, tenant, results)
            for name in generation:
                if name in results:
                    continue
                self._join(name, spans, tokenizer, prefix_ids, options, tenant, params, results)
        return results

    def _fork(self, roots, spans, tokenizer, prefix_ids, params, tenant, results) -> None:
        prompts, fits = {}, []
        for n in roots:
            prompts[n] = tokenizer.encode(self.steps[n].prompt)
            need = len(prefix_ids) + len(prompts[n]) + self.steps[n].max_new_tokens
            if need > spans.engine.spec.max_positions:
                results[n] = StepResult(n, error=f"needs {need} positions, over the model's "
                                                 f"{spans.engine.spec.max_positions}; lower its max_new_tokens")
            else:
                fits.append(n)
        if not fits:
            return
        f = Fork(spans, tokenizer, prefix_ids, [prompts[n] for n in fits], params, tenant,
                 limits=[self.steps[n].max_new_tokens for n in fits])
        f.run()
        for n, b in zip(fits, f.branches):
            r = StepResult(n, tokenizer.decode(b.token_ids), tuple(b.token_ids), error=b.error,
                           batched_with=tuple(fits))
            if b.ok and b.token_ids:
                r.span = f.span(b)
            results[n] = r

    def _join(self, name, spans, tokenizer, prefix_ids, options, tenant, params, results) -> None:
        step = self.steps[name]
        missing = [d for d in step.inputs if not (results[d].ok and results[d].span is not None)]
        if missing:
            results[name] = StepResult(name, error=f"skipped: input {missing[0]!r} failed or produced nothing")
            return
        try:
            plan, where = synthesis_plan(prefix_ids, [results[d].token_ids for d in step.inputs],
                                         tokenizer.encode(step.prompt), options=options, tenant=tenant)
            asm = spans.assemble(plan, extra_capacity=step.max_new_tokens + 1,
                                 provided={i: results[d].span for i, d in zip(where, step.inputs)})
            tokens, slots = _decode(spans, asm, _with(params, step.max_new_tokens))
            r = StepResult(name, tokenizer.decode(tokens), tuple(tokens), report=asm.report)
            if tokens:
                context = span_key(spans.identity, tuple(plan.ids), (), tenant)
                r.span = generated_span(spans, asm.cache, slots, tuple(tokens), context, tenant)
            results[name] = r
        except Exception as exc:  # noqa: BLE001 - one step's failure is kept; the others go on
            results[name] = StepResult(name, error=f"{type(exc).__name__}: {exc}")


def _with(params: SamplingParams, max_new_tokens: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, max_new_tokens=max_new_tokens)


def _decode(spans, asm, params: SamplingParams) -> tuple[list[int], list[int]]:
    """Decode from an assembly, writing every generated token's KV (the last one too: later steps read it)."""
    eng, cache = spans.engine, asm.cache
    stop = set(eng.spec.eos_token_ids if params.stop_token_ids is None else params.stop_token_ids)
    gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    logits, tokens, slots = asm.logits, [], []
    while len(tokens) < params.max_new_tokens:
        token = sample(logits[0], params, gen)
        if token in stop:
            break
        slots.append(cache.length)
        logits = eng.forward(cache, [token])
        tokens.append(token)
    return tokens, slots
