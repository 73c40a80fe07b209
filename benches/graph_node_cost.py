"""GPU time per dependent kernel node of a replayed CUDA graph (PyTorch, no Burn).

A graph of N dependent one-element kernels (`x.add_(1)` N times) is captured for several N and
replayed; the slope of the replay's GPU time over N is the cost of one dependent node, the floor
below which a small model's replay cannot go however little each kernel computes. Every timed
replay is value-checked: x must have grown by exactly N per replay. Prints one JSON row per N and
one with the fitted slope.

`--branch`: also each graph with one node more on a second stream, joined back before the
chain's last node and forked off it three nodes before its end (`"branch": "end"`, as a
data-parallel step's all-reduce started during the backward is) or after its second node
(`"start"`), each with its own fit: whether a graph that is not a straight line pays per branch
or per node. Its check: the side node ran once per replay. `--branch-op nccl`: the side node
is instead NCCL's all-reduce of the side tensor in a group of one process (`ncclAvg`, as a
data-parallel step's bucket; its check: the tensor's value unchanged), and the "none" graphs
hold that all-reduce in the chain, three nodes before its end.

`--elements N`: the chain's tensor holds N elements (default 1), so each kernel has N / 4
threads' work and more blocks. `--copy-node`: each graph also holds one device-to-device copy
(a memcpy node, as `tensor.copy_` records) in the middle of the chain: whether a graph of
kernels and one copy launches its kernels as a chain of kernels alone does.

    python3 benches/graph_node_cost.py [--reps 200] [--branch [--branch-op add|nccl]]
                                       [--elements 1] [--copy-node]
"""

import argparse
import json
import time

import torch


def side_op(op: str, y: torch.Tensor) -> None:
    if op == "nccl":
        torch.distributed.all_reduce(y, op=torch.distributed.ReduceOp.AVG)
    else:
        y.add_(1.0)


def time_graph(nodes: int, reps: int, branch: str | None = None, op: str = "add",
               elements: int = 1, copy_node: bool = False) -> dict:
    x = torch.zeros(elements, device="cuda", dtype=torch.float32)
    # The copy node's source and destination (their values are not checked).
    copy_from, copy_to = torch.ones(1 << 10, device="cuda"), torch.zeros(1 << 10, device="cuda")
    # NCCL's all-reduce of a step's bucket: 2 MB, as the bench MLP's gradients.
    y = torch.zeros(1 if op == "add" else 1 << 19, device="cuda", dtype=torch.float32)
    side = torch.cuda.Stream()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up outside the capture, as torch.cuda.graph asks
            x.add_(1.0)
            if op == "nccl":
                side_op(op, y)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(nodes):
            if branch and i == (nodes - 3 if branch == "end" else 2):
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    side_op(op, y)
            elif not branch and op == "nccl" and i == nodes - 3:
                side_op(op, y)
            if branch and i == nodes - 1:
                torch.cuda.current_stream().wait_stream(side)
            if copy_node and i == nodes // 2:
                copy_to.copy_(copy_from)
            x.add_(1.0)
    x.zero_()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    x.zero_()
    y.fill_(0.0 if op == "add" else 1.0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    host = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    host = time.perf_counter() - host
    end.record()
    torch.cuda.synchronize()
    # The side node's effect: `reps` additions, or a mean of ones over one rank (ones).
    side_value = float(reps if branch else 0) if op == "add" else 1.0
    got = (x.min().item(), x.max().item(), y[0].item())
    expected = (float(nodes * reps), float(nodes * reps), side_value)
    return {
        "what": "graph_node_cost",
        "nodes": nodes,
        "branch": branch,
        "branch_op": op,
        "elements": elements,
        "copy_node": copy_node,
        "reps": reps,
        "us_per_replay": start.elapsed_time(end) * 1000.0 / reps,
        # The host's time to launch one replay (the launches run ahead of the device while
        # the graph takes longer on the device than its launch on the host).
        "host_us_per_launch": host * 1e6 / reps,
        "check": "passed" if got == expected else f"FAILED: (x min, x max, y) = {got}, expected {expected}",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--branch", action="store_true")
    parser.add_argument("--branch-op", choices=["add", "nccl"], default="add")
    parser.add_argument("--elements", type=int, default=1)
    parser.add_argument("--copy-node", action="store_true")
    args = parser.parse_args()
    if args.branch_op == "nccl":
        torch.distributed.init_process_group(
            "nccl", store=torch.distributed.HashStore(), rank=0, world_size=1,
            device_id=torch.device("cuda", 0))
    for branch in [None, "end", "start"] if args.branch else [None]:
        fit([time_graph(n, args.reps, branch, args.branch_op, args.elements, args.copy_node)
             for n in (16, 64, 256, 1024)], branch)
    if args.branch_op == "nccl":
        torch.distributed.destroy_process_group()


def fit(rows: list, branch: str | None) -> None:
    for row in rows:
        print(json.dumps(row))
    # Least-squares slope of us per replay over nodes.
    xs = [r["nodes"] for r in rows]
    ys = [r["us_per_replay"] for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / sum((a - mx) ** 2 for a in xs)
    checks = "passed" if all(r["check"] == "passed" for r in rows) else "FAILED"
    print(json.dumps({"what": "graph_node_cost_fit", "branch": branch,
                      "branch_op": rows[0]["branch_op"], "elements": rows[0]["elements"],
                      "copy_node": rows[0]["copy_node"], "us_per_node": slope,
                      "us_at_zero_nodes": my - slope * mx, "check": checks,
                      "device": rows[0]["device"]}))


if __name__ == "__main__":
    main()
