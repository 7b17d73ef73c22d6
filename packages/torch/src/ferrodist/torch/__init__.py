"""ferrodist.torch: ferrodist as a ``torch.distributed`` backend.

Importing this package registers the backend ``"ferrodist"`` for CPU and CUDA tensors::

    import torch.distributed as dist
    import ferrodist.torch  # noqa: F401  (registers "ferrodist")

    dist.init_process_group("ferrodist")      # under torchrun, ferrodist run, or with env://
    x = torch.ones(4) * (dist.get_rank() + 1)
    dist.all_reduce(x)                        # rank 0: [3, 3, 3, 3]  rank 1: [3, 3, 3, 3]

torch's own ``DistributedDataParallel``, ``torch.distributed.pipelining`` and every
collective of ``torch.distributed`` then run over ferrodist's transports (``shm`` on one
host, ``tcp`` across hosts; ``FERRODIST_TORCH_TRANSPORT`` chooses), with ferrodist's
deadlines and error messages. See docs/torch.md.
"""

from ._group import BACKEND_NAME, FerrodistProcessGroup
from ._register import TRANSPORTS, choose_transport, register
from ._work import FerrodistWork

register()

__all__ = ["BACKEND_NAME", "FerrodistProcessGroup", "FerrodistWork", "TRANSPORTS", "choose_transport", "register"]
