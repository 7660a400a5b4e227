"""Worker functions for tests/test_launch.py (importable by spawned ranks)."""

import os
import threading


def report_env() -> dict:
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GLOO_SOCKET_IFNAME",
            "TORCHELASTIC_ERROR_FILE")
    return {k: os.environ.get(k) for k in keys}


def fail_on_rank_one() -> str:
    if os.environ["RANK"] == "1":
        raise ValueError("boom-42 from the worker")
    return "fine"


def block_forever() -> None:
    # A deliberately hung worker: the launcher's own deadline must end it.
    threading.Event().wait()
