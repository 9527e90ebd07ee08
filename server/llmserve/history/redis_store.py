"""The Redis history store (`--history-store redis://HOST:PORT/DB`): histories shared by every replica.

Every operation is one Lua script, so it is atomic across replicas: a commit writes the whole history, checks
the continuing call's lease and the session's deletion count, and enforces the limits in one step; a crash
of a replica never leaves half of it. Keys, under the prefix `llmserve:`:

    h:<session>   hash: the history (kind, turns, ids as int32 LE, messages as JSON); expires after the TTL
    t:<session>   hash: why the last history ended (`reason`) and the deletion count (`epoch`); kept a day
    l:<session>   the continuing call's lease ("<token> <request id>"), expiring after lease_s
    lru           sorted set: session -> last use (µs, the Redis server's clock): the LRU order and the TTL
    size, bytes   each history's footprint and their sum (the --session-history-mib cap)

Times are the Redis server's (TIME), so replicas with skewed clocks agree. A standalone Redis (or a
primary with replicas); not Redis Cluster, whose slots would split these keys.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from llmserve.history.codec import ids_from_bytes, ids_to_bytes
from llmserve.history.config import HistoryConfig
from llmserve.history.errors import HistoryBusy, LeaseLost, NoHistory, StoreUnavailable
from llmserve.history.lease import LeasedStore
from llmserve.history.reasons import reason_bytes, reason_count, reason_deleted, reason_ttl
from llmserve.history.records import Finished, History, HistoryInput, Turn, footprint

PREFIX = "llmserve:"
TOMBSTONE_S = 24 * 3600
# A Redis that does not answer within this long counts as lost (the call fails UNAVAILABLE).
SOCKET_TIMEOUT_S = 2.0

# Shared by every script: ARGV[1] the prefix, ARGV[2] the TTL (µs), ARGV[3] the TTL (ms), ARGV[4] the
# tombstone life (ms), ARGV[5] the TTL's NOT_FOUND reason. Each script first drops the histories idle past the
# TTL (their keys have expired or are about to), keeping why. Last use is kept in µs (exact in a Lua double),
# so that two scripts never tie in the LRU order.
_COMMON = """
local P, TTL, TTL_MS, TOMB, TTL_REASON = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local function tomb(member, reason)
  local tk = P .. 't:' .. member
  redis.call('HSET', tk, 'reason', reason)
  redis.call('PEXPIRE', tk, TOMB)
end
local function drop(member, reason)
  redis.call('DEL', P .. 'h:' .. member)
  redis.call('ZREM', P .. 'lru', member)
  local size = redis.call('HGET', P .. 'size', member)
  if size then
    redis.call('HDEL', P .. 'size', member)
    redis.call('DECRBY', P .. 'bytes', size)
  end
  if reason ~= '' then tomb(member, reason) end
end
for _, member in ipairs(redis.call('ZRANGEBYSCORE', P .. 'lru', '-inf', now - TTL)) do drop(member, TTL_REASON) end
local function epoch_of(member)
  return tonumber(redis.call('HGET', P .. 't:' .. member, 'epoch') or '0')
end
"""

# ARGV[6] session, [7] continues (0/1), [8] lease token, [9] request id, [10] lease (ms).
# -> {'ok', epoch} | {'ok', epoch, kind, turns, ids, msgs, used} | {'busy', holder} | {'missing', reason}
_START = (
    _COMMON
    + """
local key = ARGV[6]
local epoch = epoch_of(key)
if ARGV[7] == '0' then return {'ok', epoch} end
local lease = redis.call('GET', P .. 'l:' .. key)
if lease then return {'busy', string.sub(lease, string.find(lease, ' ', 1, true) + 1)} end
local h = P .. 'h:' .. key
if redis.call('EXISTS', h) == 0 then
  return {'missing', redis.call('HGET', P .. 't:' .. key, 'reason') or ''}
end
redis.call('SET', P .. 'l:' .. key, ARGV[8] .. ' ' .. ARGV[9], 'PX', tonumber(ARGV[10]))
redis.call('HSET', h, 'used', now)
redis.call('PEXPIRE', h, TTL_MS)
redis.call('ZADD', P .. 'lru', now, key)
local v = redis.call('HMGET', h, 'kind', 'turns', 'ids', 'msgs', 'used')
return {'ok', epoch, v[1], v[2], v[3], v[4], v[5]}
"""
)

# ARGV[6] session, [7] lease token ('' for a plain call), [8] epoch, [9] kind, [10] turns, [11] ids, [12] msgs,
# [13] footprint, [14] max sessions, [15] max bytes, [16] reason the turn ends the history ('' if held),
# [17] count reason, [18] bytes reason.  -> 'ok' | 'lost' | 'dropped' | 'ended'
_COMMIT = (
    _COMMON
    + """
local key = ARGV[6]
local token = ARGV[7]
if token ~= '' then
  local lk = P .. 'l:' .. key
  local lease = redis.call('GET', lk)
  if not lease or string.sub(lease, 1, #token + 1) ~= token .. ' ' then return 'lost' end
  redis.call('DEL', lk)
end
if epoch_of(key) ~= tonumber(ARGV[8]) then return 'dropped' end
drop(key, '')
if ARGV[16] ~= '' then
  tomb(key, ARGV[16])
  return 'ended'
end
local h = P .. 'h:' .. key
redis.call('HSET', h, 'kind', ARGV[9], 'turns', ARGV[10], 'ids', ARGV[11], 'msgs', ARGV[12], 'used', now)
redis.call('PEXPIRE', h, TTL_MS)
redis.call('ZADD', P .. 'lru', now, key)
redis.call('HSET', P .. 'size', key, ARGV[13])
redis.call('INCRBY', P .. 'bytes', ARGV[13])
redis.call('HDEL', P .. 't:' .. key, 'reason')
local max_sessions, max_bytes = tonumber(ARGV[14]), tonumber(ARGV[15])
while true do
  local count = redis.call('ZCARD', P .. 'lru')
  local over_count = count > max_sessions
  if not over_count and tonumber(redis.call('GET', P .. 'bytes') or '0') <= max_bytes then break end
  local oldest = redis.call('ZRANGE', P .. 'lru', 0, 1)
  local victim = oldest[1]
  if victim == key and count > 1 then victim = oldest[2] end
  drop(victim, over_count and ARGV[17] or ARGV[18])
end
return 'ok'
"""
)

# ARGV[6] session, [7] reason. -> 1 if a history was held
_DELETE = (
    _COMMON
    + """
local key = ARGV[6]
local existed = redis.call('EXISTS', P .. 'h:' .. key)
drop(key, ARGV[7])
redis.call('HINCRBY', P .. 't:' .. key, 'epoch', 1)
redis.call('PEXPIRE', P .. 't:' .. key, TOMB)
return existed
"""
)

# ARGV[6] session. -> {} | {kind, turns, ids, msgs, used}
_GET = (
    _COMMON
    + """
local h = P .. 'h:' .. ARGV[6]
if redis.call('EXISTS', h) == 0 then return {} end
return redis.call('HMGET', h, 'kind', 'turns', 'ids', 'msgs', 'used')
"""
)

# KEYS[1] the lease, ARGV[1] token, ARGV[2] lease (ms, 0: release). -> 1 if the token held it
_LEASE = """
local lease = redis.call('GET', KEYS[1])
if not lease or string.sub(lease, 1, #ARGV[1] + 1) ~= ARGV[1] .. ' ' then return 0 end
if ARGV[2] == '0' then redis.call('DEL', KEYS[1]) else redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2])) end
return 1
"""


def public_url(url: str) -> str:
    """The URL without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


class RedisHistoryStore(LeasedStore):
    """Histories in a Redis server shared by the replicas, through redis.asyncio (the loop never blocks)."""

    kind = "redis"

    def __init__(self, config: HistoryConfig, url: str) -> None:
        super().__init__(config)
        self.name = public_url(url)
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=SOCKET_TIMEOUT_S, decode_responses=False
        )
        self._scripts = {
            name: self._redis.register_script(text)
            for name, text in (("start", _START), ("commit", _COMMIT), ("delete", _DELETE), ("get", _GET))
        }
        self._lease = self._redis.register_script(_LEASE)

    async def connect(self) -> None:
        await self._call("connect", self._redis.ping())

    async def close(self) -> None:
        await self._redis.aclose()

    async def get(self, key: str) -> History | None:
        values = await self._run("get", key)
        return self._history(values) if values else None

    async def start(self, key: str, request_id: str, *, continues: bool) -> Turn:
        token = self.new_token() if continues else ""
        ms = int(self.config.lease_s * 1000)
        pending = self._run("start", key, int(continues), token, request_id, ms)
        reply = await (self.leased(pending, key, token) if continues else pending)
        status = reply[0].decode()
        if status == "busy":
            raise HistoryBusy(key, reply[1].decode(errors="replace"))
        if status == "missing":
            raise NoHistory(key, reply[1].decode() or None)
        if not continues:
            return Turn(self, key, request_id, None, epoch=int(reply[1]))
        turn = Turn(self, key, request_id, self._history(reply[2:]), epoch=int(reply[1]), lease=token)
        self.hold(turn)
        return turn

    async def commit(self, turn: Turn) -> None:
        self.stop_renewal(turn)
        token = turn.lease
        done: Finished = turn.finished()
        cfg = self.config
        reply = await self._run(
            "commit",
            turn.key,
            token or "",
            turn.epoch,
            done.kind.value,
            done.turns,
            ids_to_bytes(done.token_ids),
            json.dumps(done.messages, ensure_ascii=False),
            footprint(done.token_ids, done.messages),
            cfg.max_sessions,
            cfg.max_bytes,
            done.end_reason or "",
            reason_count(cfg.max_sessions),
            reason_bytes(cfg.max_bytes),
        )
        turn.lease = None  # freed by the commit; a failed commit leaves it to release()
        if reply == b"lost":
            raise LeaseLost(turn.key)

    async def delete(self, key: str) -> bool:
        return bool(await self._run("delete", key, reason_deleted()))

    async def _renew(self, key: str, token: str) -> bool:
        ms = int(self.config.lease_s * 1000)
        return bool(await self._call("renew", self._lease(keys=[f"{PREFIX}l:{key}"], args=[token, ms])))

    async def _release_lease(self, key: str, token: str) -> None:
        await self._call("release", self._lease(keys=[f"{PREFIX}l:{key}"], args=[token, 0]))

    # -- helpers -----------------------------------------------------------------------------------------

    async def _run(self, op: str, key: str, *args: Any) -> Any:
        cfg = self.config
        ttl = [int(cfg.ttl_s * 1_000_000), int(cfg.ttl_s * 1000)]
        common: list[Any] = [PREFIX, *ttl, TOMBSTONE_S * 1000, reason_ttl(cfg.ttl_s), key]
        return await self._call(op, self._scripts[op](keys=[], args=[*common, *args]))

    async def _call(self, op: str, pending: Any) -> Any:
        with self.timed(op):
            try:
                return await pending
            except RedisError as exc:
                raise StoreUnavailable(self.name, f"{type(exc).__name__}: {exc}") from None
            except OSError as exc:
                raise StoreUnavailable(self.name, str(exc)) from None

    def _history(self, values: list[Any]) -> History:
        kind, turns, ids, msgs, used = values
        messages = tuple((r, c) for r, c in json.loads(msgs)) if msgs else ()
        wall = int(used) / 1_000_000
        return History(HistoryInput(kind.decode()), ids_from_bytes(ids), messages, int(turns), wall, wall)
