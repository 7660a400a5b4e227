"""The alpha-beta model: the ring-order byte counts, calibration, and the CLI."""

import subprocess
import sys

import pytest

from hybrid.core.costmodel import Level, Model, calibrate, predict, predict_all
from hybrid.core.topology import Layout

S = 25 * 2**20


def bandwidth_only(inter_gbps=0.5, intra_gbps=1e6, nics=1):
    return Model(Level.from_bandwidth(0, intra_gbps), Level.from_bandwidth(0, inter_gbps), nics)


def test_2x4_flat_pushes_1_75x_the_bytes_of_hierarchical_through_each_nic():
    model = bandwidth_only()
    flat = predict(model, "flat", Layout.parse("2x4"), S)["total"]
    hier = predict(model, "hierarchical", Layout.parse("2x4"), S)["inter_allreduce"]
    assert flat / hier == pytest.approx(1.75, rel=1e-6)
    assert hier == pytest.approx(S * 8 / 0.5e9)  # 2(n-1)/n = 1 x S through a 500 Mbit/s NIC


def test_single_node_uses_only_the_intra_level_and_single_rank_nodes_only_inter():
    model = Model(Level(1e-6, 1e-10), Level(1e-3, 1e-8))
    one_node = predict(model, "flat", Layout.parse("1x4"), S)
    assert one_node["total"] == pytest.approx(2 * 3 * (1e-6 + S / 4 * 1e-10))
    leaders_only = predict(model, "hierarchical", Layout.parse("4x1"), S)
    assert leaders_only["intra_reduce"] == leaders_only["intra_broadcast"] == 0
    assert leaders_only["total"] == pytest.approx(predict(model, "flat", Layout.parse("4x1"), S)["total"])


def test_sharded_spreads_the_inter_phase_over_several_nics():
    one = predict(bandwidth_only(nics=1), "sharded", Layout.parse("2x8"), S)["inter_allreduce"]
    eight = predict(bandwidth_only(nics=8), "sharded", Layout.parse("2x8"), S)["inter_allreduce"]
    assert one / eight == pytest.approx(8)


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


def test_calibration_recovers_the_levels_it_was_measured_on():
    truth = Model(Level(50e-6, 1 / 2e9), Level(300e-6, 8 / 500e6))
    reports = [fake_report("2x4", truth, [2**20, 8 * 2**20, S]), fake_report("4x2", truth, [2**20, S])]
    fitted = calibrate(reports)
    assert fitted.intra.alpha_s == pytest.approx(truth.intra.alpha_s, rel=1e-6)
    assert fitted.inter.beta_s_per_byte == pytest.approx(truth.inter.beta_s_per_byte, rel=1e-6)


def test_calibration_needs_two_sizes():
    truth = Model(Level(1e-5, 1e-9), Level(1e-4, 1e-8))
    with pytest.raises(ValueError, match="two message sizes"):
        calibrate([fake_report("2x2", truth, [S])])


def test_cli_prints_a_1024_node_prediction():
    out = subprocess.run([sys.executable, "-m", "hybrid.costmodel", "--layout", "1024x8", "--sizes", "25M"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "world 8192" in out.stdout and "hierarchical" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "hybrid.costmodel", "--layout", "0x8"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "nnodes (0)" in bad.stderr
