"""How the durable stores (SQLite, Redis) encode a history's token ids: little-endian int32."""

from __future__ import annotations

import sys
from array import array


def ids_to_bytes(token_ids: array[int]) -> bytes:
    """Token ids as little-endian int32."""
    if token_ids.itemsize != 4:
        token_ids = array("i", token_ids)
    if sys.byteorder == "big":
        token_ids = array("i", token_ids)
        token_ids.byteswap()
    return token_ids.tobytes()


def ids_from_bytes(data: bytes) -> array[int]:
    """The token ids `ids_to_bytes` wrote."""
    ids = array("i")
    ids.frombytes(data)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids
