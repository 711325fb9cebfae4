"""Topics and subscription patterns: validation, and a trie that matches a topic against them all.

A topic is a dot-separated path of non-empty segments (`feeds.breaking-news.56`). A pattern's
segments are literals, `*` (exactly one segment) or `#` (zero or more segments). `#` may stand
anywhere, as in AMQP, not only last as NATS's `>`: `a.#.b` matches `a.b`, `a.x.b` and `a.x.y.b`.
In the middle it costs nothing in the bound below, users of RabbitMQ's topic exchanges already
know the rule, and it says things a trailing `#` cannot (`feeds.#.corrections`). Topics and
patterns are at most MAX_BYTES bytes of UTF-8 and MAX_SEGMENTS segments; a segment holds no
`*`, `#`, whitespace or control character (nor a lone surrogate), except that a pattern's
segment may be exactly `*` or `#`.

Theory of operation
-------------------
`TopicTrie` stores patterns in a trie keyed by segment: each node has a dict of literal
children and one child each for `*` and `#`, and the values (subscriber or link ids) of the
patterns that end there: a tuple while there are few (most nodes have one), a set beyond SMALL.
Patterns that share a prefix share its nodes, segment strings are interned, and nothing stores
a copy of a topic.

Read as an automaton, the trie's nodes are its states: a literal or `*` edge consumes one
segment, a `#` edge consumes none, and a `#` node loops on any segment (that is how `#` eats
"zero or more"). `match` simulates it level by level, like Thompson's NFA simulation of a
regular expression: the active set holds the nodes whose pattern prefix matches the topic's
first i segments. One step takes each active node to its literal child for segment i (one dict
lookup), its `*` child, and itself if it is a `#` node; then the closure adds the `#` children
of everything reached, since `#` may match nothing. The values of the nodes active after the
last segment are the answer.

Cost bound: a node enters an active set at most once per level. A literal or `*` node has one
parent, so it is reached once from a parent that is active once; a `#` node can be reached
twice, by its own loop and by the closure from its parent, and the `looped` set (built only
when a `#` node is active) drops the second. The walk therefore costs
O(sum over levels of the active nodes) <= O(len(topic) * nodes matching a prefix of it), plus
the size of the answer, whatever the number of patterns stored, and a stack of `#`s
(`#.#.#`, `#.a.#.a.#`) cannot blow it up exponentially: the walk never leaves the
(node, level) grid. Patterns that cannot match are never visited: a million subscriptions to
other topics cost the walk nothing.

`topic_matches` is the reference matcher the tests compare the trie against: the textbook
recursion over (pattern index, topic index), memoized on failures so it too stays polynomial.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

from irismesh.errors import ConfigurationError, ProtocolError

__all__ = [
    "MAX_BYTES",
    "MAX_SEGMENTS",
    "TopicTrie",
    "parse_pattern_from_peer",
    "parse_topic_from_peer",
    "topic_matches",
    "validate_pattern",
    "validate_topic",
]

MAX_BYTES = 255  # of UTF-8, for a topic or a pattern
MAX_SEGMENTS = 32
STAR = "*"
HASH = "#"
CACHED = 4096  # topics whose matches a trie remembers
SMALL = 8  # values a node keeps in a tuple (48 bytes for one) before a set (216 bytes)

# In a literal segment: wildcards, whitespace, C0 and C1 controls, and lone surrogates (which
# have no UTF-8 encoding).
_FORBIDDEN = re.compile(r"[\s*#\x00-\x1f\x7f-\x9f\ud800-\udfff]")
# The common case, a valid ASCII topic, in one C call: printable ASCII but space, `#`, `*`, `.`.
_ASCII_SEGMENT = r'[!"$-)+\-/-~]+'
_ASCII_TOPIC = re.compile(rf"{_ASCII_SEGMENT}(?:\.{_ASCII_SEGMENT}){{0,{MAX_SEGMENTS - 1}}}")
_SHOWN = 60  # characters of a bad topic quoted in a message

V = TypeVar("V", bound=Hashable)


# --------------------------------------------------------------------------------------------
# Validation


def _size_problem(text: str) -> str | None:
    if not text:
        return "it is empty"
    size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_BYTES:
        return f"{size} bytes, the limit is {MAX_BYTES}"
    if text.count(".") >= MAX_SEGMENTS:
        return f"{text.count('.') + 1} segments, the limit is {MAX_SEGMENTS}"
    return None


def _segment_problem(segment: str) -> str | None:
    """Why `segment` cannot be a literal segment, or None."""
    if not segment:
        return "an empty segment (a leading, trailing or doubled dot)"
    bad = _FORBIDDEN.search(segment)
    if bad is None:
        return None
    char = bad.group()
    if char in (STAR, HASH):
        return f"segment {segment!r} contains {char!r}: wildcards are whole segments"
    return (
        f"segment {segment!r} contains U+{ord(char):04X}: no whitespace, control characters or "
        "lone surrogates"
    )


def _topic_problem(topic: str) -> str | None:
    if len(topic) <= MAX_BYTES and _ASCII_TOPIC.fullmatch(topic) is not None:
        return None
    problem = _size_problem(topic)
    if problem is not None:
        return problem
    for segment in topic.split("."):
        if segment in (STAR, HASH):
            return f"{segment!r} is a wildcard: wildcards belong in subscription patterns"
        problem = _segment_problem(segment)
        if problem is not None:
            return problem
    return None  # a valid topic beyond ASCII


def _pattern_problem(pattern: str) -> str | None:
    problem = _size_problem(pattern)
    if problem is not None:
        return problem
    for segment in pattern.split("."):
        if segment not in (STAR, HASH):
            problem = _segment_problem(segment)
            if problem is not None:
                return problem
    return None


def _shown(text: str) -> str:
    return repr(text) if len(text) <= _SHOWN else repr(text[:_SHOWN]) + "..."


def validate_topic(topic: object) -> str:
    """Return `topic` if it is a valid topic to publish on; raise ConfigurationError if not."""
    return _validated(
        topic,
        False,
        "topic",
        "a topic is dot-separated non-empty segments such as 'feeds.breaking-news.56'",
    )


def validate_pattern(pattern: object) -> str:
    """Return `pattern` if it is a valid subscription pattern; raise ConfigurationError if not."""
    return _validated(
        pattern,
        True,
        "subscription pattern",
        "a pattern is dot-separated segments, each a literal, '*' (one segment) or '#' (zero or "
        "more), such as 'feeds.*.56' or 'feeds.#'",
    )


def _validated(text: object, pattern: bool, what: str, rule: str) -> str:
    if not isinstance(text, str):
        raise ConfigurationError(f"a {what} is a str, not {type(text).__name__}")
    problem = _pattern_problem(text) if pattern else _topic_problem(text)
    if problem is not None:
        raise ConfigurationError(f"bad {what} {_shown(text)}: {problem}; {rule}")
    return text


def parse_topic_from_peer(data: bytes) -> str:
    """Decode and check a topic a peer sent; raise ProtocolError("bad_topic") if it is invalid."""
    return _from_peer(data, False, "bad_topic")


def parse_pattern_from_peer(data: bytes) -> str:
    """Decode and check a peer's subscription pattern; raise ProtocolError("bad_pattern")."""
    return _from_peer(data, True, "bad_pattern")


def _from_peer(data: bytes, pattern: bool, reason: str) -> str:
    if len(data) > MAX_BYTES:
        raise ProtocolError(reason, f"{len(data)} bytes, the limit is {MAX_BYTES}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError(reason, "not UTF-8") from None
    problem = _pattern_problem(text) if pattern else _topic_problem(text)
    if problem is not None:
        raise ProtocolError(reason, problem)
    return text


# --------------------------------------------------------------------------------------------
# The reference matcher


def topic_matches(pattern: str, topic: str) -> bool:
    """Whether `pattern` matches `topic`: the simple recursive reference matcher (both checked)."""
    want = validate_pattern(pattern).split(".")
    have = validate_topic(topic).split(".")
    failed: set[tuple[int, int]] = set()  # without it, `#.#.#...` is exponential

    def rest_matches(i: int, j: int) -> bool:
        """Whether want[i:] matches have[j:]."""
        if (i, j) in failed:
            return False
        if i == len(want):
            found = j == len(have)
        elif want[i] == HASH:  # zero segments, or one more and stay on the `#`
            found = rest_matches(i + 1, j) or (j < len(have) and rest_matches(i, j + 1))
        elif j == len(have):
            found = False
        else:
            found = want[i] in (STAR, have[j]) and rest_matches(i + 1, j + 1)
        if not found:
            failed.add((i, j))
        return found

    return rest_matches(0, 0)


# --------------------------------------------------------------------------------------------
# The trie


class _Node(Generic[V]):
    __slots__ = ("children", "hash", "loops", "star", "values")

    def __init__(self, loops: bool = False) -> None:
        self.children: dict[str, _Node[V]] | None = None  # literal segment -> node
        self.star: _Node[V] | None = None
        self.hash: _Node[V] | None = None
        self.values: tuple[V, ...] | set[V] | None = None  # of the patterns that end here
        self.loops = loops  # a `#` node: consumes any segment and stays

    def child(self, segment: str) -> _Node[V] | None:
        if segment == STAR:
            return self.star
        if segment == HASH:
            return self.hash
        return None if self.children is None else self.children.get(segment)

    def add_child(self, segment: str) -> _Node[V]:
        segment = sys.intern(segment)  # the same story numbers, desks, ... under many parents
        node: _Node[V] = _Node(loops=segment == HASH)
        if segment == STAR:
            self.star = node
        elif segment == HASH:
            self.hash = node
        else:
            if self.children is None:
                self.children = {}
            self.children[segment] = node
        return node

    def drop_child(self, segment: str) -> None:
        if segment == STAR:
            self.star = None
        elif segment == HASH:
            self.hash = None
        elif self.children is not None:
            del self.children[segment]
            if not self.children:
                self.children = None

    def is_empty(self) -> bool:
        return (
            self.values is None
            and self.children is None
            and self.star is None
            and self.hash is None
        )

    def edges(self) -> Iterator[tuple[str, _Node[V]]]:
        if self.children is not None:
            yield from self.children.items()
        if self.star is not None:
            yield STAR, self.star
        if self.hash is not None:
            yield HASH, self.hash


def _close(reached: list[_Node[V]], looped: set[_Node[V]] | None) -> list[_Node[V]]:
    """Add the `#` children of every node in `reached`, in place: `#` may match nothing."""
    for node in reached:  # also visits the nodes appended below, so `#.#` chains close
        hash_child = node.hash
        if hash_child is not None and (looped is None or hash_child not in looped):
            reached.append(hash_child)
    return reached


class TopicTrie(Generic[V]):
    """Maps subscription patterns to sets of values (e.g. subscriber ids or link ids).

    `add` and `remove` check the pattern (ConfigurationError). `match` and `matches_any` trust
    the topic: check it once where it enters, with validate_topic or parse_topic_from_peer.
    """

    __slots__ = ("_cache", "_pairs", "_root")

    def __init__(self) -> None:
        self._root: _Node[V] = _Node()
        self._pairs = 0
        self._cache: dict[str, frozenset[V]] = {}

    def add(self, pattern: str, value: V) -> bool:
        """Subscribe `value` to `pattern`; False if it already was."""
        node = self._root
        for segment in validate_pattern(pattern).split("."):
            node = node.child(segment) or node.add_child(segment)
        self._cache.clear()
        values = node.values
        if values is None:
            node.values = (value,)
        elif value in values:
            return False
        elif isinstance(values, set):
            values.add(value)
        elif len(values) < SMALL:
            node.values = (*values, value)
        else:
            node.values = {*values, value}
        self._pairs += 1
        return True

    def remove(self, pattern: str, value: V) -> bool:
        """Unsubscribe `value` from `pattern` and prune empty nodes; False if it was not there."""
        segments = validate_pattern(pattern).split(".")
        path = [self._root]
        for segment in segments:
            child = path[-1].child(segment)
            if child is None:
                return False
            path.append(child)
        node = path[-1]
        values = node.values
        if values is None or value not in values:
            return False
        self._cache.clear()
        if isinstance(values, set):
            values.discard(value)
        else:
            values = tuple(other for other in values if other != value)
        node.values = values or None
        self._pairs -= 1
        for depth in range(len(segments), 0, -1):
            if not path[depth].is_empty():
                break
            path[depth - 1].drop_child(segments[depth - 1])
        return True

    def _start(self) -> list[_Node[V]]:
        root = self._root
        return [root] if root.hash is None else _close([root], None)

    def _walk(self, topic: str) -> list[_Node[V]]:
        """The nodes whose pattern matches all of `topic`, each once (see the module docstring)."""
        active = self._start()
        for segment in topic.split("."):
            reached: list[_Node[V]] = []
            looped: set[_Node[V]] | None = None
            closing = False  # whether a node reached has a `#` child (rare: skip the closure)
            for node in active:
                children = node.children
                if children is not None:
                    child = children.get(segment)
                    if child is not None:
                        reached.append(child)
                        closing = closing or child.hash is not None
                star = node.star
                if star is not None:
                    reached.append(star)
                    closing = closing or star.hash is not None
                if node.loops:
                    reached.append(node)
                    if looped is None:
                        looped = set()
                    looped.add(node)
                    closing = closing or node.hash is not None
            if not reached:
                return reached
            active = _close(reached, looped) if closing else reached
        return active

    def match(self, topic: str) -> set[V]:
        """Every value subscribed to a pattern that matches `topic` (a valid topic)."""
        found: set[V] = set()
        for node in self._walk(topic):
            if node.values is not None:
                found.update(node.values)
        return found

    def match_cached(self, topic: str) -> frozenset[V]:
        """`match`, remembered until the trie changes: publishers repeat their topics.

        At most CACHED topics are remembered (then the memory starts afresh).
        """
        found = self._cache.get(topic)
        if found is None:
            if len(self._cache) >= CACHED:
                self._cache.clear()
            found = self._cache[topic] = frozenset(self.match(topic))
        return found

    def matches_any(self, topic: str) -> bool:
        """Whether any pattern matches `topic` (a valid topic)."""
        return any(node.values is not None for node in self._walk(topic))

    def patterns(self) -> Iterator[tuple[str, V]]:
        """Every (pattern, value) pair; the trie must not change while this runs."""
        stack: list[tuple[tuple[str, ...], _Node[V]]] = [((), self._root)]
        while stack:
            path, node = stack.pop()
            if node.values is not None:
                pattern = ".".join(path)
                for value in node.values:
                    yield pattern, value
            for segment, child in node.edges():
                stack.append(((*path, segment), child))

    def node_count(self) -> int:
        """The number of nodes, the root included (a walk of the trie, for tests and benchmarks)."""
        count = 0
        stack = [self._root]
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(child for _, child in node.edges())
        return count

    def __len__(self) -> int:
        """The number of (pattern, value) pairs."""
        return self._pairs

    def __repr__(self) -> str:
        return f"<TopicTrie: {self._pairs} subscription(s)>"
