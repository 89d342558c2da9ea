"""torchcast.optim under DistributedDataParallel and FSDP2 (fully_shard):
two CPU processes, gloo over 127.0.0.1, against one process on the whole batch."""
import gc
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torchcast

STEPS = 20
TIMEOUT_S = 180

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="this torch build has no torch.distributed with gloo")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two(fn, *args):
    """Runs fn(rank, *args) in two spawned processes, bounded in time."""
    ctx = mp.spawn(fn, args=args, nprocs=2, join=False)
    deadline = TIMEOUT_S
    while not ctx.join(timeout=5):
        deadline -= 5
        if deadline <= 0:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            pytest.fail(f"the 2-process run did not finish in {TIMEOUT_S} s")


def init(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def data():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen))
            for _ in range(STEPS)]


def make_opt(params):
    return torchcast.optim.AdamW(params, lr=1e-2, compensated=True, amsgrad=True)


def train(model, opt, batches):
    for x, y in batches:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def single_process():
    model = make_model()
    opt = make_opt(model.parameters())
    train(model, opt, data())
    return [p.detach() for p in model.parameters()]


def run_worker(rank, train_fn, port, out_dir):
    """Runs train_fn(rank, out_dir) in an initialised process group.

    train_fn returns (and a collection frees any cycle) before the group is
    torn down, so that DDP's reducer and FSDP's state, which hold the group,
    die first; a group still referenced at
    interpreter exit is destroyed with its gloo threads running, which aborts
    the process ("terminate called without an active exception"). The barrier
    keeps either rank from leaving while the other still talks to it.
    """
    init(rank, port)
    try:
        train_fn(rank, out_dir)
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def ddp_train(rank, out_dir):
    model = torch.nn.parallel.DistributedDataParallel(make_model())
    opt = make_opt(model.parameters())
    train(model, opt, [(x[rank * 8:rank * 8 + 8], y[rank * 8:rank * 8 + 8]) for x, y in data()])
    state = {k: v for k, v in opt.state[next(model.parameters())].items()}
    torch.save({"params": [p.detach() for p in model.parameters()], "state": state},
               os.path.join(out_dir, f"ddp{rank}.pt"))


def fsdp_train(rank, out_dir):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    model = make_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = make_opt(model.parameters())
    train(model, opt, [(x[rank * 8:rank * 8 + 8], y[rank * 8:rank * 8 + 8])
                       for x, y in data()])
    p0 = next(model.parameters())
    assert isinstance(p0, DTensor)
    states_sharded = all(isinstance(v, DTensor) for k, v in opt.state[p0].items()
                         if k != "step")
    full = [p.full_tensor().detach() for p in model.parameters()]
    local = [p.to_local().numel() for p in model.parameters()]
    torch.save({"params": full, "states_sharded": states_sharded, "local": local},
               os.path.join(out_dir, f"fsdp{rank}.pt"))


def test_ddp_two_processes_match_one(tmp_path):
    run_two(run_worker, ddp_train, free_port(), str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"ddp{r}.pt", weights_only=True) for r in (0, 1))
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)  # identical on both ranks, bit for bit
    for key in r0["state"]:
        assert torch.equal(r0["state"][key], r1["state"][key]), key
    assert set(r0["state"]) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq",
                                "compensation"}
    # averaging two half-batch gradients rounds differently from one
    # whole-batch gradient, so the match with one process is to float32 noise
    for a, b in zip(r0["params"], single_process()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_fsdp2_two_processes_match_one(tmp_path):
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        pytest.skip("this torch has no torch.distributed.fsdp.fully_shard (FSDP2)")
    run_two(run_worker, fsdp_train, free_port(), str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"fsdp{r}.pt", weights_only=True) for r in (0, 1))
    assert r0["states_sharded"] and r1["states_sharded"]
    # the (1, 16) layer is sharded unevenly: one rank steps an empty shard
    assert 0 in r1["local"] or 0 in r0["local"]
    for a, b, c in zip(r0["params"], r1["params"], single_process()):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
