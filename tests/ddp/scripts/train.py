"""Run under `ferrodist run -n N`: DDP training on shards in real processes, compared
with one process on the whole batch (computed here too). Prints one JSON line per rank.

usage: train.py BACKEND KIND OPTIMIZER OVERLAP    (KIND: nn | torch)
"""

from __future__ import annotations

import json
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

    tolerance = 1e-10
    state = train(optimizer, torch.float64, **options)
    difference = max(float(np.max(np.abs(state[k] - v))) for k, v in reference(optimizer, torch.float64).items())
print(json.dumps({"rank": group.rank, "size": group.size, "difference": difference, "ok": difference <= tolerance}))
dist.destroy_process_group()
