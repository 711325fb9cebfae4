"""Topic matching: the trie agrees with the reference matcher, and bad topics are named at once."""

from __future__ import annotations

import random
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from irismesh._core.topics import (
    MAX_BYTES,
    MAX_SEGMENTS,
    SMALL,
    TopicTrie,
    parse_pattern_from_peer,
    parse_topic_from_peer,
    topic_matches,
    validate_pattern,
    validate_topic,
)
from irismesh.errors import ConfigurationError, ProtocolError

# A small alphabet, so that random patterns and topics actually match each other.
LITERALS = ["a", "b", "c"]
topics_st = st.lists(st.sampled_from(LITERALS), min_size=1, max_size=6).map(".".join)
patterns_st = st.lists(st.sampled_from([*LITERALS, "*", "#"]), min_size=1, max_size=5).map(".".join)
values_st = st.integers(0, 3)
pairs_st = st.lists(st.tuples(patterns_st, values_st), max_size=30)


def regex_matches(pattern: str, topic: str) -> bool:
    """A second, independent oracle: each segment, dot first, as a regular expression."""
    parts = {"*": r"\.[^.]+", "#": r"(?:\.[^.]+)*"}
    regex = "".join(parts.get(segment, re.escape("." + segment)) for segment in pattern.split("."))
    return re.fullmatch(regex, "." + topic) is not None


def brute_force(pairs: list[tuple[str, int]], topic: str) -> set[int]:
    return {value for pattern, value in pairs if topic_matches(pattern, topic)}


def trie_of(pairs: list[tuple[str, int]]) -> TopicTrie[int]:
    trie: TopicTrie[int] = TopicTrie()
    for pattern, value in pairs:
        trie.add(pattern, value)
    return trie


# --------------------------------------------------------------------------------------------
# Matching


@given(patterns_st, topics_st)
def test_the_reference_matcher_agrees_with_a_regex(pattern: str, topic: str) -> None:
    assert topic_matches(pattern, topic) == regex_matches(pattern, topic)


@given(pairs_st, st.lists(topics_st, min_size=1, max_size=10))
def test_the_trie_matches_what_the_reference_matches(
    pairs: list[tuple[str, int]], topics: list[str]
) -> None:
    trie = trie_of(pairs)
    for topic in topics:
        expected = brute_force(pairs, topic)
        assert trie.match(topic) == expected
        assert trie.matches_any(topic) == bool(expected)


@given(pairs_st, topics_st)
def test_the_walk_reaches_each_node_once(pairs: list[tuple[str, int]], topic: str) -> None:
    nodes = trie_of(pairs)._walk(topic)
    assert len(nodes) == len({id(node) for node in nodes})


@pytest.mark.parametrize(
    ("pattern", "matching", "not_matching"),
    [
        ("feeds.#", ["feeds", "feeds.a", "feeds.a.b"], ["feedsx", "other.feeds", "other"]),
        ("*.prefs.#", ["u1.prefs", "u1.prefs.theme.dark"], ["prefs", "u1.x.prefs", "a.b.prefs"]),
        ("#", ["a", "feeds.breaking-news.56", ".".join(["x"] * MAX_SEGMENTS)], []),
        ("a.#.b", ["a.b", "a.x.b", "a.x.y.b", "a.b.b"], ["a", "b", "a.b.c", "x.a.b"]),
        ("#.b", ["b", "a.b", "a.a.b"], ["b.a", "a"]),
        ("feeds.*", ["feeds.a"], ["feeds", "feeds.a.b"]),
        ("*.*", ["a.b"], ["a", "a.b.c"]),
        ("#.#", ["a", "a.b.c"], []),
        ("*.#", ["a", "a.b"], []),
        ("feeds.breaking-news.56", ["feeds.breaking-news.56"], ["feeds.breaking-news.57"]),
    ],
)
def test_examples(pattern: str, matching: list[str], not_matching: list[str]) -> None:
    trie: TopicTrie[str] = TopicTrie()
    trie.add(pattern, "sub")
    for topic in matching:
        assert topic_matches(pattern, topic), topic
        assert trie.match(topic) == {"sub"}, topic
        assert trie.matches_any(topic), topic
    for topic in not_matching:
        assert not topic_matches(pattern, topic), topic
        assert trie.match(topic) == set(), topic
        assert not trie.matches_any(topic), topic


def test_match_collects_values_from_every_matching_pattern() -> None:
    trie: TopicTrie[str] = TopicTrie()
    trie.add("feeds.sports.42", "story-reader")
    trie.add("feeds.sports.*", "desk-reader")
    trie.add("feeds.sports.*", "desk-reader-2")
    trie.add("feeds.#", "all-feeds")
    trie.add("*.politics.#", "politics")
    trie.add("#", "audit")
    assert trie.match("feeds.sports.42") == {
        "story-reader",
        "desk-reader",
        "desk-reader-2",
        "all-feeds",
        "audit",
    }
    assert trie.match("wires.politics") == {"politics", "audit"}


def test_stacked_hashes_stay_polynomial() -> None:
    pattern = ".".join(["#", "a"] * (MAX_SEGMENTS // 2))  # 32 segments, alternating
    topic = ".".join(["a"] * (MAX_SEGMENTS - 1) + ["b"])  # fails only at the last segment
    trie = trie_of([(pattern, 1), (".".join(["#"] * MAX_SEGMENTS), 2)])
    start = time.perf_counter()
    assert trie.match(topic) == {2}
    assert not topic_matches(pattern, topic)
    assert topic_matches(pattern, ".".join(["a"] * MAX_SEGMENTS))
    # Exponential backtracking would take hours; the walk takes milliseconds.
    assert time.perf_counter() - start < 2.0


def test_single_wildcard_patterns_share_a_node_per_level() -> None:
    trie = trie_of([("feeds.a.x", 1), ("feeds.a.y", 2), ("feeds.*.x", 3), ("feeds.#", 4)])
    assert trie.node_count() == 8  # root, feeds, a, x, y, *, *.x, #
    assert len(trie) == 4


# --------------------------------------------------------------------------------------------
# Adding and removing


def test_duplicate_adds_count_once() -> None:
    trie: TopicTrie[int] = TopicTrie()
    assert trie.add("feeds.#", 1)
    assert not trie.add("feeds.#", 1)
    assert trie.add("feeds.#", 2)
    assert len(trie) == 2
    assert trie.remove("feeds.#", 1)
    assert trie.match("feeds.a") == {2}


@given(st.integers(1, 3 * SMALL), st.randoms(use_true_random=False))
def test_many_values_on_one_pattern(count: int, rng: random.Random) -> None:
    trie: TopicTrie[int] = TopicTrie()
    for value in range(count):  # past SMALL, the node's tuple becomes a set
        assert trie.add("feeds.#", value)
        assert not trie.add("feeds.#", value)
    assert trie.match("feeds.a") == set(range(count))
    order = list(range(count))
    rng.shuffle(order)
    for done, value in enumerate(order, 1):
        assert trie.remove("feeds.#", value)
        assert not trie.remove("feeds.#", value)
        assert trie.match("feeds") == set(order[done:])
    assert (len(trie), trie.node_count()) == (0, 1)


def test_removing_absent_entries_changes_nothing() -> None:
    trie = trie_of([("a.b.c", 1)])
    before = trie.node_count()
    assert not trie.remove("a.b.c", 2)  # other value
    assert not trie.remove("a.b", 1)  # a prefix: a node without values
    assert not trie.remove("a.b.c.d", 1)  # longer than any stored
    assert not trie.remove("a.*.c", 1)  # a wildcard that would match it is another pattern
    assert not trie.remove("x", 1)
    assert (len(trie), trie.node_count()) == (1, before)
    assert trie.match("a.b.c") == {1}


def test_remove_prunes_only_the_branch_no_one_else_uses() -> None:
    trie = trie_of([("a.b", 1), ("a.b.c.d", 2)])
    assert trie.remove("a.b.c.d", 2)
    assert trie.node_count() == 3  # root, a, b
    assert trie.match("a.b") == {1}
    assert trie.remove("a.b", 1)
    assert trie.node_count() == 1


@given(pairs_st, st.randoms(use_true_random=False))
def test_adding_then_removing_everything_leaves_only_the_root(
    pairs: list[tuple[str, int]], rng: random.Random
) -> None:
    trie: TopicTrie[int] = TopicTrie()
    added = [trie.add(pattern, value) for pattern, value in pairs]
    distinct = set(pairs)
    assert sum(added) == len(trie) == len(distinct)
    assert sorted(trie.patterns()) == sorted(distinct)
    order = sorted(distinct)
    rng.shuffle(order)
    for pattern, value in order:
        assert trie.remove(pattern, value)
        assert not trie.remove(pattern, value)
    assert len(trie) == 0
    assert trie.node_count() == 1
    assert list(trie.patterns()) == []
    assert not trie.matches_any("a")


class TrieAgainstAModel(RuleBasedStateMachine):
    """Any interleaving of adds, removes and matches behaves like a set of pairs."""

    stored = Bundle("stored")

    def __init__(self) -> None:
        super().__init__()
        self.trie: TopicTrie[int] = TopicTrie()
        self.model: set[tuple[str, int]] = set()

    @rule(target=stored, pattern=patterns_st, value=values_st)
    def add(self, pattern: str, value: int) -> tuple[str, int]:
        assert self.trie.add(pattern, value) == ((pattern, value) not in self.model)
        self.model.add((pattern, value))
        return pattern, value

    @rule(pair=consumes(stored))
    def remove_stored(self, pair: tuple[str, int]) -> None:
        assert self.trie.remove(*pair) == (pair in self.model)
        self.model.discard(pair)

    @rule(pattern=patterns_st, value=values_st)
    def remove_any(self, pattern: str, value: int) -> None:
        assert self.trie.remove(pattern, value) == ((pattern, value) in self.model)
        self.model.discard((pattern, value))

    @rule(topic=topics_st)
    def match(self, topic: str) -> None:
        expected = brute_force(sorted(self.model), topic)
        assert self.trie.match(topic) == expected
        assert self.trie.matches_any(topic) == bool(expected)

    @precondition(lambda self: not self.model)
    @rule()
    def empty_means_only_the_root(self) -> None:
        assert self.trie.node_count() == 1

    @invariant()
    def pairs_are_the_model(self) -> None:
        pairs = list(self.trie.patterns())
        assert len(pairs) == len(self.trie) == len(self.model)
        assert set(pairs) == self.model


TestTrieAgainstAModel = TrieAgainstAModel.TestCase
TestTrieAgainstAModel.settings = settings(max_examples=50, stateful_step_count=25)


# --------------------------------------------------------------------------------------------
# Validation

TRICKY = ["a", "é", "日", "-", ".", "*", "#", " ", "\t", "\n", "\x00", "\x7f", "\x85", "\xa0"]
TRICKY += ["\u2028", "\u3000", "\ud800", "\u200b"]


def valid_by_the_rules(topic: str) -> bool:
    """The rules of the module docstring, written out one by one."""

    def allowed(char: str) -> bool:
        code = ord(char)
        return not (
            char.isspace()
            or char in "*#"
            or code < 0x20
            or 0x7F <= code <= 0x9F
            or 0xD800 <= code <= 0xDFFF
        )

    segments = topic.split(".")
    return (
        len(topic.encode("utf-8", "surrogatepass")) <= MAX_BYTES
        and len(segments) <= MAX_SEGMENTS
        and all(segment and all(map(allowed, segment)) for segment in segments)
    )


texts_st = st.lists(st.one_of(st.sampled_from(TRICKY), st.characters()), max_size=12).map("".join)


@given(texts_st)
def test_validate_topic_applies_the_rules(text: str) -> None:
    if valid_by_the_rules(text):
        assert validate_topic(text) == text
        assert parse_topic_from_peer(text.encode()) == text
    else:
        with pytest.raises(ConfigurationError, match="bad topic"):
            validate_topic(text)


@given(texts_st, texts_st)
def test_a_literal_pattern_matches_only_itself(first: str, second: str) -> None:
    if valid_by_the_rules(first) and valid_by_the_rules(second):
        assert topic_matches(first, second) == (first == second)
        assert topic_matches("#", second)


@pytest.mark.parametrize(
    "topic",
    [
        "a",
        "feeds.breaking-news.56",
        "a-b_c:d/e@f!g",
        "日本.ニュース",
        "x" * MAX_BYTES,
        ".".join(["a"] * MAX_SEGMENTS),
        "é" * (MAX_BYTES // 2),
    ],
)
def test_good_topics(topic: str) -> None:
    assert validate_topic(topic) == topic
    assert parse_topic_from_peer(topic.encode()) == topic


@pytest.mark.parametrize(
    ("topic", "says"),
    [
        ("", "it is empty"),
        ("a..b", "empty segment"),
        (".a", "empty segment"),
        ("a.", "empty segment"),
        ("feeds.*", "'*' is a wildcard"),
        ("feeds.#", "'#' is a wildcard"),
        ("fe*ds", "wildcards are whole segments"),
        ("news.#1", "wildcards are whole segments"),
        ("a b", "U+0020"),
        ("a\tb", "U+0009"),
        ("a\x00", "U+0000"),
        ("a\u2028b", "U+2028"),
        ("a\ud800", "U+D800"),
        ("x" * (MAX_BYTES + 1), f"256 bytes, the limit is {MAX_BYTES}"),
        ("é" * 128, "256 bytes"),
        (".".join(["a"] * (MAX_SEGMENTS + 1)), f"33 segments, the limit is {MAX_SEGMENTS}"),
    ],
)
def test_bad_topics_say_what_is_wrong(topic: str, says: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        validate_topic(topic)
    message = str(caught.value)
    assert says in message
    assert "bad topic" in message
    assert "such as 'feeds.breaking-news.56'" in message  # what a good one looks like
    assert len(message) < 300  # a long topic is quoted in part
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    "pattern", ["#", "*", "a.#.b", "#.#", "*.prefs.#", "feeds.*.56", "x" * MAX_BYTES]
)
def test_good_patterns(pattern: str) -> None:
    assert validate_pattern(pattern) == pattern
    assert parse_pattern_from_peer(pattern.encode()) == pattern


@pytest.mark.parametrize(
    ("pattern", "says"),
    [
        ("", "it is empty"),
        ("a..#", "empty segment"),
        ("a.b*", "wildcards are whole segments"),
        ("a.##", "wildcards are whole segments"),
        ("#a", "wildcards are whole segments"),
        ("a b.#", "U+0020"),
        (".".join(["#"] * (MAX_SEGMENTS + 1)), "33 segments"),
    ],
)
def test_bad_patterns_say_what_is_wrong(pattern: str, says: str) -> None:
    with pytest.raises(ConfigurationError, match="bad subscription pattern") as caught:
        validate_pattern(pattern)
    assert says in str(caught.value)
    trie: TopicTrie[int] = TopicTrie()
    with pytest.raises(ConfigurationError):
        trie.add(pattern, 1)
    with pytest.raises(ConfigurationError):
        trie.remove(pattern, 1)
    assert (len(trie), trie.node_count()) == (0, 1)


def test_a_topic_of_the_wrong_type_is_named() -> None:
    with pytest.raises(ConfigurationError, match="a topic is a str, not bytes"):
        validate_topic(b"feeds.a")
    with pytest.raises(ConfigurationError, match="pattern is a str, not NoneType"):
        validate_pattern(None)


# --------------------------------------------------------------------------------------------
# Bytes from peers


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"", "it is empty"),
        (b"\xff\xfe", "not UTF-8"),
        (b"a.\xed\xa0\x80", "not UTF-8"),  # an encoded surrogate
        (b"feeds.*", "wildcard"),
        (b"a..b", "empty segment"),
        (b"x" * (MAX_BYTES + 1), "256 bytes"),
    ],
)
def test_a_peers_bad_topic_is_a_protocol_error(data: bytes, says: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_topic_from_peer(data)
    assert caught.value.reason == "bad_topic"
    assert says in str(caught.value)
    assert not isinstance(caught.value, ConfigurationError)  # the peer's fault, not ours


def test_a_peers_bad_pattern_is_a_protocol_error() -> None:
    assert parse_pattern_from_peer(b"feeds.#") == "feeds.#"
    for data in (b"feeds.#x", b"\xc3", b"", b"#" * (MAX_BYTES + 1)):
        with pytest.raises(ProtocolError) as caught:
            parse_pattern_from_peer(data)
        assert caught.value.reason == "bad_pattern"


@given(st.binary(max_size=MAX_BYTES + 8))
def test_any_bytes_from_a_peer_give_a_topic_or_a_protocol_error(data: bytes) -> None:
    for parse in (parse_topic_from_peer, parse_pattern_from_peer):
        try:
            text = parse(data)
        except ProtocolError:
            continue
        assert text.encode() == data
    try:
        topic = parse_topic_from_peer(data)
    except ProtocolError:
        return
    assert validate_topic(topic) == topic
    assert validate_pattern(topic) == topic  # every topic is also a literal pattern
