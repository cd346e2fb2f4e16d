"""attnlab's compiled decode step beside the plainest static-cache transformer of the same size,
both compiled alike, side by side in one process: what a decode step costs on this machine when
nothing but the model's own arithmetic is left.

The reference is written out here, self-contained (a gpt-fast-style model: key/value buffers of
max_len rows written with index_copy_, a mask over the whole buffer, torch's fused attention, no
cache object, no per-row lengths, no rollback), with attnlab's benchmark shape: dim 256, depth 4,
4 heads of 64, GELU feed-forward of 1024, rotary positions, 256 byte tokens. Both run one-token
forwards at the same position (attnlab's cache rolled back one token after each), compiled with
torch.compile(fullgraph=True, dynamic=False) and the same inductor options (the C++ wrapper on
the CPU, the products through ATen's library calls: compile_decoding(linear="library"), since the
reference's weights are not frozen into its step); medians of per-round medians, rounds alternating.

Beside them, the floor no decode step of this model passes on this machine: the time to read, once,
the bytes the reference's step reads (every weight, one embedding row, and the whole key/value
buffers, which the mask covers), measured as the sum of a float32 tensor of that size, re-read each
time as a step re-reads its weights (so it gains from the processor's caches exactly where a step
can: a working set that fits in the last-level cache reads faster than one that does not).

    OMP_NUM_THREADS=2 python bench/static_cache_reference.py --context 256 4096 --rounds 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.bench.measure import model_config_from
from attnlab.model import Transformer
from attnlab.model.decode_compile import decode_compile_options

DIM, HEADS, DEPTH, VOCABULARY = 256, 4, 4, 256


class ReferenceBlock(nn.Module):
    """Pre-norm block with its own key/value buffers [1, H, max_len, D]."""

    def __init__(self, max_len: int) -> None:
        super().__init__()
        width = DIM // HEADS
        self.attention_norm, self.feed_forward_norm = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.to_qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.to_out = nn.Linear(DIM, DIM, bias=False)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.register_buffer("keys", torch.zeros(1, HEADS, max_len, width))
        self.register_buffer("values", torch.zeros(1, HEADS, max_len, width))

    def forward(self, x: Tensor, position: Tensor, mask: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        q, k, v = self.to_qkv(self.attention_norm(x)).view(1, 1, 3, HEADS, DIM // HEADS).unbind(2)  # [1, 1, H, D]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [1, H, 1, D]
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        self.keys.index_copy_(2, position, k)
        self.values.index_copy_(2, position, v)
        y = F.scaled_dot_product_attention(q, self.keys, self.values, attn_mask=mask)  # [1, H, 1, D]
        x = x + self.to_out(y.transpose(1, 2).reshape(1, 1, DIM))
        return x + self.down(F.gelu(self.up(self.feed_forward_norm(x))))


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


class ReferenceModel(nn.Module):
    """One token at one position -> logits [1, 1, V]."""

    def __init__(self, max_len: int) -> None:
        super().__init__()
        self.max_len = max_len
        self.embedding = nn.Embedding(VOCABULARY, DIM)
        self.blocks = nn.ModuleList(ReferenceBlock(max_len) for _ in range(DEPTH))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCABULARY, bias=False)
        width = DIM // HEADS
        frequencies = 1.0 / (10000 ** (torch.arange(0, width, 2).float() / width))
        angles = torch.outer(torch.arange(max_len).float(), frequencies)  # [max_len, D/2]
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())

    def forward(self, token: Tensor, position: Tensor) -> Tensor:
        mask = torch.arange(self.max_len) <= position[:, None]  # [1, max_len]
        cos, sin = self.cos[position], self.sin[position]  # [1, D/2]
        x = self.embedding(token)
        for block in self.blocks:
            x = block(x, position, mask, cos, sin)
        return self.head(self.norm(x))


def bytes_read_per_step(reference: ReferenceModel) -> int:
    """The bytes one step of the reference reads at least: every parameter but the embedding table
    (one row of it), and the key/value buffers whole."""
    weights = sum(p.numel() * p.element_size() for name, p in reference.named_parameters()
                  if not name.startswith("embedding."))
    row = reference.embedding.weight[0]
    buffers = sum(b.numel() * b.element_size() for name, b in reference.named_buffers()
                  if name.endswith((".keys", ".values")))
    return weights + row.numel() * row.element_size() + buffers


def median_ms(step, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def measure(context: int, rounds: int, repeats: int, backend: str = "inductor") -> dict:
    max_len = context + 128
    torch.manual_seed(0)
    reference = ReferenceModel(max_len).eval()
    options = decode_compile_options(torch.device("cpu"), None, backend, None, "library")  # as attnlab's step
    reference_step = torch.compile(reference, fullgraph=True, dynamic=False, backend=backend, options=options)
    values = dict(dim=DIM, depth=DEPTH, heads=HEADS, dim_head=DIM // HEADS, max_seq_len=max_len,
                  attention={"kind": "full"})
    model = Transformer(model_config_from(values)).eval()
    model.compile_decoding(linear="library", backend=backend)
    token, position = torch.zeros(1, 1, dtype=torch.long), torch.tensor([context])
    cache = model.new_cache(1, max_len)
    model(torch.zeros(1, context, dtype=torch.long), cache=cache)

    def attnlab_step() -> None:
        model(token, cache=cache)
        cache.truncate(context)  # the same position every time

    def reference_step_once() -> None:
        reference_step(token, position)

    n_bytes = bytes_read_per_step(reference)
    read_once = torch.ones(n_bytes // 4)  # float32: as many bytes as a step reads

    def read_step() -> None:
        read_once.sum()

    for _ in range(5):  # compiles both
        attnlab_step()
        reference_step_once()
    attnlab_ms, reference_ms, read_ms = [], [], []
    for _ in range(rounds):
        attnlab_ms.append(median_ms(attnlab_step, repeats))
        reference_ms.append(median_ms(reference_step_once, repeats))
        read_ms.append(median_ms(read_step, repeats))
    return {"context": context, "attnlab_ms": statistics.median(attnlab_ms),
            "reference_ms": statistics.median(reference_ms), "bytes_read": n_bytes,
            "read_ms": statistics.median(read_ms)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=100, help="one-token forwards a round")
    parser.add_argument("--backend", default="inductor", help="torch.compile back-end of both steps (aot_eager: a "
                        "quick check of the script)")
    args = parser.parse_args()
    for context in args.context:
        result = measure(context, args.rounds, args.repeats, args.backend)
        print(json.dumps({"threads": torch.get_num_threads(), **result}), flush=True)
        print(f"context {context}: attnlab compiled step {result['attnlab_ms']:.3f} ms, static-cache reference "
              f"{result['reference_ms']:.3f} ms ({result['reference_ms'] / result['attnlab_ms']:.2f}x attnlab's time); "
              f"reading its {result['bytes_read'] / 2**20:.1f} MiB once {result['read_ms']:.3f} ms")


if __name__ == "__main__":
    main()
