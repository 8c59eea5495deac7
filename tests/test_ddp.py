"""DistributedDataParallel with ``backend="fusion"`` on CPU (gloo, 2 processes): DDPOptimizer splits
the graph at tiny gradient buckets, between the model's two conv pipelines and inside them; after
several SGD steps the losses and parameters equal one process training eagerly on the whole batch
(``demos/ddp_train.py`` checks that on rank 0 and raises otherwise)."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "demos"))
import ddp_train  # noqa: E402


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    from fusion_backend.report import collect_reports

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        with collect_reports() as reports:
            ddp_train.run(rank, world, "cpu", steps=3, bucket_cap_mb=0.0001, options={"decide": "fuse"})
        summary = {"graphs": len(reports), "fused": sum(sum(r.counts().values()) for r in reports),
                   "reports": [str(r) for r in reports]}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(summary))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_ddp_with_split_graphs_matches_single_process_eager(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        summary = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # three graphs: [conv], [x multiplier -> leaky -> pool], [conv-transpose -> gelu -> mean]: the first
        # pipeline is cut between its conv and its epilogue, the second stays whole and is fused
        assert summary["graphs"] >= 3, summary
        assert summary["fused"] >= 1, summary
