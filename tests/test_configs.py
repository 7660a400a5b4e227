"""Every config in conf/ composes and turns into validated settings."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hybrid.comm import COMM_CHOICES, CommSettings

CONF = Path(__file__).resolve().parents[1] / "conf"


@pytest.mark.parametrize("choice", COMM_CHOICES)
def test_each_comm_config_composes_into_settings(choice):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"comm={choice}"])
    settings = CommSettings(**OmegaConf.to_container(cfg.comm, resolve=True))
    assert settings.algorithm == choice


def test_comm_group_lists_exactly_the_algorithms():
    assert sorted(p.stem for p in (CONF / "comm").glob("*.yaml")) == sorted(COMM_CHOICES)


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("algorithm", "ring", "'ring' is not one of flat, hierarchical, sharded, ddp"),
        ("intra_backend", "mpi", "comm.intra_backend='mpi' is not one of auto, gloo, nccl"),
        ("bucket_mb", 0, "comm.bucket_mb=0 must be > 0"),
        ("timeout_s", -1, "comm.timeout_s=-1 must be > 0"),
    ],
)
def test_bad_settings_name_the_value_and_what_is_allowed(field, value, needle):
    with pytest.raises(ValueError) as err:
        CommSettings(**{field: value})
    assert needle in str(err.value)
