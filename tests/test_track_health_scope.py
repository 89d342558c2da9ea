"""track(health=True): whose rows are whose. The module hooks are global, so
a watch must keep to the calls of its own thread, and a row is one module
object: two models of the same class are two sets of rows, a module shared
by two parents is one.

The rule for threads (docs/audit.md, "Threads and workers"): a module call
is recorded by the health tracks active in the thread that makes it; a
thread with no health track of its own has its calls recorded by every
health track active in the process, as track(all_casts=True) records the
casts of threads without a track."""
import math
import threading

import torch

import torchcast

TIMEOUT = 60  # seconds; a hung barrier or thread fails the test instead of the run
WIDTH = {"0": 16, "1": 16, "2": 4}  # the output width of each child of sequential()


def sequential(scale, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    return model


def output_amax(model, x):
    """Each child's output amax, by index, run outside any track."""
    amax, h = {}, x
    with torch.no_grad():
        for i, child in enumerate(model):
            h = child(h)
            amax[str(i)] = h.abs().max().item()
    return amax


def rows_of(report, phase="forward"):
    rows = {}
    for r in report.health:
        if r.phase == phase:
            assert r.module not in rows, f"two {phase} rows named {r.module}"
            rows[r.module] = r
    return rows


def run_threads(barrier, *targets):
    """Runs each target in its own thread; re-raises the first error."""
    errors = []

    def guarded(target):
        try:
            target()
        except BaseException as e:  # re-raised in the test's thread
            errors.append(e)
            barrier.abort()  # the other thread would wait for this one until TIMEOUT

    threads = [threading.Thread(target=guarded, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]


def test_concurrent_tracks_in_two_threads_keep_their_own_rows():
    calls = 6
    barrier = threading.Barrier(2, timeout=TIMEOUT)
    x = torch.randn(5, 8)
    models = {"small": sequential(1.0), "large": sequential(1e6)}  # same class, same names
    reports = {}

    def worker(name):
        model = models[name]
        with torchcast.track(health=True) as report:
            barrier.wait()  # both tracks active before either calls
            for _ in range(calls):
                barrier.wait()  # the two threads' calls interleave
                model(x).square().mean().backward()
            barrier.wait()  # both done before either exits
        reports[name] = report

    run_threads(barrier, lambda: worker("small"), lambda: worker("large"))
    for name, model in models.items():
        report = reports[name]
        forward = rows_of(report)
        assert set(forward) == {"Sequential", "0", "1", "2"}, name
        amax = output_amax(model, x)
        for i in "012":
            row = forward[i]
            assert row.health.numel == calls * x.shape[0] * WIDTH[i], (name, i)
            assert math.isclose(row.health.amax, amax[i], rel_tol=1e-6), (name, i)
        # Gradients: the hooks on each thread's outputs feed that thread's report.
        backward = rows_of(report, "backward")
        assert set(backward) == {"Sequential", "0", "1", "2"}, name
        assert backward["2"].health.numel == calls * 5 * 4
    # each report's last layer is its own model's, never the other's
    assert rows_of(reports["small"])["2"].health.amax < 1e3
    assert rows_of(reports["large"])["2"].health.amax > 1e9


def test_thread_without_a_track_is_recorded_by_the_active_track():
    """The documented rule: like other threads' casts under all_casts."""
    x = torch.randn(3, 8)
    mine, theirs = sequential(1.0), sequential(100.0, seed=1)
    entered, called = threading.Event(), threading.Event()

    def other():
        assert entered.wait(TIMEOUT)
        with torch.no_grad():
            theirs(x)
        called.set()

    thread = threading.Thread(target=other)
    thread.start()
    with torch.no_grad(), torchcast.track(health=True) as report:
        mine(x)
        entered.set()
        assert called.wait(TIMEOUT)
    thread.join(TIMEOUT)
    assert not thread.is_alive()
    forward = rows_of(report)
    # two models of one class: each its own rows, the second one numbered
    assert set(forward) == {"Sequential", "Sequential.0", "Sequential.1", "Sequential.2",
                            "Sequential#2", "Sequential#2.0", "Sequential#2.1",
                            "Sequential#2.2"}
    assert math.isclose(forward["Sequential#2.2"].health.amax, output_amax(theirs, x)["2"],
                        rel_tol=1e-6)


def test_two_root_models_of_one_class_are_separate_rows():
    x = torch.randn(4, 8)
    generator, discriminator = sequential(1.0), sequential(1e3, seed=1)  # overflows float16
    with torchcast.track(health=True) as report:
        (generator(x).sum() + discriminator(x).sum()).backward()
    forward = rows_of(report)
    assert set(forward) == {"Sequential", "Sequential.0", "Sequential.1", "Sequential.2",
                            "Sequential#2", "Sequential#2.0", "Sequential#2.1",
                            "Sequential#2.2"}
    for prefix, model in (("Sequential", generator), ("Sequential#2", discriminator)):
        for i, amax in output_amax(model, x).items():
            row = forward[f"{prefix}.{i}"]
            assert math.isclose(row.health.amax, amax, rel_tol=1e-6), (prefix, i)
            assert row.health.numel == x.shape[0] * WIDTH[i]
    assert math.isclose(forward["Sequential#2"].health.amax, forward["Sequential#2.2"].health.amax)
    overflow = {(r.module, r.phase): r.result.overflow for r in report.headroom(torch.float16)}
    assert all(overflow[(f"Sequential.{i}", "forward")] == 0 for i in "012")
    assert overflow[("Sequential#2.2", "forward")] > 0
    assert overflow[("Sequential#2.0", "forward")] == 0  # its first layer stays in range
    backward = rows_of(report, "backward")
    assert {"Sequential.0", "Sequential#2.0"} <= set(backward)
    # d(sum)/d(output) is all ones for both last layers: one row each, not merged
    assert backward["Sequential.2"].health.numel == backward["Sequential#2.2"].health.numel \
        == x.shape[0] * 4


class TwoBranches(torch.nn.Module):
    def __init__(self, shared):
        super().__init__()
        self.a = torch.nn.Sequential(shared, torch.nn.ReLU())
        self.b = torch.nn.Sequential(shared, torch.nn.Tanh())

    def forward(self, x):
        return self.b(x) + self.a(x)  # b first: the name is still the first registered


def test_shared_submodule_is_one_row_named_by_its_first_path():
    shared = torch.nn.Linear(8, 8)
    model = TwoBranches(shared)
    x = torch.randn(3, 8)
    with torch.no_grad(), torchcast.track(health=True) as report:
        model(x)
    forward = rows_of(report)
    assert set(forward) == {"TwoBranches", "a", "a.0", "a.1", "b", "b.1"}
    assert forward["a.0"].health.numel == 2 * 3 * 8


def test_submodule_shared_by_two_root_models_is_one_row():
    shared = torch.nn.Linear(8, 8)
    first = torch.nn.Sequential(shared, torch.nn.ReLU())
    second = torch.nn.Sequential(torch.nn.Tanh(), shared)
    x = torch.randn(3, 8)
    with torch.no_grad(), torchcast.track(health=True) as report:
        first(x)
        y = second(x)
    forward = rows_of(report)
    assert set(forward) == {"Sequential", "Sequential.0", "Sequential.1",
                            "Sequential#2", "Sequential#2.0"}
    assert forward["Sequential.0"].health.numel == 2 * 3 * 8  # the shared Linear, both calls
    assert forward["Sequential#2.0"].health.amax <= 1  # Tanh's alone
    assert math.isclose(forward["Sequential#2"].health.amax, y.abs().max().item())


def test_module_made_anew_each_step_continues_the_rows_of_the_one_gone():
    """A loss module built at each step is one row, not one per step; two
    models alive together stay two (the test above)."""
    model, x, y = sequential(1.0), torch.randn(4, 8), torch.randn(4, 4)
    with torch.no_grad(), torchcast.track(health=True) as report:
        for _ in range(5):
            torch.nn.MSELoss()(model(x), y)
            torch.nn.Sequential(torch.nn.Tanh())(x)  # a model made and dropped
    forward = rows_of(report)
    assert set(forward) == {"Sequential", "Sequential.0", "Sequential.1", "Sequential.2",
                            "MSELoss", "Sequential#2", "Sequential#2.0"}
    assert forward["MSELoss"].health.numel == 5
    assert forward["Sequential#2.0"].health.numel == 5 * 4 * 8


def test_report_round_trip_keeps_distinct_names():
    x = torch.randn(4, 8)
    models = sequential(1.0), sequential(1e3, seed=1)
    with torch.no_grad(), torchcast.track(health=True) as report:
        for model in models:
            model(x)
    back = torchcast.Report.from_json(report.to_json())
    assert [(r.module, r.phase) for r in back.health] == \
        [(r.module, r.phase) for r in report.health]
    assert len(back.health) == 8
