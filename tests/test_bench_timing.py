"""bench/_timing.py's interleaved(): every variant is timed rounds x iters times, no variant always
follows the same one, and a variant that raises is recorded while the others go on."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "bench"))
from _timing import interleaved  # noqa: E402


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
