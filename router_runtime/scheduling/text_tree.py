"""A character radix tree shared by tenants (targets), for approximate (text) prefix routing.

Compressed edges: a node's ``text`` is a whole edge, children are keyed by their edge's first
character, and edges are compared with ``str.startswith`` (C speed), so a 10k-character prompt walks a
handful of nodes rather than 10k.

Tenancy is prefix-closed: a tenant holding a node holds every ancestor (an insert touches the whole
path). A tenant's size is the total edge length of the nodes it holds. A node no tenant holds is
deleted at once (it can have no held children, by prefix closure).

LRU without clocks. Each tenant keeps its nodes in an intrusive doubly linked list, oldest first; an
insert moves its path to the tail leaf first, root last. So every node sits after all of its held
descendants, and the head is always a leaf of that tenant: evictable in O(1), no scan, no heap. A split
puts the new upper half right after the lower half in every holder's list: it inherits the lower
half's recency exactly, and the order invariant still holds.
"""

from __future__ import annotations

from collections.abc import Container, Hashable, Iterator
from dataclasses import dataclass


class _Node:
    __slots__ = ("children", "parent", "tenants", "text")

    def __init__(self, text: str, parent: _Node | None) -> None:
        self.text = text
        self.parent = parent
        self.children: dict[str, _Node] = {}
        self.tenants: dict[Hashable, _Entry] = {}  # tenant -> its LRU entry for this node


class _Entry:
    """One node in one tenant's LRU list."""

    __slots__ = ("next", "node", "prev")

    def __init__(self, node: _Node | None) -> None:
        self.node = node
        self.prev: _Entry = self
        self.next: _Entry = self

    def unlink(self) -> None:
        self.prev.next = self.next
        self.next.prev = self.prev

    def insert_after(self, at: _Entry) -> None:
        self.prev = at
        self.next = at.next
        at.next.prev = self
        at.next = self


class _Tenant:
    __slots__ = ("head", "size")

    def __init__(self) -> None:
        self.head = _Entry(None)  # sentinel: head.next is the least recently used, head.prev the most
        self.size = 0

    def entries(self) -> Iterator[_Entry]:
        """Oldest first; safe against unlinking the entry just yielded."""
        e = self.head.next
        while e is not self.head:
            nxt = e.next
            yield e
            e = nxt


def _common_prefix(edge: str, text: str, pos: int) -> int:
    """Length of the common prefix of ``edge`` and ``text[pos:]``, given the first character matches:
    a binary search over ``startswith`` (C comparisons) rather than a Python loop per character."""
    lo, hi = 1, min(len(edge), len(text) - pos)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.startswith(edge[:mid], pos):
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True, slots=True)
class TextMatch:
    """A walk down the tree: ``ends[k]`` is the matched length once ``nodes[k]`` is (partly) matched."""

    ends: tuple[int, ...]
    nodes: tuple[_Node, ...]

    def longest(self, among: Container[Hashable]) -> tuple[int, set[Hashable]]:
        """The longest match held by any tenant in ``among``: (matched chars, those tenants)."""
        for k in range(len(self.nodes) - 1, -1, -1):
            holders = {t for t in self.nodes[k].tenants if t in among}
            if holders:
                return self.ends[k], holders
        return 0, set()

    def chars_for(self, tenant: Hashable) -> int:
        """How much of the text ``tenant`` holds."""
        for k in range(len(self.nodes) - 1, -1, -1):
            if tenant in self.nodes[k].tenants:
                return self.ends[k]
        return 0


class TextTree:
    def __init__(self) -> None:
        self._root = _Node("", None)
        self._tenants: dict[Hashable, _Tenant] = {}

    # ---- reads ---------------------------------------------------------------------------------

    def size(self, tenant: Hashable) -> int:
        st = self._tenants.get(tenant)
        return st.size if st is not None else 0

    @property
    def tenants(self) -> list[Hashable]:
        return list(self._tenants)

    def node_count(self) -> int:
        return sum(1 for _ in self._iter_nodes()) - 1  # without the root

    def _iter_nodes(self) -> Iterator[_Node]:
        stack = [self._root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def match(self, text: str) -> TextMatch:
        node = self._root
        pos = 0
        n = len(text)
        ends: list[int] = []
        nodes: list[_Node] = []
        while pos < n:
            child = node.children.get(text[pos])
            if child is None:
                break
            edge = child.text
            if text.startswith(edge, pos):
                pos += len(edge)
                ends.append(pos)
                nodes.append(child)
                node = child
                continue
            ends.append(pos + _common_prefix(edge, text, pos))
            nodes.append(child)
            break
        return TextMatch(tuple(ends), tuple(nodes))

    # ---- mutations -----------------------------------------------------------------------------

    def insert(self, text: str, tenant: Hashable) -> None:
        """Record that ``tenant`` now holds ``text`` (and so every prefix of it), as most recent."""
        if not text:
            return
        st = self._tenants.get(tenant)
        if st is None:
            st = self._tenants[tenant] = _Tenant()
        node = self._root
        pos = 0
        n = len(text)
        path: list[_Node] = []
        while pos < n:
            first = text[pos]
            child = node.children.get(first)
            if child is None:
                leaf = _Node(text[pos:], node)
                node.children[first] = leaf
                path.append(leaf)
                break
            edge = child.text
            if text.startswith(edge, pos):
                pos += len(edge)
                path.append(child)
                node = child
                continue
            k = _common_prefix(edge, text, pos)
            node = self._split(child, k)
            path.append(node)
            pos += k
        head = st.head
        for node in reversed(path):  # leaf first: ancestors end up after their descendants
            e = node.tenants.get(tenant)
            if e is None:
                e = node.tenants[tenant] = _Entry(node)
                st.size += len(node.text)
            else:
                e.unlink()
            e.insert_after(head.prev)  # the tail: most recent

    def _split(self, child: _Node, k: int) -> _Node:
        """Cut ``child``'s edge after ``k`` characters; returns the new upper node. The original object
        keeps the lower half and its children, so existing LRU entries stay valid."""
        parent = child.parent
        assert parent is not None
        upper = _Node(child.text[:k], parent)
        parent.children[child.text[0]] = upper
        child.text = child.text[k:]
        child.parent = upper
        upper.children[child.text[0]] = child
        for t, lower in child.tenants.items():
            e = upper.tenants[t] = _Entry(upper)
            e.insert_after(lower)
        return upper

    def evict(self, tenant: Hashable, max_size: int) -> int:
        """Drop the tenant's least recently used leaves until it holds at most ``max_size`` characters;
        returns the characters dropped."""
        st = self._tenants.get(tenant)
        if st is None:
            return 0
        dropped = 0
        head = st.head
        while st.size > max_size and head.next is not head:
            dropped += self._release(head.next, tenant, st)
        return dropped

    def remove_tenant(self, tenant: Hashable) -> int:
        """Forget a tenant entirely; returns the characters it held."""
        st = self._tenants.pop(tenant, None)
        if st is None:
            return 0
        dropped = 0
        for e in st.entries():  # descendants come first, so a node is childless when released
            dropped += self._release(e, tenant, st)
        return dropped

    def _release(self, e: _Entry, tenant: Hashable, st: _Tenant) -> int:
        node = e.node
        assert node is not None
        e.unlink()
        del node.tenants[tenant]
        st.size -= len(node.text)
        if not node.tenants:
            assert not node.children, "a node no tenant holds has no held children"
            parent = node.parent
            assert parent is not None
            del parent.children[node.text[0]]
            node.parent = None
        return len(node.text)

    # ---- checks --------------------------------------------------------------------------------

    def check(self) -> None:
        """Assert the invariants (tests): prefix closure, sizes, no tenantless nodes, LRU order."""
        sizes: dict[Hashable, int] = {t: 0 for t in self._tenants}
        for node in self._iter_nodes():
            if node is self._root:
                assert not node.tenants
                continue
            assert node.text and node.tenants
            assert node.parent is not None and node.parent.children[node.text[0]] is node
            if node.parent is not self._root:
                assert node.tenants.keys() <= node.parent.tenants.keys()
            for t in node.tenants:
                sizes[t] += len(node.text)
        for t, st in self._tenants.items():
            assert st.size == sizes[t], (t, st.size, sizes[t])
            seen: set[_Node] = set()
            for e in st.entries():
                node = e.node
                assert node is not None and node.tenants.get(t) is e and e.next.prev is e
                assert all(c in seen for c in node.children.values() if t in c.tenants)
                seen.add(node)
            held = sum(1 for node in self._iter_nodes() if t in node.tenants)
            assert len(seen) == held, (t, len(seen), held)
