"""A table bounded twice: in all, and per key tenant, so one API key cannot crowd out the others.

Server-side state kept per tenant (the Weaver's prefix trees, the span cache's pending compiles and
borrowed links) is bounded least-recently-used to bound memory. With one bound, a key that invents
sub-tenants (or just sends many distinct documents) evicts every other key's entries; here each entry
is charged to its key tenant (``Tenant.key_tenant``) as well, and a key past its own bound drops its
own oldest entry first. The total bound still holds memory when many keys are busy at once.

Written here over two ``OrderedDict``: cachetools' caches evict on one bound and know no groups.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, MutableMapping
from typing import Generic, TypeVar

from contextkit.core.errors import ConfigError
from contextkit.core.tenant import Tenant

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class TenantLRU(MutableMapping, Generic[K, V]):
    """A mapping of at most ``limit`` entries, at most ``per_key`` of them charged to one key tenant.

    Args:
        limit: entries in all; past it the least recently used entry (of any key) is dropped.
        per_key: entries of one key tenant; past it that key's own least recently used entry is dropped.
        tenant_of: the tenant an entry belongs to, from its key (a name or a ``Tenant``).

    Setting an entry makes it the newest; ``touch`` does so on use. Reading does not (callers decide
    what counts as use). Iteration runs oldest first, so ``popitem()`` takes the oldest entry. Not
    thread-safe: the owner holds its own lock.
    """

    def __init__(self, limit: int, per_key: int, tenant_of: Callable[[K], Tenant | str], name: str = "limit"):
        if limit < 1 or per_key < 1:
            raise ConfigError(f"{name}: a table of at most {limit} entries, {per_key} per key tenant, holds nothing; "
                              "both must be >= 1")
        self.limit, self.per_key = limit, per_key
        self._tenant_of = tenant_of
        self._items: OrderedDict[K, tuple[str, V]] = OrderedDict()  # key -> (key tenant, value), oldest first
        self._groups: dict[str, OrderedDict[K, None]] = {}  # key tenant -> its keys, oldest first

    def __getitem__(self, key: K) -> V:
        return self._items[key][1]

    def __setitem__(self, key: K, value: V) -> None:
        owner = Tenant.of(self._tenant_of(key)).key_tenant.name
        if key in self._items:
            del self[key]
        self._items[key] = (owner, value)
        group = self._groups.setdefault(owner, OrderedDict())
        group[key] = None
        while len(group) > self.per_key:
            del self[next(iter(group))]
        while len(self._items) > self.limit:
            del self[next(iter(self._items))]

    def __delitem__(self, key: K) -> None:
        owner, _ = self._items.pop(key)
        group = self._groups[owner]
        del group[key]
        if not group:
            del self._groups[owner]

    def __iter__(self) -> Iterator[K]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def touch(self, key: K) -> None:
        """Mark ``key`` as just used (the newest, in all and within its key tenant)."""
        owner, _ = self._items[key]
        self._items.move_to_end(key)
        self._groups[owner].move_to_end(key)

    def count(self, tenant: Tenant | str) -> int:
        """Entries charged to ``tenant``'s key tenant."""
        return len(self._groups.get(Tenant.of(tenant).key_tenant.name, ()))
