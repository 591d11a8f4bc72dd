"""The connector's scheduler side: looks entries up and plans each step's loads and saves.

vLLM runs it in the scheduler process (``KVConnectorRole.SCHEDULER``; ``connector.ContextKitConnector``
delegates to it). It keeps a ``RequestState`` per request: the memoised lookup (vLLM may ask again for the
same local hit), the load vLLM accepted, the request's blocks and how many of them are saved. Lookups go
to the store in one batched call per request under the step's deadline (``lookup``); the bytes are moved
by the worker side (``worker.py``) from the ``ConnectorMeta`` built here.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from contextkit.core.errors import ConfigError, ContextKitError
from contextkit.core.policy import Budgets
from contextkit.integrations.vllm_connector.keys import KVGeometry, span_key
from contextkit.integrations.vllm_connector.limits import RepairLimits
from contextkit.integrations.vllm_connector.lookup import Lookup, Piece, RequestState
from contextkit.integrations.vllm_connector.metadata import ConnectorMeta, LoadOp, RepairPlan
from contextkit.integrations.vllm_connector.saves import SaveOp
from contextkit.integrations.vllm_connector.settings import ConnectorSettings
from contextkit.integrations.vllm_connector.stats import Counters
from contextkit.integrations.vllm_connector.wire import ConnectorAnswer, RequestOptions, WireVersionError

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from contextkit.core.policy import ReuseOptions
    from contextkit.kvstore.tiered import TieredStore
    from contextkit.spans.calibration import CalibrationProfile

log = logging.getLogger("contextkit.connector")


class ConnectorScheduler:
    """The scheduler-side half of ``ContextKitConnector`` (module docstring)."""

    def __init__(self, *, settings: ConnectorSettings, geometry: KVGeometry, store: TieredStore,
                 pic_loads: bool, step_tokens: int, profile: CalibrationProfile | None = None,
                 repair_refused: str | None = None):
        self.block_size = geometry.block_size
        # resolves policy="budget" of repaired requests (no profile: the built-in default)
        self.budgets = Budgets(profile)
        # why this server's worker cannot repair (connector._repair_refused): recompute requests then load
        # nothing (a full prefill of the span region), never unrepaired KV they did not ask for
        self.repair_refused = repair_refused
        self.context_spans = settings.context_spans
        self.geometry = geometry
        self.pic_loads = pic_loads  # False without the model's RoPE geometry: pic requests load nothing
        self.lookup = Lookup(store, geometry, timeout_s=settings.timeout_s, max_spans=settings.max_spans)
        self.limits = RepairLimits(settings=settings, geometry=geometry, step_tokens=step_tokens)
        self.counters = Counters()  # the scheduler's own (vLLM's scheduler asks for them and adds the worker's)
        self._requests: dict[str, RequestState] = {}

    def _state(self, request: Request) -> RequestState:
        st = self._requests.get(request.request_id)
        if st is None:
            ids = list(request.prompt_token_ids or [])
            try:
                opts = RequestOptions.of(request.kv_transfer_params, len(ids))
                salt = opts.namespace(request.cache_salt)  # never a salt the client chose (settings)
            except ConfigError as exc:  # the request runs, with exact reuse under its own cache_salt
                log.warning("request %s: %s; using exact reuse", request.request_id, exc)
                if isinstance(exc, WireVersionError):
                    self.counters.add("wire_mismatches")
                opts, salt = RequestOptions(), request.cache_salt
            st = RequestState(ids, opts, salt)
            if opts.mode == "pic" and opts.recompute is not None:
                try:
                    self._resolve(st)
                except Exception as exc:  # noqa: BLE001 - a bad profile or value, a bug: never into vLLM's scheduler
                    why = str(exc) if isinstance(exc, ContextKitError) else "see the connector's code"
                    log.warning("request %s: its recompute setting could not be resolved (%s: %s); it runs as exact "
                                "prefix reuse", request.request_id, type(exc).__name__, why)
                    self.counters.add("policy_fallbacks")
                    st = RequestState(ids, RequestOptions(), request.cache_salt)
            self._requests[request.request_id] = st
        return st

    def _resolve(self, st: RequestState) -> None:
        """The request's recompute setting: policy="budget" is the profile's cheapest setting within the
        budget for the prompt's length (or full prefill: then nothing is loaded), else, with no profile,
        the built-in default (query_attention at the request's ratio), with a warning the first time. On a
        server that cannot repair, full prefill of the span region, with the reason. The setting is then
        clamped to the operator's limits (``limits``). Raises on anything wrong: the caller falls back."""
        r = st.opts.recompute
        if self.repair_refused is not None:
            st.report = {"policy": "full", "requested": r.policy, "reason": self.repair_refused}
            return
        if r.policy != "budget":
            st.repair, st.report = r, {"policy": r.policy}
        else:
            self._resolve_budget(st, r)
        if st.repair is not None:
            st.repair, applied = self.limits.clamp(st.repair)
            self._clamped(st, applied)

    def _clamped(self, st: RequestState, applied: dict[str, float]) -> None:
        """Say in the request's report which limits cut its setting (counted once per request)."""
        if not applied:
            return
        if not st.report.get("clamped"):
            self.counters.add("repair_clamps")
        st.report["clamped"] = True
        st.report["limits"] = {**st.report.get("limits", {}), **applied}

    def _resolve_budget(self, st: RequestState, r: ReuseOptions) -> None:
        """policy="budget": the profile's choice for the prompt's length, or the built-in default
        (``core.policy.resolve_budget``, as on the built-in engine); "full" loads nothing."""
        got = self.budgets.resolve(r, len(st.ids))
        st.report = {"policy": got.options.policy, "fidelity_budget": got.budget, "profile": got.profile}
        if got.band is not None:
            st.report["band"] = got.band
        if got.tail_gate is not None:
            st.tail_gate = st.report["tail_gate"] = got.tail_gate
        if got.options.policy != "full":
            st.repair = got.options

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._state(request)
        if st.lookup is None or st.lookup[0] != num_computed_tokens:
            st.lookup = self._look_up(st, num_computed_tokens)
        if st.repair is not None and st.lookup[1]:
            self._hold_to_limits(st, request.request_id)
        return st.lookup[1], False

    def _look_up(self, st: RequestState, num_computed_tokens: int) -> tuple:
        """What the store holds after ``num_computed_tokens``: ``(computed, n, pieces, missing spans)``."""
        limit = len(st.ids) - 1  # vLLM computes at least the last prompt token
        missing: tuple = ()
        if st.opts.mode == "off":
            pieces: tuple[Piece, ...] = ()
        elif st.opts.mode == "pic":
            # no RoPE geometry, or a budget only full prefill meets: load nothing, vLLM computes it all
            full = st.report.get("policy") == "full"
            pieces, missing = (self.lookup.spans(st, num_computed_tokens, limit) if self.pic_loads and not full
                               else ((), ()))
        else:
            pieces = self.lookup.blocks(st, num_computed_tokens, limit)
        return num_computed_tokens, sum(p.n for p in pieces), pieces, missing

    def _hold_to_limits(self, st: RequestState, req_id: str) -> None:
        """Shed the request's repair when it would break a limit this step (``limits.RepairLimits.refusal``),
        skip it when it would cost more than vLLM computing the region it loads (``not_worth``): either way
        it loads nothing and vLLM computes its span region (the path of policy "full")."""
        computed, n, pieces, missing = st.lookup
        need = self.limits.need(st.repair, start=computed, end=computed + n, prompt=len(st.ids), pieces=pieces,
                                probe_end=st.opts.probe_end)
        if shed := self.limits.refusal(need):
            log.warning("request %s: recompute shed to a full prefill of its span region: %s", req_id, shed)
            self.counters.add("repair_sheds")
            reason = f"shed: {shed}"
        elif skip := self.limits.not_worth(need, n):  # a cost decision, not an overload: no warning
            self.counters.add("repair_skips")
            reason = f"skipped: {skip}"
        else:
            return
        st.report = {**st.report, "policy": "full", "requested": st.opts.recompute.policy, "reason": reason}
        st.repair = None
        st.lookup = (computed, 0, (), missing)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        st = self._requests.get(request.request_id)
        if st is None or num_external_tokens <= 0 or st.lookup is None:
            return
        computed, n, pieces, _ = st.lookup
        kept, total = [], 0
        for p in pieces:  # vLLM may take fewer tokens than offered
            if total >= num_external_tokens:
                break
            take = min(p.n, num_external_tokens - total)
            kept.append(p if take == p.n else Piece(p.key, p.src, take, p.dst, p.ids[:take], p.shift))
            total += take
        st.load = (computed, computed + total, tuple(kept))
        if st.repair is not None:  # this step's repairs so far: what the next request's must fit beside
            self.limits.commit(self.limits.need(st.repair, start=computed, end=computed + total, prompt=len(st.ids),
                                                probe_end=st.opts.probe_end,
                                                pieces=st.load[2]))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMeta:
        meta = ConnectorMeta()
        self.lookup.new_step()  # this step's lookups are done: the next ones get a deadline of their own
        self.limits.new_step()  # ... and its repairs are counted: the next step's get a budget of their own
        for new in scheduler_output.scheduled_new_reqs:
            st = self._requests.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            if st.saved_blocks < 0:  # first scheduled: blocks before here were hits (local or loaded)
                st.saved_blocks = new.num_computed_tokens // self.block_size
            if st.load is not None:
                start, end, pieces = st.load
                meta.loads.append(LoadOp(new.req_id, start, end, pieces, tuple(st.block_ids),
                                         self._repair_plan(st, start, end, pieces)))
                st.loaded_tokens += end - start
                st.load = None
            done = new.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            self._plan_saves(st, done, meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._requests.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    st.block_ids = list(new_ids[0])
                else:
                    st.block_ids.extend(new_ids[0])
            done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            self._plan_saves(st, done, meta)
        return meta

    def _repair_plan(self, st: RequestState, start: int, end: int, pieces: tuple[Piece, ...]) -> RepairPlan | None:
        """What the worker recomputes of this load (``core.policy.planned``: the count is fixed here, reported), cut
        to the per-request limit (``limits.RepairLimits.need``)."""
        r = st.repair
        if r is None:
            return None
        need = self.limits.need(r, start=start, end=end, prompt=len(st.ids), pieces=pieces, probe_end=st.opts.probe_end)
        if need.clamped:
            self._clamped(st, {"max_recompute_tokens": self.limits.max_tokens})
        if not need.tokens:
            return None
        p_end = st.opts.probe_end
        probe_end = len(st.ids) if p_end is None else max(end + 1, min(p_end, len(st.ids)))
        st.recomputed_tokens += need.tokens
        return RepairPlan(r.policy, need.count, need.sinks, need.moved, tuple(st.ids[:probe_end]), r.probe_layers,
                          r.check_layer, st.tail_gate)

    def _plan_saves(self, st: RequestState, done: int, meta: ConnectorMeta) -> None:
        """Saves of what this step completes: exact blocks (not for pic: its KV is approximate), for a
        span compile the whole prompt once it is computed, and for pic the spans the store lacked."""
        if st.opts.mode == "pic" and st.saved_blocks >= 0 and self.context_spans:
            self._plan_context_spans(st, done, meta)
        if st.opts.mode in ("pic", "off") or st.saved_blocks < 0:
            return
        bs, prompt = self.block_size, len(st.ids)
        full = min(done, prompt) // bs
        if full > st.saved_blocks:
            keys = self.lookup.block_keys(st)
            for b in range(st.saved_blocks, full):
                meta.saves.append(SaveOp(keys[b], b * bs, (b + 1) * bs, tuple(st.ids[b * bs : (b + 1) * bs]),
                                         tuple(st.block_ids)))
            st.saved_blocks = full
        if st.opts.mode == "span" and not st.span_saved and done >= prompt:
            key = span_key(self.geometry, st.salt, st.ids)
            # a span already stored (saved out of the request that computed it in context) is kept
            if not self.lookup.has(key):
                meta.saves.append(SaveOp(key, 0, prompt, tuple(st.ids), tuple(st.block_ids)))
            st.span_saved = True

    def _plan_context_spans(self, st: RequestState, done: int, meta: ConnectorMeta) -> None:
        """A pic request's spans the store lacked were computed by vLLM in this prompt: each is saved as span
        KV (K re-rotated to positions 0..) once computed. No compile of it alone is then needed, and the
        KV it stores saw a real context (the documents before it here), which a later request in another
        order repairs from a far closer start than KV computed alone (docs/vllm_connector.md)."""
        if st.lookup is None:
            return
        for s, e in st.lookup[3]:
            if done >= e and (s, e) not in st.context_saved:
                st.context_saved.add((s, e))
                meta.saves.append(SaveOp(span_key(self.geometry, st.salt, st.ids[s:e]), s, e, tuple(st.ids[s:e]),
                                         tuple(st.block_ids), shift=-s))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        st = self._requests.pop(request.request_id, None)
        if st is None:
            return False, None
        recompute = None
        if st.report:
            recompute = {**st.report, "recomputed_tokens": st.recomputed_tokens}
            if st.repair is not None:
                recompute["ratio"] = st.repair.ratio
                recompute["first_k"] = st.repair.first_k
                if st.repair.policy == "query_attention":
                    recompute["probe_layers"] = st.repair.probe_layers
        missing = tuple(st.lookup[3]) if st.lookup is not None else ()
        answer = ConnectorAnswer(st.opts.mode, st.loaded_tokens, recompute, missing, tuple(sorted(st.context_saved)))
        return False, answer.encode()
