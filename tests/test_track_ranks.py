"""track(nonfinite=...) across 2 gloo ranks (issue 31): DDP and FSDP2, where
rank 1 alone makes an inf at optimizer step 2 (its input times 1e39 in
float32). Each rank runs in its own process (this file run as a script), so
that "raise" shows that the other rank stops by itself, within the gloo
timeout, and the CLI under torchrun."""
import datetime
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="this torch build has no torch.distributed with gloo")

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
TIMEOUT_S = 90
GLOO_TIMEOUT_S = 20
BAD_STEP, BAD_RANK = 2, 1
BAD_LINE = "x = x * 1e39  # the inf"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env():
    return dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
                PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def run_ranks(kind, action, out_dir):
    """Runs this file as rank 0 and rank 1; returns [(returncode, stderr)]."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, HERE, kind, action, str(rank), port, str(out_dir)],
                              env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    results = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"rank {procs.index(p)} did not finish in {TIMEOUT_S} s")
        results.append((p.returncode, err))
    return results


# --- what each rank runs ------------------------------------------------------------------
def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def train(model, rank, steps=3, literal=False):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for step in range(1, steps + 1):
        x = torch.randn(4, 8, generator=gen)
        if rank == BAD_RANK and step == BAD_STEP and literal:
            x = x * torch.tensor(float("inf"))  # the literal inf
        elif rank == BAD_RANK and step == BAD_STEP:
            x = x * 1e39  # the inf
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def worker(kind, action, rank, port, out_dir):
    import torchcast
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
    model = make_model()
    literal = kind == "ddp_literal"
    if kind == "full":
        every_feature(model, rank, out_dir)
    elif kind in ("ddp", "ddp_literal"):
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    if kind != "full":
        with torchcast.track(nonfinite=action, health=True) as report:
            train(model, rank, literal=literal)
        report_ranks(report, rank, out_dir)
    del model
    dist.barrier()
    dist.destroy_process_group()


def every_feature(model, rank, out_dir):
    """A DDP step with every feature of a track on: casts (all_casts and a
    safe_to), an origin and an entry on rank 1 (and what arrives on rank
    0), health with block headroom, torchcast AdamW's update accounting,
    a compiled region."""
    import torchcast
    model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torchcast.optim.AdamW(model.parameters(), lr=1e-3, track_updates=True)
    compiled = torch.compile(lambda t: t * 2, backend="aot_eager")
    with torchcast.track(all_casts=True, nonfinite="record", health=True,
                         block_formats=("mxfp8_e4m3",)) as report:
        for step in (1, 2):
            x = compiled(torch.randn(4, 8)).half().float()
            torchcast.safe_to(x, torch.bfloat16, policy="record")
            if rank == BAD_RANK and step == BAD_STEP:
                x = x * torch.tensor(float("inf"))  # an entry
                torch.log(torch.tensor([-1.0]))  # an origin
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    report_ranks(report, rank, out_dir, all_reduce=True)


def report_ranks(report, rank, out_dir, all_reduce=False):
    """Merges the ranks' reports on rank 0, which writes it and its own
    (with ``all_reduce``, also what Report.all_reduce makes of its own)."""
    alone = report.to_dict()
    if all_reduce:
        reduced = type(report).from_dict(alone).all_reduce()
        if rank == 0:
            with open(os.path.join(out_dir, "all_reduce0.json"), "w") as f:
                f.write(reduced.to_json())
    merged = report.merge_ranks(dst=0)
    if rank == 0:
        with open(os.path.join(out_dir, "merged.json"), "w") as f:
            f.write(merged.to_json())
        with open(os.path.join(out_dir, "alone0.json"), "w") as f:
            json.dump(alone, f)
        print(merged.table(), file=sys.stderr)
    else:
        assert merged is None


# --- the tests ------------------------------------------------------------------------------
def check_merged(out_dir, collective):
    from torchcast.tracker.report import Report
    merged = Report.from_json((out_dir / "merged.json").read_text())
    origins = merged.nonfinite
    made = [o for o in origins if o.arrived_through is None]
    arrived = [o for o in origins if o.arrived_through is not None]
    first = origins[0]
    # rank 1 made it, at that step and op, at that line
    assert (first.rank, first.op, first.step, first.step_kind, first.arrived_through) == \
        (BAD_RANK, "aten::mul", BAD_STEP, "optimizer step", None), first
    assert open(first.file).read().splitlines()[first.line - 1].strip() == BAD_LINE
    assert "[rank 1]" in first.describe()
    assert all(o.rank == BAD_RANK for o in made), made
    # rank 0's NaN arrived through the gradient's collective, from rank 1
    mine = [o for o in arrived if o.rank == 0]
    assert mine, origins
    assert mine[0].arrived_through == collective
    assert mine[0].step == BAD_STEP and mine[0].from_ranks == [BAD_RANK]
    assert mine[0].reached
    assert "made on rank 1" in mine[0].describe() and "not an origin" in mine[0].describe()
    assert origins.index(mine[0]) > origins.index(first)
    # rank 0 alone made nothing: no origin of its own
    alone = json.loads((out_dir / "alone0.json").read_text())
    assert all(o["arrived_through"] for o in alone["nonfinite"]), alone["nonfinite"]
    # health rows of both ranks, labelled
    labels = {r.module.split("]")[0] + "]" for r in merged.health}
    assert labels == {"[rank 0]", "[rank 1]"}


@pytest.mark.slow
def test_ddp_merged_report_names_rank_step_and_op(tmp_path):
    results = run_ranks("ddp", "record", tmp_path)
    assert [code for code, _ in results] == [0, 0], results
    check_merged(tmp_path, "all_reduce")


@pytest.mark.slow
def test_a_literal_inf_on_one_rank_is_named_as_entering_there(tmp_path):
    results = run_ranks("ddp_literal", "record", tmp_path)
    assert [code for code, _ in results] == [0, 0], results
    from torchcast.tracker.report import Report
    origins = Report.from_json((tmp_path / "merged.json").read_text()).nonfinite
    first = origins[0]
    assert (first.rank, first.op, first.step, first.arrived_through) == \
        (BAD_RANK, "aten::mul", BAD_STEP, None), origins
    assert first.entered.startswith("argument 'other': a 0-d tensor holding inf")
    assert open(first.file).read().splitlines()[first.line - 1].strip() == \
        'x = x * torch.tensor(float("inf"))  # the literal inf'
    arrived = [o for o in origins if o.rank == 0]
    assert [(o.arrived_through, o.from_ranks) for o in arrived] == [("all_reduce", [BAD_RANK])]


def test_every_section_of_two_ranks_survives_the_merge_with_its_rank(tmp_path):
    results = run_ranks("full", "record", tmp_path)
    assert [code for code, _ in results] == [0, 0], results
    from torchcast.tracker.report import Report
    data = json.loads((tmp_path / "merged.json").read_text())
    alone = json.loads((tmp_path / "alone0.json").read_text())
    merged = Report.from_dict(data)
    assert merged.to_dict() == data  # from_dict(to_dict(r)) == r, every section
    assert data["ranks"] == [0, 1]
    # casts: both ranks' casts, merged by site (each rank cast twice per site)
    assert alone["records"] and all(r["calls"] == 2 * a["calls"] for r, a in zip(
        sorted(data["records"], key=lambda r: (r["line"], r["origin"], r["dtype"])),
        sorted(alone["records"], key=lambda r: (r["line"], r["origin"], r["dtype"]))))
    # origins and entries with their ranks, and what arrived on rank 0
    kinds = {(o["rank"], o["op"], o["entered"] is not None, o["arrived_through"])
             for o in data["nonfinite"]}
    assert {(1, "aten::mul", True, None), (1, "aten::log", False, None)} <= kinds
    assert any(rank == 0 and through == "all_reduce" for rank, _, _, through in kinds)
    # rows of each section, labelled with their rank
    for section in ("health", "block_headroom"):
        ranks = {row["module"].split("]")[0] + "]" for row in data[section]}
        assert ranks == {"[rank 0]", "[rank 1]"}, (section, ranks)
        assert len(data[section]) == 2 * len(alone[section]), section
    assert {r["name"].split("]")[0] + "]" for r in data["updates"]} == {"[rank 0]", "[rank 1]"}
    assert len(data["updates"]) == 2 * len(alone["updates"]) > 0
    assert len(data["compiled_regions"]) == 2 * len(alone["compiled_regions"]) > 0
    assert merged.headroom("mxfp8_e4m3").rows  # the block rows read as a table
    # all_reduce is the same merge, made on every rank
    assert json.loads((tmp_path / "all_reduce0.json").read_text()) == data


@pytest.mark.slow
def test_fsdp2_merged_report_names_rank_step_and_op(tmp_path):
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        pytest.skip("this torch has no torch.distributed.fsdp.fully_shard (FSDP2)")
    results = run_ranks("fsdp", "record", tmp_path)
    assert [code for code, _ in results] == [0, 0], results
    # The reach checks read FSDP2's DTensor gradients through their shards.
    check_merged(tmp_path, "reduce_scatter")


@pytest.mark.slow
def test_raise_stops_both_ranks_without_a_hang(tmp_path):
    results = run_ranks("ddp", "raise", tmp_path)
    (code0, err0), (code1, err1) = results
    assert code1 != 0 and code0 != 0, results
    assert "NonFiniteError" in err1 and "aten::mul" in err1 and "[rank 1]" in err1, err1
    assert f"optimizer step {BAD_STEP}" in err1, err1
    # rank 0 fails in its next collective, with gloo's error
    assert "NonFiniteError" not in err0, err0


SCRIPT = f'''
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in (1, 2, 3):
    x = torch.randn(3, 4)
    if rank == 1 and step == 2:
        x = x * 1e39  # the inf
    model(x.half().float()).sum().backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_cli_under_torchrun_writes_a_report_per_rank(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "torchcast", "track", "--nonfinite", "record", "--json", str(out), str(script)]
    p = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=TIMEOUT_S,
                       cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr[-4000:]
    assert not out.exists()
    made = json.loads((tmp_path / "report.rank1.json").read_text())["nonfinite"]
    assert made[0]["rank"] == 1 and made[0]["op"] == "aten::mul" and made[0]["step"] == 2
    arrived = json.loads((tmp_path / "report.rank0.json").read_text())["nonfinite"]
    assert [(o["rank"], o["arrived_through"]) for o in arrived] == [(0, "all_reduce")], arrived


if __name__ == "__main__":
    kind, action, rank, port, out_dir = sys.argv[1:]
    worker(kind, action, int(rank), port, out_dir)
