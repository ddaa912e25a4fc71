"""Dynamic batching that forms each batch when the scorer is free: whatever requests queued while the
previous batch ran go together into the next one.

Ray Serve's ``@serve.batch`` closes a batch ``batch_wait_timeout_s`` after its first request and queues
it behind the running one (``_process_batches`` in Ray 2.60), whether or not the scorer is busy. When a
batch's cost is mostly fixed -- here the feature path's SQL, ~70 ms whether a batch holds 1 request or
16 -- requests that arrive during a running batch then form many batches of one or two, each paying
that fixed cost in turn: measured on the demo model, batched served 1.0-1.4x the requests/s of
one-at-a-time (docs/serving.md). Here a batch is cut only when the scorer takes it: the requests
queued by then (up to ``max_batch_size``), and, when fewer than that are waiting, those arriving
within ``wait_s`` of the first. An idle replica therefore still answers a lone request after at most
``wait_s``, and a busy one scores everything that waited, in one pass.

The queue holds what the replica admitted: Ray Serve bounds that (``max_ongoing_requests``) and
answers 503 beyond its own queue (``max_queued_requests``), so nothing here grows without bound.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple


class DynamicBatcher:
    """``await batcher.submit(item)`` -> ``score([..., item, ...])``'s result for ``item``; ``score``
    (a list of items -> a list of results, in order) runs in a worker thread, one batch at a time."""

    def __init__(self, score: Callable[[List[Any]], Sequence[Any]], max_batch_size: int, wait_s: float):
        self.score, self.max_batch_size, self.wait_s = score, max(1, max_batch_size), max(0.0, wait_s)
        self.queue: Optional[asyncio.Queue] = None
        self.worker: Optional[asyncio.Task] = None
        self.batches: List[Tuple[int, float]] = []  # the last batches' (size, seconds): what the replica reports

    async def submit(self, item: Any) -> Any:
        if self.worker is None:  # on the event loop the requests arrive on
            self.queue = asyncio.Queue()
            self.worker = asyncio.get_running_loop().create_task(self._work())
        future = asyncio.get_running_loop().create_future()
        self.queue.put_nowait((item, future))
        return await future

    def stats(self) -> dict:
        """The last batches' mean size and mean seconds (GET /version reports them)."""
        n = len(self.batches)
        return {
            "batches": n,
            "mean_batch": sum(b for b, _ in self.batches) / n if n else 0.0,
            "mean_batch_ms": 1000 * sum(s for _, s in self.batches) / n if n else 0.0,
        }

    async def _next_batch(self) -> List[Tuple[Any, asyncio.Future]]:
        batch = [await self.queue.get()]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        while len(batch) < self.max_batch_size:
            if not self.queue.empty():  # queued while the previous batch ran: no wait
                batch.append(self.queue.get_nowait())
                continue
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self.queue.get(), left))
            except asyncio.TimeoutError:
                break
        return batch

    async def _work(self) -> None:
        while True:
            batch = await self._next_batch()
            live = [(item, future) for item, future in batch if not future.done()]  # a client gone: skipped
            if not live:
                continue
            started = time.perf_counter()
            try:
                # In a thread: the event loop goes on admitting requests into the next batch.
                results = await asyncio.to_thread(self.score, [item for item, _ in live])
            except Exception as e:  # the whole batch failed: each caller gets the error
                for _, future in live:
                    if not future.done():
                        future.set_exception(e)
                continue
            finally:
                self.batches = (self.batches + [(len(live), time.perf_counter() - started)])[-1000:]
            for (_, future), result in zip(live, results):
                if not future.done():
                    future.set_result(result)
