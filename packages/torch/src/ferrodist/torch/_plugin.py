"""The backend's name and its registration with ``torch.distributed``: all that runs when
torch imports this package by itself.

ferrodist-torch declares an entry point in torch's group ``torch.backends``; torch calls
every such entry point at the end of ``import torch`` (unless
``TORCH_DEVICE_BACKEND_AUTOLOAD=0``), so ``init_process_group("ferrodist")`` works without
``import ferrodist.torch``. What runs then must be light and must not fail: an exception
there would make ``import torch`` itself fail, in every program of the environment. So
this module imports nothing but ``torch.distributed`` and ``_names``, and the backend's
groups, transports and collectives are imported when torch makes the first group.
"""

from __future__ import annotations

import logging
from typing import Any

from ._names import BACKEND_NAME


def register() -> None:
    """Make ``"ferrodist"`` a backend of ``torch.distributed`` for CPU and CUDA tensors
    (``import ferrodist.torch`` and torch's own import do this; calling it again changes nothing)."""
    import torch.distributed as dist

    if BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND_NAME, create, extended_api=True, devices=["cpu", "cuda"])


def create(common: Any, options: Any = None) -> Any:
    """torch's creator for a group with backend ``"ferrodist"`` (see ``_register.create``)."""
    from ._register import create as make

    return make(common, options)


def autoload() -> None:
    """torch's ``torch.backends`` entry point: register the backend where torch has
    ``torch.distributed``. A failure is logged, never raised: ``import torch`` goes on, and
    ``import ferrodist.torch`` later raises it where it can be read."""
    try:
        import torch.distributed as dist

        if dist.is_available():
            register()
    except Exception:  # anything: raising here would make every `import torch` fail
        logging.getLogger("ferrodist.torch").warning(
            "ferrodist.torch could not register the backend %r while torch was imported; "
            "import ferrodist.torch to register it (and see why)",
            BACKEND_NAME,
            exc_info=True,
        )
