"""The linear kernels side by side on one weight: packed bf16, int8 and q4, 1..8 rows.

On CPUs with AVX512-BF16, ``bf16`` is the kernel's vdpbf16ps path and ``bf16-fma`` its FMA path
on the same packed weights (the path every other CPU takes).

Copies of one ``--out x --in`` weight (more bytes than the caches hold, so every call streams
from memory) in each format, bf16 activations, best of ``--repeats`` passes over the copies,
one process. Writes ``benchmarks/results/quant-kernels-*.json``.

    python -m benchmarks.quant_kernels [--threads 1] [--out 8960 --in 1536]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import machine_info, write_json


def main(argv: list[str] | None = None) -> dict[str, object]:
    from specdec.kernels.cpu_int8 import int8_linear, pack_int8, quantize_int8
    from specdec.kernels.cpu_linear import (
        bf16_dot_available,
        load_kernel,
        pack_weight,
        packed_linear,
    )
    from specdec.kernels.cpu_q4 import pack_q4, q4_linear, quantize_q4

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=int, default=8960)
    parser.add_argument("--in", dest="in_features", type=int, default=1536)
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", default="1,2,4,6,8")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    n, k = args.out, args.in_features
    weights = [torch.randn(n, k, dtype=torch.bfloat16) * 0.05 for _ in range(args.copies)]
    kernels = {
        "bf16": ([pack_weight(w) for w in weights], lambda x, p: packed_linear(x, p, n, None, torch.bfloat16)),
        "int8": ([pack_int8(*quantize_int8(w)) for w in weights], lambda x, p: int8_linear(x, *p, n, None, torch.bfloat16)),
        "q4": ([pack_q4(*quantize_q4(w)) for w in weights], lambda x, p: q4_linear(x, p, n, None, torch.bfloat16)),
    }  # fmt: skip
    if bf16_dot_available():
        fma = lambda x, p: packed_linear(x, p, n, None, torch.bfloat16, bf16_dot=0)  # noqa: E731
        kernels = {"bf16": kernels["bf16"], "bf16-fma": (kernels["bf16"][0], fma), **kernels}
    results: dict[str, dict[int, float]] = {name: {} for name in kernels}
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        for name, (packed, fn) in kernels.items():  # formats take turns at every row count
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                for p in packed:
                    fn(x, p)
                best = min(best, (time.perf_counter() - start) / len(packed))
            results[name][rows] = best * 1e3
        print(f"{rows} rows: " + ", ".join(f"{m} {results[m][rows]:.2f} ms" for m in kernels), flush=True)
    payload = {"machine": machine_info(), "config": vars(args), "vnni": bool(load_kernel().quantized_has_vnni()),
               "bf16_dot": bf16_dot_available(),
               "ms": results}  # fmt: skip
    write_json("quant-kernels", payload)
    return payload


if __name__ == "__main__":
    main()
