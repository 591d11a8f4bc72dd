"""``contextkit.reuse`` fields are typed at the edge: a wrong type or range is a 422 naming the field, on
serve and on a proxy with a connector, never a 500 with internal text."""

from __future__ import annotations

import httpx
import pytest

from contextkit.core.errors import ConfigError, InputError
from contextkit.core.policy import ReuseOptions
from contextkit.core.tenant import Tenant
from contextkit.integrations.edge.parse import parse_chat

BAD = [({"separator": [-1]}, "separator"), ({"separator": "abc"}, "separator"), ({"separator": [1.5]}, "separator"),
       ({"block_size": 1.5}, "block_size"), ({"ratio": "0.3"}, "ratio"), ({"ratio": 2}, "ratio"),
       ({"first_k": True}, "first_k"), ({"recompute_last_span": 1}, "recompute_last_span"),
       ({"max_recompute": -3}, "max_recompute"), ({"policy": "fastest"}, "policy"), ({"ratio": None, "x": 1}, "x"),
       ({"separator": [7] * 65}, "separator")]


def _body(reuse) -> dict:
    return {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "Where?"}],
            "documents": [{"text": "In Rome."}], "contextkit": {"reuse": reuse}}


@pytest.mark.parametrize("reuse, field", BAD)
def test_a_wrong_reuse_field_is_an_input_error_naming_it(reuse, field):
    with pytest.raises(InputError) as err:
        parse_chat(_body(reuse), lambda name: Tenant(), allow_reuse=True)
    assert err.value.param == "contextkit" and field in str(err.value)


def test_fields_not_sent_keep_the_defaults():
    _, request = parse_chat(_body({"policy": "first_k", "first_k": 4, "separator": [5, 6]}), lambda n: Tenant(),
                            allow_reuse=True)
    assert request.reuse == ReuseOptions(policy="first_k", first_k=4, separator=(5, 6))
    _, request = parse_chat(_body({"policy": "query_attention", "ratio": 1}), lambda n: Tenant(),
                            allow_reuse=True)  # an int is a ratio
    assert request.reuse.ratio == 1.0
    assert parse_chat(_body({}), lambda n: Tenant(), allow_reuse=True)[1].reuse == ReuseOptions()  # the budget
    with pytest.raises(InputError, match="policy='query_attention'"):  # the budget chooses the ratio
        parse_chat(_body({"ratio": 0.2}), lambda n: Tenant(), allow_reuse=True)
    with pytest.raises(ConfigError):  # in process too
        ReuseOptions(separator=(-1,))


@pytest.mark.parametrize("reuse, field", BAD[:5] + [({"separator": [10**9]}, "separator")])
def test_serve_answers_422_naming_the_field(keyed_serve, reuse, field):
    url, key, _ = keyed_serve
    r = httpx.post(url + "/v1/chat/completions", json=_body(reuse), headers={"authorization": f"Bearer {key}"},
                   timeout=120)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == "contextkit" and field in r.json()["error"]["message"]
