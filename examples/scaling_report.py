"""The demo's view of FP8 scaling health: per layer, the scale (per-tensor recipes) or the largest
block scale (MXFP8, blockwise) and the fraction of gradient elements flushed to zero, sampled by
fp8ops.monitor during training and drawn as scaling.png."""
from __future__ import annotations

import math

import fp8ops


def sample(model, step, curve):
    """Append (step, fp8ops.stats(model)) when the model's monitor sampled this step."""
    mon = getattr(model, "_fp8ops_monitor", None)
    if mon is not None and mon.sampling:
        curve.append((step, fp8ops.stats(model)))


def _series(curve, suffix):
    """{layer.role: [(step, value)]} for the stats ending in suffix."""
    out = {}
    for step, stats in curve:
        for key, value in stats.items():
            if key.endswith(suffix):
                out.setdefault(key[: -len(suffix)], []).append((step, value))
    return out


def plot(results, path):
    runs = [r for r in results if r.get("scaling_curve")]
    if not runs:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(runs), 2, figsize=(12, 3.2 * len(runs)), squeeze=False)
    for (a_scale, a_under), r in zip(axes, runs):
        curve = r["scaling_curve"]
        scales = _series(curve, ".input.scale")
        label = "input scale (log2)"
        if not scales:
            scales = _series(curve, ".input.block_scale_log2_max")
            label = "largest input block scale (log2)"
        for name, pts in sorted(scales.items()):
            ys = [v if label.startswith("largest") else math.log2(v) if v > 0 else float("nan")
                  for _, v in pts]
            a_scale.plot([s for s, _ in pts], ys, lw=1, label=name.removesuffix(".input"))
        a_scale.set(title=f"{r['name']}: {label}", xlabel="step")
        for name, pts in sorted(_series(curve, ".grad.underflow_frac").items()):
            a_under.plot([s for s, _ in pts], [100 * v for _, v in pts], lw=1,
                         label=name.removesuffix(".grad"))
        a_under.set(title=f"{r['name']}: gradient elements flushed to zero (%)", xlabel="step")
        for a in (a_scale, a_under):
            a.grid(alpha=0.3)
            a.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
