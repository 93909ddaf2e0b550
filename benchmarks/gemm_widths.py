"""The two-hot heads' output layer at its 255 outputs against the same layer padded to 256 (what
networks.TwoHotLinear runs), forward and forward + backward, on the shapes of a recipe2024 size1m update.

    OMP_NUM_THREADS=1 python3 benchmarks/gemm_widths.py

CPU GEMMs handle an output width that is no multiple of their vector width in a slower edge kernel; on this
project's CPU the 255-wide product took about twice the time of the 256-wide one. Rows: imagined states
(batch 16 x 64 starts x 16 steps = 16,384), units 64 (size1m). Prints one table row per layer variant and
the speed-up; the outputs of both are checked equal first. A second table times the heads' first layer (features
640 -> units) in torch's product against oneDNN's (what networks.Linear runs on many rows), at a few row counts.
"""

import argparse
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import networks  # noqa: E402


def timed(fn, repeats):
    fn()  # first call: allocations, GEMM dispatch
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16384, help="rows of the product (imagined states)")
    parser.add_argument("--units", type=int, default=64, help="the head's hidden width")
    parser.add_argument("--bins", type=int, default=255)
    parser.add_argument("--features", type=int, default=640, help="the features' width (size1m: 512 + 32 x 4)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.rows, args.units, generator=generator, requires_grad=True)
    weight = torch.randn(args.bins, args.units, generator=generator, requires_grad=True)
    bias = torch.randn(args.bins, generator=generator, requires_grad=True)
    upstream = torch.randn(args.rows, args.bins, generator=generator)
    pad = -args.bins % 16

    def plain():
        return F.linear(x, weight, bias)

    def padded():
        return F.linear(x, F.pad(weight, (0, 0, 0, pad)), F.pad(bias, (0, pad)))[:, :args.bins]

    with torch.no_grad():
        difference = (plain() - padded()).abs().max().item()
    print(f"rows {args.rows}  units {args.units}  bins {args.bins} (padded to {args.bins + pad})  "
          f"threads {torch.get_num_threads()}  torch {torch.__version__}  largest output difference {difference:.3g}")
    print("| layer | forward ms | forward + backward ms |")
    print("|---|---|---|")
    rows = {}
    for name, layer in ((f"{args.bins} outputs", plain), (f"padded to {args.bins + pad}", padded)):
        with torch.no_grad():
            forward = timed(layer, args.repeats)
        both = timed(lambda layer=layer: torch.autograd.grad(layer(), (x, weight, bias), upstream), args.repeats)
        rows[name] = (forward, both)
        print(f"| {name} | {forward:.2f} | {both:.2f} |")
    (plain_fw, plain_both), (pad_fw, pad_both) = rows.values()
    print(f"speedup_forward={plain_fw / pad_fw:.2f} speedup_forward_backward={plain_both / pad_both:.2f}")
    first_layer(args, generator)
    return 0


def first_layer(args, generator):
    """The heads' first layer (features -> units), forward, in torch's own product (MKL in the CPU wheels) and in
    oneDNN's, which networks.Linear calls (networks.onednn_linear) on inputs of networks.ONEDNN_MIN_ROWS rows or
    more, at a few row counts: the update's rows (the imagined states) and fewer (the world model's 1,024 replayed
    steps, a policy step's few)."""
    print(f"\nthe heads' first layer: features {args.features}  units {args.units}, forward, by rows")
    print("| rows | torch (F.linear) ms | oneDNN (networks.onednn_linear) ms | speed-up |")
    print("|---|---|---|---|")
    if not networks.ONEDNN:
        print("onednn=unavailable")
        return
    for rows in sorted({16, 256, 1024, args.rows}):
        x = torch.randn(rows, args.features, generator=generator)
        weight = torch.randn(args.units, args.features, generator=generator)
        bias = torch.randn(args.units, generator=generator)
        with torch.no_grad():
            assert torch.allclose(networks.onednn_linear(x, weight, bias), F.linear(x, weight, bias), rtol=1e-4,
                                  atol=1e-3)
            repeats = args.repeats * max(1, 1024 // rows)  # short products: more calls for a stable median
            torch_ms = timed(lambda args=(x, weight, bias): F.linear(*args), repeats)
            onednn_ms = timed(lambda args=(x, weight, bias): networks.onednn_linear(*args), repeats)
        print(f"| {rows} | {torch_ms:.3f} | {onednn_ms:.3f} | {torch_ms / onednn_ms:.2f} |")
    print(f"onednn_min_rows={networks.ONEDNN_MIN_ROWS}")


if __name__ == "__main__":
    raise SystemExit(main())
