"""What the core hands its driver: events, and frames sealed per link.

Theory of operation
-------------------
Every concern of the core appends its events to `Outbox.events` and its frames here; the
driver takes them (it swaps each list for a fresh one, so nothing may keep a reference to
`events`, `out_frames` or `in_frames`: always go through the outbox).

A frame is a header (kind, scope slot, the link's next sequence number) and a body sealed under
the link's sealer for that slot (`frame`). Control frames (slot 0) are msgpack envelopes sealed
at once (`send_out`, `send_in`).

Calls, replies and tunnel data are staged rather than sealed at once when `batching` is on (the
driver turns it on): each link collects `(slot, kind, body)` entries in `link.staged` and is
listed once in `staged_out` / `staged_in`; `seal_staged`, called by the driver once per flush,
seals one frame per link and slot, a BATCH of several entries where there are several
(`seal_batches`). A batch stays below `batch_limit` (96 KiB, below the sizes malloc serves by
mmap, and below the peer's frame limit). With batching off (the tests), everything is sealed
into `out_frames` / `in_frames` at once.

Priorities: calls and replies of a priority other than the default are staged apart
(`stage_ranked`, into `link.ranked`), and a flush seals each link's entries class by class,
highest first, the default class in its place between the positive and the negative ones: each
class in frames of its own, so a frame of a higher class is sealed (its sequence number is
lower) and sent before any of a lower class staged in the same flush, and the peer reads it
first. Entries of one class keep their order.

Publishes are staged separately, straight into the link's frame body for one slot
(`OutLink.pub_parts`, written by the publish hot path in `pubsub`: a PUBLISH_RUN whose entries
are the same bytes for every subscriber, or a BATCH for a peer that reads no runs), and the
link is listed in `published`; `seal_published` closes such a body into one frame. The staging
lists are never replaced, only cleared, so the hot paths of other concerns may hold them.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from irismesh._core.events import Event
from irismesh._core.frames import (
    BATCH_ENTRY,
    HEADER,
    MAGIC,
    MAX_BATCH,
    VERSION,
    BodyCodec,
    Kind,
    encode_batch_of,
)
from irismesh._core.links import InLink, LinkState, OutLink

_BATCH = int(Kind.BATCH)
_PUBLISH_RUN = int(Kind.PUBLISH_RUN)
_BATCH_BYTES = 96 << 10
_pack_header = HEADER.pack
_ENTRY_SIZE = BATCH_ENTRY.size


class Outbox:
    """The core's output: events, frames, and what is staged to be sealed into frames."""

    def __init__(
        self,
        *,
        codec: BodyCodec,
        stats: Counter[str],
        inbound: dict[bytes, InLink],
        max_payload: int,
    ) -> None:
        self.events: list[Event] = []
        # An OpenLink or CloseLink is among the events since the driver last looked (it opens
        # and closes links before it hands the rest on; without one it need not look).
        self.link_events = False
        # Frames to send: (link_id, frame) on dialled links, (routing_id, frame) on the others.
        self.out_frames: list[tuple[int, bytes]] = []
        self.in_frames: list[tuple[bytes, bytes]] = []
        # Off: every call and reply is sealed into out_frames/in_frames at once. On (the
        # driver): they are staged per link and sealed by seal_staged(), several to a frame.
        self.batching = False
        self.staged_out: list[OutLink] = []
        self.staged_in: list[InLink] = []
        self.published: list[OutLink] = []  # links with publishes in OutLink.pub_parts
        self.batch_limit = min(max_payload, _BATCH_BYTES)
        self._codec = codec
        self._stats = stats
        self._inbound = inbound  # the engine's table: a link forgotten meanwhile gets nothing

    # ----------------------------------------------------------------- staging

    def stage_out(self, link: OutLink, slot: int, kind: int, body: bytes) -> None:
        """A call or tunnel frame for a dialled link: staged, or sealed now."""
        if self.batching:
            if not link.staged and not link.ranked:
                self.staged_out.append(link)
            link.staged.append((slot, kind, body))
            return
        self.out_frames.append((link.link_id, self.frame(link, slot, kind, body)))

    def stage_ranked(
        self, link: OutLink | InLink, priority: int, slot: int, kind: int, body: bytes
    ) -> None:
        """A call or reply of `priority` (not 0: `stage_out` and `stage_in` stage those)."""
        if self.batching:
            if not link.staged and not link.ranked:
                if isinstance(link, OutLink):
                    self.staged_out.append(link)
                else:
                    self.staged_in.append(link)
            link.ranked.append((priority, slot, kind, body))
            return
        frame = self.frame(link, slot, kind, body)
        if isinstance(link, OutLink):
            self.out_frames.append((link.link_id, frame))
        else:
            self.in_frames.append((link.routing_id, frame))

    def stage_in(self, link: InLink, slot: int, kind: int, body: bytes) -> None:
        """A reply or tunnel frame for a link a peer dialled: staged, or sealed now."""
        if self.batching:
            if not link.staged and not link.ranked:
                self.staged_in.append(link)
            link.staged.append((slot, kind, body))
            return
        self.in_frames.append((link.routing_id, self.frame(link, slot, kind, body)))

    def send_out(self, link: OutLink, kind: int, env: list[Any]) -> None:
        """A control frame (slot 0) on a dialled link, sealed now."""
        self.out_frames.append((link.link_id, self.frame(link, 0, kind, self._codec.pack(env))))

    def send_in(self, link: InLink, kind: int, env: list[Any]) -> None:
        """A control frame (slot 0) on a link a peer dialled, sealed now."""
        self.in_frames.append((link.routing_id, self.frame(link, 0, kind, self._codec.pack(env))))

    # ----------------------------------------------------------------- sealing

    def seal_staged(self) -> None:
        """Seal what `batching` staged: one frame per link and scope (BATCH if several)."""
        published = self.published
        if published:
            for link in published:
                self.seal_published(link)
            published.clear()
        staged_out = self.staged_out
        if staged_out:
            out_frames = self.out_frames
            for link in staged_out:
                staged, link.staged = link.staged, []
                if link.ranked:
                    ranked, link.ranked = link.ranked, []
                    if link.state is LinkState.UP:
                        for frame in self.seal_ranked(link, staged, ranked):
                            out_frames.append((link.link_id, frame))
                elif link.state is LinkState.UP:
                    for frame in self.seal_batches(link, staged):
                        out_frames.append((link.link_id, frame))
            staged_out.clear()
        staged_in = self.staged_in
        if staged_in:
            in_frames, inbound = self.in_frames, self._inbound
            for inlink in staged_in:
                staged, inlink.staged = inlink.staged, []
                if inlink.ranked:
                    ranked, inlink.ranked = inlink.ranked, []
                    if inbound.get(inlink.routing_id) is inlink:
                        for frame in self.seal_ranked(inlink, staged, ranked):
                            in_frames.append((inlink.routing_id, frame))
                elif inbound.get(inlink.routing_id) is inlink:
                    for frame in self.seal_batches(inlink, staged):
                        in_frames.append((inlink.routing_id, frame))
            staged_in.clear()

    def seal_published(self, link: OutLink) -> None:
        """Seal the publishes staged for `link` as one frame (PUBLISH_RUN or BATCH)."""
        parts = link.pub_parts
        if not parts:
            return
        body = b"".join(parts)
        if link.pub_runs:  # a PUBLISH_RUN: its head, then the entries
            kind, count = _PUBLISH_RUN, len(parts) - 1
        else:
            kind, count = _BATCH, len(parts) >> 1
        parts.clear()
        link.pub_size = 0
        if link.state is not LinkState.UP:
            return
        if count > 1:
            self._stats["batches_sent"] += 1
        self.out_frames.append((link.link_id, self.frame(link, link.pub_slot, kind, body)))

    def seal_ranked(
        self,
        link: OutLink | InLink,
        staged: list[tuple[int, int, bytes]],
        ranked: list[tuple[int, int, int, bytes]],
    ) -> list[bytes]:
        """The frames for a link's staged entries of every class, the highest class first
        (the default class, `staged`, between the positive and the negative ones)."""
        classes: dict[int, list[tuple[int, int, bytes]]] = {}
        if staged:
            classes[0] = staged
        for priority, slot, kind, body in ranked:
            entries = classes.get(priority)
            if entries is None:
                entries = classes[priority] = []
            entries.append((slot, kind, body))
        frames: list[bytes] = []
        for priority in sorted(classes, reverse=True):
            frames.extend(self.seal_batches(link, classes[priority]))
        return frames

    def seal_batches(
        self, link: OutLink | InLink, staged: list[tuple[int, int, bytes]]
    ) -> list[bytes]:
        """The frames for `staged` entries: one per slot, a BATCH where several fit together."""
        frames: list[bytes] = []
        slot = staged[0][0]
        for entry in staged:
            if entry[0] != slot:
                break
        else:  # one slot (the common case): no regrouping
            self._seal_slot(link, slot, staged, frames)
            return frames
        by_slot: dict[int, list[tuple[int, int, bytes]]] = {}
        for entry in staged:
            entries = by_slot.get(entry[0])
            if entries is None:
                by_slot[entry[0]] = [entry]
            else:
                entries.append(entry)
        for slot, entries in by_slot.items():
            self._seal_slot(link, slot, entries, frames)
        return frames

    def _seal_slot(
        self,
        link: OutLink | InLink,
        slot: int,
        entries: list[tuple[int, int, bytes]],
        frames: list[bytes],
    ) -> None:
        """Seal one slot's entries into `frames`: a BATCH of as many as fit, or one alone."""
        # A batch fits the peer's frame limit (like any one body) and stays below the sizes
        # malloc serves by mmap (one batch frame per 64 KiB tunnel chunk or so, not a MiB).
        limit = self.batch_limit
        start, count = 0, len(entries)
        while start < count:
            end, size = start + 1, len(entries[start][2])
            while end < count and end - start < MAX_BATCH:
                size += len(entries[end][2]) + _ENTRY_SIZE
                if size > limit:
                    break
                end += 1
            if end - start == 1:
                _slot, kind, body = entries[start]
            else:
                kind, body = _BATCH, encode_batch_of(entries, start, end)
                self._stats["batches_sent"] += 1
            start = end
            frames.append(self.frame(link, slot, kind, body))

    def frame(self, link: OutLink | InLink, slot: int, kind: int, body: bytes) -> bytes:
        """The link's next frame: header (its next seq) and `body` sealed in `slot`."""
        link.send_seq += 1
        seq = link.send_seq
        header = _pack_header(MAGIC, VERSION, kind, 0, slot, seq)
        return header + link.send_sealers[slot].seal(header, seq, body)
