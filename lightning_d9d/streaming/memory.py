"""Memory: the one setting that bounds how much text the streaming path holds at once, and the caps derived from it.

``TEXT_CALL_CHARS`` is the unit: the characters of text one worker's tokenizer call holds. Every other cap on text
in memory is a fixed multiple of it, so one number trades memory against per-call overhead everywhere at once:

* ``WORKER_CHUNK_CHARS`` (1×): a DataLoader worker's tokenizer call. A bigger call buys no speed on one core
  and makes a worker's rows come in bursts.
* ``IN_PROCESS_CHUNK_CHARS`` (16×): a call in the training process, which tokenizes on every core.
* ``LONG_DOCUMENT_CHARS`` (4×): a longer document is tokenized in pieces of about this size, so the Encodings in
  flight are bounded by this, not by the corpus's longest document (only its int32 ids are kept whole).
* ``SAMPLE_DOCUMENT_CHARS`` (1×) and ``SAMPLE_CHARS`` (32×): the epoch estimate tokenizes each sampled document
  up to the first and about the second in all (a corpus of books costs a second or two at setup).
* ``DEFAULT_MAX_DOCUMENT_CHARS`` (256×): documents longer than this are skipped by default (64 Mi characters is
  far beyond natural documents, yet fits in memory at about 10 bytes a character while read, tokenized in
  pieces and packed); ``max_document_chars`` overrides it, and it is the only one of these that changes rows.

Trade-off: the multiples are fixed rather than each tuned alone; none but the last changes a row, so changing
``TEXT_CALL_CHARS`` moves memory and speed only.
"""

from __future__ import annotations

TEXT_CALL_CHARS = 1 << 18
WORKER_CHUNK_CHARS = TEXT_CALL_CHARS
IN_PROCESS_CHUNK_CHARS = 16 * TEXT_CALL_CHARS
LONG_DOCUMENT_CHARS = 4 * TEXT_CALL_CHARS
SAMPLE_DOCUMENT_CHARS = TEXT_CALL_CHARS
SAMPLE_CHARS = 32 * TEXT_CALL_CHARS
DEFAULT_MAX_DOCUMENT_CHARS = 256 * TEXT_CALL_CHARS
