"""python -m hybrid.bench: options, bad input, and a real (small) run."""

import json
import socket
import subprocess
import sys
import threading

import pytest

from hybrid.core.units import parse_size
from hybrid.runtime.testbed import nic_tx_bytes


def bench(*args, cwd=None, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "hybrid.bench", *args],
        capture_output=True, text=True, cwd=cwd, timeout=timeout,
    )


@pytest.mark.unit
@pytest.mark.parametrize("text,nbytes", [("1", 1), ("4K", 4096), ("25M", 25 * 2**20), ("1MB", 2**20), ("1.5k", 1536)])
def test_parse_size(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.unit
@pytest.mark.parametrize("text", ["", "1Q", "-1M", "0", "M"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


@pytest.mark.multiprocess
def test_help_documents_the_options():
    out = bench("--help")
    assert out.returncode == 0
    for option in ("--layout", "--sizes", "--algorithms", "--iters", "--output", "--dtype", "--timeout"):
        assert option in out.stdout


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "args,needle",
    [
        (["--layout", "2y2"], "'2y2'"),
        (["--sizes", "1Q"], "'1Q'"),
        (["--algorithms", "flat,bogus"], "'flat,bogus'"),
        (["--iters", "0"], "--iters 0"),
        (["--dtype", "int8"], "'int8'"),
    ],
)
def test_bad_input_is_one_clear_line_and_nonzero_exit(args, needle, tmp_path):
    out = bench(*args, "--output", str(tmp_path / "b.json"))
    assert out.returncode == 2
    error_lines = [line for line in out.stderr.splitlines() if "error" in line]
    assert len(error_lines) == 1 and needle in error_lines[0], out.stderr
    assert not (tmp_path / "b.json").exists()


@pytest.mark.multiprocess
def test_existing_output_is_not_overwritten(tmp_path):
    target = tmp_path / "b.json"
    target.write_text("precious")
    out = bench("--layout", "1x1", "--output", str(target))
    assert out.returncode == 2 and "exists" in out.stderr
    assert target.read_text() == "precious"


@pytest.mark.unit
def test_nic_tx_bytes_counts_what_crossed_the_interface():
    payload = 2 * 2**20
    server = socket.create_server(("127.0.0.1", 0))
    received = []

    def drain():
        conn, _ = server.accept()
        with conn:
            while sum(received) < payload:
                received.append(len(conn.recv(1 << 16)))

    reader = threading.Thread(target=drain)
    reader.start()
    before = nic_tx_bytes("lo")
    with socket.create_connection(server.getsockname()) as client:
        client.sendall(b"x" * payload)
        reader.join(timeout=30)
    after = nic_tx_bytes("lo")
    server.close()
    assert sum(received) == payload
    assert after - before >= payload  # payload plus TCP/IP headers (and whatever else used lo)
    with pytest.raises(ValueError, match="'nope0'"):
        nic_tx_bytes("nope0")


@pytest.mark.multiprocess
def test_small_run_prints_table_and_writes_a_new_json_file(tmp_path):
    algorithms = ("flat", "hierarchical", "sharded", "torch", "sharded-inter")
    out = bench("--layout", "2x1", "--sizes", "4K,64K", "--iters", "3", "--warmup", "1",
                "--algorithms", ",".join(algorithms), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    written = list((tmp_path / "outputs" / "bench").glob("2x1-*.json"))
    assert len(written) == 1 and f"wrote {written[0].relative_to(tmp_path)}" in out.stdout
    target = written[0]
    assert "busbw GB/s" in out.stdout and "hierarchical" in out.stdout
    report = json.loads(target.read_text())
    assert report["world_size"] == 2 and sorted(report["node_sizes"]) == [1, 1]
    rows = report["results"]
    assert {(r["bytes"], r["algorithm"]) for r in rows} == {
        (b, a) for b in (4096, 65536) for a in algorithms
    }
    for r in rows:
        assert len(r["times_s"]) == 3 and r["median_s"] > 0
        torch_row = next(t for t in rows if t["bytes"] == r["bytes"] and t["algorithm"] == "torch")
        ratios = sorted(t / b for t, b in zip(r["times_s"], torch_row["times_s"]))
        assert r["vs_torch"] == pytest.approx(ratios[1])  # paired per iteration, median of 3
        assert r["vs_torch_q1"] <= r["vs_torch"] <= r["vs_torch_q3"]
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["median_s"] / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * (2 - 1) / 2)
    hier = next(r for r in rows if r["algorithm"] == "hierarchical")
    assert hier["phases_s"]["inter_allreduce"] > 0  # two nodes of one: all traffic crosses nodes
