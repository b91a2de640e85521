"""Continuous batching: which requests run in the next step.

Requests wait in a bounded queue, join the running batch whenever a slot is free (at any step: their
prompts are prefilled, then they decode with the others) and leave as soon as they end (EOS, stop string,
max tokens, a full context, or cancellation), freeing their slot for the next one. numpy only, no engine
calls: `clover.runtime.engine` runs the steps this module plans.
"""

from __future__ import annotations

import collections
import threading

from clover.errors import CloverError
from clover.runtime.requests import Request


class QueueFull(CloverError):
    """The waiting queue is full: retry later (a server answers 429 / 503 with Retry-After)."""


class Cancelled(CloverError):
    """The request was cancelled before it finished."""


class EngineUnavailable(CloverError):
    """The engine takes no more requests: it was closed, or its loop stopped on an error (a server answers 503)."""


class Scheduler:
    """The waiting queue (bounded) and the running batch (at most `max_batch`). Thread-safe: callers submit
    from any thread; the engine's loop thread plans and retires."""

    def __init__(self, max_batch: int, max_waiting: int) -> None:
        self.max_batch, self.max_waiting = max_batch, max_waiting
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.lock = threading.Condition()
        self.refusing: EngineUnavailable | None = None  # set once the engine closes or dies: every submit raises it

    def submit(self, request: Request) -> None:
        with self.lock:
            if self.refusing is not None:
                raise self.refusing
            if len(self.waiting) >= self.max_waiting:
                raise QueueFull(
                    f"the engine's queue is full ({self.max_waiting} requests waiting, {len(self.running)} "
                    "running): retry later, or raise max_waiting / max_batch"
                )
            self.waiting.append(request)
            self.lock.notify_all()

    def admit(self) -> list[Request]:
        """Move waiting requests into the batch while there is room (first come, first served); cancelled
        ones are dropped here."""
        with self.lock:
            joined = []
            while self.waiting and len(self.running) < self.max_batch:
                r = self.waiting.popleft()
                if r.cancelled.is_set():
                    r.deliver(Cancelled("the request was cancelled"))
                    continue
                self.running.append(r)
                joined.append(r)
            return joined

    def retire(self, request: Request) -> None:
        with self.lock:
            self.running.remove(request)
            self.lock.notify_all()

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running


def kv_plan(max_batch: int, context: int, bytes_per_token: int) -> str:
    """One line: the KV memory the engine may use at most (every slot at full context)."""
    total = max_batch * context * bytes_per_token
    return (
        f"KV cache plan: up to {max_batch} sequences x {context} tokens x {bytes_per_token / 1024:.1f} KiB/token "
        f"= {total / 2**20:.0f} MiB at most (allocated as sequences grow)"
    )
