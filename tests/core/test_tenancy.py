"""Tenancy: the tenant comes from the API key, a body cannot name another tenant, cache salts are
HMACs under the server secret, the secret file is made once and private, and an open server stays on
loopback."""

from __future__ import annotations

import stat

import pytest

from contextkit.core.errors import (
    AuthenticationError,
    ConfigError,
    InputError,
    PermissionDeniedError,
    RateLimitError,
    http_status,
)
from contextkit.core.tenancy import Tenancy, check_bind, derive, load_api_keys, load_secret
from contextkit.core.tenant import Tenant

SECRET = bytes(range(32))


def test_the_tenant_comes_from_the_key():
    t = Tenancy({"key-aaaaaaaa": "acme", "key-bbbbbbbb": "globex"}, SECRET)
    assert t.authenticate("Bearer key-aaaaaaaa") == Tenant("acme")
    assert t.authenticate("bearer  key-bbbbbbbb ") == Tenant("globex")
    for bad in (None, "", "Bearer", "Basic key-aaaaaaaa", "Bearer key-cccccccc", "key-aaaaaaaa"):
        with pytest.raises(AuthenticationError) as err:
            t.authenticate(bad)
        assert http_status(err.value) == 401
    acme = Tenant("acme")
    assert t.resolve(acme, None) == t.resolve(acme, "acme") == acme
    with pytest.raises(PermissionDeniedError) as err:
        t.resolve(acme, "globex")  # naming another tenant in the body
    assert http_status(err.value) == 403 and "API key" in str(err.value)


def test_client_chosen_tenants_stay_under_the_key():
    t = Tenancy({"key-aaaaaaaa": "acme"}, SECRET, allow_client_tenant=True)
    acme = t.authenticate("Bearer key-aaaaaaaa")
    assert t.resolve(acme, "team-1") == Tenant("acme:team-1")
    assert t.resolve(acme, "globex") != Tenant("globex")  # a sub-tenant of acme, never globex itself
    opened = Tenancy(secret=SECRET, allow_client_tenant=True)
    assert opened.open and opened.authenticate(None) == Tenant()
    assert opened.resolve(Tenant(), "acme") == Tenant("acme")
    with pytest.raises(PermissionDeniedError):
        Tenancy(secret=SECRET).resolve(Tenant(), "acme")  # open, but client tenants not allowed


def test_cache_salts_are_hmacs_under_the_secret():
    a, b = Tenancy(secret=SECRET), Tenancy(secret=bytes(32))
    salt = a.cache_salt(Tenant("acme"))
    assert salt != "acme" and len(salt) == 64 and salt == a.cache_salt(Tenant("acme"))
    assert salt != a.cache_salt(Tenant("globex")) and salt != b.cache_salt(Tenant("acme"))
    assert a.cache_salt(Tenant("acme"), "user-1") not in (salt, "user-1")  # the client's salt is mixed in
    assert a.cache_salt(Tenant("acme"), "user-1") != a.cache_salt(Tenant("globex"), "user-1")
    assert derive(SECRET, "kv-mac") != derive(SECRET, "cache-salt")


def test_secret_file_is_made_once_and_private(tmp_path):
    path = tmp_path / "sub" / "secret"
    first = load_secret(path)
    assert len(first) == 32 and load_secret(path) == first
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_secret(path, "x" * 40) != first  # a configured secret wins
    with pytest.raises(ConfigError, match="at least 32"):
        load_secret(path, "short")
    path.write_bytes(b"tiny")
    with pytest.raises(ConfigError, match="fewer than 32"):
        load_secret(path)


def test_keys_from_a_file_and_bad_keys(tmp_path):
    f = tmp_path / "keys.json"
    f.write_text('{"key-aaaaaaaa": "acme"}')
    assert load_api_keys(f, {"key-bbbbbbbb": "default"}) == {"key-aaaaaaaa": "acme", "key-bbbbbbbb": "default"}
    f.write_text("[1]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_api_keys(f)
    with pytest.raises(ConfigError, match="at least 8"):
        Tenancy({"short": "acme"}, SECRET)
    with pytest.raises(ConfigError, match="tenant"):
        Tenancy({"key-aaaaaaaa": "a/b"}, SECRET)


def test_an_open_server_stays_on_loopback():
    opened, keyed = Tenancy(secret=SECRET), Tenancy({"key-aaaaaaaa": "acme"}, SECRET)
    assert "shared tenant" in check_bind(opened, "127.0.0.1") and check_bind(opened, "::1")
    for host in ("0.0.0.0", "192.168.1.5", "example.org"):
        with pytest.raises(ConfigError, match="API keys"):
            check_bind(opened, host)
    assert "1 API key" in check_bind(keyed, "0.0.0.0")


def test_a_key_tenant_named_like_a_sub_tenant_is_refused_at_load():
    """Sub-tenants are ``<key tenant>:<name>``: a key whose tenant is literally ``acme:eu`` would be the
    same tenant (and cache salt) as key ``acme`` asking for sub-tenant ``eu``. ``:`` is refused in key
    tenants (at load, naming the tenant) and in requested sub-tenants (400), so the two never meet."""
    with pytest.raises(ConfigError, match="'acme:eu'.*':'"):
        Tenancy({"key-aaaaaaaa": "acme", "key-bbbbbbbb": "acme:eu"}, SECRET, allow_client_tenant=True)
    for name in ("acme:eu", ":eu", "acme:"):
        with pytest.raises(ConfigError, match="rename"):
            Tenancy({"key-bbbbbbbb": name}, SECRET)
    t = Tenancy({"key-aaaaaaaa": "acme"}, SECRET, allow_client_tenant=True)
    acme = t.authenticate("Bearer key-aaaaaaaa")
    for sub in ("eu:x", ":", "x:"):
        with pytest.raises(InputError, match="':'") as err:
            t.resolve(acme, sub)  # acme:eu:x would be a sub-tenant of no key, and could name another's
        assert http_status(err.value) == 422
    eu = t.resolve(acme, "eu")
    assert eu == Tenant("acme:eu") and eu.key_tenant == acme and acme.key_tenant == acme
    keyed_default = Tenancy({"key-cccccccc": ""}, SECRET, allow_client_tenant=True)
    # a key of the default tenant names its sub-tenants under it too, never as top-level tenants
    assert keyed_default.resolve(Tenant(), "eu") == Tenant(":eu") and Tenant(":eu").key_tenant == Tenant()


def test_a_key_may_use_a_bounded_number_of_sub_tenants_at_once():
    """One key could invent sub-tenants without end (each one more tree, queue share and salt): the
    ``max_sub_tenants``-th + 1 in ``sub_tenant_ttl_s`` is refused with 429 and when a place frees; a
    sub-tenant in use keeps its place, and other keys have their own count."""
    now = [0.0]
    t = Tenancy({"key-aaaaaaaa": "acme", "key-bbbbbbbb": "globex"}, SECRET, allow_client_tenant=True,
                max_sub_tenants=2, sub_tenant_ttl_s=60.0, clock=lambda: now[0])
    acme, globex = t.authenticate("Bearer key-aaaaaaaa"), t.authenticate("Bearer key-bbbbbbbb")
    assert t.resolve(acme, "s0") == Tenant("acme:s0")
    now[0] = 10.0
    assert t.resolve(acme, "s1") == Tenant("acme:s1")
    with pytest.raises(RateLimitError, match="2 sub-tenants") as err:
        t.resolve(acme, "s2")
    assert http_status(err.value) == 429 and err.value.retry_after_s == pytest.approx(50.0)  # s0's place frees at 60
    assert t.resolve(acme, None) == acme and t.resolve(acme, "acme") == acme  # the key's own tenant is no sub-tenant
    assert t.resolve(globex, "s0") == Tenant("globex:s0")  # another key: its own count
    now[0] = 55.0
    assert t.resolve(acme, "s0") == Tenant("acme:s0")  # in use: its place is kept (until 115)
    now[0] = 71.0  # s1 (last used at 10) is gone
    assert t.resolve(acme, "s2") == Tenant("acme:s2")
    with pytest.raises(RateLimitError):
        t.resolve(acme, "s1")
    with pytest.raises(ConfigError, match="max_sub_tenants"):
        Tenancy({"key-aaaaaaaa": "acme"}, SECRET, max_sub_tenants=0)
