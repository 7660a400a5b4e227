"""hybrid.attach's options and refusals that need no second process (the rest: tests/test_integrations.py)."""

import subprocess
import sys

import pytest
import torch

import hybrid
from hybrid.core.attach import CommOptions

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("options,says", [
    ({"algorithm": "ring"}, "algorithm='ring' is not one of flat, hierarchical, sharded, auto"),
    ({"intra_backend": "mpi"}, "intra_backend='mpi' is not one of auto, gloo, nccl"),
    ({"timeout_s": 0}, "timeout_s=0 must be > 0 seconds"),
    ({"chunk_bytes": 0}, "chunk_bytes=0 must be a positive number of bytes"),
    ({"inter_compression": "int8"}, "inter_compression='int8' is not one of none, bf16, fp16"),
    ({"algorithm": "flat", "inter_compression": "bf16"}, "algorithm=flat has none: use none"),
])
def test_bad_options_are_named_with_what_is_allowed(options, says):
    with pytest.raises(ValueError) as err:
        CommOptions(**options)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_attach_before_the_process_group_exists_says_what_to_do():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="needs a torch DistributedDataParallel model .* got Linear"):
        hybrid.attach(model)
    with pytest.raises(RuntimeError, match="call torch.distributed.init_process_group first"):
        hybrid.connect("hierarchical")
    with pytest.raises(TypeError, match="unknown comm option\\(s\\) bucket_cap_mb: hybrid.attach takes intra_backend"):
        hybrid.connect("hierarchical", bucket_cap_mb=25)


def test_import_hybrid_stays_free_of_torch_until_a_public_name_is_used():
    """``import hybrid`` loads no torch, nor does the report (``python -m hybrid.report`` reads JSON: torch would
    cost it ~2 s); every name of ``hybrid.__all__`` (attach, Attached, CommOptions...) then resolves, loading
    it. One process for all of them: a start costs ~2 s."""
    code = ("import sys, hybrid; print('torch' in sys.modules); "
            "import hybrid.report; print('torch' in sys.modules); "
            "print(all(getattr(hybrid, name) is not None for name in hybrid.__all__), len(hybrid.__all__) > 2); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False", "True", "True", "True"]
