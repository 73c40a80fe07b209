"""PyTorch side of the train-step benchmark: the same models, math, dtype, optimizer (Adam),
input rotation and timing method as benches/train_step/, eager, with
torch.cuda.make_graphed_callables, and as one captured graph of the whole step; also the
models' forward alone (inference), eager and as one captured graph. Prints one JSON line per
row (same fields as the Rust side).

    python3 benches/torch_reference.py [--models mlp,mlp256,mlpcol,transformer,cnn,lm] [--dtype f32|bf16]
                                       [--steps 50] [--reps 30]
                                       [--modes eager,graphed,eager_fused_adam,graphed_fused_adam,
                                                graphed_loss_fused_adam,whole_step,
                                                whole_step_fused_adam,whole_step_floor,
                                                whole_step_floor_fused_adam,first_step,
                                                first_step_graphed,first_step_eager,inference,
                                                inference_graphed,
                                                inference_b1,inference_graphed_b1,
                                                ddp_eager,ddp_graphed,ddp_whole_step]
                                       [--ranks 2] [--ddp-timeout 300]

A step: forward, loss = mean(y^2) (`lm`: next-token cross-entropy against the batch's integer
targets), backward, Adam step (lr 1e-4) (`graphed_loss_fused_adam`: the loss inside the graphed
callable; `graphed*` of `lm`: graphed from the token ids), a new input batch every step
(rotating over four, so graphed runs copy each input). A rep: `steps` steps then a device sync;
reported: the median over reps of rep time / steps, with the 10th and 90th percentiles.

`whole_step*`: PyTorch's whole-network capture (docs, notes/cuda.rst, "Whole-network
capture"): forward, loss, backward and a capturable Adam step (learning rate a device scalar)
in one CUDA graph; a step copies the input into the graph's static input, writes the learning
rate (as a schedule would) and replays the graph. `*_fused_adam`: `Adam(fused=True)` (a row
PyTorch refuses is skipped with a `#` line on stderr). `whole_step_floor*`: the same graph
replayed with no input copy and no learning-rate write, the device's floor of the step.
`first_step` / `first_step_graphed` / `first_step_eager`: one measurement per process (cold
unless `--in-process`), from model creation to the end of the first trained step, setup
included: `whole_step`'s warm-up and capture, `graphed_loss_fused_adam`'s
make_graphed_callables, or `eager`'s step; its
row has `median_us` = `p10_us` = `p90_us` = that time and `"single": true`.

`inference*`: the model's forward alone (no loss, no backward, no optimizer), in eval mode
under `torch.inference_mode()`, on the model arguments of a new batch every call (rotating over
four made up front, as the steps do), timed as the steps are (a call for a step).
`inference`: eager, the no-grad context entered per call. `inference_graphed`: the forward
captured once with `torch.cuda.graph` as the docs show it (warm-up calls on a side stream, then
the capture over static inputs, both under `inference_mode`); a call copies the batch's model
arguments into the static inputs and replays the graph, its output the graph's static output
(not cloned). `inference_b1`, `inference_graphed_b1`: the same at batch size 1 (`lm`: ids
[1, LENGTH], the model's causal mask broadcasting); the row's `model` names the training batch
size all the same.

Memory: torch.cuda.memory_reserved() after the run, relative to before the model was made
(the caching allocator's pools, comparable to burn's reserved bytes), after freeing the
previous run's graphs and cached blocks; also the peak of allocated bytes during the run
(`peak_allocated_mib`), which no earlier run's pools can hide.

`ddp_*`: data parallel on `--ranks` GPUs (R), one process per rank (spawned, NCCL, rank r on
`cuda:r`), each rank training a replica on batches of its own at the model's batch size (weak
scaling: the global batch is R times the model's), the gradients averaged by
`DistributedDataParallel` (its default buckets; no buffer broadcast before each forward,
`broadcast_buffers=False` or, in newer PyTorch, `forward_sync_buffers=False`: `lm`'s mask is
constant) before an `Adam(fused=True)` step. `ddp_eager`: no graphs. `ddp_graphed`: the model
graphed with make_graphed_callables as in `graphed_fused_adam` (loss outside), then wrapped in
DDP (the docs' order), so DDP's bucketed all-reduces run eagerly after each replay of the
backward graph. `ddp_whole_step`: the docs' recipe for DDP with whole-network capture
(notes/cuda.rst, "Usage with DistributedDataParallel", NCCL >= 2.9.6):
`NCCL_ASYNC_ERROR_HANDLING=0` (and `TORCH_NCCL_ASYNC_ERROR_HANDLING=0`), DDP constructed in a
side-stream context, 11 eager DDP steps on that stream, then `whole_step_fused_adam`'s capture
(fused capturable Adam, learning rate a device scalar) on that stream too, all-reduces
included, replayed as `whole_step` replays. Every rank makes the model alike (seed 0; DDP also
broadcasts rank 0's parameters) and draws its batches by rank (CUDA seed r: rank 0 draws the
one-GPU runs' batches); each rep starts after a barrier of all ranks and a device sync. The row
is rank 0's (printed by the process that spawned the ranks), with `ranks`, `samples_per_s`
(R * batch * 1e6 / median_us) and `replicas_equal` (after the timed steps, every rank's
parameters bitwise equal to rank 0's). Not in the default `--modes` (as on the Burn side): they
run when named. With fewer than R GPUs a mode prints `# skipped: ...` and no row. A run that
fails prints a row with `error` (each failed rank's exception) and no times: a rank's failed
setup ends the other ranks 30 s after it (they may wait in a collective it never joins), a run
with no result after `--ddp-timeout` seconds is ended too. `NCCL_NVLS_ENABLE=0` unless set.

Each (model, mode) run happens in a process of its own, as on the Burn side (`--in-process`
turns that off): one-time allocations (cuBLAS workspaces, per stream, so one more for the
capture stream) then land in every row that needs them instead of only the first row of a
process, and the two sides' memory columns mean the same thing.
"""
import argparse
import ctypes
import datetime
import gc
import inspect
import json
import os
import queue
import socket
import subprocess
import sys
import time
import traceback
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

# The device every model, batch and device scalar is placed on. The bench is CUDA-only (the
# timing syncs the CUDA device, the graphed modes capture CUDA graphs); a constant so that a
# test harness can set it to "cpu" and run the eager paths.
DEVICE = "cuda"


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


class Lm(nn.Module):
    """The `lm` model (benches/train_step/models.rs's `Lm`): token and learned position embeddings,
    pre-norm transformer blocks under a causal mask, a final norm and an output head."""

    VOCAB, LENGTH, BATCH = 512, 128, 8

    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(self.VOCAB, 256)
        self.positions = nn.Embedding(self.LENGTH, 256)
        layer = nn.TransformerEncoderLayer(
            d_model=256, nhead=8, dim_feedforward=1024, dropout=0.0,
            activation="gelu", batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(256)
        self.head = nn.Linear(256, self.VOCAB)
        # The causal mask, made once and held by the model (Burn's rows pass one shared mask
        # tensor, which its graphs copy in once). Applied as a mask (`is_causal=False`): with
        # `is_causal=True` PyTorch's attention skips the masked tiles, half the work that
        # Burn's attention does.
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(self.LENGTH),
            persistent=False)

    def forward(self, ids):
        x = self.tokens(ids) + self.positions.weight[: ids.shape[1]]
        x = self.blocks(x, mask=self.mask, is_causal=False)
        return self.head(self.norm(x))


def mean_square(y):
    """The step's loss, mean(y^2)."""
    return (y * y).mean()


class Spec(NamedTuple):
    """A bench model: its row name, its constructor, a batch maker (`batch(dtype)`: a tuple of
    tensors at the training batch size; `batch(dtype, size)`: at batch size `size`), which of
    the batch's tensors the model takes, and the loss of its output on the batch."""
    name: str
    make: object
    batch: object
    model_args: object
    loss: object


def float_batch(size, shape):
    """The batch maker of a model of one float input [batch size, *shape], `size` (the
    training batch size) unless the call gives another."""
    return lambda dtype, size=size: (
        torch.rand((size, *shape), device=DEVICE, dtype=dtype),)


def lm_batch(dtype, size=Lm.BATCH):
    """`lm`'s batch: token ids [size, LENGTH] and the next-token targets [size * LENGTH]
    (int64 whatever `dtype`)."""
    ids = lambda *shape: torch.randint(0, Lm.VOCAB, shape, device=DEVICE)
    return ids(size, Lm.LENGTH), ids(size * Lm.LENGTH)


def lm_loss(logits, batch):
    return nn.functional.cross_entropy(logits.reshape(-1, Lm.VOCAB), batch[1])


def whole_batch(batch):
    return batch


def first_of(batch):
    return batch[:1]


def loss_of(spec, model, batch):
    """The step's loss on `batch`."""
    return spec.loss(model(*spec.model_args(batch)), batch)


class WithLoss(nn.Module):
    """The model and its loss as one module (takes the whole batch): the callable of the
    `graphed_loss_*` mode."""

    def __init__(self, model, spec):
        super().__init__()
        self.model = model
        self.spec = spec

    def forward(self, *batch):
        return loss_of(self.spec, self.model, batch)


LR = 1e-4

MODES = ("eager", "graphed", "eager_fused_adam", "graphed_fused_adam", "graphed_loss_fused_adam",
         "whole_step", "whole_step_fused_adam", "whole_step_floor", "whole_step_floor_fused_adam",
         "first_step", "first_step_graphed", "first_step_eager",
         "inference", "inference_graphed", "inference_b1", "inference_graphed_b1",
         "ddp_eager", "ddp_graphed", "ddp_whole_step")

# The data-parallel modes (`run_ddp`), each run on `--ranks` GPUs in processes of its own.
DDP_MODES = ("ddp_eager", "ddp_graphed", "ddp_whole_step")

# Modes whose setup PyTorch may refuse (fused Adam, capturable, learning rate a device
# tensor): such a run prints a `#` line and no row instead of failing.
REFUSABLE = ("whole_step_fused_adam", "whole_step_floor_fused_adam")

# The mode whose setup and first step each `first_step*` mode times.
FIRST_STEP_OF = {"first_step": "whole_step", "first_step_graphed": "graphed_loss_fused_adam",
                 "first_step_eager": "eager"}

# Full steps before the capture, as in the docs' example (and make_graphed_callables' default).
WARMUP_STEPS = 3

# Eager DDP steps before a capture of DDP's all-reduces: "at least 11" (notes/cuda.rst, "Usage
# with DistributedDataParallel"; DDP's first iterations rebuild its buckets and time themselves,
# which a capture cannot hold).
DDP_WARMUP_STEPS = 11

def mean_square_of(y, batch):
    return mean_square(y)


MODELS = {
    "mlp": Spec("mlp 8x256 b32", mlp, float_batch(32, (256,)), whole_batch, mean_square_of),
    "mlp256": Spec("mlp 8x256 b256", mlp, float_batch(256, (256,)), whole_batch,
                   mean_square_of),
    # PyTorch stores every Linear weight [out, in]: Burn's `mlpcol` stores them so too.
    "mlpcol": Spec("mlp 8x256 col b32", mlp, float_batch(32, (256,)), whole_batch,
                   mean_square_of),
    "transformer": Spec("transformer 2x256 s128 b8", Encoder, float_batch(8, (128, 256)),
                        whole_batch, mean_square_of),
    "cnn": Spec("cnn 2conv b32 32x32", cnn, float_batch(32, (3, 32, 32)), whole_batch,
                mean_square_of),
    "lm": Spec(f"lm 2x256 s{Lm.LENGTH} b{Lm.BATCH} v{Lm.VOCAB}", Lm, lm_batch, first_of, lm_loss),
}


def synchronize():
    """Waits for the device's queued work (nothing to wait for where a test harness has set
    DEVICE to "cpu")."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def time_steps(step, steps, reps, before_rep=None):
    """Median, 10th and 90th percentile over `reps` reps of the time per step of a rep of
    `steps` steps (after 20 warm-up steps), a rep ending with a device sync. `before_rep`:
    called before each rep's timer starts (the `ddp_*` modes: a barrier of all ranks)."""
    for i in range(20):
        step(i)
    synchronize()
    per_step = []
    # The timed steps are the CUDA profiler's range (`ncu --profile-from-start off`, as on the
    # Burn side); without a profiler attached this does nothing.
    if DEVICE == "cuda":
        torch.cuda.profiler.start()
    for _ in range(reps):
        if before_rep is not None:
            before_rep()
        start = time.perf_counter()
        for i in range(steps):
            step(i)
        synchronize()
        per_step.append((time.perf_counter() - start) * 1e6 / steps)
    if DEVICE == "cuda":
        torch.cuda.profiler.stop()
    per_step.sort()
    at = lambda q: per_step[round((len(per_step) - 1) * q)]
    return at(0.5), at(0.1), at(0.9)


def clone_batch(batch):
    return tuple(t.clone() for t in batch)


def adam_step(mode, spec, model, inputs, wrap=None):
    """The step of the eager and `graphed*` modes: Python drives forward, loss, backward and
    Adam each step; `graphed*` through make_graphed_callables' graphs of the model. `wrap`:
    applied to the (graphed) model before the optimizer is made (the `ddp_*` modes: DDP)."""
    # `graphed_loss_*`: the loss inside the graphed callable (the forward graph ends in the
    # loss, the backward graph starts from it), as Burn's `graphed_loss_*` modes.
    with_loss = mode.startswith("graphed_loss")
    if with_loss:
        model = torch.cuda.make_graphed_callables(
            WithLoss(model, spec), clone_batch(inputs[0]))
    elif mode.startswith("graphed"):
        model = torch.cuda.make_graphed_callables(
            model, clone_batch(spec.model_args(inputs[0])))
    if wrap is not None:
        model = wrap(model)
    # `*_fused_adam`: PyTorch's fused Adam (one kernel launch for all parameters), the
    # counterpart of burn_graphed::FusedAdam; otherwise the default (foreach) Adam.
    fused = mode.endswith("fused_adam")
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, fused=fused or None)

    def step(i):
        if with_loss:
            loss = model(*inputs[i % 4])
        else:
            loss = loss_of(spec, model, inputs[i % 4])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def capturable_adam(model, lr, fused):
    """Adam whose step can be captured in a CUDA graph (`capturable=True`: step count and
    bias corrections on the device), reading its learning rate from the device scalar `lr` at
    every replay. `fused`: `Adam(fused=True)`, else the default (foreach) implementation."""
    if not fused:
        return torch.optim.Adam(model.parameters(), lr=lr, capturable=True)
    try:
        return torch.optim.Adam(model.parameters(), lr=lr, fused=True, capturable=True)
    except (RuntimeError, ValueError, TypeError) as refusal:
        # A PyTorch without tensor learning rates for fused Adam: a float one, which the
        # capture bakes into the graph, so the step's `lr` write still costs its launch but
        # the graph no longer reads it.
        print(f"# fused Adam refused a tensor lr ({refusal}); float lr, the graph ignores "
              "the lr writes", file=sys.stderr)
        return torch.optim.Adam(model.parameters(), lr=lr.item(), fused=True, capturable=True)


class WholeStep(NamedTuple):
    """A captured train step. Replaying `graph` trains one step on `static_batch` at learning
    rate `lr` (a device scalar) and leaves the loss in `static_loss`. `optimizer` holds the Adam
    state the graph reads and writes: it must live as long as the graph."""
    graph: torch.cuda.CUDAGraph
    static_batch: tuple
    lr: torch.Tensor
    static_loss: torch.Tensor
    optimizer: torch.optim.Optimizer


# The kernel nodes of the graph the last setup captured (`kept_graph`, `note_kernel_nodes`),
# for its row: what burn-graphed's rows count as "graph_kernel_nodes", counted the same way.
GRAPH_KERNEL_NODES = None


def kept_graph():
    """A CUDAGraph that keeps its cudaGraph_t after capture, so that its nodes can be counted
    (`keep_graph`, PyTorch 2.8 and later); a plain one where this PyTorch has no such option."""
    try:
        return torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:
        return torch.cuda.CUDAGraph()


def note_kernel_nodes(graph):
    """Counts the kernel nodes of `graph` (from `kept_graph`, captured) through the CUDA
    driver, as burn-graphed counts its own (cuGraphGetNodes, cuGraphNodeGetType), into
    GRAPH_KERNEL_NODES; then instantiates it. None where the graph was not kept."""
    global GRAPH_KERNEL_NODES
    GRAPH_KERNEL_NODES = None
    raw = getattr(graph, "raw_cuda_graph", None)
    try:
        handle = ctypes.c_void_p(raw()) if raw else None
    except RuntimeError:
        handle = None
    if handle and handle.value:
        driver = ctypes.CDLL("libcuda.so.1")
        count = ctypes.c_size_t(0)
        if driver.cuGraphGetNodes(handle, None, ctypes.byref(count)) == 0:
            nodes = (ctypes.c_void_p * count.value)()
            if driver.cuGraphGetNodes(handle, nodes, ctypes.byref(count)) == 0:
                kind = ctypes.c_int(-1)
                kernels = 0
                for node in nodes[:count.value]:
                    if driver.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)) != 0:
                        kernels = None
                        break
                    kernels += kind.value == 0  # CU_GRAPH_NODE_TYPE_KERNEL
                GRAPH_KERNEL_NODES = kernels
    if hasattr(graph, "instantiate"):
        try:
            graph.instantiate()
        except RuntimeError:
            pass  # not kept: instantiated at capture end already


def whole_step_setup(spec, model, inputs, fused, warmup=WARMUP_STEPS, stream=None):
    """Whole-network capture as PyTorch documents it (notes/cuda.rst, "Whole-network
    capture"): `warmup` full steps on a side stream, then forward, loss, backward and the
    optimizer step captured in one graph over a static input. `stream`: the side stream of the
    warm-up, which then also captures (`ddp_whole_step`: the stream DDP was made on); else a
    new one, and torch.cuda.graph's own capture stream."""
    lr = torch.tensor(LR, device=DEVICE)
    optimizer = capturable_adam(model, lr, fused)
    static_batch = clone_batch(inputs[0])
    # Warm-up on the real batches, on a side stream (the docs' recipe). These steps advanced
    # the parameters and the optimizer state (moments, step count); a user who needs the
    # graph's first replay to be step 1 resets that state by hand. Not done here: the rows
    # time steps, they do not check values.
    side = stream if stream is not None else torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(warmup):
            optimizer.zero_grad(set_to_none=True)
            loss_of(spec, model, inputs[i % 4]).backward()
            optimizer.step()
    torch.cuda.current_stream().wait_stream(side)
    # Gradients set to None before the capture, so that backward allocates them from the
    # graph's private pool (the docs' recipe); replays then overwrite them in place.
    optimizer.zero_grad(set_to_none=True)
    graph = kept_graph()
    with torch.cuda.graph(graph, stream=stream):
        static_loss = loss_of(spec, model, static_batch)
        static_loss.backward()
        optimizer.step()
    note_kernel_nodes(graph)
    return WholeStep(graph, static_batch, lr, static_loss, optimizer)


def whole_step(mode, spec, model, inputs):
    """The step of the `whole_step*` modes: one replay of the captured step, after copying
    the input and writing the learning rate; `whole_step_floor*`: the replay alone."""
    captured = whole_step_setup(spec, model, inputs, fused=mode.endswith("fused_adam"))

    if mode.startswith("whole_step_floor"):
        def step(i):
            captured.graph.replay()
        return step
    return replay_step(captured, inputs)


def replay_step(captured, inputs):
    """The step of `whole_step` (and `ddp_whole_step`): the batch `inputs[i % 4]` copied into
    the captured step's static input, the learning rate written, one replay."""

    def step(i):
        for static, new in zip(captured.static_batch, inputs[i % 4]):
            static.copy_(new)
        # A host write of the device learning rate every step, as a schedule makes.
        captured.lr.fill_(LR)
        captured.graph.replay()

    return step


class InferenceGraph(NamedTuple):
    """A captured forward. Replaying `graph` runs the model on `static_args` (its arguments)
    and leaves its output in `static_out`. `model` holds the parameters the graph reads: it
    must live as long as the graph."""
    graph: torch.cuda.CUDAGraph
    static_args: tuple
    static_out: torch.Tensor
    model: nn.Module


def inference_capture(model, args):
    """The forward of `model` (in eval mode) captured as PyTorch documents capture
    (notes/cuda.rst, "Whole-network capture", here the forward alone): warm-up calls on a side
    stream, then the capture over static inputs (clones of the first batch's), both under
    `torch.inference_mode()`. `args`: the model arguments of the rotation's batches."""
    static_args = clone_batch(args[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.inference_mode():
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                model(*static_args)
        torch.cuda.current_stream().wait_stream(side)
        graph = kept_graph()
        with torch.cuda.graph(graph):
            static_out = model(*static_args)
        note_kernel_nodes(graph)
    return InferenceGraph(graph, static_args, static_out, model)


def inference_call(mode, spec, model, inputs):
    """The call of the `inference*` modes, `call(i)`: the model's forward on the model
    arguments of `inputs[i % 4]`, in eval mode without autograd, returning the output;
    `inference_graphed*`: the batch's arguments copied into the captured forward's static
    inputs and one replay, returning the graph's static output (overwritten by the next call)."""
    model.eval()
    args = [spec.model_args(batch) for batch in inputs]
    if not mode.startswith("inference_graphed"):
        def call(i):
            with torch.inference_mode():
                return model(*args[i % 4])
        return call

    captured = inference_capture(model, args)

    def call(i):
        for static, new in zip(captured.static_args, args[i % 4]):
            static.copy_(new)
        captured.graph.replay()
        return captured.static_out

    return call


def batch_size_of(mode):
    """The batch size of `mode`'s inputs: 1 for the `*_b1` modes, else None (the model's
    training batch size)."""
    return 1 if mode.endswith("_b1") else None


def build_step(mode, spec, model, inputs):
    """`step(i)`, one train step of `mode` on `inputs[i % 4]` (`inference*`: one forward),
    after the mode's setup. The closure holds the model, optimizer and graphs."""
    if mode.startswith("inference"):
        return inference_call(mode, spec, model, inputs)
    if mode.startswith("whole_step"):
        return whole_step(mode, spec, model, inputs)
    return adam_step(mode, spec, model, inputs)


def first_step(mode, spec, new_model, new_inputs):
    """Microseconds from model creation to the end of the first trained step of
    FIRST_STEP_OF[mode], its setup (warm-up, capture) included, and that mode's step (which
    holds the model and graphs until the memory reading)."""
    start = time.perf_counter()
    step = build_step(FIRST_STEP_OF[mode], spec, new_model(), new_inputs())
    step(0)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6, step


def fresh_memory():
    """Frees the previous run's graphs (their private pools) and cached blocks, so that this
    run's reserved memory is its own, not a reuse of the last run's pools; returns the reserved
    and allocated bytes before the run."""
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_reserved(), torch.cuda.memory_allocated()


def run(key, mode, dtype, steps, reps):
    spec = MODELS[key]
    name = spec.name
    before, before_allocated = fresh_memory()
    new_model = lambda: spec.make().to(DEVICE).to(dtype)
    size = batch_size_of(mode)
    new_inputs = lambda: [spec.batch(dtype) if size is None else spec.batch(dtype, size)
                          for _ in range(4)]
    global GRAPH_KERNEL_NODES
    GRAPH_KERNEL_NODES = None
    extra = {}
    if mode in FIRST_STEP_OF:
        first, step = first_step(mode, spec, new_model, new_inputs)
        median = p10 = p90 = first
        extra["single"] = True
    else:
        # The model before the inputs: the seeded generator's draws in that order.
        model = new_model()
        inputs = new_inputs()
        try:
            step = build_step(mode, spec, model, inputs)
        except (RuntimeError, ValueError, TypeError) as refusal:
            if mode not in REFUSABLE:
                raise
            print(f"# {name} {mode}: skipped, PyTorch refused the setup: {refusal}",
                  file=sys.stderr)
            return
        del model, inputs
        median, p10, p90 = time_steps(step, steps, reps)
    if GRAPH_KERNEL_NODES is not None and mode not in FIRST_STEP_OF:
        extra["graph_kernel_nodes"] = GRAPH_KERNEL_NODES
    reserved = (torch.cuda.memory_reserved() - before) / 2**20
    peak_allocated = (torch.cuda.max_memory_allocated() - before_allocated) / 2**20
    print(json.dumps({
        "framework": "torch", "model": name,
        "dtype": "bf16" if dtype == torch.bfloat16 else "f32", "mode": mode,
        "median_us": round(median, 1), "p10_us": round(p10, 1), "p90_us": round(p90, 1),
        "reserved_mib": round(reserved, 1),
        "peak_allocated_mib": round(peak_allocated, 1), "tf32": TF32,
        **({} if FASTPATH else {"fastpath": False}), **extra}), flush=True)
    del step


# Whether f32 matrix products and convolutions may run on TF32 tensor cores (`--tf32`); every
# row records it as "tf32". cubecl's f32 matmul autotune promotes f32 to TF32 in its
# tensor-core candidates (cubek-matmul `adjust_dtypes`), which win at the bench's shapes on an
# H100, so the Burn side's f32 rows run TF32 matmuls: `--tf32` is the like-for-like PyTorch
# row, the default (off) PyTorch's own default for matmuls.
TF32 = False


# Whether nn.TransformerEncoderLayer may take PyTorch's native fast path in inference
# (`torch.backends.mha.set_fastpath_enabled`; BURN_GRAPHED_TORCH_FASTPATH=off turns it off,
# and the rows then record "fastpath": false). The fast path applies the feed-forward's GELU in
# cuBLASLt's epilogue (`torch._addmm_activation`), which computes the tanh approximation where
# the layer's `activation="gelu"` (and its training path, and Burn's `gelu`) is the exact,
# erf-based GELU: with it off, PyTorch's forward computes what the model defines.
FASTPATH = os.environ.get("BURN_GRAPHED_TORCH_FASTPATH", "on") != "off"
torch.backends.mha.set_fastpath_enabled(FASTPATH)


# Half-precision products sum a split of k in f32 on both sides: Burn's cuBLASLt picks allow only
# that reduction (vendor_matmul.rs), where PyTorch's default lets cuBLAS add the parts in the
# dtype (`allow_{bf16,fp16}_reduced_precision_reduction`): off, for the same arithmetic.
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False


def set_math(tf32):
    """f32 arithmetic of matrix products and convolutions: plain f32, or TF32 with `tf32`."""
    global TF32
    TF32 = tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


def dtype_of(name):
    return torch.bfloat16 if name == "bf16" else torch.float32


def free_port():
    """A TCP port of 127.0.0.1 that no one listens on now (the rendezvous of a `ddp_*` run)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def describe(error):
    """An exception as a row's `error`: its type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:400]


def require_nccl(least):
    """Raises unless PyTorch's NCCL is at least `least` (a (major, minor, patch) tuple)."""
    version = torch.cuda.nccl.version()
    if isinstance(version, int):
        # Older PyTorch: NCCL's version code (major * 10000 + minor * 100 + patch since 2.9).
        version = (version // 10000, version // 100 % 100, version % 100)
    if tuple(version) < least:
        raise RuntimeError(f"NCCL {'.'.join(map(str, version))} cannot capture collectives "
                           f"(needs {'.'.join(map(str, least))})")


def ddp_step(mode, spec, model, inputs, rank):
    """`step(i)`, one data-parallel train step of `mode` on this rank's `inputs[i % 4]`, after
    the mode's setup: `model` (graphed first for `ddp_graphed`) wrapped in DDP, `Adam(fused=
    True)`; `ddp_whole_step`: DDP made on a side stream, 11 eager DDP steps, the whole step
    captured (all-reduces included) and replayed."""
    cuda = DEVICE == "cuda"
    ddp_class = nn.parallel.DistributedDataParallel
    # No broadcast of the buffers before every forward (`lm`'s mask is the same on every rank;
    # Burn's rows have no such broadcast), in the keyword this PyTorch has (newer ones renamed
    # `broadcast_buffers` to `forward_sync_buffers` and warn on the old one).
    no_sync = ("forward_sync_buffers"
               if "forward_sync_buffers" in inspect.signature(ddp_class.__init__).parameters
               else "broadcast_buffers")

    def ddp(module):
        return ddp_class(module, device_ids=[rank] if cuda else None, **{no_sync: False})

    if mode == "ddp_whole_step":
        if cuda:
            require_nccl((2, 9, 6))
        # The docs' recipe: DDP constructed in a side-stream context, which then runs the
        # eager warm-up and captures (one stream for all three, as make_graphed_callables now
        # does): the AccumulateGrad nodes DDP keeps were made on it.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model = ddp(model)
        torch.cuda.current_stream().wait_stream(side)
        captured = whole_step_setup(spec, model, inputs, fused=True, warmup=DDP_WARMUP_STEPS,
                                    stream=side)
        return replay_step(captured, inputs)
    # The one-GPU mode of the same step, its model wrapped in DDP after the graphing.
    single = {"ddp_eager": "eager_fused_adam", "ddp_graphed": "graphed_fused_adam"}[mode]
    return adam_step(single, spec, model, inputs, wrap=ddp)


def replicas_equal(parameters, ranks, agree):
    """Whether every rank's `parameters` are bitwise equal to rank 0's (DDP's all-reduces keep
    the replicas equal; a replay that skipped them would not, the ranks' batches differing)."""
    flat = torch.cat([p.detach().reshape(-1).float() for p in parameters])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    verdicts = [None] * ranks
    dist.all_gather_object(verdicts, bool(torch.equal(flat, reference)), group=agree)
    return all(verdicts)


def ddp_run(rank, ranks, key, mode, dtype, steps, reps, agree, report):
    """One rank's `ddp_*` run: setup, agreement of all ranks on it (`agree`, a gloo group),
    the timed steps, the replica check. Returns rank 0's row, `{}` on the other ranks,
    `{"stopped": ...}` where another rank's setup failed, or None where this rank's setup
    failed: `report` (which tells the parent process) then had its error at once."""
    spec = MODELS[key]
    cuda = DEVICE == "cuda"
    if cuda:
        before, before_allocated = fresh_memory()
    error = step = None
    try:
        # The model alike on every rank (seed 0, the CPU generator), the batches by rank (the
        # device's generator, seed r: rank 0 draws the one-GPU runs' batches).
        torch.manual_seed(0)
        model = spec.make().to(DEVICE).to(dtype)
        if cuda:
            torch.cuda.manual_seed(rank)
        else:
            torch.manual_seed(rank)
        inputs = [spec.batch(dtype) for _ in range(4)]
        batch = inputs[0][0].shape[0]
        parameters = list(model.parameters())
        step = ddp_step(mode, spec, model, inputs, rank)
        del model, inputs
    except Exception as failure:
        traceback.print_exc()
        error = describe(failure)
        # At once: the other ranks may wait in a collective of their setups (DDP's
        # construction, a warm-up step's all-reduce) that this rank will never join, and
        # then never reach the agreement below; the parent ends them after a grace period.
        report({"error": error})
    # Every rank learns every rank's outcome before any times: a rank that went on alone
    # would wait in its first all-reduce for ever.
    errors = [None] * ranks
    dist.all_gather_object(errors, error, group=agree)
    if error is not None:
        return None
    if any(e is not None for e in errors):
        return {"stopped": "another rank's setup failed"}

    def before_rep():
        # Every rank's rep starts together: a barrier of all ranks, then this device idle.
        if cuda:
            dist.barrier(device_ids=[rank])
        else:
            dist.barrier()
        synchronize()

    median, p10, p90 = time_steps(step, steps, reps, before_rep)
    row = {"framework": "torch", "model": spec.name,
           "dtype": "bf16" if dtype == torch.bfloat16 else "f32", "mode": mode,
           "median_us": round(median, 1), "p10_us": round(p10, 1), "p90_us": round(p90, 1),
           "tf32": TF32}
    if cuda:
        row["reserved_mib"] = round((torch.cuda.memory_reserved() - before) / 2**20, 1)
        row["peak_allocated_mib"] = round(
            (torch.cuda.max_memory_allocated() - before_allocated) / 2**20, 1)
    equal = replicas_equal(parameters, ranks, agree)
    if rank != 0:
        return {}
    print(f"# {spec.name} {mode}: replicas bitwise equal after the run: {equal}",
          file=sys.stderr)
    return {**row, "ranks": ranks, "samples_per_s": round(ranks * batch * 1e6 / median, 1),
            "replicas_equal": equal}


def ddp_rank(rank, ranks, port, key, mode, dtype_name, steps, reps, timeout, device, results):
    """A spawned rank of a `ddp_*` run: joins the process group (NCCL, rank r on `cuda:r`;
    gloo where a test harness has set DEVICE to "cpu"), runs `ddp_run` and puts
    `(rank, outcome)` on `results` (`outcome`: rank 0's row, `{}`, `{"stopped": ...}` or
    `{"error": ...}`)."""
    global DEVICE
    DEVICE = device
    cuda = device == "cuda"
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if mode == "ddp_whole_step":
        # The docs' recipe: DDP's asynchronous error handling off (both spellings: PyTorch
        # renamed the variable), before the process group is made.
        os.environ["NCCL_ASYNC_ERROR_HANDLING"] = "0"
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
    try:
        if cuda:
            torch.cuda.set_device(rank)
        # The parent's `--tf32`, through the environment that spawned ranks inherit.
        set_math(os.environ.get("BURN_GRAPHED_TORCH_TF32") == "1")
        wait = datetime.timedelta(seconds=timeout)
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=ranks,
                                timeout=wait)
        # The ranks' agreement on their setups, on the host (a rank whose capture failed may
        # have left its NCCL communicator unusable).
        agree = dist.new_group(backend="gloo", timeout=wait)
        outcome = ddp_run(rank, ranks, key, mode, dtype_of(dtype_name), steps, reps, agree,
                          lambda outcome: results.put((rank, outcome)))
    except Exception as failure:
        traceback.print_exc()
        outcome = {"error": describe(failure)}
    if outcome is not None:
        results.put((rank, outcome))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def run_ddp(key, mode, dtype_name, steps, reps, ranks, timeout):
    """A `ddp_*` run: `ranks` spawned processes (`ddp_rank`), rank 0's row printed, or a row
    with `error` where a rank failed, died or ran past `timeout` seconds (its processes then
    ended); a `# skipped:` line and no row where there are fewer than `ranks` GPUs."""
    if DEVICE == "cuda":
        count = torch.cuda.device_count()
        if count < ranks:
            print(f"# skipped: {mode} needs {ranks} GPUs, this machine has {count}", flush=True)
            return
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(
        target=ddp_rank,
        args=(rank, ranks, port, key, mode, dtype_name, steps, reps, timeout, DEVICE, results))
        for rank in range(ranks)]
    for process in processes:
        process.start()
    outcomes = {}
    deadline = time.monotonic() + timeout
    # After a first failure, how long the other ranks get to report theirs.
    grace = 30

    def take(wait):
        rank, outcome = results.get(timeout=wait)
        outcomes[rank] = outcome
        return "error" in outcome

    while len(outcomes) < ranks and time.monotonic() < deadline:
        try:
            if take(0.5):
                deadline = min(deadline, time.monotonic() + grace)
        except queue.Empty:
            dead = [rank for rank, process in enumerate(processes)
                    if rank not in outcomes and process.exitcode is not None]
            if not dead:
                continue
            # A rank that put its outcome just before exiting: it is in the queue by now.
            try:
                while True:
                    take(1)
            except queue.Empty:
                pass
            for rank in dead:
                if rank not in outcomes:
                    outcomes[rank] = {"error": f"exited with code {processes[rank].exitcode} "
                                               "without a result"}
                    deadline = min(deadline, time.monotonic() + grace)
    errors = [f"rank {rank}: {outcomes[rank]['error']}" for rank in sorted(outcomes)
              if "error" in outcomes[rank]]
    missing = [rank for rank in range(ranks) if rank not in outcomes]
    if missing:
        errors.append(f"rank(s) {', '.join(map(str, missing))}: no result "
                      f"{'after the failure' if errors else f'within {timeout:g} s'}")
    for process in processes:
        process.join(timeout=grace if not errors else 5)
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join()
    row = outcomes.get(0, {})
    if errors or "median_us" not in row:
        row = {"framework": "torch", "model": MODELS[key].name, "dtype": dtype_name,
               "mode": mode, "ranks": ranks, "tf32": TF32,
               "error": "; ".join(errors) or "rank 0 gave no row"}
        print(f"# {MODELS[key].name} {mode}: failed: {row['error']}", file=sys.stderr)
    print(json.dumps(row), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="mlp,mlp256,transformer,cnn,lm")
    parser.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--reps", type=int, default=30)
    # The default: every mode but the data-parallel ones (as on the Burn side), which run when
    # named.
    parser.add_argument("--modes", default=",".join(m for m in MODES if m not in DDP_MODES))
    # run.sh passes the same arguments to both sides; the Burn side's value check has no
    # counterpart here, so its switch is accepted and does nothing.
    parser.add_argument("--no-check", action="store_true", help="no effect (Burn side only)")
    parser.add_argument("--in-process", action="store_true",
                        help="every run in this process (default: one process per run)")
    parser.add_argument("--tf32", action="store_true",
                        help="let f32 matrix products and convolutions run on TF32 tensor cores")
    parser.add_argument("--ranks", type=int, default=2,
                        help="the GPUs (one process each) of the ddp_* modes")
    parser.add_argument("--ddp-timeout", type=float, default=300,
                        help="seconds a ddp_* run may take before its ranks are ended")
    args = parser.parse_args()
    if args.ranks < 1:
        parser.error("--ranks takes a positive number")
    # `*_fused` models are the Burn side's fused-layer variants of a model (rows of their own
    # modes, `*_fused_layers`); PyTorch's rows for them are the base model's.
    keys = [key for key in args.models.split(",") if not key.endswith("_fused")]
    runs = [(key, mode) for key in keys for mode in MODES
            if mode in args.modes.split(",")]
    if not args.in_process and len(runs) > 1:
        failed = 0
        for key, mode in runs:
            done = subprocess.run([sys.executable, __file__, "--in-process", "--models", key,
                                   "--modes", mode, "--dtype", args.dtype,
                                   "--steps", str(args.steps), "--reps", str(args.reps),
                                   "--ranks", str(args.ranks),
                                   "--ddp-timeout", str(args.ddp_timeout)]
                                  + (["--tf32"] if args.tf32 else []))
            if done.returncode != 0:
                print(f"# {key} {mode}: run failed (exit {done.returncode})", file=sys.stderr)
                failed = failed or done.returncode
        sys.exit(failed)
    dtype = dtype_of(args.dtype)
    set_math(args.tf32)
    os.environ["BURN_GRAPHED_TORCH_TF32"] = "1" if args.tf32 else "0"
    torch.manual_seed(0)
    for key, mode in runs:
        if mode in DDP_MODES:
            run_ddp(key, mode, args.dtype, args.steps, args.reps, args.ranks, args.ddp_timeout)
        else:
            run(key, mode, dtype, args.steps, args.reps)


if __name__ == "__main__":
    main()
