"""The CPU figures of the factored head at the sizes of the paper and of issue 2.

Runs `lst-bench-head --full`: the factored step against torch's chunked
F.linear_cross_entropy (D = 500 000, d = 256, m = 256), against the naive
explicit-W head (the paper's CPU size, D = 793 471, d = 300, m = 128), and the
factored step over D = 20 000 ... 2 000 000. Writes a CSV and a plot under
benchmarks/results/ named after the machine. Needs about 8 GB of memory.
"""
import sys

from lst_lightning.benchmark import main

if __name__ == "__main__":
    main(["--full", *sys.argv[1:]])
