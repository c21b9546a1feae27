"""A capture that fails half-way through on the ``torch`` backend falls back to eager cleanly -- on CPU, through a
fake of the ``torch.cuda`` calls the backend makes (``graphs.backends.torch_cuda.cuda``).

The fake behaves like torch's ``torch.cuda.graph`` on an invalidated capture:
the layer's illegal op raises inside the capture; ``__exit__`` then calls ``capture_end()``, which raises a second
error before the stream context is left (the thread stays on the capture stream), and the allocator still believes
a capture is under way, so ``empty_cache()`` raises too.  Checked: the caller's stream and GC setting come back,
both collective decisions are reached, every graph is reset (the pool is released), the log line names the root
error, and the eager fallback is bitwise the eager reference.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import logging
import sys

import pytest
import torch

from engine.plan import build_plan
from graphs import capture, decision
from graphs.backends import torch_cuda
from graphs.local_rank import make_rank_data
from tests.graphs.test_graphs_emulate import B, Block, H, S, bitwise_equal, run_steps, samples

capture_mod = sys.modules["graphs.capture"]  # the module (``graphs.capture`` the attribute is the function)


class FakeStream:
    def __init__(self, name: str):
        self.name = name

    def wait_stream(self, other) -> None:
        pass


class FakeGraph:
    def __init__(self, cuda: "FakeCuda"):
        self.cuda, self.was_reset = cuda, False

    def register_generator_state(self, gen) -> None:
        pass

    def reset(self) -> None:
        self.was_reset = True


class FakeCuda:
    """The ``torch.cuda`` calls of the torch backend; ``graph`` mimics ``torch.cuda.graph``'s enter/exit."""

    def __init__(self):
        self.default = FakeStream("default")
        self.current = self.default
        self.capturing = False
        self.allocator_capturing = False  # stuck after a failed capture_end
        self.graphs: list[FakeGraph] = []
        self.sync_mode = 0

    def is_available(self): return True
    def synchronize(self): pass
    def current_stream(self): return self.current
    def set_stream(self, stream): self.current = stream
    def Stream(self): return FakeStream("side")
    def graph_pool_handle(self): return ("pool",)
    def get_rng_state_all(self): return []
    def set_rng_state_all(self, states): pass
    def get_sync_debug_mode(self): return self.sync_mode
    def set_sync_debug_mode(self, mode): self.sync_mode = mode

    def empty_cache(self):
        if self.allocator_capturing:
            raise RuntimeError("empty_cache: the caching allocator believes a capture is under way")

    def CUDAGraph(self):
        self.graphs.append(FakeGraph(self))
        return self.graphs[-1]

    @contextlib.contextmanager
    def stream(self, stream):
        previous, self.current = self.current, stream
        yield
        self.current = previous

    @contextlib.contextmanager
    def graph(self, g, pool=None, stream=None, capture_error_mode="global"):  # torch.cuda.graph's signature
        g.capture_error_mode = capture_error_mode
        self.empty_cache()
        previous, self.current = self.current, FakeStream("capture")  # stream_ctx.__enter__
        self.capturing = self.allocator_capturing = True  # capture_begin
        failed = False
        try:
            yield
        except Exception:
            failed = True
            raise
        finally:
            self.capturing = False
            if failed:  # capture_end() raises before stream_ctx.__exit__: the thread stays on the capture stream
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
            self.allocator_capturing = False
            self.current = previous


FAKE: FakeCuda | None = None


class IllegalInCapture(Block):
    """Fine eagerly and in warmup; inside a capture its op is illegal (like a sync the warmup check missed)."""

    def forward(self, x):
        if FAKE is not None and FAKE.capturing:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return super().forward(x)


@pytest.fixture
def fake_cuda(monkeypatch):
    global FAKE
    FAKE = FakeCuda()
    monkeypatch.setattr(torch_cuda, "cuda", FAKE)
    monkeypatch.setattr(decision, "cuda_ready", lambda: True)
    monkeypatch.setattr(capture_mod, "_local_problem", lambda layers, sample_args: None)  # CPU tensors here
    calls = []
    real_agree = decision.agree

    def agree(ok, reason, group=None):
        calls.append((ok, reason))
        return real_agree(ok, reason, group)

    monkeypatch.setattr(decision, "agree", agree)
    yield FAKE, calls
    FAKE = None


def test_failed_capture_restores_stream_gc_and_pool_and_reports_the_root_error(fake_cuda, caplog):
    fake, decisions = fake_cuda
    plan = build_plan("1f1b", 2, 2)
    torch.manual_seed(0)
    eager = [[Block(), IllegalInCapture()]]
    graphed = copy.deepcopy(eager)
    gc.disable()  # the caller's setting, which capture must give back (not force GC on)
    try:
        with caplog.at_level(logging.WARNING, logger="pipecast.graphs"):
            layers = capture(graphed, plan, 0, samples(graphed, 2), backend="torch")
        gc_after = gc.isenabled()
    finally:
        gc.enable()
    assert not layers.active and layers.report.backend == "eager"
    assert not gc_after
    assert fake.current is fake.default  # not left on the capture stream
    assert [ok for ok, _ in decisions] == [True, False]  # the second, collective decision was reached
    assert fake.graphs and all(g.was_reset for g in fake.graphs)  # every graph dropped: the pool is free
    reason = layers.report.reason
    assert reason.startswith("capture error: RuntimeError: CUDA error: operation not permitted when stream is "
                             "capturing (then RuntimeError: CUDA error: operation failed due to a previous error"), reason
    assert "empty_cache" in layers.report.traceback  # the failing cleanup step is recorded, not raised
    assert [r.getMessage() for r in caplog.records if r.name == "pipecast.graphs"] == [layers.report.log_line]
    data = make_rank_data(1, 2, (S, B, H))
    assert bitwise_equal(run_steps(eager, plan, 0, data, 2), run_steps(graphed, plan, 0, data, 2))


def test_warmup_runs_with_sync_debug_errors_and_restores_the_mode(fake_cuda):
    fake, _ = fake_cuda
    seen = []

    class Probe(Block):
        def forward(self, x):
            seen.append((fake.sync_mode, fake.current.name))
            return super().forward(x)

    plan = build_plan("1f1b", 2, 2)
    graphed = [[Probe()]]
    capture(graphed, plan, 0, samples(graphed, 2), backend="torch")  # the fake cannot replay: we check warmup
    assert ("error", "side") in seen and fake.sync_mode == 0 and fake.current is fake.default


def test_graph_capture_returns_to_the_callers_stream_when_capture_end_raises(fake_cuda):
    fake, _ = fake_cuda
    with pytest.raises(RuntimeError, match="previous error during capture") as info:
        with torch_cuda.graph_capture(fake.CUDAGraph(), None):
            raise RuntimeError("illegal op")
    assert fake.current is fake.default
    assert capture_mod.root_cause(info.value).args == ("illegal op",)


def test_forward_graphs_capture_thread_local_and_backward_graphs_global(fake_cuda):
    """Forward captures tolerate other threads' CUDA calls (``capture_error_mode="thread_local"``); backward
    captures, whose kernels autograd's device thread launches, keep "global" (``graphs.backends.torch_cuda``)."""
    import inspect
    assert "capture_error_mode" in inspect.signature(torch.cuda.graph.__init__).parameters  # the installed torch
    plan = build_plan("1f1b", 2, 2)
    graphed = [[Block(), Block()]]
    layers = capture(graphed, plan, 0, samples(graphed, 2), backend="torch")
    assert layers.active, layers.report
    slots = layers.graphs.callables
    assert [s.fwd_graph.capture_error_mode for s in slots] == ["thread_local"] * 4
    assert [s.bwd_graph.capture_error_mode for s in slots] == ["global"] * 4
    layers.remove()


def test_gradient_buffers_are_allocated_on_the_callers_stream_not_the_warmup_stream(fake_cuda, monkeypatch):
    """The buffers are read on the caller's stream by every replay; allocated on the warmup side stream, their
    blocks would belong to that stream (issue 24)."""
    from graphs.backends import common
    fake, _ = fake_cuda
    streams = []
    real_of = common.GradBuffers.of

    def of(self, p):
        streams.append(fake.current.name)
        return real_of(self, p)

    monkeypatch.setattr(common.GradBuffers, "of", of)
    plan = build_plan("1f1b", 2, 2)
    graphed = [[Block(), Block()]]
    layers = capture(graphed, plan, 0, samples(graphed, 2), backend="torch")
    assert layers.active, layers.report
    assert streams and set(streams) == {"default"}


class _FakeClock:
    """Advances ``step`` seconds per graph capture (the fake's ``graph`` context) and not otherwise."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        return self.now


def test_a_capture_projected_to_outlast_the_collective_timeout_stops_and_falls_back(fake_cuda, monkeypatch,
                                                                                     caplog):
    fake, decisions = fake_cuda
    clock = _FakeClock(2.0)
    monkeypatch.setattr(capture_mod, "_clock", clock)
    real_graph = fake.graph

    @contextlib.contextmanager
    def slow_graph(g, pool=None, capture_error_mode="global"):
        with real_graph(g, pool, capture_error_mode=capture_error_mode):
            yield
        clock.now += clock.step  # each graph: synchronize, empty_cache, capture

    monkeypatch.setattr(fake, "graph", slow_graph)
    plan = build_plan("1f1b", 2, 4)
    torch.manual_seed(0)
    eager = [[Block(), Block()]]
    graphed = copy.deepcopy(eager)
    # 2 layers x 4 microbatches x (F, B) = 16 graphs at 2 s: 32 s, more than 0.8 x 30 s
    layers = capture(graphed, plan, 0, samples(graphed, 4), backend="torch", timeout_s=30.0)
    assert not layers.active and [ok for ok, _ in decisions] == [True, False]
    assert "capture would take about 32s (16 graphs" in layers.report.reason
    assert "parallel.timeout_s=30" in layers.report.reason
    assert all(g.was_reset for g in fake.graphs)
    data = make_rank_data(1, 4, (S, B, H))
    assert bitwise_equal(run_steps(eager, plan, 0, data, 1), run_steps(graphed, plan, 0, data, 1))
    # the same capture with a timeout it fits in: graphs on, a warning once it took more than half of it
    clock.now, graphed = 0.0, copy.deepcopy(eager)
    with caplog.at_level(logging.WARNING, logger="pipecast.graphs"):
        layers = capture(graphed, plan, 0, samples(graphed, 4), backend="torch", timeout_s=50.0)
    assert layers.active and layers.report.seconds == 32.0
    assert any("more than half of the collective timeout" in r.getMessage() for r in caplog.records)


def test_tensor_parallel_capture_with_expandable_segments_needs_nccl_graph_register_off(monkeypatch):
    """NCCL registers graph buffers as contiguous allocations, which expandable segments break: a rank whose graphed
    layers hold DTensor parameters (tensor-parallel collectives in the graphs) refuses to capture then, with the fix
    in the reason (NVIDIA/Megatron-LM#5474)."""
    from graphs import GraphedLayers
    layers = GraphedLayers([[Block()]])
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.delenv("NCCL_GRAPH_REGISTER", raising=False)
    assert capture_mod._nccl_register_problem(layers) is None  # plain parameters: no collective captured
    layers.modules[0][0].fc1.weight.device_mesh = object()  # what a DTensor parameter carries
    assert "NCCL_GRAPH_REGISTER=0" in capture_mod._nccl_register_problem(layers)
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "0")
    assert capture_mod._nccl_register_problem(layers) is None
    layers.remove()
