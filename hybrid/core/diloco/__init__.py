"""DiLoCo across nodes: the outer loop (:mod:`.outer_sync`) and how its pseudo-gradients travel (:mod:`.codec`).

Nodes train on their own for ``sync_every`` steps and then average how far they moved (Douillard et al.,
arXiv 2311.08105; Streaming DiLoCo, arXiv 2501.18512): hierarchical in time, where hybrid's communicator is
hierarchical in space.
"""

from hybrid.core.diloco.codec import CODECS
from hybrid.core.diloco.outer_sync import INTER_MODES, PIECE_BYTES, OuterSync, default_outer_optimizer

__all__ = ["CODECS", "INTER_MODES", "PIECE_BYTES", "OuterSync", "default_outer_optimizer"]
