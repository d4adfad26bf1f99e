"""The API benchmark's open loop (issue #11): its schedule, and a short run on SQLite
against a real broker and the reference server."""

from __future__ import annotations

import json
import tomllib

from broker.bench import api
from broker.bench.__main__ import main
from broker.config import parse_config
from broker.store import Broker, Principal

KINDS = set(api.MIX)


def test_the_schedule_is_fixed_by_its_seed_and_heartbeats_go_round_the_sessions():
    work = api.OpenLoop(rate=200, seconds=5, heartbeat_every=2, seed=7)
    sends = api.schedule(work)
    assert sends == api.schedule(work)
    assert sends != api.schedule(api.OpenLoop(rate=200, seconds=5, heartbeat_every=2, seed=8))
    assert {send.kind for send in sends} == KINDS
    times = [send.at for send in sends]
    assert times == sorted(times) and times[0] > 0 and times[-1] < work.seconds
    beats = [send.session for send in sends if send.kind == "heartbeat"]
    assert beats == [i % work.sessions for i in range(len(beats))]
    assert all(0 <= send.session < work.sessions for send in sends)


def test_a_short_open_loop_run_answers_every_request_of_both_servers(capsys):
    # The broker's heartbeats come as a hub sends them (the reference's one request each).
    work = api.OpenLoop(rate=40, seconds=3, heartbeat_every=5)
    assert (
        main(
            [
                "api",
                "--open-loop",
                "--backend=sqlite",
                "--rate=40",
                "--duration=3",
                "--heartbeat-every=5",
                "--hub-heartbeats",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["benchmark"] == "api-open-loop"
    [result] = report["results"]
    assert result["db"] == "sqlite"
    [point] = result["points"]
    assert point["offered_rate"] == 40
    for server in ("broker", "reference"):
        figures = point[server]
        assert figures["errors"] == {}, server
        assert figures["unfinished"] == 0
        assert figures["releases_without_slice"] == 0
        # Every request scheduled was sent and answered 2xx.
        assert figures["ok"] == figures["requests"] == figures["latency_ms"]["count"] > 0
        assert set(figures["kinds"]) >= KINDS
        submits = figures["kinds"]["submit"]["count"]
        assert figures["grant_latency_ms"]["count"] == submits and figures["not_granted"] == 0
        assert figures["send_lag_ms"]["count"] == figures["requests"]
        for summary in (figures["latency_ms"], figures["grant_latency_ms"]):
            assert summary["p50"] <= summary["p90"] <= summary["p99"] <= summary["max"]
        assert figures["achieved_rate"] > 0
        assert figures["live_slices_at_start"] == work.sessions + work.churn
    assert point["broker"]["leases_lapsed"] == 0 and "leases_lapsed" not in point["reference"]
    beats = point["broker"]["kinds"]["heartbeat"]["count"]
    assert 0 < point["broker"]["heartbeat_requests"] <= beats
    assert report["hub_heartbeats"] and "heartbeat_requests" not in point["reference"]
    ratios = point["broker_over_reference"]
    assert set(ratios) == {"achieved_rate", "p99"} and ratios["achieved_rate"] > 0


def test_the_store_pass_bench_times_the_service_pass_with_every_slice_running(capsys):
    assert main(["storepass", "--live=60", "--repeat=4", "--ledger=100"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["benchmark"] == "store_pass"
    assert (report["running"], report["ledger"]) == (60, 100)  # each submission withdrawn
    for figures in (report["service_pass"], report["minimal"]):
        assert 0 < figures["median_ms"] <= figures["p99_ms"]
    assert report["ratio_to_minimal_median"] > 0


def test_the_open_loop_counts_the_slices_whose_lease_lapsed(db_url, clock):
    # Its heartbeats lost, a slice ends "lost" once its lease is over; the one whose
    # heartbeat came in time lives on, and one released is not counted. The count is
    # read from the broker's database.
    config = parse_config(tomllib.loads(api.cluster_config(2)))
    broker = Broker(db_url, config, lease=120.0, clock=clock)
    try:
        user = api.users_of("alpha")[0]
        request = {"project": "alpha", "gpus": 1, "kind": "interactive"}
        kept, dropped, released = (
            broker.submit(principal=Principal(user), **request) for _ in range(3)
        )
        broker.run_pass()
        broker.release(released["id"], caller=Principal(user))
        assert api.leases_lapsed(db_url) == 0
        clock.advance(100)
        broker.heartbeat(kept["id"], caller=Principal(user))
        clock.advance(30)
        broker.run_pass()
        assert broker.get_slice(dropped["id"])["end_reason"] == "lost"
        assert broker.get_slice(kept["id"])["state"] == "granted"
    finally:
        broker.close()
    assert api.leases_lapsed(db_url) == 1
