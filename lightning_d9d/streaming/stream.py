"""Token stream: one resumable, endless stream of packed microbatches per (rank, worker).

Algorithm: the stream walks its share of row groups (``parquet_source.deal``) pass after pass, reads each row
group's text column, and cuts it into chunks of ``tokenizer_batch_size`` rows (fewer where ``chunk_chars``
caps a chunk's text). A reader thread reads ahead and hands chunks to one tokenizing thread
(``Tokenizer.encode_batch_fast`` releases the GIL and uses every core, or one core in a DataLoader worker:
``token_loader``); the consuming thread converts each chunk's ids to numpy while the next chunk is being
tokenized (the spent ``Encoding`` objects go back to the tokenizing thread, which frees them between two
calls), takes the chunks strictly in order and packs rows (``token_packing``) into microbatches of
``seq_len + 1``-token int32 rows; nothing it produces depends on timing. The rows stay compact int32 numpy until
the consuming process: from a DataLoader worker they travel pickled through its pipe, which measured cheaper
than the three int64 shared-memory tensors per microbatch built from them (``token_loader``).

State: every microbatch comes with the stream's position *after* it, as a few integers:

* ``pass``/``slot``/``row``: where reading resumes. Inside a document (concat's next unemitted token, ``offset``
  tokens into it) it is that document's row; between documents it is the row just after the last document
  taken (which may be an empty row, not yet counted). On resume reading restarts there; the carried-over
  tokens are recomputed, not saved. Packers take documents one at a time and positions never name a chunk
  boundary, so neither what packers hold nor any state depends on how documents were batched for the
  tokenizer: after a start or resume the batches grow 1, 2, 4, ... up to ``tokenizer_batch_size``, so the
  first microbatch waits for a few documents only.
* best-fit's buffer as one ``(documents, 5)`` int64 tensor: insertion number, token length, row group, row,
  and a checksum of the row-sized prefix. On resume the buffer is rebuilt from these rows at once (a pick
  needs only lengths); each document's text is re-read and its tokens are recomputed only when it is picked.
  A document longer than a row is re-tokenized only from a text prefix long enough for its first row's worth
  of tokens, and the checksum proves the prefix is byte-identical (else the prefix doubles, up to the whole
  text). So the first batch after a resume costs a few documents' tokenization, not the buffer's, even when
  the buffer holds the corpus's longest documents.
* counters (documents read, empty/null documents skipped, tokens tokenized / emitted / cropped).

Trade-off: the state is small (tens of KiB for a 1000-document buffer) and restoring it costs re-reading the
buffered documents' row groups and re-tokenizing each document when it is picked (prefixes only for long
ones); saving the tokens themselves would cost MiBs per worker.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from lightning_d9d.streaming.packing import BestFitPacker, ConcatPacker, prefix_hash
from lightning_d9d.streaming.source import RowGroupIndex, deal, pass_order

PACKINGS = ("bestfit", "concat")
_COUNTERS = ("docs", "empty", "tokens")

_tokenizer_cache: dict[str, Tokenizer] = {}


def load_tokenizer(tokenizer_json: str) -> Tokenizer:
    """Parse a serialized tokenizer once per process (parsing a large vocabulary takes a while).

    Padding and truncation saved in the JSON are switched off: a document must come out whole and unpadded
    (a ``tokenizer.json`` saved with ``truncation: {max_length: 512}`` would silently cut every document).
    """
    tok = _tokenizer_cache.get(tokenizer_json)
    if tok is None:
        tok = Tokenizer.from_str(tokenizer_json)
        tok.no_padding()
        tok.no_truncation()
        _tokenizer_cache[tokenizer_json] = tok
    return tok


def encode_documents(tok: Tokenizer, texts: list[str]) -> list:
    """``encode_batch_fast`` without the post-processor's special tokens: the stream prepends BOS itself, and a
    template such as Llama's ``"<s> $A"`` would otherwise put a second BOS (or a BERT-style ``[SEP]``) in every
    document."""
    return tok.encode_batch_fast(texts, add_special_tokens=False)


@dataclass(frozen=True)
class StreamSpec:
    """Everything a stream needs, picklable so it can travel to a DataLoader worker.

    Attributes:
        index: the row groups to read.
        tokenizer_json: the tokenizer, serialized (``Tokenizer.to_str()``).
        bos_id: the BOS token id prepended to every document.
        seq_len: tokens per row of ``inputs`` (rows hold ``seq_len + 1`` tokens).
        microbatch_size: rows per microbatch.
        packing: ``"bestfit"`` or ``"concat"``.
        seed: seeds the per-pass row-group order.
        shuffle: reshuffle row groups every pass (``False``: file order, for validation).
        num_streams: total streams (ranks x workers) the row groups are dealt to.
        tokenizer_batch_size: documents per ``encode_batch_fast`` call (and per chunk), at most.
        buffer_size: best-fit's document buffer.
        prefetch: chunks the background reader may run ahead (0: no thread, read inline).
        chunk_chars: a chunk also ends before its text passes this many characters (0: no limit; a single
            longer document is a chunk of its own). A tokenizer on one core gains nothing from large calls,
            whereas a call's size sets how bursty the rows come and how much memory its ``Encoding`` objects
            hold: ``token_loader`` sets it for DataLoader workers.
    """

    index: RowGroupIndex
    tokenizer_json: str
    bos_id: int
    seq_len: int
    microbatch_size: int
    packing: str
    seed: int
    shuffle: bool
    num_streams: int
    tokenizer_batch_size: int = 128
    buffer_size: int = 1000
    prefetch: int = 4
    chunk_chars: int = 0

    @property
    def capacity(self) -> int:
        return self.seq_len + 1


@dataclass
class _Chunk:
    pass_index: int
    slot: int
    row: int
    group: int  # global row group
    counters: tuple[int, int, int]  # docs, empty, tokens read before this chunk
    doc_rows: np.ndarray  # row (within the row group) of each non-empty document
    lengths: np.ndarray  # full token count (with BOS) of each non-empty document
    payload: Any  # concat: 1-D int32 tokens; bestfit: list of row-sized prefixes
    raw_docs: int
    empty: int
    # The position just after the last document of earlier chunks, or where reading started (which may be
    # inside this chunk's first document, after a resume).
    before: dict[str, int] | None = None

    def counters_before(self, doc: int) -> tuple[int, int, int]:
        """(documents, empty ones, tokens) read before non-empty document ``doc`` of this chunk."""
        raw_before = int(self.doc_rows[doc]) - self.row
        return (
            self.counters[0] + raw_before,
            self.counters[1] + raw_before - doc,
            self.counters[2] + int(self.lengths[:doc].sum()),
        )


def _initial_state() -> dict[str, Any]:
    return {
        "pass": 0,
        "slot": 0,
        "row": 0,
        "offset": 0,
        "docs": 0,
        "empty": 0,
        "tokens": 0,
        "batches": 0,
        "emitted": 0,
        "crops": 0,
        "cropped": 0,
        "next_seq": 0,
    }


class TokenStream:
    """An endless iterator of ``(rows, state)`` microbatches for one stream.

    ``rows`` is ``(microbatch_size, seq_len + 1)`` int32 tokens (``token_packing.microbatch_tensors`` turns it
    into ``inputs``/``targets``/``position_ids``); ``state`` is the stream's position after it.

    Args:
        spec: the stream's configuration.
        stream: this stream's number among ``spec.num_streams``.
        state: a state yielded earlier by a stream with the same spec and number, to continue exactly after it.

    Raises:
        ValueError: (when iterated) this stream has no row group, or a whole pass of it holds no document.
    """

    def __init__(self, spec: StreamSpec, stream: int, state: dict[str, Any] | None = None) -> None:
        if spec.packing not in PACKINGS:
            raise ValueError(f"packing={spec.packing!r} is not one of {PACKINGS}")
        if spec.chunk_chars < 0:
            raise ValueError(f"chunk_chars={spec.chunk_chars} must be >= 0 (0: no limit)")
        self.spec = spec
        self.stream = stream
        self.state = dict(state) if state is not None else _initial_state()
        self._stop = threading.Event()

    # ---------------------------------------------------------------- reading and tokenizing
    def _raw_chunks(self, start: tuple[int, int, int]) -> Iterator[tuple[int, int, int, int, list]]:
        """``(pass, slot, row, group, texts)`` for every chunk from ``start`` on, forever (reading only)."""
        spec = self.spec
        size = 1  # grows to tokenizer_batch_size: the first batch (also after a resume) waits for few documents
        pass_index, slot, row = start
        while True:
            groups = deal(
                pass_order(len(spec.index), spec.seed, pass_index, spec.shuffle), self.stream, spec.num_streams
            )
            if len(groups) == 0:
                raise ValueError(
                    f"stream {self.stream} of {spec.num_streams} gets no row group: the files hold "
                    f"{len(spec.index)} row groups, fewer than ranks x workers"
                )
            found_text = False
            while slot < len(groups):
                group = int(groups[slot])
                texts = spec.index.read_texts(group)
                found_text = found_text or any(texts[row:])
                # chars[i]: characters of texts[:i], to end a chunk before it passes chunk_chars.
                chars = np.cumsum([0] + [len(t) if t else 0 for t in texts]) if spec.chunk_chars else None
                while row < len(texts):
                    end = min(row + size, len(texts))
                    if chars is not None:
                        fits = int(np.searchsorted(chars, chars[row] + spec.chunk_chars, side="right")) - 1
                        end = max(row + 1, min(end, fits))
                    yield pass_index, slot, row, group, texts[row:end]
                    row = end
                    size = min(2 * size, spec.tokenizer_batch_size)
                slot, row = slot + 1, 0
            if not found_text and start[1:] == (0, 0):
                raise ValueError(
                    f"stream {self.stream}: a whole pass over its row groups {groups.tolist()} found no "
                    f"non-empty text in column {spec.index.text_column!r}"
                )
            pass_index, slot, start = pass_index + 1, 0, (pass_index + 1, 0, 0)

    def _encode(self, raw: tuple[int, int, int, int, list]) -> tuple[tuple, list[int], list]:
        """Tokenize one chunk's non-empty texts (``encode_batch_fast`` releases the GIL, uses every core)."""
        texts = raw[4]
        keep = [i for i, text in enumerate(texts) if text]  # None and "" are skipped, and counted
        encs = encode_documents(load_tokenizer(self.spec.tokenizer_json), [texts[i] for i in keep]) if keep else []
        return raw, keep, encs

    def _tokenize(self, raw: tuple[int, int, int, int, list]) -> _Chunk:
        return self._layout(*self._encode(raw))

    def _layout(self, raw: tuple[int, int, int, int, list], keep: list[int], encs: list) -> _Chunk:
        """Lay one tokenized chunk out for the packer (numpy ids, BOS first, lengths)."""
        spec = self.spec
        bos, cap = spec.bos_id, spec.capacity
        pass_index, slot, row, group, texts = raw
        lengths = np.fromiter(map(len, encs), np.int64, len(encs)) + 1  # len() of an Encoding builds no list
        head = (bos,)
        # One numpy conversion per chunk, BOS slotted in as it goes. Each document's ids list is built, copied
        # and freed in turn, so the Python ints in flight stay a document's worth (reused while cache-hot)
        # instead of the chunk's (128 long documents: ~600K ints, ~25 MB).
        if spec.packing == "concat":
            payload = np.fromiter(
                chain.from_iterable(chain.from_iterable((head, e.ids) for e in encs)), np.int32, int(lengths.sum())
            )
        else:
            # Best-fit keeps only each document's row-sized prefix; documents are views of one flat array.
            ends = np.cumsum(np.minimum(lengths, cap)).tolist()
            prefixes = chain.from_iterable(
                (head, e.ids if n <= cap else e.ids[: cap - 1]) for e, n in zip(encs, lengths.tolist())
            )
            flat = np.fromiter(chain.from_iterable(prefixes), np.int32, ends[-1] if ends else 0)
            payload = [flat[s:e] for s, e in zip([0, *ends[:-1]], ends)]
        return _Chunk(
            pass_index,
            slot,
            row,
            group,
            (0, 0, 0),
            np.asarray(keep, np.int64) + row,
            lengths,
            payload,
            len(texts),
            len(texts) - len(keep),
        )

    def _chunks(self, start: tuple[int, int, int], counters: tuple[int, int, int]) -> Iterator[_Chunk]:
        """Tokenized chunks in order, with running counters; read and tokenized ahead in threads.

        One thread reads row groups and submits chunks to one tokenizing thread (one ``encode_batch_fast`` at a
        time: concurrent calls make the tokenizer's thread pool fight over the cores, measured 15-20 % slower
        on long documents); this thread converts the ids to numpy (holding the GIL) while the next chunk is
        being tokenized (not holding it). Results are taken strictly in submission order, so timing never
        changes what is produced.
        """
        docs, empty, tokens = counters
        before = {"pass": start[0], "slot": start[1], "row": start[2], "docs": docs, "empty": empty, "tokens": tokens}
        for chunk in self._ordered(self._raw_chunks(start)):
            chunk.counters, chunk.before = (docs, empty, tokens), before
            docs += chunk.raw_docs
            empty += chunk.empty
            tokens += int(chunk.lengths.sum())
            if len(chunk.doc_rows):
                before = self._position(chunk, len(chunk.doc_rows))
            yield chunk

    def _ordered(self, raw: Iterator[tuple]) -> Iterator[_Chunk]:
        if self.spec.prefetch <= 0:
            for item in raw:
                yield self._tokenize(item)
            return
        out: queue.Queue = queue.Queue(maxsize=self.spec.prefetch)
        stop = threading.Event()
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"token-stream-{self.stream}")
        spent: deque = deque()  # laid-out chunks' Encodings, freed by the tokenizing thread

        def encode(item: tuple) -> tuple:
            # Free spent Encodings here, between two tokenizer calls, where a bare tokenizer loop frees them too:
            # the tokenizer's threads are idle now, whereas a free from the consumer runs while they allocate
            # the next chunk and contends with them for the allocator (on short documents the consumer spent
            # 42 ns/token freeing; here it costs this thread about 14 ns/token).
            while spent:
                spent.popleft().clear()
            return self._encode(item)

        def put(item: Any) -> bool:
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                for item in raw:
                    if not put(pool.submit(encode, item)):
                        return
            except BaseException as err:  # handed to the consumer, which raises it
                put(err)

        thread = threading.Thread(target=produce, name=f"token-stream-{self.stream}-reader", daemon=True)
        thread.start()
        try:
            while True:
                try:
                    item = out.get(timeout=1.0)
                except queue.Empty:
                    if not thread.is_alive() and out.empty():  # never wait on a reader that is gone
                        raise RuntimeError(
                            f"token stream {self.stream}: its reader thread ended unexpectedly"
                        ) from None
                    continue
                if isinstance(item, BaseException):
                    raise item
                raw_chunk, keep, encodings = item.result()
                chunk = self._layout(raw_chunk, keep, encodings)
                spent.append(encodings)
                yield chunk
        finally:
            stop.set()
            pool.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------- restoring best-fit's buffer
    def _restore_bestfit(self, packer: BestFitPacker, meta: np.ndarray) -> None:
        """Rebuild best-fit's buffer from its saved rows: texts are re-read now, tokens when first picked."""
        spec = self.spec
        cap = spec.capacity
        texts: dict[tuple[int, int], str] = {}
        for group in np.unique(meta[:, 2]).tolist():
            rows = spec.index.read_texts(group)
            for i in np.flatnonzero(meta[:, 2] == group):
                row, length = int(meta[i, 3]), int(meta[i, 1])
                text = rows[row] or ""
                # A long document needs only a text prefix: keep a generous one, re-read the rest if ever needed.
                texts[(group, row)] = text if length <= cap else text[: 16 * self._prefix_chars(text, length)]

        uses = Counter(zip(meta[:, 2].tolist(), meta[:, 3].tolist()))  # a small corpus may buffer a doc twice

        def fetch(row: np.ndarray) -> np.ndarray:
            group, index, length = int(row[2]), int(row[3]), int(row[1])
            text = texts[(group, index)]
            uses[(group, index)] -= 1
            if not uses[(group, index)]:
                del texts[(group, index)]
            if length <= cap:
                return self._with_bos(encode_documents(load_tokenizer(spec.tokenizer_json), [text])[0].ids)
            return self._long_prefix(group, index, text, length, int(row[4]))

        packer.restore(meta, int(self.state["next_seq"]), fetch)

    def _prefix_chars(self, text: str, length: int) -> int:
        # Characters that should hold the first row's tokens, from the document's own chars/token, with margin.
        return int(len(text) * (self.spec.capacity + 64) / length * 1.25) + 256

    def _with_bos(self, ids: list[int]) -> np.ndarray:
        prefix = np.empty(min(len(ids) + 1, self.spec.capacity), np.int32)
        prefix[0] = self.spec.bos_id
        prefix[1:] = ids[: self.spec.capacity - 1]
        return prefix

    def _long_prefix(self, group: int, row: int, text: str, length: int, checksum: int) -> np.ndarray:
        """The first row's tokens of a long document, tokenizing only a prefix of its text.

        A prefix's tokens can differ from the whole text's near the cut, so the cut leaves a margin and the
        saved checksum decides; on a mismatch the prefix doubles, up to the whole text (always exact).
        """
        tok, cap = load_tokenizer(self.spec.tokenizer_json), self.spec.capacity
        cut = self._prefix_chars(text, length)
        full = None
        while True:
            if cut >= len(text) and full is None:
                full = text = self.spec.index.read_texts(group)[row] or ""  # the kept prefix ran out: re-read
            ids = encode_documents(tok, [text[:cut]])[0].ids
            prefix = self._with_bos(ids)
            whole = cut >= len(text)
            if whole or (len(ids) + 1 >= cap + 16 and prefix_hash(prefix) == checksum):
                return prefix  # the packer verifies the checksum (a whole text that mismatches raises there)
            cut *= 2

    # ---------------------------------------------------------------- packing
    def __iter__(self) -> Iterator[tuple[np.ndarray, dict[str, Any]]]:
        spec, state = self.spec, dict(self.state)
        start = (state["pass"], state["slot"], state["row"])
        counters = tuple(state[c] for c in _COUNTERS)
        chunks = self._chunks(start, counters)
        try:
            if spec.packing == "concat":
                yield from self._iter_concat(chunks, state)
            else:
                yield from self._iter_bestfit(chunks, state)
        finally:
            chunks.close()

    def _position(self, chunk: _Chunk, doc: int, inside: bool = False) -> dict[str, int]:
        """The stream position before non-empty document ``doc`` of ``chunk`` (``doc == n``: after the last).

        ``inside``: a position inside document ``doc`` (concat's offset > 0) names that document's row. Between
        documents it is the row just after the previous document, whose following empty rows are not yet read:
        a chunk boundary can fall anywhere among them, so only this form keeps states independent of how
        documents were batched for the tokenizer.
        """
        if inside:
            docs, empty, tokens = chunk.counters_before(doc)
            return {
                "pass": chunk.pass_index,
                "slot": chunk.slot,
                "row": int(chunk.doc_rows[doc]),
                "docs": docs,
                "empty": empty,
                "tokens": tokens,
            }
        if doc == 0:
            return dict(chunk.before)
        docs, empty, tokens = chunk.counters_before(doc - 1)
        row_after = int(chunk.doc_rows[doc - 1]) + 1
        pass_index, slot, row = self._advance(chunk.pass_index, chunk.slot, chunk.group, row_after)
        return {
            "pass": pass_index,
            "slot": slot,
            "row": row,
            "docs": docs + 1,
            "empty": empty,
            "tokens": tokens + int(chunk.lengths[doc - 1]),
        }

    def _advance(self, pass_index: int, slot: int, group: int, row: int) -> tuple[int, int, int]:
        """Normalise a position whose row may be past its row group's end (to the next row group or pass)."""
        spec = self.spec
        if row < int(spec.index.num_rows[group]):
            return pass_index, slot, row
        slots_per_pass = len(range(self.stream, len(spec.index), spec.num_streams))
        if slot + 1 < slots_per_pass:
            return pass_index, slot + 1, 0
        return pass_index + 1, 0, 0

    def _iter_concat(self, chunks: Iterator[_Chunk], state: dict[str, Any]) -> Iterator:
        spec = self.spec
        packer = ConcatPacker(spec.capacity)
        skip = state["offset"]
        while True:
            rows = packer.take(spec.microbatch_size)
            while rows is None:
                chunk = next(chunks)
                if len(chunk.doc_rows):  # a chunk of only empty texts adds nothing
                    starts = np.concatenate([[0], np.cumsum(chunk.lengths[:-1])])
                    packer.add(chunk.payload, starts, chunk, skip=skip)
                    skip = 0
                rows = packer.take(spec.microbatch_size)
            chunk, doc, offset = packer.position()
            state.update(self._position(chunk, doc, inside=offset > 0))
            state["offset"] = offset
            state["batches"] += 1
            state["emitted"] += rows.size
            yield rows, self._public(state)

    def _iter_bestfit(self, chunks: Iterator[_Chunk], state: dict[str, Any]) -> Iterator:
        spec = self.spec
        packer = BestFitPacker(spec.capacity, spec.buffer_size)
        packer.crops, packer.tokens_cropped = state["crops"], state["cropped"]
        if "buffer" in state and len(state["buffer"]):
            self._restore_bestfit(packer, np.asarray(state["buffer"], np.int64).reshape(-1, 5))
        packer.next_seq = state["next_seq"]
        current: list[Any] = [None, 0]  # the chunk being added to the buffer, and its next document

        # The current chunk's documents as plain Python lists (converted once per chunk, not per document).
        lists: list[Any] = [[], [], [], 0]  # payload, lengths, rows, group

        def refill() -> None:
            """Add the next document (one per call: the buffer then never depends on chunk sizes)."""
            chunk, doc = current
            if chunk is None or doc >= len(lists[1]):
                while chunk is None or doc >= len(chunk.doc_rows):
                    chunk, doc = next(chunks), 0
                lists[:] = chunk.payload, chunk.lengths.tolist(), chunk.doc_rows.tolist(), chunk.group
            packer.add(lists[0][doc], lists[1][doc], (lists[3], lists[2][doc]))
            current[0] = chunk
            current[1] = doc + 1

        while True:
            rows = packer.take(spec.microbatch_size, refill)
            if current[0] is not None:
                state.update(self._position(current[0], current[1]))
            state["batches"] += 1
            state["emitted"] += rows.size
            state["crops"], state["cropped"], state["next_seq"] = packer.crops, packer.tokens_cropped, packer.next_seq
            out = self._public(state)
            out["buffer"] = packer.snapshot()
            yield rows, out

    @staticmethod
    def _public(state: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in state.items() if not k.startswith("_") and k != "buffer"}


def estimate_pass(spec: StreamSpec, sample_groups: int = 8, sample_docs: int = 4096) -> tuple[float, float]:
    """Estimate ``(tokens, rows)`` of one pass over ``spec.index``, from a sample and the parquet footers.

    The sample is the first rows of up to ``sample_groups`` row groups spread evenly over the files (about
    ``sample_docs`` documents in all). Tokens per pass = the sample's tokens per row (BOS included, empty rows
    counted as rows) x the footers' row count. Rows: concat packs every token, so ``tokens / (seq_len + 1)``;
    best-fit drops cropped remainders, so its rows are scaled by a yield measured by running the real packer
    over the sample's document lengths (cycled and shuffled with a fixed seed). Deterministic, so every rank
    computes the same value.
    """
    index, tok = spec.index, load_tokenizer(spec.tokenizer_json)
    groups = np.unique(np.linspace(0, len(index) - 1, min(len(index), sample_groups)).astype(np.int64))
    per_group = max(1, sample_docs // len(groups))
    raw, lengths = 0, []
    for group in groups:
        texts = index.read_texts(int(group))[:per_group]
        raw += len(texts)
        kept = [t for t in texts if t]
        lengths.extend(len(e) + 1 for e in encode_documents(tok, kept))
    tokens = sum(lengths) / max(1, raw) * index.total_rows
    if not lengths:
        return 0.0, 0.0
    if spec.packing == "concat":
        return tokens, tokens / spec.capacity
    return tokens, tokens * _bestfit_yield(lengths, spec.capacity, spec.buffer_size) / spec.capacity


def _bestfit_yield(lengths: list[int], capacity: int, buffer_size: int) -> float:
    rng = np.random.default_rng(0)
    feed = int(min(50_000, max(3 * len(lengths), 4 * buffer_size)))
    order = rng.choice(np.asarray(lengths), size=feed)
    packer = BestFitPacker(capacity, buffer_size)
    fed = iter(order.tolist())
    zeros = np.zeros(capacity, np.int32)

    class _Exhausted(Exception):
        pass

    def refill() -> None:
        for length in fed:
            packer.add(zeros[: min(length, capacity)], length, (0, 0))
            return
        raise _Exhausted

    try:
        while True:
            packer.take(1, refill)
    except _Exhausted:
        pass
    consumed = int(order.sum()) - int(packer.snapshot()[:, 1].sum())
    return packer.tokens_emitted / consumed if consumed > 0 else 1.0
