"""fp8ops.grouped_linear (forward + backward) against bf16 torch._grouped_mm and
torch._scaled_grouped_mm, side by side in one run, on a GPU, at the expert shapes of
mixture-of-experts models.

One step: y = experts(x), y.backward(dy), for x [M, K] bf16 sorted by expert (requires grad), a
bf16 weight [E, N, K] and dy [M, N] bf16; the gradients are cleared before each step. M is the
number of (token, expert) rows the layer sees. Variants:
  - `bf16 grouped_mm`: torch._grouped_mm with its autograd (the baseline of the speed-ups; where
    it raises, `bf16 loop` is the baseline);
  - `bf16 loop`: one bf16 matmul per expert (autograd), what a model without grouped GEMMs runs;
  - `current`, `blockwise`: fp8ops.grouped_linear with CurrentScaling (a scale per expert) or
    BlockwiseScaling, the weight cast every step (as after every optimizer step);
  - `scaled_grouped_mm`: the three GEMMs as torch._scaled_grouped_mm (E4M3, row-wise scales: per
    row of x and dy, per output column of each expert's weight, per (expert, row) of the weight
    gradient's operands), the casts written in plain torch ops (amax, divide, to float8): what a
    model can build from torch alone. Where torch has no such op on the device, its cells say so.
Shapes: each model's two expert projections, gate_up (K = hidden, N = 2 * ffn) and down
(K = ffn, N = hidden), for Mixtral-8x7B (E=8, hidden 4096, ffn 14336), Llama-4-17B-16E (E=16,
hidden 5120, ffn 8192) and DeepSeek-V3 (256 routed experts of hidden 7168, ffn 2048: a slice of
32 local experts, as under expert parallelism). Routing: balanced (M / E rows each) or skewed (one
expert at 4x the mean, the others sharing the rest), every group a multiple of 16 rows. Per shape
the variants are timed in interleaved rounds (bench/_timing.py: each variant --iters steps per
round, CUDA events, the L2 flushed before each step); reported: the baseline's median ms and each
variant's speed-up (baseline time / its time), with their geometric means.

    python bench/bench_grouped.py [--rounds R] [--iters N] [--models mixtral,llama4,deepseek]
                                  [--tokens 8192,65536] [--projs gate_up,down]
                                  [--routings balanced,skewed]
    python bench/bench_grouped.py --device cpu --smoke     # runs end to end; not a measurement

Writes bench/results/grouped.md (a smoke run only to --out) and prints it.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _timing import (add_smoke_options, device_info, error_text, interleaved,  # noqa: E402
                     results_dir, write_table)

# name: (label, experts E, hidden, expert ffn)
MODELS = {
    "mixtral": ("Mixtral-8x7B", 8, 4096, 14336),
    "llama4": ("Llama-4-17B-16E", 16, 5120, 8192),
    "deepseek": ("DeepSeek-V3 (32 of 256 experts)", 32, 7168, 2048),
}
SMOKE_MODELS = {"tiny": ("tiny", 8, 64, 48)}
TOKENS = (8192, 65536)
SMOKE_TOKENS = (512,)
PROJS = ("gate_up", "down")
ROUTINGS = ("balanced", "skewed")
BASELINE, FALLBACK_BASELINE = "bf16 grouped_mm", "bf16 loop"
VARIANTS = (BASELINE, FALLBACK_BASELINE, "current", "blockwise", "scaled_grouped_mm")
ALIGN = 16  # rows per group: a multiple of this (torch._scaled_grouped_mm's alignment)
E4M3_MAX = 448.0


def group_sizes(m: int, e: int, routing: str) -> list:
    """Rows per expert, summing to m, each a multiple of ALIGN: all equal (balanced), or expert 0
    at 4x the mean and the others sharing the rest as evenly as ALIGN allows (skewed)."""
    if m % (ALIGN * e):
        raise ValueError(f"tokens {m} must be a multiple of {ALIGN} * experts ({e})")
    if routing == "balanced" or e == 1:
        return [m // e] * e
    hot = min(4 * m // e, m)
    units, cold = (m - hot) // ALIGN, e - 1
    return [hot] + [ALIGN * (units // cold + (i < units % cold)) for i in range(cold)]


def proj_shape(proj: str, hidden: int, ffn: int) -> tuple:
    """(K, N) of a projection: gate_up maps hidden to 2 * ffn, down maps ffn to hidden."""
    return (hidden, 2 * ffn) if proj == "gate_up" else (ffn, hidden)


def offsets_of(sizes, device) -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.int64, device=device).cumsum(0).to(torch.int32)


# ---------------------------------------------------------------------------------------------
# the variants: each returns step(), one forward + backward on its own copies of x and W
# ---------------------------------------------------------------------------------------------
def _leaves(x, w):
    return x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()


def _autograd_step(forward, x, w, dy):
    x, w = _leaves(x, w)

    def step():
        x.grad = w.grad = None
        forward(x, w).backward(dy)
    step.leaves = (x, w)  # what carries the gradients
    return step


def bf16_grouped_mm(x, w, dy, sizes, offsets):
    return _autograd_step(lambda x, w: torch._grouped_mm(x, w.transpose(1, 2), offs=offsets),
                          x, w, dy)


def bf16_loop(x, w, dy, sizes, offsets):
    bounds = _bounds(sizes)
    return _autograd_step(lambda x, w: torch.cat([x[lo:hi] @ w[g].t()
                                                   for g, (lo, hi) in enumerate(bounds)]),
                          x, w, dy)


def fp8ops_step(recipe):
    def make(x, w, dy, sizes, offsets):
        import fp8ops
        return _autograd_step(lambda x, w: fp8ops.grouped_linear(x, w, offsets, recipe=recipe),
                              x, w, dy)
    return make


def _bounds(sizes):
    ends = [0]
    for s in sizes:
        ends.append(ends[-1] + s)
    return list(zip(ends[:-1], ends[1:]))


def _rowwise(t: torch.Tensor, dim: int):
    """t cast to E4M3 with one scale per slice along `dim` reduced: (data, scale_inv), where
    data * scale_inv (broadcast) approximates t."""
    amax = t.abs().amax(dim=dim, keepdim=True).float().clamp(min=1e-12)
    scale = E4M3_MAX / amax
    data = (t.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)  # t's layout
    return data, scale.reciprocal()


def scaled_grouped_mm(x, w, dy, sizes, offsets):
    """The three GEMMs of the step as torch._scaled_grouped_mm (row-wise E4M3), with the
    casts in plain torch ops. x and dy are cast per row for forward and dgrad; the weight per
    (expert, output column) for forward and per (expert, input column) for dgrad; the weight
    gradient's operands dy^T [N, M] and x^T [K, M] per (expert, row) over the expert's rows."""
    x, w = _leaves(x, w)
    bounds = _bounds(sizes)
    out = torch.bfloat16

    def per_group_rows(t_t: torch.Tensor):
        """t_t [R, M] cast with a scale per (group, row) over the group's columns: (data [R, M],
        scale_inv flattened [E * R], group-major)."""
        data = torch.empty(t_t.shape, dtype=torch.float8_e4m3fn, device=t_t.device)
        scale_invs = []
        for lo, hi in bounds:
            d, s_inv = _rowwise(t_t[:, lo:hi], 1)
            data[:, lo:hi] = d
            scale_invs.append(s_inv.reshape(-1))
        return data, torch.cat(scale_invs).contiguous()

    def step():
        x.grad = w.grad = None
        xd = x.detach()
        wd = w.detach()
        # forward: y = x W^T, mat_b [E, K, N] column-major (W's own [E, N, K] rows)
        xq, x_si = _rowwise(xd, 1)  # [M, 1]
        wq, w_si = _rowwise(wd, 2)  # [E, N, 1]
        y = torch._scaled_grouped_mm(xq, wq.transpose(1, 2), x_si.reshape(-1),
                                     w_si.reshape(wq.shape[0], -1), offs=offsets, out_dtype=out)
        # dgrad: dx = dy W, mat_b [E, N, K] column-major: W^T's rows, scaled per (expert, k)
        gq, g_si = _rowwise(dy, 1)
        wtq, wt_si = _rowwise(wd.transpose(1, 2).contiguous(), 2)  # [E, K, N], [E, K, 1]
        dx = torch._scaled_grouped_mm(gq, wtq.transpose(1, 2), g_si.reshape(-1),
                                      wt_si.reshape(wtq.shape[0], -1), offs=offsets,
                                      out_dtype=out)
        # wgrad: dW_g = dy_g^T x_g, grouped along M: mat_a dy^T [N, M] row-major, mat_b x
        # [M, K] column-major (x^T's rows)
        gtq, gt_si = per_group_rows(dy.t().contiguous())
        xtq, xt_si = per_group_rows(xd.t().contiguous())
        dw = torch._scaled_grouped_mm(gtq, xtq.t(), gt_si, xt_si, offs=offsets, out_dtype=out)
        x.grad, w.grad = dx, dw
        return y
    step.leaves = (x, w)
    return step


MAKERS = {
    BASELINE: bf16_grouped_mm,
    FALLBACK_BASELINE: bf16_loop,
    "scaled_grouped_mm": scaled_grouped_mm,
}


def makers():
    import fp8ops
    return {**MAKERS, "current": fp8ops_step(fp8ops.CurrentScaling()),
            "blockwise": fp8ops_step(fp8ops.BlockwiseScaling())}


def _pick(value: str, known, what: str) -> list:
    picked = [v for v in value.split(",") if v]
    unknown = [v for v in picked if v not in known]
    if unknown:
        raise SystemExit(f"unknown {what}: {', '.join(unknown)} (known: {', '.join(known)})")
    return picked


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per shape")
    ap.add_argument("--iters", type=int, default=5, help="timed steps per variant per round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)),
                    help="rows M the layer sees (token-expert pairs), comma-separated")
    ap.add_argument("--projs", default=",".join(PROJS))
    ap.add_argument("--routings", default=",".join(ROUTINGS))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    add_smoke_options(ap, "tiny shapes, 1 round of 2 steps: checks that it runs, measures nothing")
    args = ap.parse_args(argv)
    if args.smoke:
        args.rounds, args.iters, args.warmup = 1, 2, 1
    out_dir = results_dir(args, os.path.join(HERE, "results"))
    dev = args.device
    info = device_info(dev)
    models = SMOKE_MODELS if args.smoke else {k: MODELS[k] for k in
                                              _pick(args.models, MODELS, "models")}
    tokens = SMOKE_TOKENS if args.smoke else [int(t) for t in args.tokens.split(",") if t]
    projs = _pick(args.projs, PROJS, "projections")
    routings = _pick(args.routings, ROUTINGS, "routings")
    names = _pick(args.variants, VARIANTS, "variants")
    if BASELINE not in names and FALLBACK_BASELINE not in names:
        raise SystemExit(f"--variants needs a baseline: {BASELINE!r} or {FALLBACK_BASELINE!r}")
    make = makers()
    rows = []
    for label, e, hidden, ffn in models.values():
        for proj in projs:
            k, n = proj_shape(proj, hidden, ffn)
            for m in tokens:
                for routing in routings:
                    sizes = group_sizes(m, e, routing)
                    offsets = offsets_of(sizes, dev)
                    g = torch.Generator(device=dev).manual_seed(0)
                    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
                    w = (torch.randn(e, n, k, device=dev, generator=g) / k ** 0.5).to(
                        torch.bfloat16)
                    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16, generator=g)
                    steps, row = {}, {}
                    for name in names:
                        try:
                            steps[name] = make[name](x, w, dy, sizes, offsets)
                        except Exception as exc:  # noqa: BLE001 - recorded in the table
                            row[name] = error_text(exc)
                    row.update(interleaved(steps, dev, args.rounds, args.iters, args.warmup))
                    key = (label, proj, e, k, n, m, routing, max(sizes))
                    rows.append((key, row))
                    base = baseline(row)
                    print(f"{label} {proj} E={e} K={k} N={n} M={m} {routing}: "
                          f"{base} {cell_ms(row.get(base))} ms  " +
                          "  ".join(f"{v} {cell_ratio(row, v)}" for v in names if v != base),
                          flush=True)
                    del x, w, dy, steps
                    if dev == "cuda":
                        torch.cuda.empty_cache()
    table = render(rows, names, info, args)
    write_table(out_dir, "grouped.md", table)
    return rows


def baseline(row) -> str:
    """The variant the speed-ups divide: bf16 grouped_mm, or the bf16 loop where it raised."""
    return BASELINE if isinstance(row.get(BASELINE), float) else FALLBACK_BASELINE


def ratio(row, name):
    """baseline time / the variant's time, or None when either raised."""
    t, t_base = row.get(name), row.get(baseline(row))
    if isinstance(t, float) and isinstance(t_base, float):
        return t_base / t
    return None


def cell_ratio(row, name) -> str:
    r, t = ratio(row, name), row.get(name)
    return f"{r:.2f}" if r is not None else (t if isinstance(t, str) else "-")


def cell_ms(t) -> str:
    return f"{t:.3f}" if isinstance(t, float) else str(t)


def geomean_cell(values) -> str:
    ok = [v for v in values if v is not None]
    if not ok:
        return "-"
    g = f"{math.exp(sum(map(math.log, ok)) / len(ok)):.2f}"
    return g if len(ok) == len(values) else f"{g} ({len(ok)} of {len(values)} shapes)"


def render(rows, names, info, args) -> str:
    timing = (f"median over {args.rounds} interleaved rounds of {args.iters} CUDA-event-timed "
              "steps per variant, L2 flushed before each step")
    if args.smoke:
        timing = (f"SMOKE RUN on {args.device}: wall clock, {args.rounds} round of {args.iters} "
                  "steps, tiny shapes; checks that the script runs, NOT a measurement")
    others = [v for v in names if v != BASELINE]
    lines = ["# Grouped (mixture-of-experts) linear, forward + backward: fp8ops.grouped_linear "
             "and torch._scaled_grouped_mm vs bf16 torch._grouped_mm (speed-up = baseline time / "
             "variant time; the baseline is bf16 grouped_mm, or the bf16 loop where it raised)",
             "", ", ".join(f"{k}: {v}" for k, v in info.items()), "", timing, "",
             "| model | proj | E | K | N | M | routing | largest group | baseline | "
             "baseline ms | " +
             " | ".join(f"{v} speed-up" for v in others) + " |",
             "|---|---|---:|---:|---:|---:|---|---:|---|---:|" + "---:|" * len(others)]
    for (label, proj, e, k, n, m, routing, largest), row in rows:
        base = baseline(row)
        lines.append(f"| {label} | {proj} | {e} | {k} | {n} | {m} | {routing} | {largest} | "
                     f"{base} | {cell_ms(row.get(base))} | " +
                     " | ".join(cell_ratio(row, v) for v in others) + " |")
    lines.append("| geomean | | | | | | | | | | " +
                 " | ".join(geomean_cell([ratio(row, v) for _, row in rows]) for v in others) +
                 " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
