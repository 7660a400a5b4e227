"""examples/ as the docs show them: each program appears verbatim on its page, and runs with exactly the command
printed after it (two torchrun agents, 2 nodes x 2 CPU workers on this machine), from the repository's root."""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess

import pytest

from helpers.documented import EXAMPLES, REPO, examples_on

PAGES = {"ddp_torchrun.py": "README.md", "lightning_ddp.py": "docs/integrations.md",
         "hf_trainer.py": "docs/integrations.md", "accelerate_loop.py": "docs/integrations.md"}


@pytest.mark.unit
def test_every_example_is_shown_verbatim_with_its_command_and_the_readme_s_is_the_communicator_page_s():
    assert sorted(EXAMPLES) == sorted(PAGES)
    for name, page in PAGES.items():
        assert name in examples_on(page), f"{page} does not show examples/{name} verbatim"
    assert examples_on("docs/communicator.md") == {"ddp_torchrun.py": examples_on("README.md")["ddp_torchrun.py"]}


def run_documented(command: str, timeout_s: float = 180) -> str:
    """The command as a reader pastes it into bash at the repository's root; its process group is killed after."""
    shell = subprocess.Popen(["bash", "-c", command], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True, env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
    try:
        return shell.communicate(timeout=timeout_s)[0]
    except subprocess.TimeoutExpired:
        os.killpg(shell.pid, signal.SIGKILL)
        pytest.fail(f"still running after {timeout_s} s:\n{shell.communicate()[0][-4000:]}")
    finally:
        try:
            os.killpg(shell.pid, signal.SIGKILL)  # the backgrounded agent too, if anything was left
        except ProcessLookupError:
            pass


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(PAGES))
def test_the_example_runs_as_documented_and_only_node_leaders_cross_nodes(name):
    before = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout
    output = run_documented(examples_on(PAGES[name])[name])
    # Ranks print at once into one pipe: a line may begin right after another's text, before its newline.
    calls = {int(rank): ast.literal_eval(counts)
             for rank, counts in re.findall(r"rank (\d+)\b[^{\n]*(\{[^}]*\})", output)}
    assert sorted(calls) == [0, 1, 2, 3], output[-4000:]
    assert "Traceback" not in output and "Error" not in output, output[-4000:]
    assert [calls[r]["inter_allreduce"] > 0 for r in range(4)] == [True, False, True, False]
    assert len({calls[r]["intra_reduce"] for r in range(4)}) == 1 and calls[0]["intra_reduce"] > 0
    if name == "ddp_torchrun.py":  # it prints the replicas' weights and the loss averaged over ranks
        assert len(set(re.findall(r"mean loss (\S+), weights (\S+),", output))) == 1, output[-2000:]
    after = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout
    assert after == before  # the example wrote nothing into the repository
