"""Threads for a batch's tokenizer calls: the Rust tokenizer releases the GIL, so one part of a batch is tokenized
on a thread while the main thread renders the next (``conversations.encode_rows``, ``chat_pairs``)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

TOKENIZE_PARTS, TOKENIZE_MIN_PART, TOKENIZE_IN_FLIGHT = 8, 16, 2
"""A batch is tokenized in up to 8 parts of at least 16 conversations, 2 parts at a time."""


def tokenizing_threads(thread_safe: bool = True) -> ThreadPoolExecutor | _Inline:
    """Threads for one batch's tokenizer calls, used as ``with tokenizing_threads() as threads:``. They end with
    the batch: none outlives it, so a later fork (loader workers, ``num_proc``) never copies a process whose threads
    are running (Python 3.12 warns of it), and starting two threads is nothing beside a batch's tokenizing.

    Args:
        thread_safe: the calls go to a Rust tokenizer itself (safe from several threads); else (a tokenizer's
            ``__call__``, which sets its backend's padding and truncation on every call) each runs at once, in
            the calling thread.
    """
    return ThreadPoolExecutor(TOKENIZE_IN_FLIGHT, thread_name_prefix="seqmem-tokenize") if thread_safe else _Inline()


class _Inline:
    """An executor that runs each call when it is submitted, in the caller's thread."""

    def __enter__(self) -> _Inline:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as error:  # noqa: BLE001 (given back by result(), as a thread's would be)
            future.set_exception(error)
        return future
