"""ferrodist.torch: ferrodist as a ``torch.distributed`` backend.

Installing ferrodist-torch registers the backend ``"ferrodist"`` for CPU and CUDA tensors
when torch is imported (torch's ``torch.backends`` entry points); importing this package
registers it too, where that is turned off (``TORCH_DEVICE_BACKEND_AUTOLOAD=0``)::

    import torch.distributed as dist

    dist.init_process_group("ferrodist")      # under torchrun, ferrodist run, or with env://
    x = torch.ones(4) * (dist.get_rank() + 1)
    dist.all_reduce(x)                        # rank 0: [3, 3, 3, 3]  rank 1: [3, 3, 3, 3]

torch's own ``DistributedDataParallel``, ``torch.distributed.pipelining`` and every
collective of ``torch.distributed`` then run over ferrodist's transports (``shm`` on one
host, ``tcp`` across hosts; ``FERRODIST_TORCH_TRANSPORT`` chooses), with ferrodist's
deadlines and error messages. See docs/torch.md.

Registering is light (it imports ``torch.distributed`` only); the classes below, and with
them ferrodist's collectives and transports, are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._plugin import BACKEND_NAME, register

if TYPE_CHECKING:
    from ._group import FerrodistProcessGroup
    from ._names import TRANSPORTS
    from ._register import choose_transport, preload
    from ._shrink import shrink_group
    from ._work import FerrodistWork

register()

#: Where each of the other public names lives.
_LAZY = {
    "FerrodistProcessGroup": "._group",
    "FerrodistWork": "._work",
    "TRANSPORTS": "._names",
    "choose_transport": "._register",
    "preload": "._register",
    "shrink_group": "._shrink",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "BACKEND_NAME",
    "FerrodistProcessGroup",
    "FerrodistWork",
    "TRANSPORTS",
    "choose_transport",
    "preload",
    "register",
    "shrink_group",
]
