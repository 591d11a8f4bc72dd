"""The tenant: whose history a request may reuse. Validated once, where a request enters, and carried
down under this one name (the ordering tree, span keys, kvstore entries; vLLM's ``cache_salt`` is
derived from it by ``contextkit.core.tenancy``).
"""

from __future__ import annotations

from dataclasses import dataclass

from contextkit.core.errors import InputError

MAX_TENANT_CHARS = 128
_FORBIDDEN = frozenset("@/\\\x00")


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

    def __str__(self) -> str:
        return self.name
