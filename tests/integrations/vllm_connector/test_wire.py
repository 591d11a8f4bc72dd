"""The proxy <-> connector wire format (integrations/vllm_connector/wire.py): what the proxy writes the
connector reads back as it was meant, both ways, and a message of another version is refused."""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from contextkit.core.errors import ConfigError
from contextkit.core.policy import ReuseOptions, for_connector, variant
from contextkit.core.tenancy import pic_salt
from contextkit.integrations.vllm_connector.wire import (
    PROTOCOL_VERSION,
    ConnectorAnswer,
    RequestOptions,
    WireVersionError,
)


@st.composite
def repairs(draw):
    """Any setting the proxy could send (the ones ReuseOptions itself refuses are not messages)."""
    try:
        return ReuseOptions(policy=draw(st.sampled_from(["budget", "query_attention", "kv_deviation", "first_k"])),
                            ratio=draw(st.floats(0, 1)),
                            max_recompute=draw(st.one_of(st.none(), st.integers(1, 4096))),
                            first_k=draw(st.integers(0, 8)), probe_layers=draw(st.integers(0, 24)),
                            check_layer=draw(st.integers(0, 4)))
    except ConfigError:
        assume(False)


@st.composite
def requests(draw):
    mode = draw(st.sampled_from(["exact", "span", "pic", "off"]))
    cuts = sorted(draw(st.sets(st.integers(0, 500), min_size=2, max_size=12)))
    spans = tuple(zip(cuts[::2], cuts[1::2])) if mode == "pic" else ()
    if mode == "pic" and not spans:
        spans = ((0, 1),)
    recompute = draw(st.one_of(st.none(), repairs())) if mode == "pic" else None
    probe_end = draw(st.one_of(st.none(), st.integers(1, 10_000))) if recompute is not None else None
    return RequestOptions(mode=mode, spans=spans, salt=draw(st.one_of(st.none(), st.text(max_size=20))),
                          recompute_last=mode == "pic" and draw(st.booleans()), recompute=recompute,
                          probe_end=probe_end)


@given(requests())
def test_a_request_reads_back_as_it_was_written(request):
    assert RequestOptions.of(request.encode(), 501) == request


@given(st.sampled_from(["exact", "pic"]), st.integers(0, 10**6),
       st.lists(st.tuples(st.integers(0, 999), st.integers(1000, 2000)), max_size=4))
def test_an_answer_reads_back_as_it_was_written(mode, loaded, spans):
    answer = ConnectorAnswer(mode, loaded, {"policy": "query_attention", "recomputed_tokens": 7}, tuple(spans),
                             tuple(spans[:1]))
    assert ConnectorAnswer.of(answer.encode()) == answer


def test_an_uncapped_recompute_keeps_its_salt_on_the_connectors_side():
    """``max_recompute: None`` (uncapped) used to be left out of the message and read back as the default
    cap, so the connector's salt variant differed from the proxy's and the request ran as exact reuse."""
    repair = for_connector(ReuseOptions(policy="query_attention", ratio=1.0, max_recompute=None))
    sent = RequestOptions(mode="pic", spans=((0, 4),), salt="tenant", recompute=repair)
    got = RequestOptions.of(sent.encode(), 10)
    assert got.recompute.max_recompute is None
    assert got.namespace(pic_salt("tenant", recompute_last=False, variant=variant(repair))) == "tenant"


def test_the_probe_end_travels_with_the_setting_and_does_not_change_its_salt():
    sent = RequestOptions(mode="pic", spans=((0, 4),), salt="t", recompute=ReuseOptions(policy="kv_deviation"))
    got = RequestOptions.of(sent.with_probe_end(9).encode(), 10)
    assert got.probe_end == 9 and got.recompute == sent.recompute
    assert sent.with_probe_end(9).encode()["contextkit"]["recompute"]["probe_end"] == 9  # the wire's shape
    assert RequestOptions(mode="pic", spans=((0, 4),), salt="t").with_probe_end(9).probe_end is None


def _pic(recompute) -> dict:
    return {"contextkit": {"v": PROTOCOL_VERSION, "mode": "pic", "spans": [[0, 4]], "salt": "t",
                           "recompute": recompute}}


@pytest.mark.parametrize("raw, needle", [
    ("x", "must be an object"),
    ({"policy": "attention"}, "does not run inside vLLM"),
    ({"policy": "none"}, "does not run inside vLLM"),
    ({"ratio": 1.5, "policy": "query_attention"}, "ratio"),
    ({"policy": "query_attention", "shuffle": True}, "unknown fields"),
    ({"probe_end": 0}, "probe_end"),
    ({"probe_end": "9"}, "probe_end"),
    ({"policy": "budget", "fidelity_budget": 0}, "budget"),
    ({"policy": "query_attention", "ratio": "lots"}, "recompute"),
])
def test_bad_recompute_settings_say_what_is_wrong(raw, needle):
    with pytest.raises(ConfigError, match=needle):
        RequestOptions.of(_pic(raw), 10)


@pytest.mark.parametrize("version", [None, PROTOCOL_VERSION + 1, str(PROTOCOL_VERSION), 0])
def test_messages_of_another_version_are_refused_both_ways(version):
    request, answer = RequestOptions(mode="span").encode(), ConnectorAnswer("exact", 3).encode()
    for message in (request, answer):
        if version is None:
            del message["contextkit"]["v"]
        else:
            message["contextkit"]["v"] = version
    with pytest.raises(WireVersionError, match="same contextkit release"):
        RequestOptions.of(request, 10)
    with pytest.raises(WireVersionError, match="same contextkit release"):
        ConnectorAnswer.of(answer)


def test_no_entry_is_an_exact_request_and_no_answer_and_malformed_ones_are_refused():
    assert RequestOptions.of(None, 10) == RequestOptions() and RequestOptions.of({}, 10).mode == "exact"
    assert ConnectorAnswer.of(None) is None and ConnectorAnswer.of({"other": 1}) is None
    with pytest.raises(ConfigError):
        ConnectorAnswer.of({"contextkit": {"v": PROTOCOL_VERSION, "loaded_tokens": "12"}})
    with pytest.raises(ConfigError):
        RequestOptions.of({"contextkit": [1, 2]}, 10)
