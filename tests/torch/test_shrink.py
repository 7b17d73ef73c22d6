"""``torch.distributed.shrink_group`` over the "ferrodist" backend, on CPU tensors (Gloo
raises ``TypeError`` there): 3 ranks started by hand, rank 2 killed or left behind, the
other two shrink the default group, all_reduce on it and train torch's DDP over it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("ferrodist.torch", reason="ferrodist-torch is not installed (pip install packages/torch)")

SCRIPT = Path(__file__).parent / "scripts" / "shrink.py"
_PLACE = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "FERRODIST_TOKEN")


@pytest.mark.parametrize("mode", ["kill", "exclude"])
def test_shrink_group_goes_on_without_the_lost_rank(tmp_path, mode):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in _PLACE and not k.startswith("TORCHELASTIC_")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="3", FERRODIST_TORCH_TRANSPORT="tcp")
    ranks = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), mode, str(tmp_path)],
            env=dict(env, RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(3)
    ]
    codes, outputs = [], []
    for p in ranks:
        try:
            out, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        codes.append(p.returncode)
        outputs.append(out.decode()[-3000:])
    assert codes[:2] == [0, 0], outputs
    assert codes[2] == (-9 if mode == "kill" else 0), outputs
    for r in (0, 1):
        result = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert result["size"] == 2 and result["new_rank"] == r, result
        assert result["sum"] == [3.0] * 4, result
        assert result["ddp_equal"] is True, result
        assert result["pair"] == [11.0, True], result
        if mode == "kill":
            assert "failure" in result, result
