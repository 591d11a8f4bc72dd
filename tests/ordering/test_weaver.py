"""Prefix-tree ordering: tree invariants, greedy vs exact oracle, tenants, bounds, bad input, threads."""

from __future__ import annotations

import random
import threading

import pytest

from contextkit.core.errors import ConfigError, InputError
from contextkit.ordering.tree import PrefixTree
from contextkit.ordering.weaver import MAX_K, Doc, Weaver, oracle, reusable, search


def _docs(ids, tokens=100):
    return [Doc(id=str(i), tokens=tokens if isinstance(tokens, int) else tokens[k]) for k, i in enumerate(ids)]


def test_served_set_in_a_new_order_is_restored_and_fully_reusable():
    w = Weaver(block_size=1)
    first = w.order(_docs("abc"))
    assert first.order == (0, 1, 2) and first.reusable_tokens == 0  # nothing served yet: retrieval order
    again = w.order(_docs("cab"))  # same set, retrieved in another order
    assert [("cab")[i] for i in again.order] == list("abc")
    assert again.reusable_tokens == 300 and again.matched_docs == 3


def test_order_is_a_permutation_and_rest_keeps_retrieval_order():
    w = Weaver(block_size=1)
    w.order(_docs("xy"))
    got = w.order(_docs("qyzxw"))
    assert sorted(got.order) == list(range(5))
    assert ["qyzxw"[i] for i in got.order] == ["x", "y", "q", "z", "w"]


def test_reuse_counts_whole_blocks():
    w = Weaver(block_size=32)
    w.order(_docs("ab", tokens=[50, 30]))
    got = w.order(_docs("ab", tokens=[50, 30]))
    assert got.reusable_tokens == 64  # 80 tokens -> 2 whole blocks of 32
    changed = w.order(_docs("ab", tokens=[51, 30]))  # a changed document is a different prefix
    assert changed.reusable_tokens == 0


def _random_tree(rng: random.Random, ids: str, n: int) -> PrefixTree:
    tree = PrefixTree()
    for _ in range(n):
        seq = rng.sample(ids, rng.randint(1, 5))
        tree.insert((d, rng.choice([20, 40, 90, 200])) for d in seq)
    return tree


def test_exact_search_equals_brute_force_oracle():
    rng = random.Random(0)
    for trial in range(60):
        tree = _random_tree(rng, "abcdefgh", 12)
        tokens = {}
        stack = list(tree.root.children.values())
        while stack:  # give the request the lengths the tree knows (else nothing can match)
            n = stack.pop()
            tokens.setdefault(n.doc_id, n.tokens)
            stack.extend(n.children.values())
        ids = rng.sample("abcdefgh", rng.randint(1, 6))
        docs = [Doc(id=i, tokens=tokens.get(i, 10)) for i in ids]
        brute_order, brute = oracle(tree, docs, block_size=16)
        order, best = search(tree, docs, block_size=16)
        assert best == brute, trial
        assert reusable(tree, [docs[i] for i in order], 16)[0] == best


def test_greedy_never_beats_the_oracle_and_can_lose_to_it():
    rng = random.Random(1)
    for _ in range(40):
        tree = _random_tree(rng, "abcdef", 10)
        w = Weaver(block_size=1)
        w._trees[""] = tree
        docs = [Doc(id=i, tokens=20) for i in rng.sample("abcdef", 5)]
        _, best = oracle(tree, docs, block_size=1)
        assert w.order(docs, record=False).reusable_tokens <= best
    # a light first node hides a heavy path: greedy takes the heavy first node, the oracle the path
    tree = PrefixTree()
    tree.insert([("a", 10), ("b", 500)])
    tree.insert([("c", 100)])
    w = Weaver(block_size=1)
    w._trees[""] = tree
    docs = [Doc(id="a", tokens=10), Doc(id="b", tokens=500), Doc(id="c", tokens=100)]
    assert w.order(docs, record=False).reusable_tokens == 100
    assert oracle(tree, docs, block_size=1)[1] == 510


def test_tenants_never_share_orders():
    w = Weaver(block_size=1)
    w.order(_docs("abc"), tenant="t1")
    other = w.order(_docs("cab"), tenant="t2")
    assert other.order == (0, 1, 2) and other.reusable_tokens == 0
    assert w.order(_docs("cab"), tenant="t1").reusable_tokens == 300


def test_tree_stays_within_its_bound_under_a_long_random_stream():
    rng = random.Random(2)
    tree = PrefixTree(max_nodes=500)
    for _ in range(5000):
        tree.insert((str(rng.randrange(2000)), 64) for _ in range(rng.randint(1, 10)))
        assert tree.size <= 500
    assert tree.size == sum(1 for _ in tree._nodes())


def test_recent_sequences_survive_eviction():
    tree = PrefixTree(max_nodes=10)
    for i in range(20):
        tree.insert([(f"old{i}", 10)])
    tree.insert([("new", 10), ("newer", 10)])
    assert [n.doc_id for n in tree.walk(["new", "newer"])] == ["new", "newer"]


def test_bad_input():
    w = Weaver()
    with pytest.raises(InputError, match="twice"):
        w.order([Doc(id="a", tokens=1), Doc(id="a", tokens=1)])
    with pytest.raises(InputError, match="at most"):
        w.order([Doc(id=str(i), tokens=1) for i in range(MAX_K + 1)])
    with pytest.raises(InputError, match="negative"):
        w.order([Doc(id="a", tokens=-1)])
    empty = w.order([])
    assert empty.order == () and empty.reusable_tokens == 0
    with pytest.raises(ConfigError):
        Weaver(block_size=0)
    with pytest.raises(ConfigError):
        PrefixTree(max_nodes=0)


def test_concurrent_orders_from_many_threads():
    w = Weaver(block_size=16, max_nodes=300)
    errors = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(300):
                ids = rng.sample(range(60), 8)
                got = w.order([Doc(id=str(i), tokens=64) for i in ids], tenant=str(seed % 2))
                assert sorted(got.order) == list(range(8))
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for tenant in ("0", "1"):
        tree = w.tree(tenant)
        assert tree.size <= 300 and tree.size == sum(1 for _ in tree._nodes())


def test_tenant_names_must_be_valid_cache_salts():
    w = Weaver()
    for bad in ("a/b", "x@y", "back\\slash", "nul\x00", "t" * 129):
        with pytest.raises(InputError, match="cache_salt"):
            w.order(_docs("ab"), tenant=bad)
    assert w.order(_docs("ab"), tenant="never-seen-before").reusable_tokens == 0  # unknown: empty tree


def test_greedy_lookup_ignores_tree_paths_outside_the_request():
    w = Weaver(block_size=1)
    for i in range(200):  # many unrelated first documents at the root
        w.order([Doc(id=f"noise{i}", tokens=10)])
    w.order(_docs("abc"))
    got = w.order(_docs("bca"))
    assert ["bca"[i] for i in got.order] == list("abc") and got.matched_docs == 3


def test_memory_is_bounded_by_tenants_and_id_length():
    w = Weaver(block_size=1, max_tenants=3)
    for i in range(10):
        w.order(_docs("ab"), tenant=f"peek{i}", record=False)  # asking creates nothing
    assert w.tenants == 0
    for t in ("t1", "t2", "t3"):
        w.order(_docs("ab"), tenant=t)
    w.order(_docs("ab"), tenant="t1")  # t1 used again: t2 is now the least recent
    w.order(_docs("ab"), tenant="t4")
    assert w.tenants == 3
    assert w.order(_docs("ba"), tenant="t1", record=False).matched_docs == 2  # kept
    assert w.order(_docs("ba"), tenant="t2", record=False).matched_docs == 0  # dropped, starts afresh
    with pytest.raises(InputError, match="over 256"):
        w.order([Doc(id="x" * 257, tokens=4)])


def test_a_key_inventing_sub_tenants_evicts_only_its_own_trees():
    """Trees are bounded per key tenant too: key ``acme`` naming a new sub-tenant on every request
    (``acme:0``, ``acme:1``, ...) drops its own oldest trees, never another key's, while each sub-tenant
    still has a tree of its own (they never learn each other's orders)."""
    w = Weaver(block_size=1)  # the defaults: 1024 trees in all
    w.order(_docs("abc"), tenant="globex")
    w.order(_docs("abc"), tenant="acme")
    for i in range(1100):  # more sub-tenants than the whole table holds
        w.order(_docs("ab"), tenant=f"acme:{i}")
    assert w.order(_docs("cba"), tenant="globex", record=False).matched_docs == 3  # globex's history is kept
    assert w.tenants <= w.max_trees_per_key + 1 < w.max_tenants  # acme's trees (its own among them), and globex's
    assert w.order(_docs("ba"), tenant="acme:1099", record=False).matched_docs == 2
    assert w.order(_docs("ba"), tenant="acme:0", record=False).matched_docs == 0  # its own oldest went first
    w.order(_docs("xy"), tenant="acme:1098")
    assert w.order(_docs("yx"), tenant="acme:1099", record=False).matched_docs == 0  # sub-tenants stay apart
    with pytest.raises(ConfigError, match="max_trees_per_key"):
        Weaver(max_trees_per_key=0)
