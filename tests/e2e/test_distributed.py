"""DDP and FSDP2 with ``backend="fusion"`` on CPU (gloo, 2 processes), through
``demos/distributed_train.py``: after several steps the losses and the parameter updates equal the
same data-parallel training computed serially by one eager process (checked against float64 on rank
0, which raises otherwise).  Under DDP, tiny gradient buckets make DDPOptimizer split the graph
between the model's two conv pipelines and inside the first; under FSDP2 the compiled model is
sharded whole; a classifier with a BatchNorm in training mode trains under DDP with AdamW, each rank
normalising with its own shard's statistics; DDP's timed steps compile afresh.  All run in the same
two processes, forked from the test's own (a spawned process would import torch, Dynamo, Inductor and
the package again, seconds of CPU each on a CPU box).  The training settings (optimizer, learning
rate, loss) are checked without starting processes."""

import contextlib
import io
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

DEMOS = Path(__file__).resolve().parents[2] / "demos"
sys.path.insert(0, str(DEMOS))
import distributed_train  # noqa: E402
from distributed_train import Training  # noqa: E402

WRAPPERS = ("ddp", "fsdp2")
BATCHNORM_TRAINING = Training(optimizer="adamw", lr=0.01, weight_decay=0.01)


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    # Forked: an OpenMP pool the test's process started (more than one thread, outside xdist) would
    # hang the first parallel region here; two ranks share the machine anyway.
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        workload = distributed_train.Workload("two-pipelines", world)
        summary = {}
        for how in WRAPPERS:
            torch._dynamo.reset()  # as in a fresh process: the other wrapper's frames are not this one's
            reports = distributed_train.check_parity(workload, how, rank, world, "cpu", steps=3,
                                                     bucket_cap_mb=0.0001, options={"decide": "fuse"})
            summary[how] = {"graphs": len(reports), "fused": [m.pattern for r in reports for m in r.matches],
                            "reports": [str(r) for r in reports]}
            if how == "ddp":
                # The timed steps compile afresh, with DDP's default buckets: code compiled just before for
                # the same model with tiny buckets and the same options (as the demo's parity run does) is
                # not reused, and fusion's timed run reports one graph of its own.
                earlier = distributed_train.wrap(workload.model(), how, "cpu", "fusion", 0.0001, None)
                distributed_train.train(earlier, list(earlier.parameters()), workload, Training(), 1, [rank],
                                        world, "cpu")  # fmt: skip
                printed = io.StringIO()
                with contextlib.redirect_stdout(printed):
                    distributed_train.time_backends(workload, how, rank, world, "cpu", 10, 25.0, ("eager", "fusion"))
                summary["timed"] = printed.getvalue()
        torch._dynamo.reset()
        # BatchNorm in training mode: the reference must follow DDP's per-shard statistics (a
        # whole-batch reference differs at the first step's loss already); check_parity raises if not.
        # DDP's default buckets keep conv -> BatchNorm -> ReLU in one graph, fused.
        batchnorm = distributed_train.Workload("conv-batchnorm", world)
        reports = distributed_train.check_parity(batchnorm, "ddp", rank, world, "cpu", steps=3,
                                                 bucket_cap_mb=25.0, options={"decide": "fuse"},
                                                 training=BATCHNORM_TRAINING)
        summary["batchnorm"] = {"graphs": len(reports), "fused": [m.pattern for r in reports for m in r.matches]}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(summary))
    finally:
        dist.destroy_process_group()
    # NOTE: the outcome is on disk, so the worker leaves without the interpreter's teardown: in the
    # full CPU suite (2 cores, under load) that teardown once aborted a rank with "terminate called
    # without an active exception" after both parities had passed (a C++ thread still joinable at exit;
    # alone the test passes).  A failure above still raises and fails the spawn.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.heavy
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_ddp_and_fsdp2_training_match_single_process_eager(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # What every rank would otherwise import at its first compile, imported once here, before the fork.
    # NOTE: forked, not spawned: each spawned rank imported torch, Dynamo, Inductor and the package
    # afresh (2-core CPU box, full suite: 40 s of CPU per rank with spawn, 21 s forked).
    import torch._inductor.compile_fx  # noqa: F401

    import fusion_backend.backend  # noqa: F401

    # A process that has initialised CUDA (an xdist worker that ran GPU tests first) cannot fork ranks
    # that touch CUDA again ("Cannot re-initialize CUDA in forked subprocess"): those spawn.
    start = "spawn" if torch.cuda.is_initialized() else "fork"
    mp.start_processes(_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True, start_method=start)
    for rank in range(2):
        summary = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # DDP: three graphs, [conv], [x multiplier -> leaky -> pool], [conv-transpose -> gelu -> mean]: the
        # first pipeline is cut between its conv and its epilogue, the second stays whole and is fused
        assert summary["ddp"]["graphs"] == 3 and summary["ddp"]["fused"] == ["conv_epilogue"], summary["ddp"]
        # FSDP2: one graph, both pipelines fused
        assert summary["fsdp2"]["graphs"] == 1 and summary["fsdp2"]["fused"] == ["conv_epilogue"] * 2, summary["fsdp2"]
        # BatchNorm under DDP: one graph, its conv -> batch_norm(train) -> relu fused
        assert summary["batchnorm"] == {"graphs": 1, "fused": ["conv_batch_norm"]}, summary["batchnorm"]
    timed = json.loads((tmp_path / "rank0.json").read_text())["timed"]
    assert "ms/step" in timed and "fusion's timed run:\n  backend saw 1 graph(s)" in timed, timed


def _settings(argv: list[str], declared: dict) -> Training:
    return distributed_train.training_settings(distributed_train.parse_args(argv), declared)


def test_training_defaults_and_overrides(tmp_path):
    """Two-pipelines keeps SGD lr 0.1, momentum 0.9; a benchmark file gets SGD lr 0.01, momentum 0.9,
    or the TRAIN_* defaults it declares (for its own optimizer only); the command line wins."""
    builtin = distributed_train.Workload("two-pipelines", 2).declared
    assert _settings([], builtin) == Training("sgd", 0.1, 0.9, 0.0, "auto")
    assert _settings(["--optimizer", "adamw"], builtin) == Training("adamw", 1e-3, 0.9, 0.01, "auto")
    plain = tmp_path / "plain.py"
    plain.write_text("import torch\nModel = torch.nn.Identity\n"
                     "def get_inputs():\n    return [torch.randn(4, 3)]\n"
                     "def get_init_inputs():\n    return []\n")
    assert distributed_train.Workload(str(plain), 2).declared == {}
    assert _settings([], {}) == Training("sgd", 0.01, 0.9, 0.0, "auto")
    assert (_settings(["--lr", "0.05", "--momentum", "0.5", "--weight-decay", "1e-4", "--loss", "mse"], {})
            == Training("sgd", 0.05, 0.5, 1e-4, "mse"))
    declaring = tmp_path / "declaring.py"
    declaring.write_text(plain.read_text() + 'TRAIN_OPTIMIZER = "adamw"\nTRAIN_LR = 3e-4\n'
                         'TRAIN_LOSS = "mse"\nTRAIN_STEPS = 5\n')
    declared = distributed_train.Workload(str(declaring), 2).declared
    assert _settings([], declared) == Training("adamw", 3e-4, 0.9, 0.01, "mse")
    assert _settings(["--weight-decay", "0"], declared) == Training("adamw", 3e-4, 0.9, 0.0, "mse")
    assert _settings(["--optimizer", "sgd"], declared) == Training("sgd", 0.01, 0.9, 0.0, "mse")
    with pytest.raises(SystemExit, match="momentum"):
        _settings(["--momentum", "0.9"], declared)
    with pytest.raises(SystemExit, match="TRAIN_OPTIMIZER"):
        _settings([], {"TRAIN_OPTIMIZER": "lamb"})
    assert str(Training("adamw", 1e-3, 0.9, 0.01, "mse")) == "AdamW lr 0.001, weight decay 0.01, mse loss"
    assert str(Training("sgd", 0.1, 0.9, 0.0, "cross-entropy")) == ("SGD lr 0.1, momentum 0.9, "
                                                                  "cross-entropy loss")
    parse, steps = distributed_train.parse_args, distributed_train.parity_steps
    assert steps(parse([]), {}) == 20 and steps(parse([]), declared) == 5
    assert steps(parse(["--steps", "2"]), declared) == 2


def test_per_process_batch_is_world_draws_of_the_files_batch(tmp_path):
    """With ``per_process_batch`` K each process's shard is K ``get_inputs()`` batches (drawn afresh
    per process, the same in every process), non-tensor inputs are kept; without it the file's
    batch is the global one."""
    spec = tmp_path / "batch.py"
    spec.write_text("import torch\nModel = torch.nn.Identity\n"
                    "def get_inputs():\n    return [torch.randn(4, 3), 0.5]\n"
                    "def get_init_inputs():\n    return []\n")
    split = distributed_train.Workload(str(spec), 3).batch(7)
    scaled = distributed_train.Workload(str(spec), 3, per_process_batch=1).batch(7)
    assert split[0].shape == (4, 3) and scaled[0].shape == (12, 3) and scaled[1] == 0.5
    assert torch.equal(scaled[0][:4], split[0]) and not torch.equal(scaled[0][:4], scaled[0][4:8])
    assert torch.equal(distributed_train.shard(scaled, 1, 3, "cpu")[0], scaled[0][4:8])
    assert torch.equal(distributed_train.Workload(str(spec), 3, per_process_batch=1).batch(7)[0], scaled[0])
    doubled = distributed_train.Workload(str(spec), 3, per_process_batch=2).batch(7)
    assert doubled[0].shape == (24, 3) and torch.equal(doubled[0][:12], scaled[0])
    parse = distributed_train.parse_args
    assert [parse(a).per_process_batch for a in ([], ["--per-process-batch"], ["--per-process-batch", "4"])] == [0, 1, 4]
    with pytest.raises(SystemExit, match="positive number"):
        distributed_train.Workload(str(spec), 3, per_process_batch=-1)


def test_resnet18_file_declares_a_short_small_step_check():
    """The ResNet-18 file loads without torchvision and trains the demo with SGD lr 0.001 and
    cross-entropy for 3 steps (its docstring says why)."""
    declared = distributed_train.Workload(str(DEMOS / "realnets" / "resnet18.py"), 2).declared
    assert _settings([], declared) == Training("sgd", 0.001, 0.9, 1e-4, "cross-entropy")
    assert distributed_train.parity_steps(distributed_train.parse_args([]), declared) == 3


def _first_update(training: Training) -> tuple[dict, dict]:
    """The conv-batchnorm model's parameters before one step of ``training`` on one process, and the
    step's update (in float64: the update is not lost in the parameter's rounding)."""
    workload = distributed_train.Workload("conv-batchnorm", 1)
    model = workload.model().double()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    distributed_train.train(model, model.parameters(), workload, training, 1, [0], 1, "cpu", torch.float64)
    return start, {n: p.detach() - start[n] for n, p in model.named_parameters()}


def test_train_honours_optimizer_and_learning_rate():
    """SGD's first step is -lr (gradient + weight decay x parameter); AdamW's is -lr g / (|g| + eps),
    less lr x weight decay x parameter (decoupled), with torch's default eps."""
    _, sgd = _first_update(Training("sgd", 1.0, 0.9))
    _, small = _first_update(Training("sgd", 0.01, 0.9))
    start, decayed = _first_update(Training("sgd", 0.01, 0.9, weight_decay=0.1))
    for name, update in sgd.items():
        assert update.abs().max() > 0, name
        torch.testing.assert_close(small[name], 0.01 * update, rtol=1e-9, atol=1e-15)
        torch.testing.assert_close(decayed[name], 0.01 * (update - 0.1 * start[name]), rtol=1e-9, atol=1e-15)
    start, adamw = _first_update(Training("adamw", 0.003, weight_decay=0.5))
    for name, update in adamw.items():
        gradient = -sgd[name]  # SGD's first step with lr 1: -gradient
        torch.testing.assert_close(update, -0.003 * (0.5 * start[name] + gradient / (gradient.abs() + 1e-8)),
                                   rtol=1e-7, atol=1e-12)


def test_loss_follows_the_output():
    """Cross-entropy for a classifier's (batch, classes) logits, the squared error otherwise; its
    targets are drawn whole per step and split by rank like the inputs."""
    assert distributed_train.loss_kind("auto", torch.zeros(4, 10)) == "cross-entropy"
    for shape in [(4,), (4, 1), (4, 3, 5, 5)]:
        assert distributed_train.loss_kind("auto", torch.zeros(shape)) == "mse"
    assert distributed_train.loss_kind("mse", torch.zeros(4, 10)) == "mse"
    labels = [distributed_train.shard_target(torch.zeros(4, 10), 3, r, 2, "cross-entropy") for r in range(2)]
    whole = distributed_train.shard_target(torch.zeros(8, 10), 3, 0, 1, "cross-entropy")
    assert whole.dtype == torch.int64 and int(whole.max()) < 10 and torch.equal(torch.cat(labels), whole)


def test_batchnorm_with_batch_statistics_is_named():
    note = distributed_train.batch_statistics_note(distributed_train.ConvBatchNorm())
    assert note and "each process's shard" in note
    assert distributed_train.batch_statistics_note(distributed_train.TwoPipelines()) is None
    assert distributed_train.batch_statistics_note(distributed_train.ConvBatchNorm().eval()) is None
    with pytest.raises(SystemExit, match="SyncBatchNorm"):
        synced = nn.SyncBatchNorm.convert_sync_batchnorm(distributed_train.ConvBatchNorm())
        distributed_train.batch_statistics_note(synced)
