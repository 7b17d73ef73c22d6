"""The names the backend is known by: to torch (``BACKEND_NAME``, what
``init_process_group`` takes) and to users choosing a transport (``TRANSPORT_VARIABLE``,
``TRANSPORTS``). Importing it imports nothing: torch's autoload reads it."""

from __future__ import annotations

__all__ = ["BACKEND_NAME", "TRANSPORTS", "TRANSPORT_VARIABLE"]

#: The name torch knows the backend by: ``init_process_group("ferrodist")``.
BACKEND_NAME = "ferrodist"
#: The variable that chooses the transport of the backend's groups.
TRANSPORT_VARIABLE = "FERRODIST_TORCH_TRANSPORT"
#: The transports a torch group can run over (``FERRODIST_TORCH_TRANSPORT``).
TRANSPORTS = ("auto", "shm", "tcp", "levels", "mpi")
