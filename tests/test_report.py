"""hybrid.tools.report on a sweep directory laid out as Hydra writes it (jobs made up here)."""

import json
import re
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import hybrid.app.checks  # noqa: F401  registers the schema (train_schema) with Hydra's ConfigStore
from hybrid.app.config import packaged_conf_dir
from hybrid.app.observability.metrics import TAIL_STEPS
from hybrid.core.costmodel import Level, Model, predict
from hybrid.core.topology import Layout
from hybrid.tools.report import load_jobs, main, report_figure
from hybrid.tools.report.breakdown import breakdown_figure

pytestmark = pytest.mark.multiprocess

MB25 = 25 * 2**20


def make_job(root, num, nnodes, nproc, comm, comm_s=None, step_s=1.0, finished=True, extra=None, overrides=(),
             steps=10):
    job = root / str(num)
    (job / ".hydra").mkdir(parents=True)
    with initialize_config_dir(config_dir=str(packaged_conf_dir()), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"cluster.nnodes={nnodes}", f"cluster.nproc_per_node={nproc}",
                                                       f"comm={comm}", "model.width=1024", "model.depth=6", *overrides])
    OmegaConf.save(cfg, job / ".hydra" / "config.yaml")  # as Hydra writes it (interpolations kept)
    if finished:
        phases = {"flat_allreduce": 0.0, "intra_reduce": 0.0, "inter_allreduce": 0.0, "intra_broadcast": 0.0}
        phases.update(comm_s or {})
        (job / "metrics.json").write_text(json.dumps({
            "steps": steps, "steps_run": steps, "comm_s": {k: v * steps for k, v in phases.items()},
            "bytes": {k: 0 for k in phases}, "mean_step_s": step_s, "median_step_s": step_s,
            "samples_per_s": 256 / step_s, "param_bytes": MB25, "final_loss": 1.0,
            "tail_loss_steps": min(steps, TAIL_STEPS), **(extra or {})}))


def test_report_tables_speedups_failures_and_plot(tmp_path):
    # Per step: flat 0.8 s of communication; hierarchical 0.5 s; sharded 0.45 s.
    make_job(tmp_path, 0, 2, 4, "flat", {"flat_allreduce": 0.8}, step_s=1.2)
    make_job(tmp_path, 1, 2, 4, "hierarchical", {"intra_reduce": 0.1, "inter_allreduce": 0.3, "intra_broadcast": 0.1},
             step_s=0.9)
    make_job(tmp_path, 2, 2, 4, "sharded", {"intra_reduce": 0.1, "inter_allreduce": 0.25, "intra_broadcast": 0.1},
             step_s=0.85)
    make_job(tmp_path, 3, 4, 2, "hierarchical", {"intra_reduce": 0.05, "inter_allreduce": 0.5, "intra_broadcast": 0.05})
    make_job(tmp_path, 4, 2, 4, "ddp", step_s=1.3)
    make_job(tmp_path, 5, 4, 2, "flat", finished=False)  # failed or still running
    out = subprocess.run([sys.executable, "-m", "hybrid.report", str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    report = (tmp_path / "report.md").read_text()
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): [c.strip() for c in line.split("|")[1:-1]]
            for line in report.splitlines() if line.startswith("| 2x4") or line.startswith("| 4x2")}
    assert rows[("2x4", "hierarchical")][9] == "1.60"  # comm speed-up: 0.8 / 0.5
    assert rows[("2x4", "sharded")][9] == "1.78"
    assert rows[("2x4", "hierarchical")][10] == "1.33"  # step speed-up: 1.2 / 0.9
    assert rows[("2x4", "ddp")][3:8] == ["-"] * 5  # torch runs DDP's all-reduce: no phase counters
    assert "5: 4x2 flat mlp w1024 d6" in report  # listed, not dropped
    assert "Median absolute prediction error" in report and "Cost model calibrated" in report
    assert (tmp_path / "report.png").stat().st_size > 1000
    assert "5/6 jobs finished" in out.stdout


def test_report_rejects_a_directory_without_jobs(tmp_path):
    out = subprocess.run([sys.executable, "-m", "hybrid.report", str(tmp_path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "holds no Hydra jobs" in out.stderr


def test_auto_jobs_are_set_against_the_fastest_fixed_algorithm(tmp_path):
    make_job(tmp_path, 0, 2, 4, "flat", {"flat_allreduce": 0.8}, step_s=1.2)
    make_job(tmp_path, 1, 2, 4, "hierarchical", {"intra_reduce": 0.1, "inter_allreduce": 0.3}, step_s=0.9)
    make_job(tmp_path, 2, 2, 4, "sharded", {"intra_reduce": 0.1, "inter_allreduce": 0.25}, step_s=0.85)
    decisions = [{"bytes": 2**20, "chosen": "flat", "predicted_s": {}}, {"bytes": MB25, "chosen": "hierarchical",
                                                                        "predicted_s": {}}]
    make_job(tmp_path, 3, 2, 4, "auto", {"intra_reduce": 0.1, "inter_allreduce": 0.3}, step_s=0.88,
             extra={"comm_auto": {"decisions": decisions}, "runs_as": f"1048576:flat,{MB25}:hierarchical"})
    out = subprocess.run([sys.executable, "-m", "hybrid.report", str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    report = (tmp_path / "report.md").read_text()
    row = next(line for line in report.splitlines() if line.startswith("| mlp w1024 d6 | 2x4 |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    # Step: sharded is fastest (0.85 s); communication: sharded too (0.35 s per step against auto's 0.4 s).
    assert cells[2:] == [f"1048576:flat,{MB25}:hierarchical", "880.0", "sharded", "850.0", "1.035",
                         "400.0", "sharded", "350.0", "1.143"]
    assert "auto / best step time: worst 1.035" in report


def _ranks(compute, comm_wait, step, exposed):
    phases = {"flat_allreduce": 0.0, "intra_reduce": 0.0, "inter_allreduce": 0.0, "intra_broadcast": 0.0}
    return [{"rank": r, "node": r // 2, "compute_s": compute, "comm_wait_s": comm_wait, "step_s": step,
             "exposed_s": {**phases, **exposed}, "phase_s": {**phases, **exposed}} for r in range(4)]


def test_the_breakdown_stacks_compute_exposed_phases_and_the_rest_per_comm(tmp_path):
    make_job(tmp_path, 0, 2, 2, "hierarchical", {"inter_allreduce": 0.4}, step_s=0.9,
             extra={"ranks": _ranks(0.5, 0.3, 0.9, {"inter_allreduce": 0.2, "intra_broadcast": 0.05})})
    make_job(tmp_path, 1, 2, 2, "ddp", step_s=1.0, extra={"ranks": _ranks(0.6, 0.4, 1.0, {})})
    make_job(tmp_path, 2, 2, 2, "flat", {"flat_allreduce": 0.5}, step_s=1.1)  # an older run: no accounts
    out = subprocess.run([sys.executable, "-m", "hybrid.report", str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    report = (tmp_path / "report.md").read_text()
    table = report[report.index("## Where a step's time goes"):].splitlines()
    rows = {line.split("|")[3].strip(): [c.strip() for c in line.split("|")[4:-1]] for line in table
            if line.startswith("| mlp")}
    # compute, flat / intra_reduce / inter / intra_broadcast exposed, comm_wait without a phase, other
    assert rows["hierarchical"] == ["500.0", "0.0", "0.0", "200.0", "50.0", "50.0", "100.0"]
    assert rows["ddp"] == ["600.0", "0.0", "0.0", "0.0", "0.0", "400.0", "0.0"]
    assert "flat" not in rows
    assert (tmp_path / "report_breakdown.png").stat().st_size > 1000


def test_the_peers_table_sets_torchs_own_comms_beside_hybrids_with_memory_network_and_loss(tmp_path):
    """hsdp, DDP with torch's fp16 hook and hybrid's 16-bit inter-node hop are rows of their own (not folded
    into ddp or hierarchical), with samples/s against plain DDP, the largest rank's peak RSS, the busiest
    node's NIC bytes per step and the final loss; torch's own comms show no hybrid phases."""
    peers = {"peak_rss_mb": [900.0, 700.0], "nic_tx_bytes_per_step": 25e6, "final_loss": 2.0, "tail_loss": 2.5}
    make_job(tmp_path, 0, 2, 4, "ddp", step_s=1.0, extra=peers)
    make_job(tmp_path, 1, 2, 4, "ddp", step_s=0.8, extra={**peers, "nic_tx_bytes_per_step": 12.5e6},
             overrides=["comm.torch_hook=fp16"])
    make_job(tmp_path, 2, 2, 4, "hsdp", step_s=0.5, extra={**peers, "peak_rss_mb": [500.0, 400.0]})
    make_job(tmp_path, 3, 2, 4, "hierarchical", {"intra_reduce": 0.1, "inter_allreduce": 0.2, "intra_broadcast": 0.1},
             step_s=0.4, extra={**peers, "final_loss": 2.01}, overrides=["comm.inter_compression=bf16"])
    make_job(tmp_path, 5, 2, 4, "sharded", {"intra_reduce": 0.1, "inter_allreduce": 0.2, "intra_broadcast": 0.1},
             step_s=0.45, extra={**peers, "peak_rss_mb": [600.0, 610.0], "optimizer_state_bytes": [2**21, 2**22]},
             overrides=["comm.shard_optimizer=true"])
    # A plain hierarchical job calibrates the cost model, which then prices jobs: not the 16-bit ones.
    make_job(tmp_path, 4, 2, 4, "hierarchical", {"intra_reduce": 0.1, "inter_allreduce": 0.4, "intra_broadcast": 0.1},
             step_s=0.6, extra=peers)
    out = subprocess.run([sys.executable, "-m", "hybrid.report", str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    report = (tmp_path / "report.md").read_text()
    peers_part = report.split("## Side by side with torch's own")[1].split("##")[0]
    rows = {line.split("|")[3].strip(): [c.strip() for c in line.split("|")[4:-1]]
            for line in peers_part.splitlines() if line.startswith("| mlp")}
    # 10-step runs: the tail window (20 steps) would be the whole run, so no tail-loss column
    assert rows["ddp"] == ["256", "1.00", "900", "-", "25.00", "2.0000"]
    assert rows["ddp+fp16"] == ["320", "1.25", "900", "-", "12.50", "2.0000"]
    assert rows["hsdp"] == ["512", "2.00", "500", "-", "25.00", "2.0000"]
    assert rows["hierarchical+bf16"] == ["640", "2.50", "900", "-", "25.00", "2.0100"]
    assert rows["sharded+zero"] == ["569", "2.22", "610", "4.0", "25.00", "2.0000"]  # its optimizer: largest rank
    assert "last 20 steps" not in report
    main = {tuple(c.strip() for c in line.split("|")[1:3]): [c.strip() for c in line.split("|")[1:-1]]
            for line in report.split("## Side by side")[0].splitlines() if line.startswith("| 2x4")}
    assert main[("2x4", "hsdp")][3:8] == ["-"] * 5 and main[("2x4", "ddp+fp16")][3:8] == ["-"] * 5
    assert main[("2x4", "hierarchical+bf16")][4] == "200.0"  # its inter phase, ms per step


# --- The report states its answer: headlines, honest numbers, plots from 0 -------------------------------------

TESTBED = ["cluster.testbed.enabled=true", "cluster.testbed.link_mbit=500"]
NAN_OR_INF = re.compile(r"\b(inf|nan)\b", re.IGNORECASE)


def testbed_job(root, num, nnodes, nproc, comm, step_s, comm_s=None, nic=None, compute=0.15, steps=12, **kw):
    """A finished testbed job with the fields the trainer writes there (run_metrics.py, step_accounts.py): NIC
    bytes per step of each node and the busiest's, every rank's accounts, tail loss and its window."""
    extra = {"peak_rss_mb": [410.0] * nnodes, "final_loss": 2.3, "tail_loss": 2.31,
             "ranks": _ranks(compute, step_s - compute, step_s, {})}
    if nic is not None:
        extra |= {"nic_tx_bytes_per_step_by_node": [nic * 0.98] + [nic] * (nnodes - 1), "nic_tx_bytes_per_step": nic}
    extra |= kw.pop("extra", {})
    make_job(root, num, nnodes, nproc, comm, comm_s, step_s=step_s, extra=extra, overrides=[*TESTBED, *kw.pop(
        "overrides", [])], steps=steps, **kw)


@pytest.fixture
def four_jobs(tmp_path):
    """2x2 and 2x4, flat and hierarchical, 25 MiB on 500 Mbit/s testbed links; 12-step runs (flat_vs_hier's)."""
    testbed_job(tmp_path, 0, 2, 2, "flat", 0.700, {"flat_allreduce": 0.52}, nic=39.3e6)
    testbed_job(tmp_path, 1, 2, 2, "hierarchical", 0.477,
                {"intra_reduce": 0.032, "inter_allreduce": 0.344, "intra_broadcast": 0.0012}, nic=26.5e6)
    testbed_job(tmp_path, 2, 2, 4, "flat", 0.838, {"flat_allreduce": 0.68}, nic=45.9e6)
    testbed_job(tmp_path, 3, 2, 4, "hierarchical", 0.634,
                {"intra_reduce": 0.105, "inter_allreduce": 0.329, "intra_broadcast": 0.0088}, nic=27.0e6,
                extra={"ranks": _ranks(0.16, 0.47, 0.634, {"intra_reduce": 0.1, "inter_allreduce": 0.1,
                                                          "intra_broadcast": 0.1435})})
    return tmp_path


def run_report(sweep):
    assert main([str(sweep)]) == 0
    return (sweep / "report.md").read_text()


def test_every_shape_gets_a_headline_with_its_ratio_and_the_nic_bytes_behind_it(four_jobs):
    report = run_report(four_jobs)
    heads = [line for line in report.splitlines() if line.startswith("- **")]
    assert heads[0].startswith("- **2x2, mlp w1024 d6 (25 MiB), testbed links 500 Mbit/s:** hierarchical is "
                               "fastest, 1.47x faster per step than flat (runner-up; 477 ms against 700 ms).")
    assert heads[1].startswith("- **2x4, mlp w1024 d6 (25 MiB), testbed links 500 Mbit/s:** hierarchical is "
                               "fastest, 1.32x faster per step than flat (runner-up; 634 ms against 838 ms).")
    # the reason, measured at the NIC: bytes per step and the wire time they need at 500 Mbit/s
    assert ("The busiest node's NIC sends 43.8 MiB per step under flat, 25.7 MiB under hierarchical (at least 734 ms and "
            "432 ms on the wire at 500 Mbit/s).") in heads[1]
    assert len(heads) == 2 and report.index("## Headlines") < report.index("## mlp w1024 d6")
    # Both hierarchical jobs cross the network between 2 nodes: every inter call is one size, so no model, and
    # no crossing claimed without one.
    assert "No cost model: inter: not fitted (all inter calls the same size" in report
    assert "overtake" not in report and "keeps" not in report


def test_no_inf_or_nan_and_the_unfitted_bandwidth_in_words(tmp_path):
    """2x2, 2x4 and 4x2 hierarchical whose intra time does not grow with size (4x as long for 3x the steps and
    1.5x the bytes): least squares gives a negative per-byte cost, clamped to 0, once printed as 'inf Mbit/s'."""
    testbed_job(tmp_path, 0, 2, 2, "hierarchical", 0.5, {"intra_reduce": 0.02, "inter_allreduce": 0.33}, nic=26e6)
    testbed_job(tmp_path, 1, 2, 4, "hierarchical", 0.6, {"intra_reduce": 0.1, "inter_allreduce": 0.33}, nic=26e6)
    testbed_job(tmp_path, 2, 4, 2, "hierarchical", 0.8, {"intra_reduce": 0.02, "inter_allreduce": 0.57}, nic=39e6)
    testbed_job(tmp_path, 3, 2, 4, "flat", 0.8, {"flat_allreduce": 0.65}, nic=46e6)
    testbed_job(tmp_path, 4, 2, 4, "ddp", 0.81, nic=46e6, extra={"samples_per_s": float("nan")})
    report = run_report(tmp_path)
    assert NAN_OR_INF.search(report) is None, NAN_OR_INF.search(report)
    assert "intra: bandwidth not fitted (the time per call did not grow with its size" in report
    assert "No crossing point: the cost model's intra bandwidth was not fitted." in report


def test_the_crossing_is_where_the_cost_model_says_flat_would_overtake(tmp_path):
    """Jobs timed exactly as a known model prices them: the calibration recovers it, and the link rate the
    headline names is where the model's flat and hierarchical communication times cross."""
    truth = Model(Level.from_bandwidth(1000, 2.0), Level.from_bandwidth(1000, 0.5))
    for num, (n, g) in enumerate(((2, 4), (4, 2), (2, 2))):
        phases = predict(truth, "hierarchical", Layout.uniform(n, g), MB25)
        testbed_job(tmp_path, num, n, g, "hierarchical", 0.15 + phases["total"],
                    {p: phases[p] for p in ("intra_reduce", "inter_allreduce", "intra_broadcast")})
    flat = predict(truth, "flat", Layout.uniform(2, 4), MB25)["total"]
    testbed_job(tmp_path, 3, 2, 4, "flat", 0.15 + flat, {"flat_allreduce": flat})
    report = run_report(tmp_path)
    head = next(line for line in report.splitlines() if line.startswith("- **2x4"))
    assert "hierarchical is fastest" in head
    rate = re.search(r"flat would overtake hierarchical with links faster than ([\d.]+) Gbit/s", head)
    assert rate, head
    layout = Layout.uniform(2, 4)

    def flat_minus_hier(gbit):
        model = Model(truth.intra, Level.from_bandwidth(1000, gbit))
        return predict(model, "flat", layout, MB25)["total"] - predict(model, "hierarchical", layout, MB25)["total"]

    crossing = float(rate.group(1))
    assert flat_minus_hier(crossing * 0.98) > 0 > flat_minus_hier(crossing * 1.02)
    assert "the fitted inter-node level: 500 Mbit/s" in head
    # its latency advantage keeps hierarchical ahead at any size in the model: said, as computed
    assert "keeps hierarchical ahead of flat at every gradient size from 256 KiB to 2.44 GiB" in head


def test_the_phase_tables_say_which_time_they_show(four_jobs):
    report = run_report(four_jobs).splitlines()
    phase_header = next(line for line in report if line.startswith("| shape | comm |"))
    exposed_header = next(line for line in report if line.startswith("| model | shape | comm | compute"))
    assert "intra_broadcast ms (time in call)" in phase_header and "exposed" not in phase_header
    assert "intra_broadcast exposed ms (waited on by the step)" in exposed_header
    assert "time in call" not in exposed_header

    def under(header):  # the first line after the table
        k = report.index(header) + 1
        while report[k].startswith("|"):
            k += 1
        return report[k + 1]

    assert under(phase_header).startswith("Time in call: rank 0's seconds inside each phase's calls")
    assert under(exposed_header).startswith("Exposed: the part of a phase the training step waited for")
    hier = next(line for line in report[report.index(exposed_header):]
                if line.startswith("| mlp w1024 d6 | 2x4 | hierarchical |"))
    assert hier.split("|")[8].strip() == "143.5"  # 2x4 hierarchical's intra_broadcast, exposed
    hier = next(line for line in report if line.startswith("| 2x4 | hierarchical |"))
    assert hier.split("|")[6].strip() == "8.8"  # ... and in call on rank 0


def test_the_tail_loss_shows_only_for_runs_longer_than_its_window(tmp_path):
    testbed_job(tmp_path, 0, 2, 2, "flat", 0.7, {"flat_allreduce": 0.5}, steps=TAIL_STEPS)
    testbed_job(tmp_path, 1, 2, 2, "hierarchical", 0.5, {"inter_allreduce": 0.3}, steps=2 * TAIL_STEPS,
                extra={"tail_loss": 2.125})
    report = run_report(tmp_path)
    peers = report.split("## Side by side with torch's own")[1].split("##")[0]
    assert f"| loss, mean of the last {TAIL_STEPS} steps (all ranks) |" in peers
    rows = {line.split("|")[3].strip(): line.split("|")[-2].strip() for line in peers.splitlines()
            if line.startswith("| mlp")}
    assert rows == {"flat": "-", "hierarchical": "2.1250"}


def test_every_plot_starts_at_0_and_names_the_link(four_jobs):
    jobs = load_jobs(four_jobs)
    fig = report_figure(jobs)
    assert [ax.get_ylim()[0] for ax in fig.axes] == [0.0, 0.0]
    assert fig.get_suptitle().startswith("testbed links 500 Mbit/s")
    bars = breakdown_figure(jobs, "testbed links 500 Mbit/s")
    panels = bars.axes
    assert len(panels) == 2 and all(ax.get_ylim()[0] == 0.0 for ax in panels)
    assert panels[0].get_shared_y_axes().joined(panels[0], panels[1])  # one y scale
    assert len(bars.legends) == 1 and all(ax.get_legend() is None for ax in panels)  # one legend, for the figure
    run_report(four_jobs)
    assert (four_jobs / "report.png").stat().st_size > 1000
    assert (four_jobs / "report_breakdown.png").stat().st_size > 1000


def test_ddp_is_drawn_in_the_communication_panel_or_said_missing(tmp_path):
    testbed_job(tmp_path, 0, 2, 4, "flat", 0.84, {"flat_allreduce": 0.68}, nic=45.9e6)
    testbed_job(tmp_path, 1, 2, 4, "ddp", 0.85, nic=45.9e6)  # per-rank accounts: its exposed wait is drawn
    comm_panel = report_figure(load_jobs(tmp_path)).axes[1]
    labels = comm_panel.get_legend_handles_labels()[1]
    assert labels == ["flat, in calls", "flat, exposed", "ddp, exposed (no phase counters)"]
    make_job(tmp_path, 2, 2, 2, "ddp", step_s=0.6, overrides=TESTBED)  # an older run: no accounts
    make_job(tmp_path, 3, 2, 2, "flat", {"flat_allreduce": 0.5}, step_s=0.6, overrides=TESTBED)
    fig = report_figure(load_jobs(tmp_path))
    notes = [t.get_text() for t in fig.axes[1].texts]
    assert notes == ["ddp at 2x2: no phase counters and no per-rank accounts: not drawn"]
    assert fig.get_suptitle().startswith("testbed links 500 Mbit/s")


def test_a_loopback_sweep_says_so_on_the_figure_and_in_the_headline(tmp_path):
    make_job(tmp_path, 0, 2, 2, "flat", {"flat_allreduce": 0.05}, step_s=0.1)
    make_job(tmp_path, 1, 2, 2, "hierarchical", {"inter_allreduce": 0.06}, step_s=0.12)
    report = run_report(tmp_path)
    assert "- **2x2, mlp w1024 d6 (25 MiB), no network limit (loopback):** flat is fastest, 1.20x faster per step " \
           "than hierarchical (runner-up; 100 ms against 120 ms). Communication per step (rank 0's time in phase " \
           "calls): hierarchical 60 ms, flat 50 ms." in report
    assert report_figure(load_jobs(tmp_path)).get_suptitle().startswith("no network limit (loopback)")


def test_a_diloco_job_is_named_by_its_schedule_so_a_sweep_over_h_keeps_its_jobs_apart():
    from hybrid.tools.report import comm_label

    def label(**comm):
        return comm_label(OmegaConf.create(comm))

    assert label(algorithm="diloco", sync_every=32) == "diloco:h32"
    assert label(algorithm="diloco", sync_every=8, fragments=4, overlap=True, inter_compression="fp8") == \
        "diloco:h8:f4:overlap+fp8"
    assert label(algorithm="hierarchical", inter_compression="bf16") == "hierarchical+bf16"


def test_jobs_that_logged_their_loss_get_curves_by_samples_and_wall_time_and_their_bytes(tmp_path):
    """A sweep of comms that train differently (DiLoCo is another optimizer): report_loss.png holds one row per
    shape with the loss against samples and wall time, read from each job's TensorBoard log by TensorBoard's own
    reader, and the bytes across nodes per step (the comm's counters; torch's own DDP has none, said so)."""
    from torch.utils.tensorboard import SummaryWriter

    from hybrid.tools.report.loss import bytes_per_step, loss_figure, loss_points, smoothed

    make_job(tmp_path, 0, 2, 2, "ddp", steps=40, extra={"samples_per_step": 64})
    make_job(tmp_path, 1, 2, 2, "diloco", steps=40, extra={"samples_per_step": 64, "bytes": {
        "inter_allreduce": 40 * 1000, "intra_broadcast": 40 * 500, "flat_allreduce": 0, "intra_reduce": 0}})
    make_job(tmp_path, 2, 2, 2, "hierarchical", steps=40, extra={"samples_per_step": 64})  # logged 4 steps only
    for num, every in ((0, 1), (1, 1), (2, 10)):
        with SummaryWriter(str(tmp_path / str(num) / "tb")) as writer:
            for step in range(every, 41, every):
                writer.add_scalar("train/loss", 3.0 / step, step, walltime=1000.0 + step * (num + 1))
    jobs = {j.comm: j for j in load_jobs(tmp_path)}
    assert [p[:2] for p in loss_points(jobs["diloco:h32"])][:2] == [(1, 3.0), (2, 1.5)]
    assert bytes_per_step(jobs["diloco:h32"]) == (1000.0, "rank 0's bytes across nodes per step")
    assert bytes_per_step(jobs["ddp"])[0] is None
    assert smoothed([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    fig = loss_figure(list(jobs.values()))
    by_samples, by_time, sent = fig.axes
    assert [line.get_label() for line in by_samples.get_lines()] == ["ddp", "diloco:h32"]  # not the 4-point job
    assert by_samples.get_lines()[1].get_xdata()[-1] == 40 * 64  # samples seen
    assert by_time.get_lines()[1].get_xdata()[-1] == 2 * 39  # seconds from the first logged step
    assert [round(b.get_height(), 6) for b in sent.patches] == [0.0, 0.001]
    assert "(no counts)" in sent.get_xticklabels()[0].get_text()
    assert main([str(tmp_path)]) == 0 and (tmp_path / "report_loss.png").stat().st_size > 1000
