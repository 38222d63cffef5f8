"""stepguard.coordination against itself and against torchft (the real peer)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torchft._torchft as torchft_c  # the real peer, pinned in the test extras

from stepguard.coordination import LighthouseClient, LighthouseServer


@pytest.fixture
def lighthouse():
    server = LighthouseServer("127.0.0.1:0", min_replicas=1)
    try:
        yield server
    finally:
        server.shutdown()


def _local(server) -> str:
    return f"http://127.0.0.1:{server.port()}"


def test_own_client_round_trip(lighthouse) -> None:
    client = LighthouseClient(_local(lighthouse), timedelta(seconds=10))
    client.heartbeat("a")
    q1 = client.quorum("a", timedelta(seconds=10), address="m", step=3, data={"k": [1]})
    assert [m.replica_id for m in q1.participants] == ["a"]
    assert q1.participants[0].data == {"k": [1]}
    assert q1.participants[0].step == 3
    q2 = client.quorum("a", timedelta(seconds=10), step=4)
    assert q2.quorum_id == q1.quorum_id  # same membership, same id
    assert q2.created.seconds >= q1.created.seconds
    with pytest.raises(TimeoutError):
        # "b" heartbeats via its quorum request, "a" does not request: split brain
        client.quorum("b", timedelta(milliseconds=300))
    client.close()


def test_torchft_client_against_stepguard_lighthouse(lighthouse) -> None:
    client = torchft_c.LighthouseClient(_local(lighthouse), timedelta(seconds=10))
    client.heartbeat("t")
    q = client.quorum("t", timedelta(seconds=10), address="x", step=9, data={"v": 2})
    assert q.participants[0].replica_id == "t"
    assert q.participants[0].step == 9
    assert q.participants[0].data == {"v": 2}
    with pytest.raises(TimeoutError):
        client.quorum("u", timedelta(milliseconds=300))


def test_stepguard_client_against_torchft_lighthouse() -> None:
    server = torchft_c.LighthouseServer("127.0.0.1:0", 1)
    try:
        port = server.address().rsplit(":", 1)[1]
        client = LighthouseClient(f"http://127.0.0.1:{port}", timedelta(seconds=10))
        client.heartbeat("z")
        q = client.quorum("z", timedelta(seconds=10), step=7, data={"a": 1})
        assert q.quorum_id == 1
        assert q.participants[0].data == {"a": 1}
        with pytest.raises(TimeoutError):
            client.quorum("y", timedelta(milliseconds=300))
        client.close()
    finally:
        server.shutdown()


def test_connect_failure_is_runtime_error() -> None:
    server = LighthouseServer("127.0.0.1:0", min_replicas=1)
    port = server.port()
    server.shutdown()
    with pytest.raises(RuntimeError, match="failed to connect"):
        LighthouseClient(f"http://127.0.0.1:{port}", timedelta(milliseconds=300))
