"""Run under `ferrodist run -n N`: DDP training on shards in real processes, compared
with one process on the whole batch (computed here too). Prints one JSON line per rank.

usage: train.py BACKEND KIND OPTIMIZER OVERLAP [HOOK]

KIND: nn (ferrodist.nn, float64), torch (a PyTorch CPU module, float64) or cuda (the
PyTorch module on each rank's GPU, float32: a tolerance of 1e-4, 2e-2 with HOOK=bf16).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent))
from _training import max_difference, train_ddp, train_reference

import ferrodist.collectives as dist

backend, kind, optimizer, overlap = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "on"
group = dist.init_process_group(backend, timeout=60)
options = {"overlap": overlap, "bucket_cap_mb": 0.001, "first_bucket_cap_mb": 0.0002}
if kind == "nn":
    tolerance = 1e-10
    difference = max_difference(train_ddp(group, optimizer, **options), train_reference(optimizer))
else:
    import torch
    from test_torch_models import reference, train

    dt, device, tolerance = torch.float64, "cpu", 1e-10
    if kind == "cuda":
        from ferrodist.ddp import bf16_compress

        local = int(os.environ.get("LOCAL_RANK", group.rank))
        dt, device = torch.float32, f"cuda:{local % torch.cuda.device_count()}"
        hook = sys.argv[5] if len(sys.argv) > 5 else "none"
        options = {"comm_hook": bf16_compress if hook == "bf16" else None, "bucket_cap_mb": 0.005}
        tolerance = 2e-2 if hook == "bf16" else 1e-4
    state = train(optimizer, dt, device, **options)
    difference = max(float(np.max(np.abs(state[k] - v))) for k, v in reference(optimizer, dt).items())
print(json.dumps({"rank": group.rank, "size": group.size, "difference": difference, "ok": difference <= tolerance}))
dist.destroy_process_group()
