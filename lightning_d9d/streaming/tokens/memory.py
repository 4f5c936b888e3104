"""Memory: the one setting that bounds how much text the streaming path holds at once, and the caps derived from it.

``TEXT_CALL_CHARS`` is the characters one worker's tokenizer call holds; every other cap on text in memory is a
fixed multiple of it (``WORKER_CHUNK_CHARS``, ``IN_PROCESS_CHUNK_CHARS``, ``LONG_DOCUMENT_CHARS``, the sample caps,
``DEFAULT_MAX_DOCUMENT_CHARS``), so one number trades memory against per-call overhead everywhere. Only
``DEFAULT_MAX_DOCUMENT_CHARS`` (documents longer are skipped unless ``max_document_chars`` says otherwise) changes
rows; the others move memory and speed only.
"""

from __future__ import annotations

TEXT_CALL_CHARS = 1 << 18
WORKER_CHUNK_CHARS = TEXT_CALL_CHARS  # larger buys no speed on one core and makes a worker's rows come in bursts
IN_PROCESS_CHUNK_CHARS = 16 * TEXT_CALL_CHARS  # the training process tokenizes on every core
LONG_DOCUMENT_CHARS = 4 * TEXT_CALL_CHARS  # longer: tokenized in pieces, so Encodings never scale with a document
SAMPLE_DOCUMENT_CHARS = TEXT_CALL_CHARS
SAMPLE_CHARS = 32 * TEXT_CALL_CHARS
DEFAULT_MAX_DOCUMENT_CHARS = 256 * TEXT_CALL_CHARS  # far beyond natural documents, yet fits in memory while packed
