"""The layout benchmark's logic on CPU (gloo, tiny config): it runs, every field is present, the eager
baseline runs at each layout, the comparison table is produced, det's bits equal tp1's; and the
wait/transfer split and skew read from synthetic arrival records. Timings on CPU mean nothing; only
their presence and consistency (wait + transfer = span) are asserted."""

from __future__ import annotations

import pytest

from h3lab.bench.collectives import run_collectives_bench
from h3lab.bench.layout_stats import first_large_skew, split_calls, spread
from h3lab.bench.layouts import run_layout_bench

LAYOUTS = ("tp1", "tp2+sp", "cp2")


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts") / "bench.json"
    return run_layout_bench(
        ",".join(LAYOUTS),
        [16],
        out=out,
        config="tiny",
        device="cpu",
        steps=2,
        warmup=1,
        collective_steps=1,
        diagnose=True,
        diagnose_steps=1,
        diagnose_runner_steps=1,
        timeout_s=300,
    )


def test_every_case_and_field_is_present(bench):
    assert bench["launch"]["ok"], bench["launch"].get("agent_log_tail")
    assert bench["missing"] == [] and all(bench["ranks_done"])
    assert sorted(bench["cases"]) == sorted(f"{name}@16" for name in LAYOUTS)
    for key, case in bench["cases"].items():
        for mode in ("det", "eager"):
            m = case[mode]
            assert m["step_ms"]["n"] == 2 and m["step_ms"]["median"] > 0, (key, mode)
            assert set(m["step_ms"]) == {"n", "median", "p10", "p90", "min", "max"}
            assert len(m["per_rank_step_ms"]) == case["world"]
            assert m["collective_steps"] == 1 and set(m["collectives"]) == set(m["per_rank_step_ms"])
            assert m["first_step"] and "peak_gib" in m and "skew" in m
        assert case["eager"]["sdpa_backend"]["chosen"] == "default (CPU)"
        if case["world"] == 1:  # tp1 moves nothing
            assert case["det"]["sites"] == [] and case["eager"]["sites"] == []
            continue
        for mode in ("det", "eager"):
            for r, c in case[mode]["collectives"].items():
                assert c["sent_per_step"] > 0 and c["calls_per_step"] > 0, (key, mode, r)
                total = c["wait_ms"]["median"] + c["transfer_ms"]["median"]
                assert total == pytest.approx(c["span_ms"]["median"], abs=1e-6), (key, mode, r)  # one step: exact
            assert case[mode]["skew"]["site"] is not None


def test_det_bits_equal_tp1_and_the_table_has_every_layout(bench):
    rows = {row["layout"]: row for row in bench["comparison"]}
    assert sorted(rows) == sorted(LAYOUTS)
    for name, row in rows.items():
        assert row["det_ms"] > 0 and row["eager_ms"] > 0 and row["ratio"] > 0 and row["overhead"] > 0
        assert row["speedup_det"] > 0 and row["speedup_eager"] > 0
        bits = row["bits_vs_tp1"]
        assert bits["equal"] and bits["compared"] > 20 and not bits["replica_conflicts"], (name, bits)
    assert rows["tp1"]["overhead"] == pytest.approx(1.0)
    assert rows["cp2"]["eager_grad_sync_ms"] > 0  # CP sums every weight gradient over its ranks
    for name in LAYOUTS:
        assert name in bench["table"]
    assert "det/eager" in bench["table"].splitlines()[0]


def test_the_diagnosis_runs_every_suspect(bench):
    for key in ("tp2+sp@16", "cp2@16"):
        diag = bench["cases"][key]["diagnose"]
        assert diag["arrival_barrier"]["measured_wait_ms_by_site"]
        assert set(diag["progress_file"]["ticks_per_step"].values()) != {0}
        assert diag["heartbeat"]["step_ms_on"] > 0
        assert all(m is None or m["count"] == 0 for m in diag["triton_cache_misses"].values())  # torch backend
        assert diag["host_syncs"] == {"0": None, "1": None}  # CUDA only
    runner = bench["cases"]["tp2+sp@16"]["diagnose"]["runner_path"]  # the first diagnosed case only
    for variant in ("rebuilt", "prepared"):
        (repeat,) = runner[variant]["repeats"]
        assert repeat["first_call_site"] == "meta.keys" and len(repeat["host_ms_to_first_collective"]) == 2
        assert repeat["block_timings"]
    assert "runner_path" not in bench["cases"]["cp2@16"]["diagnose"]


def _call(kind, site, group, arrive, exit_, nbytes=4 << 20):
    return {
        "kind": kind,
        "site": site,
        "group": group,
        "bytes": nbytes,
        "sent": nbytes,
        "received": nbytes,
        "arrive_ns": arrive,
        "exit_ns": exit_,
        "host_in_ns": arrive,
        "host_out_ns": exit_,
    }


def test_wait_is_the_late_peers_arrival_and_transfer_the_rest():
    ms = 1_000_000
    calls = {
        0: [_call("reduce_units", "a", [0, 1], 0, 9 * ms, 1024), _call("reduce_units", "b", [0, 1], 10 * ms, 20 * ms)],
        1: [
            _call("reduce_units", "a", [0, 1], 5 * ms, 9 * ms, 1024),
            _call("reduce_units", "b", [0, 1], 12 * ms, 20 * ms),
        ],
    }
    split = split_calls(calls)
    a0, b0 = split[0]
    a1, b1 = split[1]
    assert (a0["wait_ms"], a0["transfer_ms"]) == (5.0, 4.0)
    assert (a1["wait_ms"], a1["transfer_ms"]) == (0.0, 4.0)
    assert (b0["wait_ms"], b0["transfer_ms"], b1["wait_ms"]) == (2.0, 8.0, 0.0)
    skew = first_large_skew(calls)  # "a" moves 1 KiB: the first call of >= 1 MiB is "b"
    assert skew == {"site": "b", "bytes": 4 << 20, "spread_ms": 2.0}


def test_a_peer_arriving_after_the_call_ended_is_clock_error_not_wait():
    ms = 1_000_000
    # rank 1's arrival is read 3 ms after rank 0's call returned: no real collective allows that
    calls = {
        0: [_call("reduce_units", "a", [0, 1], 0, 6 * ms)],
        1: [_call("reduce_units", "a", [0, 1], 9 * ms, 10 * ms)],
    }
    (a0,), (a1,) = split_calls(calls)[0], split_calls(calls)[1]
    assert (a0["wait_ms"], a0["transfer_ms"], a0["clock_error_ms"]) == (6.0, 0.0, 3.0)
    assert (a1["wait_ms"], a1["transfer_ms"], a1["clock_error_ms"]) == (0.0, 1.0, 0.0)


def test_spread_uses_nearest_ranks():
    s = spread([float(v) for v in range(1, 21)])
    assert (s["n"], s["min"], s["max"], s["median"], s["p10"], s["p90"]) == (20, 1.0, 20.0, 10.5, 3.0, 18.0)
    assert spread([])["median"] is None


def test_collectives_bench_checks_its_bits(tmp_path):
    record = run_collectives_bench(
        2, [0.25], out=tmp_path / "c.json", device="cpu", iters=2, warmup=1, segment_mib=0.0625
    )
    assert record["launch"]["ok"], record["launch"].get("agent_log_tail")
    names = {(r["op"], r["name"]) for r in record["rows"]}
    for op in ("all_reduce", "reduce_scatter"):
        assert {(op, n) for n in ("gather_tree", "scatter_tree", "scatter_tree/seg0.0625MiB", "backend")} <= names
    assert all(r["bitwise_equal_tree"] for r in record["rows"] if r["name"] != "backend")
    assert all(r["bus_bw_gbs"] > 0 for r in record["rows"])
