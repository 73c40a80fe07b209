"""GPU time per dependent kernel node of a replayed CUDA graph (PyTorch, no Burn).

A graph of N dependent one-element kernels (`x.add_(1)` N times) is captured for several N and
replayed; the slope of the replay's GPU time over N is the cost of one dependent node, the floor
below which a small model's replay cannot go however little each kernel computes. Every timed
replay is value-checked: x must have grown by exactly N per replay. Prints one JSON row per N and
one with the fitted slope.

    python3 benches/graph_node_cost.py [--reps 200]
"""

import argparse
import json

import torch


def time_graph(nodes: int, reps: int) -> dict:
    x = torch.zeros(1, device="cuda", dtype=torch.float32)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up outside the capture, as torch.cuda.graph asks
            x.add_(1.0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(nodes):
            x.add_(1.0)
    x.zero_()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    x.zero_()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    got, expected = x.item(), float(nodes * reps)
    return {
        "what": "graph_node_cost",
        "nodes": nodes,
        "reps": reps,
        "us_per_replay": start.elapsed_time(end) * 1000.0 / reps,
        "check": "passed" if got == expected else f"FAILED: x = {got}, expected {expected}",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    rows = [time_graph(n, args.reps) for n in (16, 64, 256, 1024)]
    for row in rows:
        print(json.dumps(row))
    # Least-squares slope of us per replay over nodes.
    xs = [r["nodes"] for r in rows]
    ys = [r["us_per_replay"] for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / sum((a - mx) ** 2 for a in xs)
    checks = "passed" if all(r["check"] == "passed" for r in rows) else "FAILED"
    print(json.dumps({"what": "graph_node_cost_fit", "us_per_node": slope,
                      "us_at_zero_nodes": my - slope * mx, "check": checks,
                      "device": rows[0]["device"]}))


if __name__ == "__main__":
    main()
