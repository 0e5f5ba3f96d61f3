"""Typed control-plane records and the fan-out's typed failure."""

from __future__ import annotations

import pickle

import pytest

from rollfleet.errors import FleetOperationFailed, NotSupported
from rollfleet.health import HealthState, ReplicaRecord
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


class _Fenced(ControlFanOut):
    """Just the fan-out's bookkeeping: which replicas it fenced, and why."""

    def __init__(self, ids: list[str]) -> None:
        self._records = {rid: ReplicaRecord(replica_id=rid, handle=None, state=HealthState.HEALTHY) for rid in ids}
        self.fenced: dict[str, str] = {}

    def _fail(self, record: ReplicaRecord, detail: str) -> None:
        self.fenced[record.replica_id] = detail


def test_a_fan_out_fences_the_failed_replicas_and_fails_only_when_none_succeeded():
    fan = _Fenced(["r0", "r1", "r2"])
    report = fan._settle({"r0": None, "r1": RuntimeError("boom"), "r2": TimeoutError()}, "pause")
    assert report["ok"] == ["r0"] and sorted(report["fenced"]) == ["r1", "r2"]
    assert "boom" in fan.fenced["r1"] and fan.fenced["r1"].startswith("pause failed")
    with pytest.raises(FleetOperationFailed) as err:
        _Fenced(["r1", "r2"])._settle({"r1": RuntimeError("boom"), "r2": TimeoutError()}, "pause")
    assert err.value.op == "pause" and sorted(err.value.failures) == ["r1", "r2"]
    again = pickle.loads(pickle.dumps(err.value))  # crosses Ray boundaries intact
    assert again.failures == err.value.failures and again.op == "pause"
    caller = _Fenced(["r0", "r1"])
    with pytest.raises(NotSupported):  # the caller's mistake: raised as is, nobody fenced
        caller._settle({"r0": NotSupported("vllm", "sleep"), "r1": RuntimeError()}, "sleep")
    assert caller.fenced == {}
    assert _Fenced(["r0", "r1"])._settle({"r0": 1, "r1": None}, "resume") == {"ok": ["r0", "r1"], "fenced": {}}
