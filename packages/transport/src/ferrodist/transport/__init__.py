"""ferrodist.transport: moving bytes between ranks (the ``Transport`` protocol and its backends)."""

from ._protocol import DEFAULT_TIMEOUT, Request, Transport
from ._simulated import SimulatedTransport

__all__ = ["DEFAULT_TIMEOUT", "Request", "SimulatedTransport", "Transport"]
