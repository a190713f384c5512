"""What one kernel launch costs on this device, the unit that launch-bound step times are read
against: an empty Triton kernel launched from Python, a one-element torch operator, and on a GPU
one node of a CUDA graph of empty kernels replayed (the graph step's unit).

    python3 scripts/launch_cost.py [--launches 2000] [--smoke] [--out DIR | --update-results]

Each launch row is the wall-clock of ``--launches`` back-to-back launches, synchronised once,
divided by their count: the host's cost a launch where the kernels queue faster than they run,
else the device's. The graph row captures ``--launches`` empty kernels in one CUDA graph and
divides its replay's time by their count. The median of 5 repeats of each; one torch thread.
Writes ``launch_cost.csv`` (a row per unit: ``us`` the microseconds of one). On a CPU (``--smoke``
in the test suite) only the torch operator is measured, and the other rows say why not.
"""
from __future__ import annotations

import argparse
import statistics
import time

# benchlib first: in a bare checkout (the GPU machine) it puts the package on the path.
from benchlib import add_output_args, output_dir, save_rows

import torch

COLUMNS = ["device", "unit", "launches", "us", "note"]
REPEATS = 5


def _empty_kernel():
    import triton  # noqa: PLC0415

    @triton.jit
    def empty(x_ptr):
        pass

    return empty


def per_launch_us(launch, n: int, sync) -> float:
    """Microseconds a launch: the median over REPEATS of n launches, synchronised once."""
    launch()
    sync()  # the first launch compiles or loads its code
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        for _ in range(n):
            launch()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / n * 1e6


def graph_node_us(launch, n: int) -> float:
    """Microseconds a node: a CUDA graph of n empty kernels, its replay timed by CUDA events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as capture asks
        launch()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            launch()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times) / n


def measure(device: str, n: int) -> list[dict]:
    x = torch.zeros(1, device=device)
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = [{"device": device, "unit": "torch_op", "launches": n,
             "us": round(per_launch_us(lambda: x.add_(1), n, sync), 3), "note": "x.add_(1), one element"}]
    if not cuda:
        why = "no CUDA device: a Triton launch here is the interpreter's"
        return rows + [{"device": device, "unit": u, "launches": 0, "us": "", "note": why}
                       for u in ("triton_empty", "cuda_graph_node")]
    empty = _empty_kernel()
    launch = lambda: empty[(1,)](x)  # noqa: E731
    rows.append({"device": device, "unit": "triton_empty", "launches": n,
                 "us": round(per_launch_us(launch, n, sync), 3), "note": "an empty @triton.jit kernel, one program"})
    rows.append({"device": device, "unit": "cuda_graph_node", "launches": n, "us": round(graph_node_us(launch, n), 3),
                 "note": f"a graph of {n} empty Triton kernels replayed"})
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launches", type=int, default=2000)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="100 launches (the test suite)")
    add_output_args(p)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = measure(args.device, 100 if args.smoke else args.launches)
    for r in rows:
        print(f"{r['unit']:<16} {r['us'] or '-':>10} us  {r['note']}", flush=True)
    save_rows(args, output_dir(args, "launch_cost"), "launch_cost", rows, COLUMNS, argv)


if __name__ == "__main__":
    main()
