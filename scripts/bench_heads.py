"""Training-step time of every output head over D, d and m (issue 5), side by side.

On a GPU: D in {10k, 100k, 793 471, 2M, 10M, 20M}, d in {512, 300}, m in {128, 1024},
CUDA-event medians, peak memory beyond the parameters, the issue's target checks.
On CPU (one thread): D in {10k, 100k, 793 471}, d = 300, m = 128. ``--smoke``: every
code path at tiny sizes in seconds. Writes benchmarks/results/bench_heads_<machine>.csv,
.md and .png. See docs/benchmarks.md; ``--help`` for the options.
"""
import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("lst_lightning") is None:  # run from a bare checkout (GPU machine)
    root = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(root / "src"), str(root / "triton_kernels")]

from lst_lightning.bench_heads import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
