"""TenantLRU: a table bounded in all and per key tenant; a key past its share drops its own oldest."""

from __future__ import annotations

import pytest

from contextkit.core.errors import ConfigError
from contextkit.core.tenant_lru import TenantLRU


def test_a_key_past_its_share_drops_its_own_oldest_and_the_total_stays_bounded():
    t: TenantLRU[str, int] = TenantLRU(limit=5, per_key=2, tenant_of=lambda name: name)
    t["globex"] = 0
    for i in range(10):
        t[f"acme:{i}"] = i  # acme's sub-tenants are charged to acme
    assert list(t) == ["globex", "acme:8", "acme:9"] and t.count("acme:x") == 2 and t.count("globex") == 1
    t.touch("acme:8")  # used: now acme's newest, so acme:9 goes next
    t["acme"] = 10
    assert list(t) == ["globex", "acme:8", "acme"]
    for name in ("b", "c", "d"):  # other keys: past the total, the oldest of all goes
        t[name] = 0
    assert len(t) == 5 and "globex" not in t and t.popitem() == ("acme:8", 8)  # oldest first
    assert t.count("acme") == 1
    del t["acme"]
    assert t.count("acme") == 0 and list(t) == ["b", "c", "d"]
    with pytest.raises(ConfigError, match=">= 1"):
        TenantLRU(0, 1, str)
