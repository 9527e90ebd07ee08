"""api/admission.py on its own: which streams may start (draining, the server's and each identity's caps, duplicate
request ids, with a short wait for a cancelled stream's id), and the one scoping rule for caller-named ids. Through a
server: tests/service/test_service_errors.py (caps and duplicates), test_identity_scoping.py."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmserve.api.admission import REUSE_WAIT_S, Admission, scoped
from llmserve.api.errors import RETRY_DELAY_S, ServiceError


async def refused(admission: Admission, identity: str | None, request_id: str) -> ServiceError:
    with pytest.raises(ServiceError) as err:
        await admission.admit(identity, request_id)
    return err.value


async def test_a_request_id_in_flight_waits_for_its_stream_to_end_before_it_is_a_duplicate() -> None:
    """An id whose stream ends within the wait is admitted; one that stays is not."""
    admission = Admission(max_streams=8, max_per_identity=None)
    first = await admission.admit(None, "x")
    ended = admission.ended(first)
    asyncio.get_running_loop().call_later(0.05, admission.release, first)  # the cancelled stream's handler ends
    second = await admission.admit(None, "x")
    assert ended.is_set() and admission.ended(second) is not ended
    started = time.monotonic()
    err = await refused(admission, None, "x")  # the second stream goes on
    assert err.code == grpc.StatusCode.ALREADY_EXISTS and err.message == "request_id 'x' is already in flight"
    assert time.monotonic() - started >= REUSE_WAIT_S * 0.9


async def test_the_same_id_under_two_identities_is_two_streams() -> None:
    admission = Admission(max_streams=8, max_per_identity=None)
    await admission.admit("alice", "x")
    await admission.admit("bob", "x")
    assert len(admission) == 2


async def test_the_servers_cap_is_resource_exhausted_with_a_retry_delay_and_frees_as_streams_end() -> None:
    admission = Admission(max_streams=2, max_per_identity=None)
    keys = [await admission.admit(None, f"r{i}") for i in range(2)]
    err = await refused(admission, None, "r2")
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.retry_after_s == RETRY_DELAY_S
    assert "--max-concurrent-streams" in err.message
    admission.release(keys[0])
    await admission.admit(None, "r2")


async def test_one_identity_at_its_cap_leaves_room_for_another() -> None:
    admission = Admission(max_streams=8, max_per_identity=1)
    alice = await admission.admit("alice", "a")
    err = await refused(admission, "alice", "b")
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-streams-per-identity" in err.message
    assert err.retry_after_s == RETRY_DELAY_S
    await admission.admit("bob", "a")
    admission.release(alice)
    await admission.admit("alice", "b")


async def test_draining_refuses_new_streams_and_idle_is_when_the_last_one_ends() -> None:
    admission = Admission(max_streams=8, max_per_identity=None)
    await asyncio.wait_for(admission.wait_idle(), 1)
    key = await admission.admit(None, "r")
    admission.draining = True
    err = await refused(admission, None, "s")
    assert (err.code, err.message) == (grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
    idle = asyncio.ensure_future(admission.wait_idle())
    await asyncio.sleep(0.01)
    assert not idle.done()
    admission.release(key)
    await asyncio.wait_for(idle, 1)
    assert len(admission) == 0


def test_ids_are_scoped_to_their_identity_and_the_scoping_is_injective() -> None:
    assert scoped(None, "s1") == "s1"  # authentication off: the caller's name itself
    assert scoped("alice", "s1") != scoped("bob", "s1")
    # A name that contains what another identity's prefix would look like cannot collide with it.
    assert scoped("a/b", "c") != scoped("a", "b/c")


NAMES = st.text(alphabet="a1:/", max_size=6)


@given(NAMES, NAMES, st.data())
def test_two_identities_names_never_scope_to_the_same_key(identity: str, name: str, data: st.DataObject) -> None:
    """Another split of the same characters into identity and name (the likeliest collision) is another key."""
    joined = f"{identity}/{name}"
    cut = data.draw(st.integers(0, len(joined) - 1))
    other = (joined[:cut], joined[cut + 1 :])
    assert (scoped(identity, name) == scoped(*other)) == ((identity, name) == other)


async def test_a_pooling_call_counts_its_inputs_whole_and_takes_no_stream_slot() -> None:
    admission = Admission(max_streams=2, max_per_identity=None, max_pooling_inputs=100, max_call_inputs=64)
    big = await admission.admit_pooling(None, "e1", 64)
    err = await refused_pooling(admission, None, "e2", 40)  # 64 + 40 > 100: refused whole, not 36 of them
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.retry_after_s == RETRY_DELAY_S
    assert "--max-pooling-inputs" in err.message and admission.inputs_in_flight == 64
    await admission.admit_pooling(None, "e3", 36)
    streams = [await admission.admit(None, f"g{i}") for i in range(2)]  # Generate keeps both its slots
    assert len(admission) == 4
    admission.release(big)
    await admission.admit_pooling(None, "e2", 40)
    admission.release(streams[0])
    assert admission.inputs_in_flight == 76


async def test_the_pooling_caps_hold_one_whole_call_at_least_and_share_by_identity() -> None:
    assert Admission(4, None, max_pooling_inputs=10, max_call_inputs=256).max_inputs == 256
    admission = Admission(max_streams=8, max_per_identity=2, max_pooling_inputs=400, max_call_inputs=32)
    assert admission.max_inputs_per_identity == 100  # 2/8 of the inputs, as of the streams
    await admission.admit_pooling("alice", "a", 80)
    err = await refused_pooling(admission, "alice", "b", 32)
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-streams-per-identity" in err.message
    await admission.admit_pooling("bob", "b", 32)
    assert Admission(8, 1, max_pooling_inputs=64, max_call_inputs=32).max_inputs_per_identity == 32


async def refused_pooling(admission: Admission, identity: str | None, request_id: str, inputs: int) -> ServiceError:
    with pytest.raises(ServiceError) as err:
        await admission.admit_pooling(identity, request_id, inputs)
    return err.value
