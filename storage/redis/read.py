"""Reading one value over a bulk-lane connection (storage/redis/lane.py) into the caller's memory.

Role: the two ways RespLane.get_into reads a value: one GETRANGE of the whole blob for values up
to the lane's whole_get_max, GETRANGE pieces in a sliding window past it. A value of exactly
header + len(out) whose header says raw (blob_header.fits_in_place) has its payload received into out ->
placed(header); any shorter value is received whole into fresh memory -> hit(blob); an absent key
-> MISS. No blob for `out` is longer than header + len(out) (storage/codec/__init__.py), so a longer value
is never read: too_long (the adapter counts it: a miss). At most header + len(out) + 1 bytes
of a value ever cross the socket (GETRANGE bounds what the server sends), whatever is stored.

State: none; the connection is the caller's, used by one executor thread at a time.

Why pieces in a window rather than one GET (or one MULTI/EXEC of pieces): Redis 7 copies a reply
into reply blocks it allocates for it, all before writing any of it. For a 32 MiB GET that is one
block past jemalloc's oversize threshold (8 MiB), fresh memory page-faulted by the server on every
read; a MULTI of 1 MiB pieces still holds 32 MiB of blocks at once. With a few pieces in flight the
server reuses a few warm blocks (measured on the 32 MiB bench: ~0.3 s of Redis CPU per GiB read,
against ~0.6-0.8 s for a GET or a MULTI of pieces).

Consistency without MULTI: each command touches one key (cluster-safe) but the read is not one
atomic command. The header read at the end must equal the one read first, and the pieces must add
up to the length STRLEN gave; a value replaced meanwhile (another sidecar storing the same key) is
then ERROR "changed while it was read" -- a miss, nothing deleted -- never a hit. A value replaced
and put back within one read (same header at both ends) fails the caller's payload checksum
instead.

Primitives in call order (each consumes every reply it asked for, so the connection stays usable;
resp.ReplyMismatch or a socket error when it cannot):
  get_whole(conn, key, head_len, out)                one GETRANGE of header + len(out) + 1 bytes
                                                     (one more than any blob: a longer value shows)
  get_pieces(conn, key, head_len, out, piece_bytes)  STRLEN (a longer value ends it here, the
                                                     replies asked ahead skipped), GETRANGE of the
                                                     header, GETRANGEs of piece_bytes over the
                                                     payload, the header again, PIECE_WINDOW pieces
                                                     asked ahead
"""

from __future__ import annotations

from dataclasses import dataclass

from storage.base import LOAD_MISS, LoadResult
from storage.codec import blob_header
from storage.redis import resp

PIECE_WINDOW = 4  # GETRANGE pieces asked ahead of the one being received

CHANGED = LoadResult.error("redis: the value changed while it was read")


def too_long(length: int, total: int) -> LoadResult:
    return LoadResult.too_long(f"redis: a value of {length}+ bytes where a blob has at most {total}")


def get_whole(conn: resp.Connection, key: bytes, head_len: int, out: memoryview) -> LoadResult:
    """One GETRANGE: atomic, and cheap for the server below jemalloc's oversize threshold."""
    total = head_len + out.nbytes
    conn.send([resp.command(b"GETRANGE", key, b"0", b"%d" % total)])
    line = conn.readline()
    if line[:1] == b"-":
        return LoadResult.error(f"redis: {resp.error_text(line[1:])}")
    if line[:1] != b"$":
        raise resp.ReplyMismatch(f"unexpected GETRANGE reply {line[:64]!r}")
    length = int(line[1:])
    if length <= 0:  # no such key (GETRANGE answers an empty string)
        if length == 0:
            conn.crlf()
        return LOAD_MISS
    if length > total:  # total + 1 bytes at most: skipped, never kept
        conn.skip(length + 2)
        return too_long(length, total)
    if length == total:
        header = bytearray(head_len)
        conn.read_into(memoryview(header))
        if blob_header.fits_in_place(header, out.nbytes):
            conn.read_into(out)
            conn.crlf()
            return LoadResult.placed(bytes(header))
        blob = bytearray(length)
        blob[:head_len] = header
        conn.read_into(memoryview(blob)[head_len:])
    else:
        blob = bytearray(length)
        conn.read_into(memoryview(blob))
    conn.crlf()
    return LoadResult.hit(memoryview(blob))


def get_pieces(
    conn: resp.Connection, key: bytes, head_len: int, out: memoryview, piece_bytes: int
) -> LoadResult:
    """Replies of [STRLEN, header, pieces..., header again], the header piece routed to a small
    buffer and the payload pieces into out (or the whole value into fresh memory)."""
    total = head_len + out.nbytes
    header_cmd = resp.command(b"GETRANGE", key, b"0", b"%d" % (head_len - 1))
    pieces = [
        resp.command(b"GETRANGE", key, b"%d" % start, b"%d" % (min(start + piece_bytes, total) - 1))
        for start in range(head_len, total, piece_bytes)
    ]
    window = resp.Window(
        conn, [resp.command(b"STRLEN", key), header_cmd, *pieces, header_cmd], PIECE_WINDOW + 2
    )
    length = _strlen(window)
    if isinstance(length, LoadResult):
        return length
    if length > total:
        window.drain()  # the few replies asked ahead: bounded by the window, skipped
        return too_long(length, total)
    window.next()
    n = conn.bulk_len()
    if n != min(length, head_len):  # replaced since STRLEN
        conn.skip(n + 2)
        window.drain()
        return CHANGED
    dest = _Destination.receive_header(conn, n, length, head_len, out)
    first = bytes(dest.blob[: min(length, head_len)])
    whole = _receive_pieces(window, len(pieces), dest.body)
    whole = _same_header(window, first) and whole  # always read: every reply is consumed
    if not whole:
        return CHANGED
    return LoadResult.placed(bytes(dest.blob)) if dest.placed else LoadResult.hit(memoryview(dest.blob))


def _strlen(window: resp.Window) -> int | LoadResult:
    """The value's length from STRLEN's reply; an error reply or 0 (no such key) ends the read."""
    window.next()
    line = window.conn.readline()
    if line[:1] == b"-":
        window.drain()
        return LoadResult.error(f"redis: {resp.error_text(line[1:])}")
    if line[:1] != b":":
        raise resp.ReplyMismatch(f"unexpected STRLEN reply {line[:64]!r}")
    length = int(line[1:])
    if length == 0:
        window.drain()
        return LOAD_MISS
    return length


@dataclass(slots=True)
class _Destination:
    """Where the value goes: `blob` (what the result returns: the header alone when `placed`, else
    the whole value) and `body`, the memory the payload pieces are received into."""

    blob: bytearray
    body: memoryview
    placed: bool

    @classmethod
    def receive_header(
        cls, conn: resp.Connection, n: int, length: int, head_len: int, out: memoryview
    ) -> _Destination:
        """Receive the header piece (`n` bytes, announced) and choose where the rest goes."""
        total = head_len + out.nbytes
        if length == total:
            header = bytearray(head_len)
            conn.read_into(memoryview(header))
            if blob_header.fits_in_place(header, out.nbytes):
                dest = cls(header, out, True)
            else:  # as long as a raw blob, but not one: returned whole
                blob = bytearray(total)
                blob[:head_len] = header
                dest = cls(blob, memoryview(blob)[head_len:], False)
        else:  # shorter than a raw blob (length < total: get_pieces refused longer ones)
            blob = bytearray(length)
            conn.read_into(memoryview(blob)[:n])
            body = memoryview(blob)[head_len:length] if length > head_len else memoryview(blob)[:0]
            dest = cls(blob, body, False)
        conn.crlf()
        return dest


def _receive_pieces(window: resp.Window, pieces: int, body: memoryview) -> bool:
    """The payload pieces, back to back into `body`; False (the rest skipped) when they do not
    fill it exactly."""
    conn = window.conn
    changed = False
    offset = 0
    for _ in range(pieces):
        window.next()
        n = conn.bulk_len()
        if changed or offset + n > body.nbytes:
            conn.skip(n + 2)
            changed = True
            continue
        conn.read_into(body[offset : offset + n])
        conn.crlf()
        offset += n
    return not changed and offset == body.nbytes


def _same_header(window: resp.Window, first: bytes) -> bool:
    """Reads the header again: the same bytes mean the same blob was read throughout."""
    conn = window.conn
    window.next()
    n = conn.bulk_len()
    again = bytearray(n)
    conn.read_into(memoryview(again))
    conn.crlf()
    return again == first
