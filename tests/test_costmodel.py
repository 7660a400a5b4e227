"""The alpha-beta model: the ring-order byte counts, calibration, and the CLI."""

import subprocess
import sys
from dataclasses import replace

import pytest

from hybrid.core.costmodel import Level, Model, calibrate, predict, predict_all
from hybrid.core.topology import Layout

S = 25 * 2**20


def bandwidth_only(inter_gbps=0.5, intra_gbps=1e6, nics=1):
    return Model(Level.from_bandwidth(0, intra_gbps), Level.from_bandwidth(0, inter_gbps), nics)


@pytest.mark.unit
def test_2x4_flat_pushes_1_75x_the_bytes_of_hierarchical_through_each_nic():
    model = bandwidth_only()
    flat = predict(model, "flat", Layout.parse("2x4"), S)["total"]
    hier = predict(model, "hierarchical", Layout.parse("2x4"), S)["inter_allreduce"]
    assert flat / hier == pytest.approx(1.75, rel=1e-6)
    assert hier == pytest.approx(S * 8 / 0.5e9)  # 2(n-1)/n = 1 x S through a 500 Mbit/s NIC


@pytest.mark.unit
def test_single_node_uses_only_the_intra_level_and_single_rank_nodes_only_inter():
    model = Model(Level(1e-6, 1e-10), Level(1e-3, 1e-8))
    one_node = predict(model, "flat", Layout.parse("1x4"), S)
    assert one_node["total"] == pytest.approx(2 * 3 * (1e-6 + S / 4 * 1e-10))
    leaders_only = predict(model, "hierarchical", Layout.parse("4x1"), S)
    assert leaders_only["intra_reduce"] == leaders_only["intra_broadcast"] == 0
    assert leaders_only["total"] == pytest.approx(predict(model, "flat", Layout.parse("4x1"), S)["total"])


@pytest.mark.unit
def test_sharded_spreads_the_inter_phase_over_several_nics():
    one = predict(bandwidth_only(nics=1), "sharded", Layout.parse("2x8"), S)["inter_allreduce"]
    eight = predict(bandwidth_only(nics=8), "sharded", Layout.parse("2x8"), S)["inter_allreduce"]
    assert one / eight == pytest.approx(8)


@pytest.mark.unit
def test_at_scale_latency_makes_hierarchy_win_even_for_small_messages():
    model = Model(Level.from_bandwidth(2, 3600), Level.from_bandwidth(5, 400))
    times = predict_all(model, Layout.parse("1024x8"), 64 * 2**10)
    assert times["flat"] > 5 * times["hierarchical"]


def fake_report(layout: str, model: Model, sizes) -> dict:
    lay = Layout.parse(layout)
    rows = []
    for size in sizes:
        phases = predict(model, "hierarchical", lay, size)
        rows.append({"runs_as": "hierarchical", "bytes": size,
                     "phases_s": {k: v for k, v in phases.items() if k != "total" and v}})
    return {"node_sizes": list(lay.node_sizes), "results": rows}


@pytest.mark.unit
def test_calibration_recovers_the_levels_it_was_measured_on():
    truth = Model(Level(50e-6, 1 / 2e9), Level(300e-6, 8 / 500e6))
    reports = [fake_report("2x4", truth, [2**20, 8 * 2**20, S]), fake_report("4x2", truth, [2**20, S])]
    fitted = calibrate(reports)
    assert fitted.intra.alpha_s == pytest.approx(truth.intra.alpha_s, rel=1e-6)
    assert fitted.inter.beta_s_per_byte == pytest.approx(truth.inter.beta_s_per_byte, rel=1e-6)


@pytest.mark.unit
def test_calibration_needs_two_sizes():
    truth = Model(Level(1e-5, 1e-9), Level(1e-4, 1e-8))
    with pytest.raises(ValueError, match="two message sizes"):
        calibrate([fake_report("2x2", truth, [S])])


@pytest.mark.multiprocess
def test_cli_prints_a_1024_node_prediction():
    out = subprocess.run([sys.executable, "-m", "hybrid.costmodel", "--layout", "1024x8", "--sizes", "25M"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "world 8192" in out.stdout and "hierarchical" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "hybrid.costmodel", "--layout", "0x8"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "nnodes (0)" in bad.stderr


@pytest.mark.unit
def test_nics_per_connection_caps_and_channels_by_hand():
    """4 nodes x 4 GPUs, 100 MB, 4 NICs of 100 Gbit/s (beta 8e-11 s/B), 5 us per step, one connection at most
    25 Gbit/s (3.2e-10 s/B), flat striped over 4 channels. Worked by hand:
    flat: 4 connections on 4 NICs -> max(8e-11/4, 3.2e-10/4) = 8e-11 s/B (capped by the connections);
          ring of 16: 2*15*(5e-6 + 1e8/16*8e-11) = 30 * 5.05e-4 = 0.01515 s
    hierarchical: the leader's one connection -> max(8e-11, 3.2e-10) = 3.2e-10 s/B;
          ring of 4: 2*3*(5e-6 + 2.5e7*3.2e-10) = 6 * 8.005e-3 = 0.04803 s
    sharded: 4 groups on 4 NICs -> 8e-11 s/B; ring of 4 on S: 6*(5e-6 + 2.5e7*8e-11) = 6 * 2.005e-3 = 0.01203 s"""
    model = Model(Level(0, 0), Level(5e-6, 8e-11), nics_per_node=4, conn_gbps=25, flat_channels=4)
    layout, size = Layout.parse("4x4"), 1e8
    assert predict(model, "flat", layout, size)["total"] == pytest.approx(0.01515)
    assert predict(model, "hierarchical", layout, size)["inter_allreduce"] == pytest.approx(0.04803)
    assert predict(model, "sharded", layout, size)["inter_allreduce"] == pytest.approx(0.01203)
    # Without the cap every connection fills its NIC: flat 4x faster than one NIC, the leader back at 8e-11.
    uncapped = Model(Level(0, 0), Level(5e-6, 8e-11), nics_per_node=4, flat_channels=4)
    assert predict(uncapped, "flat", layout, size)["total"] == pytest.approx(30 * (5e-6 + 6.25e6 * 2e-11))
    assert predict(uncapped, "hierarchical", layout, size)["inter_allreduce"] == pytest.approx(6 * (5e-6 + 2.5e7 * 8e-11))


@pytest.mark.unit
def test_one_tcp_stream_per_nic_makes_parallel_groups_win_on_a_single_slow_nic():
    """Horovod PR #3608's shape (one 10 Gbit/s NIC, 6 GPUs per node): if one connection carries 2.5 Gbit/s,
    sharded's 6 concurrent groups fill the NIC and the leaders' single ring gets a quarter of it."""
    capped = Model(Level(0, 0), Level.from_bandwidth(0, 10), conn_gbps=2.5)
    layout = Layout.parse("32x6")
    hier = predict(capped, "hierarchical", layout, S)["inter_allreduce"]
    sharded = predict(capped, "sharded", layout, S)["inter_allreduce"]
    assert hier / sharded == pytest.approx(4.0)
    plain = Model(Level(0, 0), Level.from_bandwidth(0, 10))  # no cap: one NIC is one NIC, whoever fills it
    assert predict(plain, "hierarchical", layout, S)["inter_allreduce"] == pytest.approx(
        predict(plain, "sharded", layout, S)["inter_allreduce"])


@pytest.mark.unit
def test_two_nodes_as_a_tree_send_s_not_two_n_minus_one_over_n_s():
    tree = Model(Level(0, 0), Level.from_bandwidth(0, 100), two_node_tree=True)
    ring = Model(Level(0, 0), Level.from_bandwidth(0, 100))
    layout = Layout.parse("2x8")
    assert predict(tree, "flat", layout, S)["total"] == pytest.approx(S * 8 / 100e9)
    assert predict(ring, "flat", layout, S)["total"] == pytest.approx(2 * 15 / 16 * S * 8 / 100e9)
    assert predict(tree, "flat", Layout.parse("4x8"), S)["total"] == predict(ring, "flat", Layout.parse("4x8"), S)["total"]


@pytest.mark.unit
@pytest.mark.parametrize("key, value", [("nics_per_node", 0), ("flat_channels", 0), ("leader_nics", -1),
                                        ("conn_gbps", 0.0), ("overlap", 1.5)])
def test_bad_model_parameters_are_refused_by_name(key, value):
    with pytest.raises(ValueError, match=f"^{key}={value}"):
        Model(Level(0, 1e-9), Level(0, 1e-9), **{key: value})


@pytest.mark.multiprocess
def test_cli_json_has_seconds_algbw_and_busbw_per_size_and_algorithm():
    out = subprocess.run([sys.executable, "-m", "hybrid.costmodel", "--layout", "5x8", "--sizes", "1G,25M",
                          "--intra-gbps", "3600", "--inter-gbps", "400", "--nics-per-node", "4", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    import json

    report = json.loads(out.stdout)
    rows = {(r["bytes"], r["algorithm"]): r for r in report["predictions"]}
    assert set(rows) == {(size, a) for size in (2**30, 25 * 2**20) for a in ("flat", "hierarchical", "sharded")}
    for (size, _), row in rows.items():
        assert row["algbw_GBps"] == pytest.approx(size / row["seconds"] / 1e9)
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 2 * 39 / 40)
    # NCCL-style flat stripes over the 4 NICs by default: faster than the leaders' single NIC at 1 GiB.
    assert rows[(2**30, "flat")]["seconds"] < rows[(2**30, "hierarchical")]["seconds"]
    assert report["model"]["flat_channels"] == 4
    bad = subprocess.run([sys.executable, "-m", "hybrid.costmodel", "--conn-gbps", "0", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].endswith("conn_gbps=0.0 must be > 0 (or None: "
                                                                                  "no per-connection cap)")


def bench_report(layout: str, model: Model, sizes, nics: int = 1, chunk_mb: float = 4.0, scale: float = 1.0) -> dict:
    """A hybrid.bench report as the model would time it (each time x ``scale``), with its per-phase times."""
    from hybrid.tools.costmodel import as_benched

    lay = Layout.parse(layout)
    report = {"layout": layout, "node_sizes": list(lay.node_sizes), "testbed_nics_per_node": nics,
              "options": {"chunk_mb": chunk_mb}, "results": []}
    for size in sizes:
        m = as_benched(model, report, size)
        for alg in ("flat", "hierarchical", "sharded"):
            phases = predict(m, alg, lay, size, chunk_mb * 2**20)
            total = phases.pop("total")
            report["results"].append({"algorithm": alg, "runs_as": alg, "bytes": size, "median_s": total * scale,
                                      "phases_s": {k: v * scale for k, v in phases.items() if v}})
    return report


@pytest.mark.unit
def test_calibration_takes_the_nic_from_flat_and_phases_only_from_one_piece_rows():
    """Flat is one collective through one NIC: its rows give the inter level. A pipelined row's phase clocks
    also run while the other level works; poisoned here, they must not move the fit."""
    truth = Model(Level(1e-3, 3e-9), Level(0, 8 / 500e6))
    report = bench_report("2x4", truth, [2**20, 4 * 2**20, 16 * 2**20, 80 * 2**20])
    for row in report["results"]:
        if row["bytes"] > 4 * 2**20 and row["runs_as"] != "flat":
            row["phases_s"] = {k: 10 * v for k, v in row["phases_s"].items()}
    fitted = calibrate([report])
    assert fitted.inter.beta_s_per_byte == pytest.approx(truth.inter.beta_s_per_byte, rel=1e-6)
    assert fitted.intra.alpha_s == pytest.approx(truth.intra.alpha_s, rel=1e-6)
    assert fitted.intra.beta_s_per_byte == pytest.approx(truth.intra.beta_s_per_byte, rel=1e-6)


@pytest.mark.unit
def test_as_benched_spreads_the_leaders_pieces_over_at_most_the_window_of_nics():
    from hybrid.tools.costmodel import as_benched

    model = Model(Level(0, 1e-9), Level(0, 1e-8))
    report = {"testbed_nics_per_node": 4, "options": {"chunk_mb": 4.0}}
    assert as_benched(model, report, 2**20).leader_nics == 1  # one piece: one collective, one NIC
    assert as_benched(model, report, 64 * 2**20).leader_nics == 2  # PIPELINE_WINDOW pieces in flight
    assert as_benched(model, report, 64 * 2**20).nics_per_node == 4
    assert as_benched(model, report, 64 * 2**20).flat_channels == 1  # gloo: one collective on one NIC


@pytest.mark.unit
def test_check_compares_every_row_at_the_median_of_repeated_runs():
    from hybrid.tools.costmodel import check

    truth = Model(Level(1e-3, 3e-9), Level(0, 8 / 500e6))
    sizes = [2**20, 16 * 2**20]
    runs = [bench_report("2x4", truth, sizes, nics=2, scale=s) for s in (1.0, 1.2, 0.5)]
    result = check(truth, runs + [bench_report("4x2", truth, sizes, scale=1.1)])
    assert len(result["rows"]) == 2 * 2 * 3
    for row in result["rows"]:
        expected = 0.0 if row["layout"] == "2x4" else 1 / 1.1 - 1  # the median run is the unscaled one
        assert row["runs"] == (3 if row["layout"] == "2x4" else 1)
        assert row["error"] == pytest.approx(expected, abs=1e-9)
    assert result["worst_abs_error"] == pytest.approx(1 - 1 / 1.1)
    with pytest.raises(ValueError, match="no multi-node"):
        check(truth, [bench_report("1x4", truth, sizes)])


@pytest.mark.multiprocess
def test_cli_calibrates_on_one_bench_and_checks_others(tmp_path):
    import json

    truth = Model(Level(1e-3, 3e-9), Level(0, 8 / 500e6))
    base, other = tmp_path / "2x4-1nic.json", tmp_path / "4x2-2nic.json"
    base.write_text(json.dumps(bench_report("2x4", truth, [2**20, 4 * 2**20, 40 * 2**20])))
    other.write_text(json.dumps(bench_report("4x2", truth, [2**20, 40 * 2**20], nics=2)))
    out = subprocess.run([sys.executable, "-m", "hybrid.costmodel", "--calibrate", str(base), "--check", str(base),
                          str(other), "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert len(result["rows"]) == 15 and result["worst_abs_error"] < 1e-6
    assert {(r["layout"], r["nics_per_node"]) for r in result["rows"]} == {("2x4", 1), ("4x2", 2)}
    bad = subprocess.run([sys.executable, "-m", "hybrid.costmodel", "--check", str(tmp_path / "none.json")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "none.json" in bad.stderr and len(bad.stderr.strip().splitlines()) <= 2


@pytest.mark.unit
def test_calibration_fits_how_much_of_the_lesser_level_a_pipeline_hides():
    """Pipelined totals of a cluster that hides 60% of the intra phases behind the NIC: the fit finds 0.6,
    and predictions move from all-hidden towards phases-added accordingly."""
    truth = Model(Level(1e-3, 4e-9), Level(0, 8 / 500e6), overlap=0.6)
    fitted = calibrate([bench_report("2x4", truth, [2**20, 4 * 2**20, 16 * 2**20, 80 * 2**20])])
    assert fitted.overlap == pytest.approx(0.6, abs=1e-6)
    layout, size, chunk = Layout.parse("2x4"), 80 * 2**20, 4 * 2**20
    hidden = predict(replace(truth, overlap=1.0), "hierarchical", layout, size, chunk)
    added = predict(replace(truth, overlap=0.0), "hierarchical", layout, size, chunk)
    assert added["total"] == pytest.approx(hidden["intra_reduce"] + hidden["inter_allreduce"] + hidden["intra_broadcast"])
    assert hidden["total"] < predict(truth, "hierarchical", layout, size, chunk)["total"] < added["total"]


@pytest.mark.multiprocess
def test_published_comparison_runs_and_prints_every_row():
    """experiments/published_vs_model.py, as RESULTS.md quotes it: one table row per published measurement."""
    from pathlib import Path

    script = Path(__file__).parent.parent / "experiments" / "published_vs_model.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + 13
    assert "of 13 rows within 25%" in out.stdout
