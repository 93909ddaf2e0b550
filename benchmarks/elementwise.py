"""Two elementwise computations of the update, compiled by Inductor on the CPU, each as torch's plain
formula against the one this project runs, on the shapes of a recipe2024 size1m update:

    OMP_NUM_THREADS=1 python3 benchmarks/elementwise.py

- The recurrent cells' candidate tanh (networks.tanh) on the imagined rows (batch 16 x 64 starts = 1,024)
  x deter 512, once per imagined step: torch.tanh, which a compiled CPU kernel computes with a 1-ulp
  library tanh, against tanh through one exponential.
- The two-hot heads' prediction (distributions.TwoHot.mean) on the imagined rows (16 x 64 x 15 = 15,360)
  x 255 bins, three heads per update (reward, critic, slow critic): the official code's formula
  (probabilities from a log-softmax, then the symmetric sum of each bin pair) against the symmetric sum of
  the softmax's numerators divided once by their sum, itself summed over the same pairs (one loop).

Prints one table row per computation (milliseconds per call, the speed-up) and each pair's largest
difference, which must stay at rounding level: for tanh absolute (|tanh| <= 1), for the two-hot mean relative to
E[|bin|], the size of the terms the symmetric sum cancels (a mean near 0 from bins of 1e8 keeps only what float32
rounding of those terms leaves, in either formula).
"""

import argparse
import os
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import distributions  # noqa: E402
import networks  # noqa: E402


def timed(fn, args, repeats):
    for _ in range(2):  # compilation, then a warm call
        fn(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def official_mean(logits, bins):
    """The official TwoHot prediction (embodied/jax/outs.py, pred) for logits in the natural bin order:
    softmax probabilities, the middle bin, then each bin below it (flipped) added to its mirror above."""
    probs = torch.log_softmax(logits, -1).exp()
    m = logits.shape[-1] // 2
    lower = (probs[..., :m] * bins[:m]).flip(-1)
    return (lower + probs[..., m + 1:] * bins[m + 1:]).sum(-1) + probs[..., m] * bins[m]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1024, help="rows of the recurrent step (imagined starts)")
    parser.add_argument("--deter", type=int, default=512)
    parser.add_argument("--twohot_rows", type=int, default=15360, help="rows of a two-hot head (imagined states)")
    parser.add_argument("--bins", type=int, default=255)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.rows, args.deter, generator=generator) * 2
    natural = torch.randn(args.twohot_rows, args.bins, generator=generator) * 3
    # As the heads emit them: in the mirrored order, the rows of a layer padded to a multiple of 16 outputs.
    padded = -(-args.bins // 16) * 16
    mirrored = torch.nn.functional.pad(natural[:, distributions.mirrored_order(args.bins)], (0, padded - args.bins))
    mirrored = mirrored[:, :args.bins]
    bins = distributions.symexp_bins(args.bins)

    def twohot_mean(logits):
        return distributions.TwoHot(logits, squash=False, mirrored=True).mean()

    pairs = {"recurrent tanh": ((torch.tanh, (x,)), (networks.tanh, (x,)), 1.0),
             "two-hot mean": ((lambda logits: official_mean(logits, bins), (natural,)), (twohot_mean, (mirrored,)),
                              (torch.softmax(natural, -1) * bins.abs()).sum(-1))}
    print(f"threads {torch.get_num_threads()}  torch {torch.__version__}  tanh rows {args.rows} x {args.deter}  "
          f"two-hot rows {args.twohot_rows} x {args.bins} (symexp bins)  OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print("| computation | torch's formula ms | this project's ms | speed-up | largest difference |")
    print("|---|---|---|---|---|")
    for name, ((plain, plain_args), (ours, our_args), scale) in pairs.items():
        plain, ours = torch.compile(plain), torch.compile(ours)
        with torch.no_grad():
            want, got = plain(*plain_args), ours(*our_args)
            difference = ((got - want).abs() / scale).max().item()
            plain_ms, our_ms = timed(plain, plain_args, args.repeats), timed(ours, our_args, args.repeats)
        print(f"| {name} | {plain_ms:.3f} | {our_ms:.3f} | {plain_ms / our_ms:.2f} | {difference:.2g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
