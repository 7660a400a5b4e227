"""docs/compatibility.md's table against the configuration's own checks: every comm x cluster.recovery x
comm.shard_optimizer x cluster.intra_mode, built from the config's constants, composed and validated as
``python -m hybrid.train`` would, and held to the cell the page shows for it."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

import hybrid.app.train  # noqa: F401  registers the schema with Hydra's ConfigStore
from hybrid.app.checks import settings_of
from hybrid.app.config import COMM_ALGORITHMS, IN_PLACE, INTRA_MODES, RECOVERY_MODES, packaged_conf_dir

pytestmark = pytest.mark.unit

PAGE = Path(__file__).resolve().parents[1] / "docs" / "compatibility.md"
COLUMNS = [(recovery, shard) for recovery in RECOVERY_MODES for shard in (False, True)]
SECTIONS = {"process": "## Process mode", "thread": "## Thread mode"}


def page_cells() -> dict[tuple[str, str, str, bool], str]:
    """(intra_mode, comm, recovery, shard_optimizer) -> the cell's text."""
    text = PAGE.read_text()
    cells = {}
    for intra, heading in SECTIONS.items():
        section = text.split(heading, 1)[1].split("\n## ", 1)[0]
        for line in section.splitlines():
            row = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(row) == 1 + len(COLUMNS) and row[0] in COMM_ALGORITHMS:
                for (recovery, shard), cell in zip(COLUMNS, row[1:], strict=True):
                    cells[(intra, row[0], recovery, shard)] = cell
    return cells


def outcome(base: DictConfig, intra: str, recovery: str, shard: bool) -> str | None:
    """None where the configuration is valid, else its one-line refusal, as ``python -m hybrid.train`` checks it
    (:func:`hybrid.app.checks.settings_of`). ``base``: the comm's composed config (composing takes 0.2 s, so each
    comm is composed once and its cells set on copies of it)."""
    cfg = base.copy()
    values = {"cluster.recovery": recovery, "comm.shard_optimizer": shard, "cluster.intra_mode": intra}
    if recovery == IN_PLACE:
        values["cluster.min_nnodes"] = 1
    for key, value in values.items():
        OmegaConf.update(cfg, key, value)
    try:
        settings_of(cfg)
    except ValueError as exc:
        return str(exc)
    return None


CELLS = list(itertools.product(INTRA_MODES, COMM_ALGORITHMS, RECOVERY_MODES, (False, True)))


def test_the_page_has_a_cell_for_every_combination_and_no_other():
    assert sorted(page_cells()) == sorted(CELLS)


def test_each_cell_says_what_the_configuration_checks_do():
    cells, wrong = page_cells(), []
    with initialize_config_dir(config_dir=str(packaged_conf_dir()), version_base="1.3"):
        bases = {comm: compose(config_name="config", overrides=[f"comm={comm}", "cluster.nnodes=2",
                                                                 "cluster.nproc_per_node=2"])
                 for comm in COMM_ALGORITHMS}
    outcomes = {key: outcome(bases[key[1]], key[0], *key[2:]) for key in CELLS}
    for key in CELLS:
        refusal, cell = outcomes[key], cells[key]
        if cell == "runs":
            if refusal is not None:
                wrong.append(f"{key}: the page says runs, the checks say {refusal!r}")
            continue
        quoted = re.fullmatch(r'refused: "(.+)"', cell)
        assert quoted, f"{key}: cell {cell!r} is neither 'runs' nor 'refused: \"<a phrase of the refusal>\"'"
        if refusal is None or quoted.group(1) not in refusal:
            wrong.append(f"{key}: the page quotes {quoted.group(1)!r}, the checks say {refusal!r}")
        elif re.search(r"\byet\b", refusal):
            wrong.append(f"{key}: the refusal {refusal!r} says 'yet': a refusal left names a reason of its own")
    assert not wrong, "\n".join(wrong)
