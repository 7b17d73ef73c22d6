"""Launch variables, interface selection, and a live TCP link fed a corrupt stream."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from _helpers import tcp_world
from ferrodist.core import InvalidArgument, ProtocolError
from ferrodist.transport import launch_info
from ferrodist.transport._frames import DATA, encode_header
from ferrodist.transport._start.net import local_address


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        (
            {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "29500"},
            (2, 4, 0, "env", "h", 29500),
        ),
        (
            {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
            (1, 2, 1, "openmpi", None, None),
        ),
        ({"PMI_RANK": "3", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1"}, (3, 8, 1, "pmi", None, None)),
        ({"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "2"}, (5, 6, 2, "slurm", None, None)),
        # ferrodist run / torchrun variables win over the scheduler's.
        ({"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "7", "SLURM_NTASKS": "9"}, (0, 2, 0, "env", None, None)),
    ],
)
def test_launch_info_reads_every_launcher(env, expected):
    info = launch_info(env)
    if expected is None:
        assert info is None
        return
    assert (info.rank, info.world_size, info.local_rank, info.source, info.master_addr, info.master_port) == expected
    assert info.single_host == (info.local_world_size == info.world_size)
    assert info.under_mpi == (info.source in ("openmpi", "pmi", "pmix"))


@pytest.mark.parametrize(
    "env", [{"RANK": "x", "WORLD_SIZE": "2"}, {"RANK": "2", "WORLD_SIZE": "2"}, {"RANK": "0", "WORLD_SIZE": "0"}]
)
def test_bad_launch_variables_are_clear_errors(env):
    with pytest.raises(InvalidArgument):
        launch_info(env)


def test_socket_interface_can_be_chosen(monkeypatch):
    monkeypatch.setenv("FERRODIST_SOCKET_IFNAME", "lo")
    assert local_address("10.1.2.3") == "127.0.0.1"
    monkeypatch.setenv("FERRODIST_SOCKET_IFNAME", "no-such-interface0")
    with pytest.raises(InvalidArgument, match=r"no IPv4 address on that interface \(interfaces here: .*lo"):
        local_address("10.1.2.3")
    monkeypatch.delenv("FERRODIST_SOCKET_IFNAME")
    assert local_address("127.0.0.1") == "127.0.0.1"


def raw_socket_of(transport, peer) -> socket.socket:
    return transport._links[peer].sock


def test_garbage_on_a_live_link_is_a_protocol_error_for_the_waiting_rank():
    t0, t1 = tcp_world(2)
    try:
        raw_socket_of(t1, 0).sendall(b"\x00" * 64)  # not a frame header
        with pytest.raises(ProtocolError, match="not a ferrodist frame"):
            t0.recv(np.zeros(4), 1, tag=0, timeout=5)
    finally:
        t0.close()
        t1.close()


def test_an_oversized_frame_is_refused_without_allocating_it():
    t0, t1 = tcp_world(2)
    try:
        link = t1._links[0]
        with link.framing.send_lock:
            header = encode_header(DATA, 5, link.framing.send_seq, 0, 1 << 60)  # an exabyte
            link.framing.send_seq += 1
            link.sock.sendall(header)
        with pytest.raises(ProtocolError, match="over this process's limit"):
            t0.recv(np.zeros(4), 1, tag=5, timeout=5)
    finally:
        t0.close()
        t1.close()


def test_a_frame_out_of_sequence_is_a_protocol_error():
    t0, t1 = tcp_world(2)
    try:
        link = t1._links[0]
        with link.framing.send_lock:
            link.sock.sendall(encode_header(DATA, 1, link.framing.send_seq + 3, 0, 0))
        with pytest.raises(ProtocolError, match="arrived where frame 1 was due"):
            t0.recv(np.zeros(0), 1, tag=1, timeout=5)
    finally:
        t0.close()
        t1.close()


def test_without_mpi4py_the_mpi_backend_names_the_extra(monkeypatch):
    import sys

    from ferrodist.core import BackendUnavailable
    from ferrodist.transport import MpiTransport

    monkeypatch.setitem(sys.modules, "mpi4py", None)  # as if it were not installed
    with pytest.raises(BackendUnavailable, match=r"pip install -e './packages/transport\[mpi\]'"):
        MpiTransport()


@pytest.mark.parametrize(
    ("env", "missing", "unset"),
    [
        # a variable forgotten: never a silent world of one
        (
            {"RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29800"},
            "WORLD_SIZE is not set",
            "unset RANK, MASTER_ADDR and MASTER_PORT",
        ),
        ({"WORLD_SIZE": "2"}, "RANK, MASTER_ADDR and MASTER_PORT are not set", "unset WORLD_SIZE"),
        ({"WORLD_SIZE": "1"}, "RANK is not set", "unset WORLD_SIZE"),  # a world of one needs no master
        ({"RANK": "0", "LOCAL_RANK": "0"}, "WORLD_SIZE, MASTER_ADDR and MASTER_PORT are not set", "unset RANK"),
        ({"OMPI_COMM_WORLD_RANK": "1"}, "OMPI_COMM_WORLD_SIZE is not set", "unset OMPI_COMM_WORLD_RANK"),
        ({"OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_RANK is not set", "unset OMPI_COMM_WORLD_SIZE"),
        ({"PMI_RANK": "0"}, "PMI_SIZE is not set", "unset PMI_RANK"),
        ({"PMIX_RANK": "0"}, "OMPI_COMM_WORLD_SIZE is not set", "unset PMIX_RANK"),
    ],
)
def test_a_launcher_variable_without_the_others_names_the_missing_ones(env, missing, unset):
    with pytest.raises(InvalidArgument) as raised:
        launch_info(env)
    said = str(raised.value)
    assert said.startswith(missing + " but "), said
    assert unset in said and "to run this process alone" in said, said
    for name, value in env.items():
        if name != "LOCAL_RANK":
            assert f"{name}={value!r}" in said, said


def test_the_callers_rank_and_size_stand_in_for_missing_variables_only():
    info = launch_info({"WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}, rank=3)
    assert (info.rank, info.world_size, info.source, info.master_addr, info.master_port) == (3, 4, "env", "h", 29500)
    # torch.multiprocessing.spawn's pattern: MASTER_* in the environment, rank and size as arguments
    info = launch_info({"MASTER_ADDR": "h", "MASTER_PORT": "29500"}, rank=1, world_size=2)
    assert (info.rank, info.world_size, info.master_addr, info.master_port) == (1, 2, "h", 29500)
    assert launch_info({"RANK": "2", "WORLD_SIZE": "4"}, rank=0, world_size=8).rank == 2  # the environment's own
    assert launch_info({}, rank=0, world_size=2) is None  # nothing set: no launcher
    with pytest.raises(InvalidArgument, match=r"rank=5 and WORLD_SIZE=4 do not describe a rank of a job"):
        launch_info({"WORLD_SIZE": "4"}, rank=5)


@pytest.mark.parametrize(
    "env",
    [
        {"MASTER_ADDR": "h", "MASTER_PORT": "29500"},  # the caller may give rank= and world_size= itself
        {"LOCAL_RANK": "1"},  # picks a GPU in a process of its own
        {"SLURM_PROCID": "0", "SLURM_JOB_ID": "7"},  # an sbatch script run without --ntasks
        {"SLURM_NTASKS": "4"},  # an salloc shell
        {"PMIX_RANK": "1", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"},  # srun --mpi=pmix: SLURM's variables place it
    ],
)
def test_variables_that_leave_no_rank_half_set_are_not_errors(env):
    info = launch_info(env)
    assert info is None or info.source == "slurm"


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"RANK": "abc"}, "RANK='abc' is not an integer: it is this process's rank"),
        ({"RANK": "abc", "WORLD_SIZE": "2"}, "RANK='abc' is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer: it is the number of ranks"),
        ({"MASTER_PORT": "http"}, "MASTER_PORT='http' is not an integer"),
    ],
)
def test_a_launcher_variable_that_is_not_a_number_is_named_with_what_to_do(env, said):
    with pytest.raises(InvalidArgument, match=said) as raised:
        launch_info(env)
    assert "set it to a number, or unset it" in str(raised.value)
