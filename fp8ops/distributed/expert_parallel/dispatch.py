"""The two all-to-alls of an expert-parallel layer, as autograd Functions.

  dispatch  forward: the tokens' FP8 cast (wire.py) to the ranks holding their experts, where the
            values come out in the tokens' dtype carrying that cast (DISPATCHED) for the first
            grouped layer to read as it is; backward: the tokens' gradient back in high
            precision.
  combine   forward: the experts' outputs back to the ranks that routed the tokens, in high
            precision; backward: the gradient sent to the experts in FP8, in the cast the last
            grouped layer's dgrad makes of its dY (wire.grad_cast), dequantized there.
With fp8=False both travel in the tokens' dtype both ways (the high-precision baseline)."""
from __future__ import annotations

import torch

from . import wire
from .routing import Routing, all_to_all_rows, unsort

# the attribute that carries a dispatched tensor's FP8 cast (a RowsCast) to the first layer
DISPATCHED = "_fp8ops_dispatched"


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, offsets, routing: Routing, recipe, fp8: bool):
        ctx.routing = routing
        if not fp8:
            got = all_to_all_rows(rows, routing.recv_splits, routing.send_splits, routing.group)
            return got[routing.order]
        sent = wire.send(wire.forward_cast(rows, offsets, recipe, routing.group), routing)
        out = wire.values(sent, routing.local_offsets, rows.dtype)
        setattr(out, DISPATCHED, wire.rows_cast(sent))
        return out

    @staticmethod
    def backward(ctx, grad):
        routing = ctx.routing
        back = all_to_all_rows(unsort(grad, routing.order), routing.send_splits,
                               routing.recv_splits, routing.group)
        return back, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, offsets, routing: Routing, recipe, fp8: bool):
        ctx.routing, ctx.recipe, ctx.fp8, ctx.dtype = routing, recipe, fp8, rows.dtype
        ctx.save_for_backward(offsets)
        return all_to_all_rows(unsort(rows, routing.order), routing.send_splits,
                               routing.recv_splits, routing.group)

    @staticmethod
    def backward(ctx, grad):
        routing = ctx.routing
        if not ctx.fp8:
            got = all_to_all_rows(grad, routing.recv_splits, routing.send_splits, routing.group)
            return got[routing.order], None, None, None, None
        (offsets,) = ctx.saved_tensors
        sent = wire.send(wire.grad_cast(grad.contiguous(), offsets, ctx.recipe, routing.group),
                         routing)
        return wire.values(sent, routing.local_offsets, ctx.dtype), None, None, None, None


def dispatch(rows: torch.Tensor, offsets: torch.Tensor, routing: Routing, recipe,
             fp8: bool) -> torch.Tensor:
    """rows [M, K] sorted by expert (offsets int32 [E], M = offsets[-1]) -> the rows of this
    rank's experts from every rank, sorted by local expert (routing.local_offsets); with fp8,
    they carry their cast (attribute DISPATCHED)."""
    return _Dispatch.apply(rows, offsets, routing, recipe, fp8)


def combine(rows: torch.Tensor, offsets: torch.Tensor, routing: Routing, recipe,
            fp8: bool) -> torch.Tensor:
    """The inverse move: this rank's experts' output rows back to the ranks that sent the
    tokens, in their order (offsets: those ranks' own, for the gradient's cast)."""
    return _Combine.apply(rows, offsets, routing, recipe, fp8)
