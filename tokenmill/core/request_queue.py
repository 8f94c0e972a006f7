"""Waiting queues of the scheduler: FCFS (deque) and priority (heap).

Both expose the same small interface: `add`, `prepend` (a preempted request
goes back in front), `peek`, `pop`, `remove`, `len`, iteration in
scheduling order.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from tokenmill.core.request import Request


class FCFSRequestQueue:
    """Arrival order; preempted requests are put back at the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        """The next request to schedule. Raises IndexError if empty."""
        return self._queue[0]

    def pop(self) -> Request:
        """Remove and return the next request. Raises IndexError if empty."""
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        """Remove `request` (O(n); aborts only). Raises ValueError if absent."""
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue:
    """Smallest `(priority, arrival_time, request_id)` first (`Request.__lt__`).

    A preempted request re-enters by the same key, so `prepend` is `add`.
    """

    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    def prepend(self, request: Request) -> None:
        self.add(request)

    def peek(self) -> Request:
        """The next request to schedule. Raises IndexError if empty."""
        return self._heap[0]

    def pop(self) -> Request:
        """Remove and return the next request. Raises IndexError if empty."""
        return heapq.heappop(self._heap)

    def remove(self, request: Request) -> None:
        """Remove `request` (O(n); aborts only). Raises ValueError if absent."""
        self._heap.remove(request)
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._heap))


def create_request_queue(policy: str) -> FCFSRequestQueue | PriorityRequestQueue:
    """The waiting queue for a scheduling policy.

    Raises:
        ValueError: if `policy` is neither "fcfs" nor "priority".
    """
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"Unknown scheduling policy {policy!r}; use 'fcfs' or 'priority'.")
