"""Typed control-plane records and the fan-out's typed failure."""

from __future__ import annotations

import pickle

import pytest

from rollfleet.errors import FleetOperationFailed, NotSupported
from rollfleet.health import HealthState
from rollfleet.manager.fanout import ControlFanOut
from rollfleet.records import FleetEvent, FleetStatus, ReplicaInfo, ReplicaStatus

pytestmark = pytest.mark.unit


def test_records_serialise_without_handles_and_with_plain_states():
    handle = object()  # a Ray handle must never reach JSON
    info = ReplicaInfo(
        replica_id="r0",
        state=HealthState.HEALTHY,
        address="http://10.0.0.1:8000",
        handle=handle,
        node_id="n1",
        devices=["0", "1"],
    )
    status = FleetStatus(
        current_version=3,
        membership_epoch=7,
        replicas={"r0": ReplicaStatus(**info.model_dump(), inflight=2, detail="probe ok")},
        events=[FleetEvent(t=1.0, replica_id="r0", from_state=HealthState.SYNCING, to=HealthState.HEALTHY)],
    )
    body = status.to_json()
    assert "handle" not in body["replicas"]["r0"] and body["replicas"]["r0"]["state"] == "healthy"
    assert body["events"][0]["from"] == "syncing" and body["events"][0]["to"] == "healthy"
    assert info.handle is handle and status.replicas["r0"].devices == ["0", "1"]
    with pytest.raises(AttributeError):
        info.no_such_field  # noqa: B018  - a typo fails where it is made
    with pytest.raises(Exception):
        ReplicaInfo(replica_id="r1", state="resting")  # not a health state


def test_a_failed_fan_out_names_every_failed_replica_and_not_supported_passes_through():
    results = {"r0": None, "r1": RuntimeError("boom"), "r2": TimeoutError()}
    with pytest.raises(FleetOperationFailed) as err:
        ControlFanOut._raise_first(results, "pause")
    assert err.value.op == "pause" and sorted(err.value.failures) == ["r1", "r2"]
    assert "boom" in err.value.failures["r1"]
    again = pickle.loads(pickle.dumps(err.value))  # crosses Ray boundaries intact
    assert again.failures == err.value.failures and again.op == "pause"
    with pytest.raises(NotSupported):
        ControlFanOut._raise_first({"r0": NotSupported("vllm", "sleep"), "r1": RuntimeError()}, "sleep")
    ControlFanOut._raise_first({"r0": 1, "r1": None}, "resume")  # no failure: nothing raised
