"""bench/_timing.py's interleaved(): every variant is timed rounds x iters times, no variant always
follows the same one, and a variant that raises is recorded while the others go on."""
from __future__ import annotations

import gc
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "bench"))
from _timing import captured_step, interleaved  # noqa: E402


def test_every_variant_is_timed_and_follows_different_ones():
    calls = []
    steps = {name: (lambda name=name: calls.append(name)) for name in "abcde"}
    out = interleaved(steps, "cpu", rounds=6, iters=2, warmup=1)
    assert list(out) == list("abcde") and all(isinstance(t, float) for t in out.values())
    timed = calls[5:]  # after one warm-up call each
    assert all(timed.count(name) == 6 * 2 for name in "abcde")
    # the variant run before each one's first call of a round
    before = {name: set() for name in "abcde"}
    for prev, cur in zip(timed[1::2], timed[2::2]):
        if prev != cur:
            before[cur].add(prev)
    assert all(len(names) >= 2 for names in before.values()), before


def test_a_variant_that_raises_is_recorded_and_the_others_go_on():
    state = {"n": 0}

    def flaky():
        state["n"] += 1
        if state["n"] == 3:  # the second timed call: in the first round
            raise RuntimeError("out of memory")

    out = interleaved({"ok": lambda: None, "flaky": flaky}, "cpu", rounds=4, iters=2, warmup=1)
    assert isinstance(out["ok"], float)
    assert "out of memory" in out["flaky"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_captured_step_keeps_the_tensors_its_graph_reads():
    """captured_step's replays read the input the captured closure made; the step alone must
    keep it alive (freed, its memory goes to the next allocation and the replays train on that:
    the graph-mode benchmarks' weights went non-finite)."""
    def make():
        torch.manual_seed(0)
        w = torch.randn(64, 64, device="cuda", requires_grad=True)
        x = torch.randn(32, 64, device="cuda")  # held by the closures only

        def forward_backward():
            (x @ w).square().sum().backward()

        def zero_grad():
            w.grad = None
        return w, captured_step(forward_backward, zero_grad, lambda: None)

    w, step = make()
    gc.collect()
    junk = torch.full((1 << 20,), 1e30, device="cuda")  # what a freed input's memory would hold
    step()
    torch.cuda.synchronize()
    torch.manual_seed(0)
    w_ref = torch.randn(64, 64, device="cuda", requires_grad=True)
    x_ref = torch.randn(32, 64, device="cuda")
    (x_ref @ w_ref).square().sum().backward()
    del junk
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-5, atol=1e-5)
