"""Host batches to sharded device arrays on a background thread, so transfers overlap compute.

Each queued batch carries the host iterator's state *after* producing it; `state()` returns
the state matching the last batch handed to the loop, which is what a checkpoint must record
so that a resumed run continues with the next unseen batch (prefetched-but-unused batches are
not skipped)."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.sharding import NamedSharding

_DONE = object()


class Prefetcher:
    def __init__(
        self,
        host_iter: Iterator[Any],
        sharding: NamedSharding,
        state_fn: Callable[[], Any],
        size: int = 2,
    ):
        self._it = host_iter
        self._sharding = sharding
        self._state_fn = state_fn
        self._q: queue.Queue = queue.Queue(maxsize=size)
        self._last_state = state_fn()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, daemon=True, name="pdctl-prefetch")
        self._thread.start()

    def _work(self) -> None:
        try:
            while not self._stop.is_set():
                batch = next(self._it)
                st = self._state_fn()
                dev = jax.tree.map(
                    lambda x: jax.make_array_from_process_local_data(self._sharding, x), batch
                )
                self._q.put((dev, st))
        except StopIteration:
            self._q.put((_DONE, None))
        except BaseException as e:  # surfaced to the loop on the next get
            self._q.put((e, None))

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        item, st = self._q.get()
        if item is _DONE:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        self._last_state = st
        return item

    def state(self) -> Any:
        return self._last_state

    def close(self) -> None:
        self._stop.set()
        while self._thread.is_alive():
            with contextlib.suppress(queue.Empty):
                self._q.get(timeout=0.05)
