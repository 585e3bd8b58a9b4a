"""The dense trunk packed into one file (:mod:`.format`, :mod:`.pack`) and streamed
through pinned layers and a ring arena (:mod:`.stream`). The plan that decides which
layers are pinned is the memory planner's (:mod:`k3.memory.planner`)."""

from .format import PackedTrunk, TrunkLayer, TrunkTensor
from .pack import pack_trunk, verify_trunk
from .stream import TrunkStreamer

__all__ = ["PackedTrunk", "TrunkLayer", "TrunkStreamer", "TrunkTensor", "pack_trunk", "verify_trunk"]
