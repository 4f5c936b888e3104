"""Best-fit's packing loop, compiled (numba): the buffer, the picks and the rows' bytes without Python per piece.

The buffer is a table of piece slots (``SLOT_COLUMNS``) in per-length FIFO lists, one list per length up to the
row capacity and one for longer pieces (``bestfit``'s whole documents, which only a crop takes). A pick is the
largest length that fits, the oldest of that length: a scan down the list heads from the space left (a few hundred
compiled steps at most, against a ``bisect`` and a ``deque`` per piece in Python). The pieces' tokens live in one
int32 arena (a piece is copied in when buffered, out when placed; the arena is compacted when it runs out), so a
row is written in place, flags and provenance beside it. Documents come from a *source* (a chunk's flat tokens
and their starts and lengths), one per top-up, as the Python packer took one per ``refill()``: the rows never depend
on how documents are grouped. The loop stops and says why where Python must act: a refill (the source ran dry), a
piece restored lazily whose tokens must be fetched, or a table to grow. Trade-off: every buffered token is copied
twice (in, out) instead of once, which costs far less than the Python per piece it saves; the first call in a
fresh environment compiles (cached on disk: later processes load it).
"""

from __future__ import annotations

import numpy as np
from numba import njit

# The int64 scalars the loop keeps between calls (settings, then the buffer's, the counters', the source's and the
# row's state), as indices into one array.
(CAP, BUF, FULL_FROM, GROW_START, GROW_PER_ROW, MULTIPLE, PAD_ID, SPLIT, FLAGGED, HOLD, RECORD,
 COUNT, ARENA_END, NEXT_SEQ, ADDED, ROWS_TAKEN, FREE_TOP, PUSHED, POPPED, RECORDED,
 DOCS, SPLIT_DOCS, CHUNKS, GAP_PADDING, CP_PADDING, CROPS, CROPPED,
 SOURCE_NEXT, SOURCE_STOP, ROW, POS, OPEN_END, SIZE, IN_ROW, ROWS, LAZY, NEED_ARENA, NEED_SLOTS,
 SCALARS) = range(39)  # fmt: skip

# A slot: the piece's 8 META_COLUMNS, then where its tokens start in the arena (-1: restored lazily, not fetched
# yet; -2: a free slot), how many are there, the next slot of its length's list (-1: none), and whether the piece
# continues a document (its first token is no target).
TOKENS_AT, TOKENS_HELD, NEXT, CONTINUES = 8, 9, 10, 11
SLOT_COLUMNS = 12
LAZY_TOKENS, FREE = -1, -2

DONE, REFILL, FETCH, GROW = 0, 1, 2, 3  # why the loop returned

_START, _NO_TARGET, _CP_PAD = 1, 2, 4  # packing.START, NO_TARGET, CP_PAD (numba reads module constants)


def _crc_tables() -> np.ndarray:
    """CRC-32 (zlib's polynomial) lookup tables for slicing by 16 bytes: table ``k`` advances a byte by ``k`` more."""
    tables = np.zeros((16, 256), np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0xEDB88320 if c & 1 else c >> 1
        tables[0, i] = c
    for k in range(1, 16):
        tables[k] = (tables[k - 1] >> 8) ^ tables[0, tables[k - 1] & 0xFF]
    return tables


_CRC = _crc_tables()


@njit(cache=True, nogil=True)
def crc32_int32(tokens: np.ndarray, start: int, stop: int) -> int:
    """zlib's CRC-32 of ``tokens[start:stop]``'s int32 bytes (little-endian), as ``packing.prefix_hash`` gives:
    four tokens (16 bytes) per step, sliced by 16 (fewer bytes per step cost more per byte)."""
    t = _CRC
    crc = np.uint32(0xFFFFFFFF)
    mask = np.uint32(0xFF)
    i = start
    while i + 3 < stop:
        a = crc ^ np.uint32(tokens[i] & 0xFFFFFFFF)
        b = np.uint32(tokens[i + 1] & 0xFFFFFFFF)
        c = np.uint32(tokens[i + 2] & 0xFFFFFFFF)
        d = np.uint32(tokens[i + 3] & 0xFFFFFFFF)
        crc = (t[15, a & mask] ^ t[14, (a >> np.uint32(8)) & mask] ^ t[13, (a >> np.uint32(16)) & mask]
               ^ t[12, a >> np.uint32(24)] ^ t[11, b & mask] ^ t[10, (b >> np.uint32(8)) & mask]
               ^ t[9, (b >> np.uint32(16)) & mask] ^ t[8, b >> np.uint32(24)] ^ t[7, c & mask]
               ^ t[6, (c >> np.uint32(8)) & mask] ^ t[5, (c >> np.uint32(16)) & mask] ^ t[4, c >> np.uint32(24)]
               ^ t[3, d & mask] ^ t[2, (d >> np.uint32(8)) & mask] ^ t[1, (d >> np.uint32(16)) & mask]
               ^ t[0, d >> np.uint32(24)])  # fmt: skip
        i += 4
    while i < stop:
        value = np.uint32(tokens[i] & 0xFFFFFFFF)
        for _ in range(4):
            crc = t[0, (crc ^ value) & mask] ^ (crc >> np.uint32(8))
            value = value >> np.uint32(8)
        i += 1
    return int(crc ^ np.uint32(0xFFFFFFFF))


@njit(cache=True, nogil=True)
def _push(sc, slots, free, heads, tails, pushed, row, at, held, continues) -> None:
    top = sc[FREE_TOP] - 1
    s = free[top]
    sc[FREE_TOP] = top
    for j in range(8):
        slots[s, j] = row[j]
        pushed[sc[PUSHED], j] = row[j]
    sc[PUSHED] += 1
    slots[s, TOKENS_AT], slots[s, TOKENS_HELD], slots[s, NEXT], slots[s, CONTINUES] = at, held, -1, continues
    length = row[1]
    b = length if length <= sc[CAP] else sc[CAP] + 1
    if tails[b] < 0:
        heads[b] = s
    else:
        slots[tails[b], NEXT] = s
    tails[b] = s
    sc[COUNT] += 1


@njit(cache=True, nogil=True)
def _add_document(sc, slots, free, heads, tails, pushed, arena, tokens, start, length, key0, key1) -> int:
    """Buffer the document ``tokens[start:start + length]`` (BOS first): DONE, or GROW (nothing buffered)."""
    cap, split = sc[CAP], sc[SPLIT]
    if split:
        count = 1 if length <= cap else (length - 1) // cap + 1
        keep = length
    else:
        count = 1
        keep = length if length < sc[HOLD] else sc[HOLD]
    if sc[FREE_TOP] < count or sc[PUSHED] + count > len(pushed) or sc[ARENA_END] + keep > len(arena):
        sc[NEED_ARENA], sc[NEED_SLOTS] = keep, count
        return GROW
    base = sc[ARENA_END]
    arena[base : base + keep] = tokens[start : start + keep]
    sc[ARENA_END] = base + keep
    seq = sc[NEXT_SEQ]
    row = np.zeros(8, np.int64)
    row[2], row[3] = key0, key1
    if not split:
        whole = length <= sc[HOLD]
        row[0], row[1], row[5] = seq, length, 1 if whole else 0
        if not whole:
            row[6], row[7] = crc32_int32(arena, base, base + keep), sc[HOLD]
        _push(sc, slots, free, heads, tails, pushed, row, base, keep, 0)
    elif count == 1:
        row[0], row[1], row[5] = seq, length, 1
        _push(sc, slots, free, heads, tails, pushed, row, base, length, 0)
    else:
        for chunk in range(count):
            at = chunk * cap
            size = cap if chunk < count - 1 else length - at
            row[0], row[1], row[4], row[5] = seq + chunk, size, at, 1 if chunk == count - 1 else 0
            row[6], row[7] = crc32_int32(arena, base + at, base + at + size), size
            _push(sc, slots, free, heads, tails, pushed, row, base + at, size, 1 if chunk > 0 else 0)
        sc[SPLIT_DOCS] += 1
        sc[CHUNKS] += count
    sc[NEXT_SEQ] = seq + count
    sc[ADDED] += 1
    sc[DOCS] += 1
    return DONE


@njit(cache=True, nogil=True)
def add_documents(sc, slots, free, heads, tails, pushed, arena, tokens, starts, lengths, keys0, keys1) -> int:
    """Buffer the source's documents from ``sc[SOURCE_NEXT]`` to ``sc[SOURCE_STOP]`` (all of them): DONE or GROW."""
    while sc[SOURCE_NEXT] < sc[SOURCE_STOP]:
        d = sc[SOURCE_NEXT]
        code = _add_document(sc, slots, free, heads, tails, pushed, arena, tokens, starts[d], lengths[d], keys0[d],
                             keys1[d])  # fmt: skip
        if code != DONE:
            return code
        sc[SOURCE_NEXT] = d + 1
    return DONE


@njit(cache=True, nogil=True)
def push_rows(sc, slots, free, heads, tails, pushed, rows, at, held, continues) -> None:
    """Buffer pieces given as rows (insertion order) with their tokens' place in the arena (room checked by the
    caller)."""
    for i in range(len(rows)):
        _push(sc, slots, free, heads, tails, pushed, rows[i], at[i], held[i], continues[i])


@njit(cache=True, nogil=True)
def _unlink(sc, slots, free, heads, tails, popped, b, s, before) -> None:
    after = slots[s, NEXT]
    if before < 0:
        heads[b] = after
    else:
        slots[before, NEXT] = after
    if tails[b] == s:
        tails[b] = before
    popped[sc[POPPED]] = slots[s, 0]
    sc[POPPED] += 1
    slots[s, TOKENS_AT] = FREE
    free[sc[FREE_TOP]] = s
    sc[FREE_TOP] += 1
    sc[COUNT] -= 1


@njit(cache=True, nogil=True)
def _start_row(sc) -> None:
    """Open the next row: the buffer's size for it (growing as rows are taken), nothing placed yet."""
    taken = sc[ROWS_TAKEN]
    sc[ROWS_TAKEN] = taken + 1
    size = sc[BUF]
    if taken < sc[FULL_FROM] and sc[GROW_PER_ROW]:
        size = min(size, sc[GROW_START] + taken * sc[GROW_PER_ROW])
    sc[SIZE], sc[POS], sc[OPEN_END], sc[IN_ROW] = size, 0, 0, 1


@njit(cache=True, nogil=True)
def _place(sc, slots, record, arena, out, flags, r, at, pos, s, length, flagged) -> None:
    """Copy piece ``s``'s first ``length`` tokens into row ``r`` at ``pos``, recording it and flagging its start."""
    src = slots[s, TOKENS_AT]
    out[at + pos : at + pos + length] = arena[src : src + length]
    if sc[RECORD]:
        k = sc[RECORDED]
        record[k, 0], record[k, 1], record[k, 2] = r, pos, length
        record[k, 3], record[k, 4], record[k, 5] = slots[s, 2], slots[s, 3], slots[s, 4]
        sc[RECORDED] = k + 1
    if flagged:
        flags[at + pos] |= _START


@njit(cache=True, nogil=True)
def _pad_gap(sc, out, flags, at, pos, cap, pad) -> None:
    """Pad the rest of a row: a run that starts positions and trains nothing (``bestfit_split``)."""
    out[at + pos : at + cap] = pad
    flags[at + pos] |= _START
    for i in range(at + pos, at + cap):
        flags[i] |= _NO_TARGET
    sc[GAP_PADDING] += cap - pos


@njit(cache=True, nogil=True)
def _shortest(slots, heads, cap):
    """The piece a gap crops, the oldest of the shortest: (its length bucket, its slot, the slot before it)."""
    b, s, before = 1, -1, -1
    while b <= cap and heads[b] < 0:
        b += 1
    if b <= cap:
        return b, heads[b], before
    b = cap + 1  # only pieces longer than a row: the first of the shortest
    walk, prev = heads[b], -1
    while walk >= 0:
        if s < 0 or slots[walk, 1] < slots[s, 1]:
            s, before = walk, prev
        prev, walk = walk, slots[walk, NEXT]
    return b, s, before


@njit(cache=True, nogil=True)
def _round_up(sc, out, flags, at, pos, cap, multiple, pad) -> int:
    """Pad a piece ending at ``pos`` to a multiple of ``2·c`` (the row's end where that leaves one token)."""
    stop = -(-pos // multiple) * multiple
    if stop >= cap - 1:
        stop = cap
    if stop != pos:
        out[at + pos : at + stop] = pad
        for i in range(at + pos, at + stop):
            flags[i] |= _CP_PAD | _NO_TARGET
        if stop < cap:  # what follows must not be the target of padding
            flags[at + stop] |= _NO_TARGET
        sc[CP_PADDING] += stop - pos
    return stop


@njit(cache=True, nogil=True)
def pack(sc, slots, free, heads, tails, pushed, popped, record, arena, tokens, starts, lengths, keys0, keys1, out,
         flags) -> int:  # fmt: skip
    """Pack rows ``sc[ROW]`` to ``sc[ROWS]`` into ``out`` (flat ``rows × capacity``) and ``flags``, documents from the
    source as the buffer needs them; returns DONE, or why Python must act first (the state kept: call again)."""
    cap, multiple, pad, flagged, split = sc[CAP], sc[MULTIPLE], sc[PAD_ID], sc[FLAGGED], sc[SPLIT]
    while True:
        if not sc[IN_ROW]:
            if sc[ROW] == sc[ROWS]:
                return DONE
            _start_row(sc)
        pos, r = sc[POS], sc[ROW]
        if pos >= cap:
            sc[IN_ROW], sc[ROW] = 0, r + 1
            continue
        while sc[COUNT] < sc[SIZE]:
            if sc[SOURCE_NEXT] == sc[SOURCE_STOP]:
                return REFILL
            d = sc[SOURCE_NEXT]
            code = _add_document(sc, slots, free, heads, tails, pushed, arena, tokens, starts[d], lengths[d],
                                 keys0[d], keys1[d])  # fmt: skip
            if code != DONE:
                return code
            sc[SOURCE_NEXT] = d + 1
        if sc[POPPED] >= len(popped) or (sc[RECORD] and sc[RECORDED] >= len(record)):
            sc[NEED_ARENA], sc[NEED_SLOTS] = 0, 0
            return GROW
        at, length = r * cap, cap - pos
        while length > 0 and heads[length] < 0:
            length -= 1
        if length == 0 and split:  # nothing fits: pad the rest
            _pad_gap(sc, out, flags, at, pos, cap, pad)
        elif length == 0:  # nothing fits: crop the shortest (the oldest of its length)
            b, s, before = _shortest(slots, heads, cap)
            if slots[s, TOKENS_AT] == LAZY_TOKENS:
                sc[LAZY] = s
                return FETCH
            _place(sc, slots, record, arena, out, flags, r, at, pos, s, cap - pos, flagged)
            sc[CROPS] += 1
            sc[CROPPED] += slots[s, 1] - (cap - pos)
            _unlink(sc, slots, free, heads, tails, popped, b, s, before)
        if length == 0:
            sc[IN_ROW], sc[ROW] = 0, r + 1
            continue
        s = heads[length]
        if slots[s, TOKENS_AT] == LAZY_TOKENS:
            sc[LAZY] = s
            return FETCH
        _place(sc, slots, record, arena, out, flags, r, at, pos, s, length, flagged)
        # Not the target of the token before it: that token is another document's, or (a piece cut at a shorter
        # row length, now sharing a row) it is followed in its own document by other text.
        if flagged and (slots[s, CONTINUES] or sc[OPEN_END]):
            flags[at + pos] |= _NO_TARGET
        if flagged:
            sc[OPEN_END] = 0 if slots[s, 5] else 1
        _unlink(sc, slots, free, heads, tails, popped, length, s, -1)
        pos += length
        if multiple > 1 and pos < cap:
            pos = _round_up(sc, out, flags, at, pos, cap, multiple, pad)
        sc[POS] = pos


@njit(cache=True, nogil=True)
def compact(slots, arena, fresh) -> int:
    """Copy every buffered piece's tokens into ``fresh`` (in slot order), updating their places; the tokens held."""
    end = 0
    for s in range(len(slots)):
        at = slots[s, TOKENS_AT]
        if at >= 0:
            held = slots[s, TOKENS_HELD]
            fresh[end : end + held] = arena[at : at + held]
            slots[s, TOKENS_AT] = end
            end += held
    return end
