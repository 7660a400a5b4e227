"""comm=auto: which algorithms it weighs, how the cost model prices pipelined buckets, and what it picks.

The collective parts (calibration agreed by every rank, results equal to torch's flat mean, DDP parity with
buckets taking different algorithms) run in the 2x2 job of tests/test_comm_multiprocess.py.
"""

from dataclasses import replace
from datetime import timedelta

import pytest
import torch

from hybrid.core.comm import AutoCommunicator, CommGroups, group_kinds_for
from hybrid.core.comm.auto import CALIBRATION_SIZES, auto_candidates, fit_calibration
from hybrid.core.costmodel import Level, Model, predict
from hybrid.core.topology import Layout, Topology

pytestmark = pytest.mark.unit

MiB = 2**20


def _groups(topology):
    """Groups as CommGroups.build names them; no process group is needed while nothing is sent."""
    kinds = frozenset(group_kinds_for("auto", topology))
    return CommGroups(topology, "gloo", "gloo", timedelta(seconds=1), world=None, intra=None, leaders=None,
                      cross=object() if "cross" in kinds else None, kinds=kinds)


@pytest.mark.parametrize(("nodes", "expected", "for_zero"), [
    (((0, 1, 2, 3),), ("flat",), ("hierarchical",)),   # one node: no slow link to spare
    (((0,), (1,), (2,)), ("flat",), ("hierarchical",)),  # one worker per node: every algorithm is the same ring
    (((0, 1), (2, 3)), ("flat", "hierarchical", "sharded"), ("hierarchical", "sharded")),
    (((0, 1, 2), (3,)), ("flat", "hierarchical"), ("hierarchical",)),  # uneven: sharded's shards would not line up
])
def test_candidates_follow_the_layout_and_so_do_the_groups(nodes, expected, for_zero):
    """And for a node-sharded optimizer (comm.shard_optimizer) only the algorithms with an intra-node phase,
    which gathers its updated parameters: never flat."""
    topo = Topology(0, nodes)
    assert auto_candidates(topo) == expected and auto_candidates(topo, shards_optimizer=True) == for_zero
    kinds = {"flat": {"world"}, "hierarchical": {"intra", "leaders"}, "sharded": {"intra", "cross"}}
    assert set(group_kinds_for("auto", topo)) == set().union(*(kinds[a] for a in expected))
    calibrates = {"world"} if len(for_zero) > 1 else set()  # measure_levels times flat's level too
    assert set(group_kinds_for("auto", topo, shards_optimizer=True)) == calibrates.union(*(kinds[a] for a in for_zero))


def test_pipelining_hides_the_cheaper_phases_behind_the_slowest():
    model = Model(Level(0.0, 1e-9), Level(0.0, 1e-8))  # inter 10x slower per byte
    layout, size = Layout.parse("2x4"), 64 * MiB
    summed = predict(model, "hierarchical", layout, size)
    piped = predict(model, "hierarchical", layout, size, chunk_bytes=4 * MiB)
    # 16 pieces: one piece through all three phases, then 15 at the inter phase's pace.
    piece = {k: v / 16 for k, v in piped.items() if k != "total"}
    assert piped["total"] == pytest.approx(sum(piece.values()) + 15 * piece["inter_allreduce"])
    assert piped["total"] < summed["total"]
    # Where the node is the bottleneck, its reduce and broadcast share the intra level: they pace together.
    slow_intra = predict(Model(Level(0.0, 1e-8), Level(0.0, 1e-9)), "hierarchical", layout, size, chunk_bytes=4 * MiB)
    piece = {k: v / 16 for k, v in slow_intra.items() if k != "total"}
    assert slow_intra["total"] == pytest.approx(
        sum(piece.values()) + 15 * (piece["intra_reduce"] + piece["intra_broadcast"]))
    assert piped["inter_allreduce"] == pytest.approx(summed["inter_allreduce"])  # same bytes in all
    with pytest.raises(ValueError, match="chunk_bytes=0"):
        predict(model, "hierarchical", layout, size, chunk_bytes=0)


def _auto(topology, model, compression="none"):
    return AutoCommunicator(_groups(topology), model=model, inter_compression=compression)


def test_slow_network_picks_hierarchical_for_large_buckets_and_flat_where_intra_latency_dominates():
    # Intra: 2 ms per step but fast bytes; inter: 10 us per step, 1 Gbit/s.
    model = Model(Level(2e-3, 8 / 100e9), Level(10e-6, 8 / 1e9))
    auto = _auto(Topology(0, ((0, 1, 2, 3), (4, 5, 6, 7))), model)
    big, small = auto.decide(25 * MiB), auto.decide(4096)
    assert big.chosen == "hierarchical"
    assert small.chosen == "flat"
    # The predictions it chose from are the cost model's, pipelined in the communicator's pieces.
    layout = Layout.parse("2x4")
    for name, seconds in big.predicted_s.items():
        assert seconds == pytest.approx(predict(model, name, layout, 25 * MiB, chunk_bytes=auto.chunk_bytes)["total"])
    # Sharded costs what hierarchical does over one NIC per node: equal predictions go to the simpler one.
    assert big.predicted_s["sharded"] == big.predicted_s["hierarchical"]
    assert auto.decide(25 * MiB) is big  # decided once per size
    report = auto.report()
    assert [d["bytes"] for d in report["decisions"]] == [4096, 25 * MiB]
    assert report["model"]["inter"]["gbit_per_s"] == pytest.approx(1.0)


def test_compressing_the_inter_hop_halves_its_price_for_the_two_level_algorithms_only():
    model = Model(Level(0.0, 8 / 10e9), Level(0.0, 8 / 1e9))
    topo = Topology(0, ((0, 1), (2, 3)))
    plain, compressed = _auto(topo, model).decide(8 * MiB), _auto(topo, model, "bf16").decide(8 * MiB)
    assert compressed.predicted_s["flat"] == plain.predicted_s["flat"]
    assert compressed.predicted_s["hierarchical"] < 0.75 * plain.predicted_s["hierarchical"]
    # bf16 tensors travel in 16 bits already: no saving to price in.
    bf16 = _auto(topo, model, "bf16").decide(8 * MiB, torch.bfloat16)
    assert bf16.predicted_s["hierarchical"] == plain.predicted_s["hierarchical"]


def test_levels_measured_from_an_algorithms_own_collectives_price_it_instead_of_the_derivation():
    derived = Model(Level(1e-4, 8 / 10e9), Level(10e-6, 8 / 1e9))
    topo = Topology(0, ((0, 1, 2, 3), (4, 5, 6, 7)))
    before = _auto(topo, derived).decide(2 * MiB)
    assert before.predicted_s["sharded"] == before.predicted_s["hierarchical"]  # one NIC: priced alike
    # Measured: the all-to-all is cheaper than the rooted reduce, and the 4 concurrent cross all-reduces
    # of 1/4 each take 0.9x what the leaders' one does (per byte of shard: 4 x 0.9 the inter beta).
    measured = replace(derived, sharded_intra=Level(0.5e-4, 8 / 20e9),
                       sharded_inter=Level(10e-6, 0.9 * 4 * 8 / 1e9), flat=Level(10e-6, 2 * 8 / 1e9))
    after = _auto(topo, measured).decide(2 * MiB)
    assert after.chosen == "sharded" and after.predicted_s["sharded"] < 0.95 * after.predicted_s["hierarchical"]
    assert after.predicted_s["hierarchical"] == before.predicted_s["hierarchical"]  # its own levels: unchanged
    assert after.predicted_s["flat"] == pytest.approx(2 * before.predicted_s["flat"], rel=0.01)
    # bf16 on the inter hop also makes the measured cross level cheaper.
    squeezed = _auto(topo, measured, "bf16").decide(2 * MiB)
    assert squeezed.predicted_s["sharded"] < after.predicted_s["sharded"]
    assert squeezed.predicted_s["flat"] == after.predicted_s["flat"]
    assert set(_auto(topo, measured).report()["model"]) == {"intra", "inter", "flat", "sharded_intra", "sharded_inter"}


@pytest.mark.parametrize("timed_sharded", [True, False])  # equal nodes; nodes of 3 and 1 (priced as 2 x 3)
def test_the_fitted_model_reproduces_the_timed_points_on_the_layout_it_prices(timed_sharded):
    sizes, layout = CALIBRATION_SIZES, Layout.uniform(2, 3)
    # Times of the form latency + size / rate, as each phase was timed (the slowest rank's).
    shape = {"intra": (3e-4, 4e9), "inter": (1e-3, 5e7), "flat": (2e-3, 4e7), "s_intra": (2e-4, 6e9),
             "s_inter": (1.5e-3, 5.5e7)}
    if not timed_sharded:
        del shape["s_intra"], shape["s_inter"]
    seconds = {k: [lat + s / rate for s in sizes] for k, (lat, rate) in shape.items()}
    model = fit_calibration(seconds, sizes, layout)
    assert (model.sharded_inter is not None) == timed_sharded
    for i, size in enumerate(sizes):
        assert predict(model, "flat", layout, size)["total"] == pytest.approx(seconds["flat"][i])
        hier = predict(model, "hierarchical", layout, size)
        assert hier["intra_reduce"] + hier["intra_broadcast"] == pytest.approx(seconds["intra"][i])
        assert hier["inter_allreduce"] == pytest.approx(seconds["inter"][i])
        if timed_sharded:
            sharded = predict(model, "sharded", layout, size)
            assert sharded["intra_reduce"] + sharded["intra_broadcast"] == pytest.approx(seconds["s_intra"][i])
            assert sharded["inter_allreduce"] == pytest.approx(seconds["s_inter"][i])


def test_one_candidate_needs_no_calibration_and_runs_flat():
    auto = AutoCommunicator(_groups(Topology(0, ((0, 1, 2, 3),))))  # would need groups to calibrate
    assert auto.model is None
    assert auto.decide(25 * MiB).chosen == "flat"
    assert auto.report()["calibration_s"] == 0.0


class _Recorder:
    def __init__(self):
        self.scalars_seen, self.texts, self.lines = [], [], []

    def scalars(self, step, values):
        self.scalars_seen.append((step, values))

    def text(self, tag, text, step):
        self.texts.append((tag, text, step))

    def status(self, line):
        self.lines.append(line)


def test_each_new_decision_goes_to_tensorboard_once_with_its_predictions():
    from hybrid.app.observability.run_metrics import describe_auto_calibration, log_auto_decisions

    model = Model(Level(2e-3, 8 / 100e9), Level(10e-6, 8 / 1e9))
    auto = _auto(Topology(0, ((0, 1), (2, 3))), model)
    assert "inter alpha 10 us, 1 Gbit/s" in describe_auto_calibration(auto)
    auto.decide(4096), auto.decide(25 * MiB), auto.decide(4096, torch.bfloat16)  # a bf16 bucket of 4096 bytes too
    out, logged = _Recorder(), set()
    log_auto_decisions(auto, out, 10, logged)
    assert logged == {"4096B", f"{25 * MiB}B", "4096B_bfloat16"}
    tags = {k for _, values in out.scalars_seen for k in values}
    assert tags == {f"comm_auto/{b}/predicted_{a}_ms" for b in logged for a in auto.candidates}
    (tag, table, step), = out.texts
    assert tag == "comm_auto/decisions" and step == 10
    assert f"| {25 * MiB} | float32 | hierarchical |" in table and "| 4096 | float32 | flat |" in table
    assert "| 4096 | bfloat16 | flat |" in table
    log_auto_decisions(auto, out, 20, logged)  # nothing new: nothing logged
    assert len(out.texts) == 1
