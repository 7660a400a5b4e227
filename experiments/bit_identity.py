"""Digests of every communicator's output and of short hooked DDP trainings (2x2), to compare code versions.

Run it at two commits and compare the JSON files: equal digests mean bit-identical results (it showed that moving
the modules into layers changed no bit). It falls back to the older flat module paths, so it runs on older code too.

    python experiments/bit_identity.py /tmp/after.json
"""
import hashlib
import importlib
import importlib.util
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def imports() -> dict:
    """The names used below, from the package's layers (or, on older code, from its flat modules)."""
    if importlib.util.find_spec("hybrid.core") is not None:
        places = {"comm": "hybrid.core.comm", "costmodel": "hybrid.core.costmodel",
                  "distributed": "hybrid.runtime.distributed", "topology": "hybrid.core.topology"}
    else:
        places = {"comm": "hybrid.comm", "costmodel": "hybrid.costmodel", "distributed": "hybrid.distributed",
                  "topology": "hybrid.topology"}
    comm, cost = importlib.import_module(places["comm"]), importlib.import_module(places["costmodel"])
    dist_mod, topo = importlib.import_module(places["distributed"]), importlib.import_module(places["topology"])
    return {"CommGroups": comm.CommGroups, "make_communicator": comm.make_communicator,
            "register_comm_hook": comm.register_comm_hook, "AutoCommunicator": comm.AutoCommunicator,
            "Level": cost.Level, "Model": cost.Model, "init_distributed": dist_mod.init_distributed,
            "shutdown_distributed": dist_mod.shutdown_distributed, "discover_topology": topo.discover_topology}


def digest(ts):
    h = hashlib.sha256()
    for t in ts:
        h.update(t.detach().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]

def work():
    m = imports()
    env = m["init_distributed"](timeout_s=60)
    try:
        topo = m["discover_topology"](env)
        torch.set_num_threads(1)
        groups = m["CommGroups"].build(topo, timeout_s=60)
        out = {}
        forced = m["Model"](m["Level"](1e-3, 0.0), m["Level"](0.0, 4e-3 / 8192))
        comms = {name: (lambda name=name, **kw: m["make_communicator"](name, groups, **kw)) for name in ("flat", "hierarchical", "sharded")}
        comms["auto_forced"] = lambda **kw: m["AutoCommunicator"](groups, model=forced, **kw)
        for name, make in comms.items():
            for comp in (("none", "bf16") if name != "flat" else ("none",)):
                for chunk in (12, 4096, 4 * 2**20):
                    comm = make(chunk_bytes=chunk, inter_compression=comp)
                    res = []
                    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
                        for size in ((1, 7, 1000) if chunk == 12 else (1, 7, 1000, 2**18 + 3)):
                            g = torch.Generator().manual_seed(7919 * topo.rank + size)
                            x = torch.randn(size, generator=g, dtype=torch.float64).to(dtype)
                            for _ in range(2):  # twice: error feedback carries over
                                res.append(comm.all_reduce_mean_(x.clone(), key=("k", size)))
                    out[f"{name}/{comp}/{chunk}"] = digest(res)
        for name in ("flat", "hierarchical", "sharded"):
            torch.manual_seed(0)
            model = DDP(nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)]), bucket_cap_mb=0.01)
            st = m["register_comm_hook"](model, m["make_communicator"](name, groups, chunk_bytes=4096))
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            g = torch.Generator().manual_seed(dist.get_rank())
            for _ in range(5):
                opt.zero_grad()
                model(torch.randn(8, 64, generator=g)).square().mean().backward()
                opt.step()
            st.close()
            out[f"ddp/{name}"] = digest(list(model.parameters()))
        return out
    finally:
        m["shutdown_distributed"]()

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bit_identity as bits
    try:
        from hybrid.core.topology import Layout
        from hybrid.runtime.launch import launch_local
    except ImportError:
        from hybrid.launch import launch_local
        from hybrid.topology import Layout
    res = launch_local(Layout.parse("2x2"), bits.work, (), timeout_s=300)
    json.dump(res, open(sys.argv[1], "w"), indent=1, sort_keys=True)
    print(len(res[0]), "digests per rank")
