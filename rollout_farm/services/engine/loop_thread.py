"""An event loop on a thread of its own, for an engine whose client lives on one loop (SGLang's tokenizer manager and
its zmq sockets; vLLM's HTTP client) while calls come from the replica's loop (agenerate) and from worker threads
(health checks, scoring, weight commits): the replica's loop awaits the futures of `submit`, holding no thread, and
a thread blocks on `run_until_complete`."""

from __future__ import annotations

import asyncio
import threading


class LoopThread:
    def __init__(self, name: str = "engine-loop"):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name=name, daemon=True).start()

    def submit(self, awaitable):
        async def run():
            return await awaitable

        return asyncio.run_coroutine_threadsafe(run(), self.loop)

    def run_until_complete(self, awaitable):
        return self.submit(awaitable).result()

    def call(self, fn, *args, **kwargs):
        self.loop.call_soon_threadsafe(lambda: fn(*args, **kwargs))
