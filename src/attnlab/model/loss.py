"""Cross-entropy of the output projection computed in chunks of tokens, never holding the whole
[tokens, vocabulary] logits (nor their float32 copy and softmax) at once.

With a large vocabulary the logits dominate training memory: MiniMind's 6400 tokens x 512
positions x batch 32 are 105M floats, 420 MB in float32, and autograd keeps them plus the softmax
for backward. Here each chunk's logits live only inside the loop: the forward pass computes, chunk
by chunk, the loss and at once its gradients with respect to the hidden states and the vocabulary
matrix (d loss / d logits = softmax - one_hot, divided by the number of counted targets), and the
backward pass only scales those stored gradients. Peak extra memory: one chunk's logits
[chunk, V] plus the gradients [N, E] and [V, E], whatever N is.

The same idea is known as a fused linear cross-entropy; the result equals
`F.cross_entropy(hidden @ weight.T, targets, ignore_index=-100)` to float32 rounding
(tests/test_loss.py).

Legend: N tokens (batch x time, flattened), E hidden width, V vocabulary, C chunk.
"""

from __future__ import annotations

import torch
from torch import Tensor

IGNORE_INDEX = -100  # targets with this value count neither in the loss nor in its mean


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk_size: int) -> Tensor:  # noqa: D102
        # hidden [N, E], weight [V, E], targets [N] -> mean loss over counted targets (scalar, float32)
        counted = targets != IGNORE_INDEX  # [N]
        n_counted = counted.sum().clamp(min=1).float()
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None  # [N, E]
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            h = hidden[rows]  # [C, E]
            logits = (h @ weight.t()).float()  # [C, V]; under autocast the matmul runs in its dtype
            safe_targets = targets[rows].clamp(min=0)  # [C]; ignored rows are zeroed below
            keep = counted[rows].float()  # [C]
            log_normaliser = logits.logsumexp(dim=-1)  # [C]
            target_logits = logits.gather(1, safe_targets[:, None]).squeeze(1)  # [C]
            total += ((log_normaliser - target_logits) * keep).sum()
            if need_hidden or need_weight:
                grad_logits = (logits - log_normaliser[:, None]).exp_()  # [C, V] softmax
                grad_logits[torch.arange(len(safe_targets), device=logits.device), safe_targets] -= 1
                grad_logits *= (keep / n_counted)[:, None]
                if need_hidden:
                    grad_hidden[rows] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)  # [C, E]
                if need_weight:
                    grad_weight += grad_logits.t() @ h.float()  # [V, E]
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total / n_counted

    @staticmethod
    def backward(ctx, grad_output: Tensor):  # noqa: D102
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_output.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_output).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None


def chunked_linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, chunk_size: int) -> Tensor:
    """Mean cross-entropy of `hidden @ weight.T` against `targets` (IGNORE_INDEX skipped), computed
    `chunk_size` rows at a time. hidden [..., E], weight [V, E], targets [...] -> scalar."""
    return ChunkedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1),
                                           chunk_size)
