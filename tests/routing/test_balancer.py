"""GlobalRequestLoadBalancer: verl's CPU test cases, plus what verl lacks."""

from __future__ import annotations

import pytest

from rollfleet.errors import NoServerAvailable
from rollfleet.routing import GlobalRequestLoadBalancer, get_policy
from rollfleet.types import LoadReport

pytestmark = pytest.mark.unit


def make(n=3, **kw):
    return GlobalRequestLoadBalancer({f"s{i}": f"h{i}" for i in range(n)}, **kw)


def test_least_loaded_spreads_requests():
    lb = make(3)
    chosen = [lb.acquire_server(f"r{i}")[0] for i in range(6)]
    assert sorted(chosen) == ["s0", "s0", "s1", "s1", "s2", "s2"]
    assert lb.get_status()["servers"] == {"s0": 2, "s1": 2, "s2": 2}


def test_least_loaded_wins_and_release_rebalances():
    lb = make(2)
    a, _ = lb.acquire_server("a")
    b, _ = lb.acquire_server("b")
    assert {a, b} == {"s0", "s1"}
    lb.release_server(a)
    c, _ = lb.acquire_server("c")
    assert c == a  # the released server is now the least loaded


def test_unknown_and_extra_release_ignored():
    lb = make(2)
    lb.release_server("nope")
    lb.release_server("s0")  # zero count: ignored
    assert lb.get_inflight_count("s0") == 0
    sid, _ = lb.acquire_server("x")
    lb.release_server(sid)
    lb.release_server(sid)
    assert lb.get_inflight_count(sid) == 0
    assert lb.get_total_inflight() == 0


def test_same_request_id_sticks():
    lb = make(3)
    first, handle = lb.acquire_server("traj-1")
    for _ in range(5):
        sid, h = lb.acquire_server("traj-1")
        assert (sid, h) == (first, handle)
    assert lb.decisions["sticky"] == 5


def test_removed_server_invalidates_sessions_and_readd_works():
    lb = make(2)
    sid, _ = lb.acquire_server("t")
    lb.remove_servers([sid])
    assert sid not in lb.get_all_servers()
    other, _ = lb.acquire_server("t")
    assert other != sid
    assert lb.decisions["sticky_invalidated"] == 1
    lb.add_servers({sid: "new-handle"})
    assert lb.get_all_servers()[sid] == "new-handle"
    assert lb.get_inflight_count(sid) == 0


def test_empty_pool_raises_no_server_available():
    lb = GlobalRequestLoadBalancer({})
    with pytest.raises(NoServerAvailable, match="No available servers"):
        lb.acquire_server("x")
    lb2 = make(1)
    lb2.set_routable("s0", False)
    with pytest.raises(NoServerAvailable):
        lb2.acquire_server("y")


def test_status_and_counts():
    lb = make(2)
    for i in range(3):
        lb.acquire_server(f"r{i}")
    st = lb.get_status()
    assert st["total_inflight"] == 3 == lb.get_total_inflight()
    assert st["active_servers"] == 2 and st["registered_handles"] == 2
    cleared = lb.clear_sticky_cache()
    assert cleared["cleared_entries"] == 3
    assert sum(cleared["server_loads"].values()) == 3


def test_finish_session_frees_sticky_entry():
    lb = make(2)
    lb.acquire_server("t")
    assert lb.sticky_server("t") is not None
    assert lb.finish_session("t") is True
    assert lb.sticky_server("t") is None
    assert lb.finish_session("t") is False


def test_sticky_gives_way_when_overloaded_and_saturated():
    lb = make(2, sticky_overload_factor=1.5, sticky_overload_slack=2)
    sid, _ = lb.acquire_server("hot")
    # pile load on the sticky replica (other callers' requests, as reported by the replica)...
    lb.report_load(LoadReport(replica_id=sid, inflight=20, inflight_tokens=2000, timestamp=1.0))
    assert lb.acquire_server("hot")[0] == sid  # ... but its engine runs them all: stay for the cache
    lb.report_load(LoadReport(replica_id=sid, inflight=20, inflight_tokens=2000, waiting=3, timestamp=2.0))
    other, _ = lb.acquire_server("hot")  # requests queue there now: give way
    assert other != sid and lb.sticky_server("hot") == other
    assert lb.decisions["spill_over"] == 1
    kv = make(2, sticky_overload_factor=1.5, sticky_overload_slack=2, sticky_spill_kv_usage=0.8)
    s1, _ = kv.acquire_server("hot")
    kv.report_load(LoadReport(replica_id=s1, inflight=20, inflight_tokens=2000, kv_usage=0.85))
    assert kv.acquire_server("hot")[0] != s1  # a KV cache near full is saturated too
    # below the bound it stays sticky, saturated or not
    lb2 = make(2, sticky_overload_factor=1.5, sticky_overload_slack=50)
    s2, _ = lb2.acquire_server("hot")
    lb2.report_load(LoadReport(replica_id=s2, inflight=20, inflight_tokens=2000, waiting=5))
    assert lb2.acquire_server("hot")[0] == s2


def test_unroutable_replica_is_skipped_and_session_moves():
    lb = make(2, policy="least_tokens")
    sid, _ = lb.acquire_server("t")
    lb.set_routable(sid, False)
    for i in range(5):
        assert lb.acquire_server(f"n{i}")[0] != sid
    assert lb.acquire_server("t")[0] != sid


def test_least_tokens_counts_tokens_not_requests():
    lb = make(2, policy="least_tokens", seed=0)
    big, _ = lb.acquire_server("big", prompt_len=10_000)
    smalls = [lb.acquire_server(f"s{i}", prompt_len=100)[0] for i in range(5)]
    assert all(s != big for s in smalls)  # least_inflight would have alternated
    verl = make(2)
    b, _ = verl.acquire_server("big", prompt_len=10_000)
    assert [verl.acquire_server(f"s{i}", prompt_len=100)[0] for i in range(3)].count(b) >= 1


def test_load_reports_combine_with_local_counts():
    lb = make(2, policy="least_tokens", seed=0)
    lb.report_load(LoadReport(replica_id="s0", inflight=10, inflight_tokens=5000))
    assert lb.acquire_server("a", prompt_len=10)[0] == "s1"


def test_a_late_report_counts_our_share_as_the_replica_counted_it_not_as_it_is_now():
    """A polled report is up to a probe interval old. Our 12 requests it counted have finished
    since; subtracting our count *now* (0) would leave 12 phantom requests of others on s0 and
    send every new session to s1 (what the gateway-vs-router benchmark caught)."""
    lb = make(2, policy="least_tokens", seed=0)
    taken = [lb.acquire_server(f"old{i}", prompt_len=100) for i in range(24)]
    assert sum(1 for sid, _ in taken if sid == "s0") == 12
    late = LoadReport(replica_id="s0", inflight=12, inflight_tokens=1200, by_client={lb.client_id: (12, 1200)})
    for sid, _ in taken:
        lb.release_server(sid, prompt_len=100)
    lb.report_load(late)
    new = [lb.acquire_server(f"new{i}", prompt_len=100)[0] for i in range(16)]
    assert new.count("s0") == new.count("s1") == 8
    # the same late report without the split: the old guess, phantom load and all
    guess = make(2, policy="least_tokens", seed=0)
    guess.report_load(LoadReport(replica_id="s0", inflight=12, inflight_tokens=1200))
    assert [guess.acquire_server(f"new{i}", prompt_len=100)[0] for i in range(12)].count("s0") == 0


def test_a_split_report_without_our_entry_is_all_others_and_older_reports_are_dropped():
    lb = make(2, policy="least_tokens", seed=0)
    mine, _ = lb.acquire_server("mine", prompt_len=100)  # counted locally, not yet at the replica
    other = "s1" if mine == "s0" else "s0"
    lb.report_load(LoadReport(replica_id=mine, inflight=5, inflight_tokens=500, by_client={}, timestamp=2.0))
    assert lb.get_status()["estimated_load"][mine] == 1 + 5
    lb.report_load(LoadReport(replica_id=mine, inflight=0, inflight_tokens=0, by_client={}, timestamp=1.0))
    assert lb.get_status()["estimated_load"][mine] == 1 + 5  # older than the last one applied
    lb.set_handle(mine, "restarted")  # a new process, a new clock: its reports count again
    lb.report_load(LoadReport(replica_id=mine, inflight=0, inflight_tokens=0, by_client={}, timestamp=0.5))
    assert lb.get_status()["estimated_load"] == {mine: 1, other: 0}


def test_ties_are_not_always_first_for_least_tokens():
    lb = make(4, policy="least_tokens", seed=1, sticky=False)
    firsts = set()
    for i in range(40):
        sid, _ = lb.acquire_server(f"r{i}", prompt_len=1)
        lb.release_server(sid, 1)
        firsts.add(sid)
    assert len(firsts) > 1


def test_full_determinism_uses_rendezvous_and_is_stable():
    lb = make(4, full_determinism=True)
    assert lb.policy.name == "rendezvous"
    ids = [f"req-{i}" for i in range(200)]
    before = {r: lb.acquire_server(r)[0] for r in ids}
    lb2 = make(4, full_determinism=True)
    lb2.remove_servers(["s3"])
    after = {r: lb2.acquire_server(r)[0] for r in ids}
    moved = [r for r in ids if before[r] != after[r]]
    assert all(before[r] == "s3" for r in moved)  # only s3's keys move
    assert 20 < len(moved) < 80


def test_unknown_policy_lists_valid_ones():
    with pytest.raises(ValueError, match="least_tokens"):
        get_policy("nope")


def test_power_of_two_balances():
    lb = make(4, policy="power_of_two", seed=3, sticky=False)
    for i in range(400):
        lb.acquire_server(f"r{i}", prompt_len=10)
    loads = lb.get_status()["servers"].values()
    assert max(loads) - min(loads) <= 20


def test_a_rolling_update_sends_new_trajectories_to_the_new_version_and_keeps_sessions_where_they_are():
    from rollfleet.client.fleet_view import FleetView
    from rollfleet.health import FleetSnapshot

    lb = make(3, policy="least_tokens", seed=0)
    old_session, _ = lb.acquire_server("old-session")
    healthy = {f"s{i}": "healthy" for i in range(3)}
    rolling = FleetSnapshot(1, 4, healthy, {"s0": 5, "s1": 4, "s2": 4}, rolling_version=5)
    assert sorted(rolling.routable_ids()) == ["s0", "s1", "s2"]  # both versions serve meanwhile
    assert rolling.preferred_ids() == ["s0"]
    FleetView(lb).apply(rolling)
    assert {lb.acquire_server(f"new-{i}")[0] for i in range(6)} == {"s0"}
    assert lb.acquire_server("old-session")[0] == old_session  # a session stays with its prefix cache
    assert lb.decisions["newest_version"] == 6

    done = FleetSnapshot(1, 5, healthy, {"s0": 5, "s1": 5, "s2": 4})  # s2 failed its commit
    assert done.preferred_ids() is None and sorted(done.routable_ids()) == ["s0", "s1"]
    FleetView(lb).apply(done)
    assert "s2" not in {lb.acquire_server(f"after-{i}")[0] for i in range(6)}  # stale weights: never
    # a booting replica (no version yet) is never routable, rolling or not
    assert "s1" not in FleetSnapshot(1, 4, healthy, {"s0": 4, "s1": None, "s2": 4}, rolling_version=5).routable_ids()


def _output(version):
    from rollfleet.types import TokenOutput

    return TokenOutput(token_ids=[1], extra_fields={"global_steps": version, "max_global_steps": version})


def test_a_session_never_goes_back_a_weight_version_when_it_leaves_its_replica():
    """A turn that ended on weights committed after this client's last snapshot (a rolling wave,
    or a keep-mode commit not published yet) raises the session's floor: its next turn may leave a
    saturated replica only for one known to be as new (seen: a rolling update's next turn on the
    old version, min_global_steps 7 after a turn that reached 8)."""
    from rollfleet.client.fleet_view import FleetView
    from rollfleet.health import FleetSnapshot

    lb = make(3, sticky_overload_factor=1.5, sticky_overload_slack=2)
    healthy = {f"s{i}": "healthy" for i in range(3)}
    FleetView(lb).apply(FleetSnapshot(1, 7, healthy, {"s0": 7, "s1": 7, "s2": 7}))  # as the client last saw it
    sid, _ = lb.acquire_server("traj")
    lb.observe_output(sid, "traj", _output(8))  # its replica committed 8 meanwhile
    lb.release_server(sid)
    lb.report_load(LoadReport(replica_id=sid, inflight=20, inflight_tokens=2000, waiting=3, timestamp=1.0))
    assert lb.acquire_server("traj")[0] == sid  # saturated, but every other replica is older: stay
    assert lb.decisions["version_floor"] == 1 and lb.decisions["spill_over"] == 0
    # once another replica is seen on 8 (its own output, or a snapshot), the session may move there
    newer = next(s for s in ("s0", "s1", "s2") if s != sid)
    lb.observe_output(newer, "other-traj", _output(8))
    assert lb.acquire_server("traj")[0] == newer
    # a new trajectory has no floor: it goes wherever load says
    assert lb.acquire_server("fresh")[0] not in (sid, newer)
    # an older snapshot label does not lower what an output showed
    FleetView(lb).apply(FleetSnapshot(1, 7, healthy, {"s0": 7, "s1": 7, "s2": 7}))
    lb.set_routable(newer, False)
    assert lb.acquire_server("traj")[0] == sid


def test_a_session_whose_newer_replica_is_gone_goes_on_elsewhere_and_counts_it():
    """Nothing newer routable and its replica gone: the turn is served on what is left (refusing
    would lose the trajectory), and the regression is counted where routing decisions show."""
    lb = make(2)
    sid, _ = lb.acquire_server("traj")
    lb.observe_output(sid, "traj", _output(8))
    lb.release_server(sid)
    lb.set_version("s0", 7)
    lb.set_version("s1", 7)
    lb.set_routable(sid, False)
    assert lb.acquire_server("traj")[0] != sid
    assert lb.decisions["version_regressed"] == 1
    other = next(s for s in ("s0", "s1") if s != sid)
    lb.release_server(other)
    # unstick (its replica failed it) keeps the floor: the turn goes back to the one replica on 8,
    # though the other is idle and the newer one is loaded
    lb.set_routable(sid, True)
    lb.report_load(LoadReport(replica_id=sid, inflight=5, inflight_tokens=500, timestamp=1.0))
    lb.unstick("traj")
    assert lb.acquire_server("traj")[0] == sid
    lb.release_server(sid)
    assert lb.decisions["version_regressed"] == 1
    # finishing the session forgets it: the same turn now goes where load says
    assert lb.finish_session("traj") is True
    assert lb.acquire_server("traj")[0] == other


def test_a_session_turn_is_never_held_by_the_dispatch_limit_and_a_rollback_clears_the_floors():
    from rollfleet.client.fleet_view import FleetView
    from rollfleet.health import FleetSnapshot

    lb = make(2, max_inflight_per_replica=1)
    healthy = {"s0": "healthy", "s1": "healthy"}
    view = FleetView(lb)
    view.apply(FleetSnapshot(1, 8, healthy, {"s0": 8, "s1": 8}))
    sid, _ = lb.acquire_server("traj")
    lb.observe_output(sid, "traj", _output(8))
    lb.unstick("traj")  # its replica failed the turn
    lb.acquire_server("filler")  # every replica now at the limit
    assert lb.try_acquire_server("new") is None  # a new placement waits for room ...
    assert lb.try_acquire_server("traj") is not None  # ... the session's next turn does not
    # the fleet goes back to version 5 (a learner restored from a checkpoint) and s1 restarts on
    # it: a floor of 8 would count every turn there as a regression
    lb.set_handle("s1", "h1-restarted")
    view.apply(FleetSnapshot(1, 5, healthy, {"s0": 5, "s1": 5}))
    lb.set_routable("s0", False)
    lb.unstick("traj")
    lb.acquire_server("traj")
    assert lb.decisions["version_regressed"] == 0


def test_a_saturated_replica_below_the_floor_keeps_the_turn_but_it_is_counted():
    """After an earlier regression the session's own replica may be older than its floor: it keeps
    the turn when nothing qualifies, labelled as the regression it is."""
    lb = make(2, sticky_overload_factor=1.5, sticky_overload_slack=2)
    sid, _ = lb.acquire_server("traj")
    lb.release_server(sid)
    lb.set_version("s0", 7)
    lb.set_version("s1", 7)
    lb.observe_output("gone", "traj", _output(8))  # the floor came from a replica since removed
    lb.report_load(LoadReport(replica_id=sid, inflight=20, inflight_tokens=2000, waiting=3, timestamp=1.0))
    assert lb.acquire_server("traj")[0] == sid
    assert lb.decisions["version_regressed"] == 1 and lb.decisions["version_floor"] == 0


def test_a_session_turn_is_not_held_when_its_replica_failed_it_or_left():
    """Whether its replica was quarantined, failed the turn (``unstick``) or left the fleet, a
    session's next turn is placed afresh without waiting for room (no version floor here)."""
    for lose in ("quarantine", "unstick", "remove"):
        lb = make(3, max_inflight_per_replica=1)
        sid, _ = lb.try_acquire_server("sess", 10, [1, 2, 3])
        lb.release_server(sid, 10)
        for other in ("s0", "s1", "s2"):  # other clients' requests: every replica at the limit
            lb.report_load(LoadReport(replica_id=other, inflight=1, inflight_tokens=10, timestamp=1.0))
        if lose == "quarantine":
            lb.set_routable(sid, False)
        elif lose == "unstick":
            lb.unstick("sess")
        else:
            lb.remove_servers([sid])
        assert lb.sticky_server("sess") is None, lose  # not a replica its turn may go to
        assert lb.is_placed("sess"), lose  # but a session: the client's gate lets it try
        assert lb.try_acquire_server("new", 10, [9]) is None, lose  # a new placement waits ...
        assert lb.try_acquire_server("sess", 10, [1, 2, 3, 4]) is not None, lose  # ... the turn does not


def test_a_request_sent_before_its_replica_left_never_uncounts_the_one_readded_under_its_id():
    lb = make(2)
    lb.report_load(LoadReport(replica_id="s1", inflight=5, inflight_tokens=500, timestamp=1.0))
    old, _ = lb.acquire_server("old", 100)
    assert old == "s0"
    lb.remove_servers(["s0"])
    lb.add_servers({"s0": "h0-new"})
    new, _ = lb.acquire_server("new", 100)
    assert new == "s0"
    lb.release_server(old, 100)  # the old request ends: the new one is still counted
    assert lb.get_inflight_count("s0") == 1
    lb.release_server(new, 100)
    assert lb.get_inflight_count("s0") == 0
    # released the other way round, the count is over for a while, never under, and ends at 0
    lb.acquire_server("old2", 100)
    lb.remove_servers(["s0"])
    lb.add_servers({"s0": "h0-newer"})
    lb.acquire_server("new2", 100)
    lb.release_server("s0", 100)  # new2 ends first
    assert lb.get_inflight_count("s0") == 1
    lb.release_server("s0", 100)
    assert lb.get_inflight_count("s0") == 0
    # removed twice while requests of both earlier incarnations run: neither uncounts the third's
    for name in ("a", "b"):
        assert lb.acquire_server(name, 100)[0] == "s0"
        lb.remove_servers(["s0"])
        lb.add_servers({"s0": f"h0-{name}"})
    assert lb.acquire_server("c", 100)[0] == "s0"
    lb.release_server("s0", 100)
    lb.release_server("s0", 100)  # a and b end
    assert lb.get_inflight_count("s0") == 1


def test_the_same_actor_readded_carries_only_the_tokens_still_in_flight_there():
    """Two requests of 1,000 prompt tokens on s0; s0 removed, one ends, s0 re-added as the very
    same actor, the other ends. Releasing on the removed replica used to uncount the request but
    not its tokens: 1,000 tokens stayed on s0 for good, which ``least_tokens`` routes by."""
    lb = GlobalRequestLoadBalancer({"s0": "h0", "s1": "h1"}, policy="least_tokens", seed=0)
    lb.set_routable("s1", False)
    taken = [lb.acquire_server(f"q{i}", prompt_len=1000) for i in range(2)]
    assert [sid for sid, _ in taken] == ["s0", "s0"]
    lb.remove_servers(["s0"])
    lb.release_server("s0", 1000, taken[0][1])
    lb.add_servers({"s0": "h0"})
    assert lb.get_status()["estimated_load"]["s0"] == 1
    lb.release_server("s0", 1000, taken[1][1])
    state = lb._servers["s0"]
    assert (state.local, state.local_tokens, state.view.inflight_tokens) == (0, 0, 0)


def test_a_late_report_of_a_replicas_earlier_actor_is_not_the_new_ones():
    """s0 restarted in place (a new handle); a response of its dead actor, sent before, arrives
    now with that actor's load (40 requests of others, 30 waiting). It used to be taken as the new
    actor's, and its clock set the bar the new actor's own reports had to pass."""
    lb = GlobalRequestLoadBalancer({"s0": "old", "s1": "h1"}, policy="least_inflight", seed=0)
    lb.set_handle("s0", "new")
    lb.report_load(LoadReport("s0", inflight=40, waiting=30, kv_usage=0.99, timestamp=1_000.0), "old")
    assert lb.get_status()["estimated_load"]["s0"] == 0
    lb.report_load(LoadReport("s0", inflight=2, timestamp=5.0), "new")  # another node's clock, behind
    assert lb.get_status()["estimated_load"]["s0"] == 2


def test_a_session_stays_placed_when_no_replica_is_left_to_place_its_turn_on():
    """Its replica quarantined and none other routable: the turn fails with NoServerAvailable, and
    the session used to be forgotten, its retried turn then held like a new placement."""
    lb = make(1, max_inflight_per_replica=1)
    sid, _ = lb.try_acquire_server("sess", 10, [1, 2, 3])
    lb.release_server(sid, 10)
    lb.set_routable(sid, False)
    with pytest.raises(NoServerAvailable):
        lb.try_acquire_server("sess", 10, [1, 2, 3, 4])
    assert lb.is_placed("sess")
    lb.set_routable(sid, True)
    lb.report_load(LoadReport(replica_id=sid, inflight=1, inflight_tokens=10, timestamp=1.0))  # at the limit
    assert lb.try_acquire_server("new", 10, [9]) is None
    assert lb.try_acquire_server("sess", 10, [1, 2, 3, 4]) is not None


def test_a_session_keeps_its_replica_through_a_moment_with_none_routable():
    """The whole fleet unroutable for a moment (a weight sync, a restart): the turn tried then
    fails, and its retry used to be placed afresh, away from the replica holding its prefix."""
    lb = make(2, policy="least_inflight", sticky_overload_factor=100, sticky_overload_slack=100)
    sid, _ = lb.acquire_server("sess")
    lb.release_server(sid)
    lb.report_load(LoadReport(replica_id=sid, inflight=5, inflight_tokens=50, timestamp=1.0))
    assert lb.acquire_server("probe")[0] != sid  # a fresh placement goes to the other one
    for s in ("s0", "s1"):
        lb.set_routable(s, False)
    with pytest.raises(NoServerAvailable):
        lb.acquire_server("sess")
    for s in ("s0", "s1"):
        lb.set_routable(s, True)
    assert lb.sticky_server("sess") == sid
    assert lb.acquire_server("sess")[0] == sid
    assert lb.decisions["sticky"] == 1


def test_a_release_naming_its_handle_uncounts_the_incarnation_it_was_counted_on():
    """A replica removed and re-added under its id: the new one's requests, released first, used
    to uncount the removed one's, leaving the new one counted busy (held back at the limit) until
    the old request ended."""
    lb = make(1, max_inflight_per_replica=1)
    sid, old_handle = lb.acquire_server("A")
    lb.remove_servers([sid])
    lb.add_servers({sid: "h0-new"})
    assert lb.acquire_server("B") == (sid, "h0-new")
    lb.release_server(sid, 0, "h0-new")  # B ends
    assert lb.get_inflight_count(sid) == 0
    assert lb.try_acquire_server("C") is not None  # the new replica is free
    lb.release_server(sid, 0, old_handle)  # A ends on the removed one: C stays counted
    assert lb.get_inflight_count(sid) == 1
    lb.release_server(sid, 0, "h0-new")
    assert lb.get_inflight_count(sid) == 0
    # restarted in place (a new handle, same id), then removed and re-added: a request sent before
    # the restart names a handle neither of them has, and is uncounted where it was sent from
    lb.acquire_server("E")
    lb.set_handle(sid, "h0-restarted")
    lb.remove_servers([sid])
    lb.add_servers({sid: "h0-third"})
    lb.acquire_server("F")
    lb.release_server(sid, 0, "h0-new")  # E, sent to the handle before the restart
    assert lb.get_inflight_count(sid) == 1
    lb.release_server(sid, 0, "h0-third")
    assert lb.get_inflight_count(sid) == 0
    # re-added as the very same actor, the requests there are its load again
    lb.acquire_server("D")
    lb.remove_servers([sid])
    lb.add_servers({sid: "h0-third"})
    assert lb.get_inflight_count(sid) == 1
    lb.release_server(sid, 0, "h0-third")
    assert lb.get_inflight_count(sid) == 0


def test_a_turn_with_a_version_floor_is_a_session_even_with_stickiness_off():
    """``sticky: false``: the balancer lets a floored turn through the dispatch limit, but the
    client's gate asked only the sticky table whether it was a session, and held it."""
    lb = make(1, sticky=False, max_inflight_per_replica=1)
    sid, _ = lb.acquire_server("sess")
    lb.observe_output(sid, "sess", _output(3))
    lb.release_server(sid)
    assert lb.is_placed("sess") and not lb.is_placed("new")
    lb.finish_session("sess")
    assert not lb.is_placed("sess")


async def test_the_client_releases_on_the_incarnation_its_request_went_to():
    import asyncio

    from rollfleet.client import LLMServerClient
    from rollfleet.config import RolloutConfig
    from rollfleet.server.local import LocalHandle
    from rollfleet.types import ReplicaResponse

    class Replica:
        def __init__(self, gate: asyncio.Event) -> None:
            self.gate = gate

        async def generate_with_load(self, request_id, prompt_ids, params=None, **kwargs):
            await self.gate.wait()
            return ReplicaResponse(_output(0), LoadReport(replica_id="s0"))

    old_gate, new_gate = asyncio.Event(), asyncio.Event()
    new_gate.set()
    client = LLMServerClient(RolloutConfig(response_length=4), servers={"s0": LocalHandle(Replica(old_gate))})
    old = asyncio.ensure_future(client.generate("A", prompt_ids=[1, 2]))
    await asyncio.sleep(0)
    client.balancer.remove_servers(["s0"])
    client.balancer.add_servers({"s0": LocalHandle(Replica(new_gate))})
    await client.generate("B", prompt_ids=[1, 2])
    assert client.balancer.get_inflight_count("s0") == 0
    old_gate.set()
    await old
    assert client.balancer.get_inflight_count("s0") == 0


def test_a_restarted_replica_carries_none_of_the_dead_actors_load():
    """The controller's snapshot beside the new handle still held the dead actor's last report
    (12 requests of other clients), applied after the handle reset the report clock: the replica
    looked full, and once that report's clock (another node's) was ahead of the new actor's,
    every later report was dropped: no placement there again with a dispatch limit."""
    from rollfleet.client.fleet_view import FleetView
    from rollfleet.health import FleetSnapshot
    from rollfleet.types import LoadReport

    bal = GlobalRequestLoadBalancer({"A": "a1", "B": "b"}, max_inflight_per_replica=4)
    view = FleetView(bal, controller=None)
    me = bal.client_id
    healthy, versions = {"A": "healthy", "B": "healthy"}, {"A": 1, "B": 1}
    old = LoadReport("A", inflight=12, inflight_tokens=1200, timestamp=900_000.0, by_client={me: (0, 0)})
    idle_b = LoadReport("B", timestamp=5.0, by_client={me: (0, 0)})
    view.apply(
        FleetSnapshot(
            1, 1, healthy, versions, loads={"A": old, "B": idle_b}, handles={"A": "a1", "B": "b"}, seq=("c", 1)
        )
    )
    assert bal.get_status()["estimated_load"]["A"] == 12
    view.apply(FleetSnapshot(2, 1, healthy, versions, loads={"A": old}, handles={"A": "a2", "B": "b"}, seq=("c", 2)))
    assert bal.get_status()["estimated_load"]["A"] == 0  # none of it runs on the new actor
    new = LoadReport("A", inflight=1, inflight_tokens=10, timestamp=3_600.0, by_client={me: (0, 0)})
    view.apply(FleetSnapshot(2, 1, healthy, versions, loads={"A": new}, seq=("c", 3)))
    assert bal.get_status()["estimated_load"]["A"] == 1  # the new actor's own clock is taken
    assert sorted(bal.acquire_server(f"r{i}")[0] for i in range(4)) == ["A", "A", "B", "B"]
    bal.add_servers({"B": "b"})  # re-added as it is (verl's API): its requests stay counted
    assert bal.get_status()["servers"]["B"] == 2
