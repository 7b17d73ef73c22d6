"""ferrodist.transport: moving bytes between ranks (the ``Transport`` protocol and its backends)."""

from ._aborts import Notice
from ._faults import Faults
from ._mpi import MpiCollectives, MpiTransport
from ._protocol import DEFAULT_TIMEOUT, NativeCollectives, Request, Store, Transport
from ._shm.collectives import IN_PLACE, ShmCollectives
from ._shm.transport import ShmTransport
from ._simulated import SimulatedTransport
from ._start.env import LaunchInfo, launch_info, this_host
from ._start.net import interface_address, local_address
from ._start.store import KeyValue, StoreClient, StoreServer
from ._tcp.transport import TcpTransport
from ._warmup import transport_kernels

__all__ = [
    "DEFAULT_TIMEOUT",
    "Faults",
    "IN_PLACE",
    "KeyValue",
    "LaunchInfo",
    "MpiCollectives",
    "MpiTransport",
    "NativeCollectives",
    "Notice",
    "Request",
    "ShmCollectives",
    "ShmTransport",
    "SimulatedTransport",
    "Store",
    "StoreClient",
    "StoreServer",
    "TcpTransport",
    "Transport",
    "interface_address",
    "launch_info",
    "local_address",
    "this_host",
    "transport_kernels",
]
