"""PyTorch side of the train-step benchmark: the same models, math, dtype, optimizer (Adam),
input rotation and timing method as benches/train_step.rs, eager and with
torch.cuda.make_graphed_callables. Prints one JSON line per row (same fields as the Rust side).

    python3 benches/torch_reference.py [--models mlp,mlp256,transformer,cnn] [--dtype f32|bf16]
                                       [--steps 50] [--reps 30]
                                       [--modes eager,graphed,eager_fused_adam,graphed_fused_adam,
                                                graphed_loss_fused_adam]

A step: forward, loss = mean(y^2), backward, Adam step (lr 1e-4) (`graphed_loss_fused_adam`:
the loss inside the graphed callable), a new input batch every step
(rotating over four, so graphed runs copy each input). A rep: `steps` steps then a device sync;
reported: the median over reps of rep time / steps, with the 10th and 90th percentiles.
Memory: torch.cuda.memory_reserved() after the run, relative to before the model was made
(the caching allocator's pools, comparable to burn's reserved bytes), after freeing the
previous run's graphs and cached blocks; also the peak of allocated bytes during the run
(`peak_allocated_mib`), which no earlier run's pools can hide.

Each (model, mode) run happens in a process of its own, as on the Burn side (`--in-process`
turns that off): one-time allocations (cuBLAS workspaces, per stream, so one more for the
capture stream) then land in every row that needs them instead of only the first row of a
process, and the two sides' memory columns mean the same thing.
"""
import argparse
import gc
import json
import subprocess
import sys
import time

import torch
from torch import nn


def mlp():
    layers = []
    for _ in range(8):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    return nn.Sequential(*layers)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            d_model=256, nhead=8, dim_feedforward=1024, dropout=0.0,
            activation="gelu", batch_first=True, norm_first=False)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)

    def forward(self, x):
        return self.encoder(x)


def cnn():
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


class WithLoss(nn.Module):
    """`mean(model(x)^2)` as one module: the callable of the `graphed_loss_*` mode."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        y = self.model(x)
        return (y * y).mean()


MODES = ("eager", "graphed", "eager_fused_adam", "graphed_fused_adam", "graphed_loss_fused_adam")

MODELS = {
    "mlp": ("mlp 8x256 b32", mlp, (32, 256)),
    "mlp256": ("mlp 8x256 b256", mlp, (256, 256)),
    "transformer": ("transformer 2x256 s128 b8", Encoder, (8, 128, 256)),
    "cnn": ("cnn 2conv b32 32x32", cnn, (32, 3, 32, 32)),
}


def time_steps(step, steps, reps):
    for i in range(20):
        step(i)
    torch.cuda.synchronize()
    per_step = []
    # The timed steps are the CUDA profiler's range (`ncu --profile-from-start off`, as on the
    # Burn side); without a profiler attached this does nothing.
    torch.cuda.profiler.start()
    for _ in range(reps):
        start = time.perf_counter()
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
        per_step.append((time.perf_counter() - start) * 1e6 / steps)
    torch.cuda.profiler.stop()
    per_step.sort()
    at = lambda q: per_step[round((len(per_step) - 1) * q)]
    return at(0.5), at(0.1), at(0.9)


def run(key, mode, dtype, steps, reps):
    name, make, shape = MODELS[key]
    torch.cuda.synchronize()
    # Free the previous run's graphs (their private pools) and cached blocks, so that this
    # run's reserved memory is its own, not a reuse of the last run's pools.
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_reserved()
    before_allocated = torch.cuda.memory_allocated()
    model = make().cuda().to(dtype)
    inputs = [torch.rand(shape, device="cuda", dtype=dtype) for _ in range(4)]
    # `graphed_loss_*`: the loss inside the graphed callable (the forward graph ends in the
    # loss, the backward graph starts from it), as Burn's `graphed_loss_*` modes.
    with_loss = mode.startswith("graphed_loss")
    if with_loss:
        model = torch.cuda.make_graphed_callables(WithLoss(model), (inputs[0].clone(),))
    elif mode.startswith("graphed"):
        model = torch.cuda.make_graphed_callables(model, (inputs[0].clone(),))
    # `*_fused_adam`: PyTorch's fused Adam (one kernel launch for all parameters), the
    # counterpart of burn_graphed::FusedAdam; otherwise the default (foreach) Adam.
    fused = mode.endswith("fused_adam")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, fused=fused or None)

    def step(i):
        if with_loss:
            loss = model(inputs[i % 4])
        else:
            y = model(inputs[i % 4])
            loss = (y * y).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    median, p10, p90 = time_steps(step, steps, reps)
    reserved = (torch.cuda.memory_reserved() - before) / 2**20
    peak_allocated = (torch.cuda.max_memory_allocated() - before_allocated) / 2**20
    print(json.dumps({
        "framework": "torch", "model": name,
        "dtype": "bf16" if dtype == torch.bfloat16 else "f32", "mode": mode,
        "median_us": round(median, 1), "p10_us": round(p10, 1), "p90_us": round(p90, 1),
        "reserved_mib": round(reserved, 1),
        "peak_allocated_mib": round(peak_allocated, 1)}), flush=True)
    del model, optimizer, inputs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="mlp,mlp256,transformer,cnn")
    parser.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--modes", default=",".join(MODES))
    # run.sh passes the same arguments to both sides; the Burn side's value check has no
    # counterpart here, so its switch is accepted and does nothing.
    parser.add_argument("--no-check", action="store_true", help="no effect (Burn side only)")
    parser.add_argument("--in-process", action="store_true",
                        help="every run in this process (default: one process per run)")
    args = parser.parse_args()
    runs = [(key, mode) for key in args.models.split(",") for mode in MODES
            if mode in args.modes.split(",")]
    if not args.in_process and len(runs) > 1:
        failed = 0
        for key, mode in runs:
            done = subprocess.run([sys.executable, __file__, "--in-process", "--models", key,
                                   "--modes", mode, "--dtype", args.dtype,
                                   "--steps", str(args.steps), "--reps", str(args.reps)])
            if done.returncode != 0:
                print(f"# {key} {mode}: run failed (exit {done.returncode})", file=sys.stderr)
                failed = failed or done.returncode
        sys.exit(failed)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    # Plain f32 arithmetic on both sides: no TF32 in matrix products or convolutions.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    for key, mode in runs:
        run(key, mode, dtype, args.steps, args.reps)


if __name__ == "__main__":
    main()
