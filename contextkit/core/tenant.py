"""The tenant: whose history a request may reuse. Validated once, where a request enters, and carried
down under this one name (the ordering tree, span keys, kvstore entries; vLLM's ``cache_salt`` is
derived from it by ``contextkit.core.tenancy``).

A sub-tenant (one a key's client chose, ``Tenancy.resolve``) is named ``<key tenant>:<name>``, and
neither part may hold ``:`` (``Tenancy`` refuses it in both), so the name alone says which key tenant a
tenant belongs to (``Tenant.key_tenant``): per-key limits and fair shares need no second field, and the
name stays the one value span keys and kvstore entries carry.
"""

from __future__ import annotations

from dataclasses import dataclass

from contextkit.core.errors import InputError

MAX_TENANT_CHARS = 128
_FORBIDDEN = frozenset("@/\\\x00")
SUB = ":"  # between a key tenant and its sub-tenant's own name
# sub-tenants one API key may use at once (``Tenancy``); per-key tables (the Weaver's trees) keep as many
# entries of one key, plus the key's own tenant
MAX_SUB_TENANTS = 64


@dataclass(frozen=True, slots=True)
class Tenant:
    """A namespace of cached state. ``Tenant()`` (name ``""``) is the shared default.

    A name is at most 128 characters without ``@``, ``/``, ``\\`` or NUL: it names an ordering tree,
    is part of every span key and kvstore entry, and is sent to vLLM as a cache salt, and each of those
    must accept it. An unknown tenant is not an error: it starts with nothing cached.
    """

    name: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise InputError(f"tenant must be a string, got {type(self.name).__name__}", "tenant")
        if len(self.name) > MAX_TENANT_CHARS or _FORBIDDEN & set(self.name):
            raise InputError(
                f"tenant {self.name[:40]!r} must be at most {MAX_TENANT_CHARS} characters without '@', '/', "
                "'\\' or NUL (it names an ordering tree, span keys and vLLM's cache_salt)", "tenant",
            )

    @classmethod
    def of(cls, value: Tenant | str | None) -> Tenant:
        """``value`` as a Tenant (a name is validated; None is the default tenant)."""
        if isinstance(value, Tenant):
            return value
        return cls("" if value is None else value)

    @property
    def key_tenant(self) -> Tenant:
        """The tenant of the API key this one belongs to: itself, or for a sub-tenant
        (``<key tenant>:<name>``) the part before the ``:``. Limits and fair shares are per key tenant,
        so inventing sub-tenants gives a key no more of the server; cached state stays per tenant."""
        key, sep, _ = self.name.partition(SUB)
        return Tenant(key) if sep else self

    def __str__(self) -> str:
        return self.name
