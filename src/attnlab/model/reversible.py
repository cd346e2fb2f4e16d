"""Reversible residual layers: activation memory that does not grow with depth.

"The Reversible Residual Network" (Gomez et al., arXiv 1707.04585), as the Reformer (Kitaev et al.,
arXiv 2001.04451) and both seeds use it. The residual stream is doubled into two streams; each
block is the pair of branches F = dropout(attention(norm(.))) and G = feed_forward(norm(.)):

    x1 = x2 = x                       (stack input)
    y1 = x1 + F(x2)                   (Reformer eq. 7)
    y2 = x2 + G(y1)
    output = (y1 + y2) / 2            (stack output, as the public Reformer implementation)

Training keeps only the last block's outputs; the backward pass recovers each block's inputs from
its outputs (x2 = y2 - G(y1), x1 = y1 - F(x2)) and recomputes the branches with the random state
and autocast state of the forward, so dropout masks and Gumbel noise repeat exactly. Modules with
per-step statistics (routing centroids) consult `is_recomputing()` so the recomputation does not
count twice. Auxiliary losses computed inside the stack leave it as outputs of the autograd
function, so their gradients flow. Decoding with a cache (or any forward without gradients) runs
the same two-stream network directly, with no recomputation.

Legend: B batch, T tokens, dim model width.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn

from attnlab.attention.base import is_recomputing, recomputing  # noqa: F401 - the flag lives with attention

# ----------------------------------------------------------------------------------------------
# The two branches of a Block (model/transformer.py) and the plain two-stream evaluation


def attention_branch(block: nn.Module, x: Tensor, cache=None) -> Tensor:
    return block.dropout(block.attention(block.attention_norm(x), cache))


def feed_forward_branch(block: nn.Module, x: Tensor) -> Tensor:
    return block.feed_forward(block.feed_forward_norm(x))


def attention_modules(block: nn.Module) -> list[nn.Module]:
    return [block.attention_norm, block.attention, block.dropout]


def feed_forward_modules(block: nn.Module) -> list[nn.Module]:
    return [block.feed_forward_norm, block.feed_forward]


def two_stream(blocks: Sequence[nn.Module], x: Tensor, caches: Sequence | None = None) -> Tensor:
    """The reversible network evaluated plainly (decoding, no-grad, and the tests' reference)."""
    x1 = x2 = x  # [B, T, dim]
    for index, block in enumerate(blocks):
        x1 = x1 + attention_branch(block, x2, None if caches is None else caches[index])
        x2 = x2 + feed_forward_branch(block, x1)
    return (x1 + x2) / 2


def reversible_blocks(blocks: Sequence[nn.Module], x: Tensor, caches: Sequence | None = None) -> Tensor:
    """x [B, T, dim] -> [B, T, dim] through the blocks as a reversible two-stream stack."""
    if caches is not None or not torch.is_grad_enabled():
        return two_stream(blocks, x, caches)
    aux_slots: list[tuple[nn.Module, str]] = []  # filled by the forward, in output order
    parameters = [p for block in blocks for p in block.parameters() if p.requires_grad]
    y1, y2, *aux_values = ReversibleStack.apply(x, list(blocks), aux_slots, *parameters)
    # hand the differentiable auxiliary losses back to their modules for collect_aux_losses()
    for (module, name), value in zip(aux_slots, aux_values):
        module.aux_losses = {**module.aux_losses, name: value}
    return (y1 + y2) / 2


# ----------------------------------------------------------------------------------------------
# The autograd function


def _aux_losses(modules: list[nn.Module]) -> list[tuple[nn.Module, str, Tensor]]:
    found = []
    for root in modules:
        for module in root.modules():
            for name, value in getattr(module, "aux_losses", {}).items():
                found.append((module, name, value))
    return found


class _RandomState:
    """CPU (and the tensor's CUDA device) generator state, restorable around a recomputation."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        devices = [self.device] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


class ReversibleStack(torch.autograd.Function):
    """Forward without saving activations; backward reconstructs and recomputes block by block."""

    @staticmethod
    def forward(ctx, x: Tensor, blocks: list[nn.Module], aux_slots: list, *parameters: Tensor):
        device_type = x.device.type
        ctx.autocast = (
            torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type), device_type
        )
        ctx.blocks, ctx.parameters, ctx.states, ctx.aux_counts = blocks, parameters, [], []
        x1 = x2 = x
        aux_values = []
        for block in blocks:
            attention_state = _RandomState(x.device)
            x1 = x1 + attention_branch(block, x2)
            feed_forward_state = _RandomState(x.device)
            x2 = x2 + feed_forward_branch(block, x1)
            ctx.states.append((attention_state, feed_forward_state))
            found = _aux_losses(attention_modules(block)), _aux_losses(feed_forward_modules(block))
            ctx.aux_counts.append((len(found[0]), len(found[1])))
            for module, name, value in found[0] + found[1]:
                aux_slots.append((module, name))
                aux_values.append(value)
        ctx.save_for_backward(x1.detach(), x2.detach())
        return (x1, x2, *aux_values)

    @staticmethod
    def backward(ctx, grad_y1: Tensor, grad_y2: Tensor, *grad_aux: Tensor):
        y1, y2 = ctx.saved_tensors
        enabled, dtype, device_type = ctx.autocast
        index_of = {id(p): i for i, p in enumerate(ctx.parameters)}
        parameter_grads: list[Tensor | None] = [None] * len(ctx.parameters)
        aux_end = len(grad_aux)
        for block, (attention_state, feed_forward_state), (n_attention_aux, n_ff_aux) in zip(
            reversed(ctx.blocks), reversed(ctx.states), reversed(ctx.aux_counts)
        ):
            aux_start = aux_end - n_attention_aux - n_ff_aux
            block_grad_aux = grad_aux[aux_start:aux_end]
            aux_end = aux_start
            # y2 = x2 + G(y1): recompute G, then x2 = y2 - G(y1)
            y1 = y1.detach().requires_grad_()
            with torch.enable_grad(), recomputing(), feed_forward_state.restored(), torch.autocast(
                device_type, dtype=dtype, enabled=enabled
            ):
                g_out = feed_forward_branch(block, y1)
                ff_aux = [value for _, _, value in _aux_losses(feed_forward_modules(block))]
            inputs = [y1, *_block_parameters(feed_forward_modules(block))]
            grads = _grad([g_out, *ff_aux], inputs, [grad_y2, *block_grad_aux[n_attention_aux:]])
            grad_y1 = grad_y1 + grads[0]
            _accumulate(parameter_grads, index_of, inputs[1:], grads[1:])
            with torch.no_grad():
                x2 = y2 - g_out
            # y1 = x1 + F(x2): recompute F, then x1 = y1 - F(x2)
            x2 = x2.detach().requires_grad_()
            with torch.enable_grad(), recomputing(), attention_state.restored(), torch.autocast(
                device_type, dtype=dtype, enabled=enabled
            ):
                f_out = attention_branch(block, x2)
                attention_aux = [value for _, _, value in _aux_losses(attention_modules(block))]
            inputs = [x2, *_block_parameters(attention_modules(block))]
            grads = _grad([f_out, *attention_aux], inputs, [grad_y1, *block_grad_aux[:n_attention_aux]])
            grad_y2 = grad_y2 + grads[0]
            _accumulate(parameter_grads, index_of, inputs[1:], grads[1:])
            with torch.no_grad():
                x1 = y1 - f_out
            y1, y2 = x1, x2.detach()
        # the stack input fed both streams
        return (grad_y1 + grad_y2, None, None, *parameter_grads)


def _block_parameters(modules: list[nn.Module]) -> list[Tensor]:
    return [p for module in modules for p in module.parameters() if p.requires_grad]


def _grad(outputs: list[Tensor], inputs: list[Tensor], grad_outputs: list[Tensor]) -> list[Tensor]:
    """torch.autograd.grad over the outputs that carry a graph; unused inputs get zeros."""
    pairs = [(out, grad) for out, grad in zip(outputs, grad_outputs) if out.requires_grad]
    grads = torch.autograd.grad(
        [out for out, _ in pairs], inputs, [grad for _, grad in pairs], allow_unused=True
    )
    return [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads)]


def _accumulate(totals: list, index_of: dict[int, int], parameters: list[Tensor], grads: list[Tensor]) -> None:
    for parameter, grad in zip(parameters, grads):
        slot = index_of[id(parameter)]
        totals[slot] = grad if totals[slot] is None else totals[slot] + grad
