"""`python -m attnlab.bench.worker TASK JSON`: one measurement, printed as one JSON line."""

from __future__ import annotations

import json
import os
import sys

import torch

from attnlab.bench import measure


def main() -> None:
    task, arguments = sys.argv[1], json.loads(sys.argv[2])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    functions = {"train": measure.measure_train, "decode": measure.measure_decode, "layer": measure.measure_layer}
    print(json.dumps(functions[task](**arguments)))


if __name__ == "__main__":
    main()
