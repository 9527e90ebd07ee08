"""Leases for the stores several processes share (sqlite_store.py, redis_store.py).

A continuing call takes its session's lease in the store at `start()`; while the call runs a task renews it
every third of `lease_s`; the commit frees it in the same store operation that writes the turn (and checks
that it still holds it), and `release()` frees it for a call that ends otherwise. A holder that dies stops
renewing, so its session is free again within `lease_s`.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import uuid
from collections.abc import Awaitable
from typing import TypeVar

from llmserve.history.config import HistoryConfig
from llmserve.history.errors import StoreUnavailable
from llmserve.history.records import Turn
from llmserve.history.store import HistoryStore, log

T = TypeVar("T")


class LeasedStore(HistoryStore):
    """A store shared by processes: continuing calls take an expiring lease, renewed while they run."""

    def __init__(self, config: HistoryConfig) -> None:
        super().__init__(config)
        self._cleanups: set[asyncio.Future[None]] = set()

    @abc.abstractmethod
    async def _renew(self, key: str, token: str) -> bool:
        """Extend the lease by lease_s if `token` still holds it; whether it does."""

    @abc.abstractmethod
    async def _release_lease(self, key: str, token: str) -> None:
        """Free the lease if `token` still holds it."""

    @staticmethod
    def new_token() -> str:
        return uuid.uuid4().hex

    async def leased(self, pending: Awaitable[T], key: str, token: str) -> T:
        """Await the store call that may take `token`'s lease. A caller cancelled meanwhile (its client went
        away) leaves the call to land, then frees the lease: it never blocks the session for lease_s."""
        task = asyncio.ensure_future(pending)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(lambda done: self._free_after(done, key, token))
            raise

    def _free_after(self, done: asyncio.Future[T], key: str, token: str) -> None:
        if done.cancelled() or done.exception() is not None:
            return
        cleanup = asyncio.ensure_future(self._free_quietly(key, token))
        self._cleanups.add(cleanup)
        cleanup.add_done_callback(self._cleanups.discard)

    async def _free_quietly(self, key: str, token: str) -> None:
        with contextlib.suppress(StoreUnavailable):
            await self._release_lease(key, token)

    def hold(self, turn: Turn) -> None:
        """Renew the turn's lease in the background until it commits or is released."""
        if turn.lease is not None:
            turn.renewal = asyncio.get_running_loop().create_task(self._keep(turn.key, turn.lease))

    async def _keep(self, key: str, token: str) -> None:
        every = self.config.lease_s / 3
        while True:
            await asyncio.sleep(every)
            try:
                with self.timed("renew"):
                    held = await self._renew(key, token)
            except StoreUnavailable as exc:
                log.warning("%s; the lease of session %r may lapse", exc, key)
                continue
            if not held:
                return  # lost: the commit will say so

    def stop_renewal(self, turn: Turn) -> None:
        if turn.renewal is not None:
            turn.renewal.cancel()
            turn.renewal = None

    async def release(self, turn: Turn) -> None:
        self.stop_renewal(turn)
        token, turn.lease = turn.lease, None
        if token is None:
            return
        try:
            with self.timed("release"):
                await self._release_lease(turn.key, token)
        except StoreUnavailable as exc:
            log.warning("%s; the lease of session %r lapses after %g s", exc, turn.key, self.config.lease_s)
