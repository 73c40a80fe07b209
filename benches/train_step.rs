//! Train-step benchmark: eager Burn against graphed Burn on the same models, the counterpart of
//! `benches/torch_reference.py` (same models, math, dtype, optimizer, input rotation and timing
//! method). Built and bundled by `cargo xtask gpu-test` (or `cargo xtask bench`); run on a GPU
//! machine with `bash target/gpu-bundle/run.sh bench`, which runs both sides and writes the
//! JSON lines that `benches/report.py` turns into BENCHMARKS.md's table and plot.
//!
//! ```text
//! train_step [--models mlp,mlp256,mlpcol,transformer,cnn,lm,mlp_fused,transformer_fused,lm_fused,cnn_fused]
//!            [--dtype f32|bf16] [--steps 50] [--reps 30]
//!            [--modes eager,graphed,graphed_no_input_copy,graphed_no_param_copy,graphed_static,
//!                     eager_fused_adam,graphed_fused_adam,graphed_static_fused_adam,
//!                     graphed_guarded_fused_adam,eager_multi_adam,graphed_multi_adam,
//!                     graphed_static_multi_adam,graphed_loss_static_multi_adam,
//!                     graphed_multi_adam_no_check,graphed_multi_adam_no_input_copy]
//!            [--host-profile FILE] [--kernel-trace FILE] [--no-check] [--in-process]
//!            [--check-cost] [--ranks 2] [--tf32 off|on]
//! ```
//!
//! `mlp_fused`, `transformer_fused`, `lm_fused` and `cnn_fused` are `mlp`, `transformer`, `lm`
//! and `cnn` with
//! `burn_graphed::nn`'s fused layers (the same parameters); their rows carry the model's name and the mode with
//! `_fused_layers` appended (`whole_step_fused_layers`, ...), PyTorch having no such variant.
//!
//! Each (model, mode) run happens in a process of its own (this binary runs itself once per
//! pair, `--in-process` turns that off): cubecl's pools only return whole empty pages, so in one
//! process a run's reserved bytes depended on the runs before it (H100, stop 22: the MLP after
//! the CNN measured eager 0 MiB and graphed 117 MiB; alone, 18 and 38). Kernels and autotune
//! results come from cubecl's persistent cache (`run.sh bench` turns it on), so a process costs
//! its CUDA context and little else.
//!
//! `--modes` picks the runs, in the order given, repeats included (default all but
//! `graphed_static` and the two A/B modes: `graphed_multi_adam_no_check`, which is
//! `graphed_multi_adam` without the check of buffers written outside the graphs
//! (`FaultInjection::SkipWriteCheck`), and `graphed_multi_adam_no_input_copy`, the same without
//! the input's copy into its static buffer (`FaultInjection::SkipInputCopy`; its values are
//! wrong, so its check must fail): what each part costs, run as `A,B,B,A`); `run.sh
//! profile` uses it to trace one mode. `graphed_static` is graphed with `OutputPolicy::Static` (no hand-out copies);
//! `graphed_guarded_fused_adam` with `OutputPolicy::Guarded`; the `*_fused_adam` modes train
//! with `burn_graphed::FusedAdam` instead of burn's `Adam`, the `*_multi_adam` modes with
//! `burn_graphed::MultiTensorAdam` (one fusion operation for all parameters);
//! `graphed_loss_static_multi_adam` graphs the loss too (`Case::call_loss`; PyTorch's
//! counterpart `graphed_loss_fused_adam`, a mode `--modes` accepts and this side skips). The
//! inference modes print the host's time per call and its phases
//! (`burn_graphed::testing::time_phases`: plan, lookup, admission, copies, fusion's drain,
//! check and replay, hand-out); `inference_graphed_b1_no_check` and `inference_graphed_b1_floor`
//! are their A/B modes (no check of written buffers; nothing copied or checked, so the floor's
//! outputs are not the batch's and its value check must fail). `--host-profile FILE` (feature
//! `host-profile`, bundled by `cargo xtask gpu-test`) samples the host's stacks during each
//! run's timed steps and appends the most frequent functions to `FILE`: where the host's time
//! goes when a step is launch-bound. Sampling slows the run: its timings are not results.
//! `--kernel-trace FILE` (cubecl backends) appends every kernel each run launches, per phase
//! (setup, each phase of the capture as burn-graphed announces it, warm-up, timed, read back,
//! check) with its device time where cubecl returned one, and the kernels launched while a
//! graph recorded: eager's kernels beside the graph's, without a profiler (ncu missed most of
//! an eager bf16 step, whose launches cubecl skipped: see `assert_ran`). Timing every launch
//! slows the run: its timings are not results either. Warnings of the libraries go to stderr with the phase they came in, and each row counts the autotune
//! keys cubecl decided unmeasured (`autotune_unmeasured`, see `warn_log`).
//!
//! One *step* is: forward, loss, `backward()`, `GradientsParams`, Adam step, with a new input
//! batch every step (rotating over four batches prepared in advance, so that graphed runs copy
//! each input, as `make_graphed_callables` does for a tensor at another address). A *rep* is
//! `steps` steps followed by a device sync; the reported time per step is the median over reps
//! of (rep time / steps), with the 10th and 90th percentiles as spread. Memory is the device
//! allocator's reserved bytes after the run (its pools only grow), relative to before the
//! model was made.
//!
//! `BURN_GRAPHED_FUSION_REMOVE=NAME[,NAME]` (an environment variable, so that `run.sh bench`
//! passes it to this side only) removes burn's built-in fusion optimizations of those names
//! (`burn_cubecl::fusion::BUILTIN_NAMES`, e.g. `ReduceBroadcasted`) before the first tensor
//! operation, and each row records them as `fusion_removed`: the transformer profile of stop 23
//! found burn-fusion's fused layer norm (`ReduceBroadcasted`, one thread per row) the largest
//! kernel of its step, and removing it showed that it was not what the step waits for
//! (BENCHMARKS.md).
//!
//! Graphed runs are repeated with the input copies or the parameter copies deliberately
//! skipped (`FaultInjection`, numbers only: those results are wrong), so that the two copy
//! overheads are reported separately.
//!
//! Every timed run but eager Burn's (the reference, read back by `assert_ran`) is followed, in
//! its own process, by a value check (`--no-check` skips it). Training modes, the whole step's
//! floor and the first step: a fresh model, drawn after seeding the device (the same start in
//! every process), trains 4 steps at learning rate 1e-2 on four seeded batches (the floor: on
//! the batch it was captured on) eagerly and, from a deep copy, in the row's mode, and
//! `burn_graphed_testkit::StepCheck` compares every loss and every parameter element (its
//! docs state the bounds). Inference modes: [`OutputCheck`], every output element against the
//! eager call's, with a stale batch as its control. The row's `check_*` fields record it. A
//! failed check prints a failure row (`"error"`, no times) instead of the timing row and
//! exits with status 3; so does a fault-injection mode whose check passes, since its check must
//! fail (it shows what the copies it skips protect).
//! `BURN_GRAPHED_DOT_DIR=DIR` writes every graph the run captures to `DIR` as Graphviz DOT
//! (`burn_graphed::write_graphs_as_dot`; CUDA).
//!
//! `BURN_GRAPHED_CHECK_DUMP=DIR` writes each check's losses and small parameters to `DIR`, for
//! `benches/check_dump_compare.py` to set a bf16 run beside an f32 run of the same model.

use std::time::{Duration, Instant};

use burn::module::ParamId;
use burn::module::{Module, ModuleMapper, Param};
use burn::nn::attention::generate_autoregressive_mask;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig};
use burn::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::nn::{
    Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig, LinearLayout,
    PaddingConfig2d, Relu,
};
use burn::optim::{AdamConfig, GradientsParams, ModuleOptimizer};
use burn::prelude::*;
use burn::tensor::{Bool, Distribution, FloatDType, TensorData};
use burn_graphed::testing::FaultInjection;
use burn_graphed::{
    Collective, DataParallel, FusedAdamConfig, Graphed, GraphedConfig, GraphedStep,
    MultiTensorAdam, OutputPolicy, TensorGroup, replica_on,
};
use burn_graphed_testkit::{StepCheck, deep_copy, param_values, read_flat, require_finite};

#[derive(Module, Debug)]
struct Mlp {
    layers: Vec<Linear>,
}

/// The bench's MLP, 8 x Linear(256, 256), its weights stored in `layout`.
fn mlp_of(layout: LinearLayout, device: &Device) -> Mlp {
    Mlp {
        layers: (0..8)
            .map(|_| LinearConfig::new(256, 256).with_layout(layout).init(device))
            .collect(),
    }
}

/// The `mlp` with `burn_graphed::nn::Linear` layers (`mlp_fused`): the same parameters; on at
/// most 8 rows (the batch-1 inference modes) its layers run their own kernel.
#[derive(Module, Debug)]
struct FusedMlp {
    layers: Vec<burn_graphed::nn::Linear>,
}

fn fused_mlp_forward(m: &FusedMlp, mut x: Tensor<2>) -> Tensor<2> {
    for layer in &m.layers {
        x = Relu::new().forward(layer.forward(x));
    }
    x
}

fn mlp_forward(m: &Mlp, mut x: Tensor<2>) -> Tensor<2> {
    for layer in &m.layers {
        x = Relu::new().forward(layer.forward(x));
    }
    x
}

#[derive(Module, Debug)]
struct Encoder {
    encoder: TransformerEncoder,
}

fn encoder_forward(m: &Encoder, x: Tensor<3>) -> Tensor<3> {
    m.encoder.forward(TransformerEncoderInput::new(x))
}

/// The `transformer` with `burn_graphed::nn`'s fused layers: burn-nn's encoder, initialized
/// alike, converted (the same parameters, layer norms fused).
#[derive(Module, Debug)]
struct FusedEncoder {
    encoder: burn_graphed::nn::TransformerEncoder,
}

fn fused_encoder_forward(m: &FusedEncoder, x: Tensor<3>) -> Tensor<3> {
    m.encoder
        .forward(burn_graphed::nn::TransformerEncoderInput::new(x))
}

#[derive(Module, Debug)]
struct Cnn {
    conv1: Conv2d,
    conv2: Conv2d,
    pool: AdaptiveAvgPool2d,
    head: Linear,
}

fn cnn_forward(m: &Cnn, x: Tensor<4>) -> Tensor<2> {
    let x = Relu::new().forward(m.conv1.forward(x));
    let x = Relu::new().forward(m.conv2.forward(x));
    let x = m.pool.forward(x).flatten::<2>(1, 3);
    m.head.forward(x)
}

/// The `cnn` model: two 3x3 convolutions (3 -> 16 -> 32 channels, padding 1), ReLU, global
/// average pooling and a linear head (`torch_reference.py`'s `Cnn`).
fn make_cnn(d: &Device) -> Cnn {
    Cnn {
        conv1: Conv2dConfig::new([3, 16], [3, 3])
            .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
            .init(d),
        conv2: Conv2dConfig::new([16, 32], [3, 3])
            .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
            .init(d),
        pool: AdaptiveAvgPool2dConfig::new([1, 1]).init(),
        head: LinearConfig::new(32, 10).init(d),
    }
}

/// A batch of the `cnn`'s `[rows, 3, 32, 32]` images.
fn cnn_input(d: &Device, rows: usize) -> Tensor<4> {
    Tensor::random([rows, 3, 32, 32], Distribution::Default, d)
}

/// The `cnn` with `burn_graphed::nn`'s `Conv2d` and `Linear` layers (`cnn_fused`), converted
/// from [`make_cnn`]'s model: the same parameters.
#[derive(Module, Debug)]
struct FusedCnn {
    conv1: burn_graphed::nn::Conv2d,
    conv2: burn_graphed::nn::Conv2d,
    pool: AdaptiveAvgPool2d,
    head: burn_graphed::nn::Linear,
}

fn fused_cnn_forward(m: &FusedCnn, x: Tensor<4>) -> Tensor<2> {
    let x = Relu::new().forward(m.conv1.forward(x));
    let x = Relu::new().forward(m.conv2.forward(x));
    let x = m.pool.forward(x).flatten::<2>(1, 3);
    m.head.forward(x)
}

fn mean_square<const D: usize>(y: Tensor<D>) -> Tensor<1> {
    y.powi_scalar(2).mean()
}

/// The `lm` model: token and learned position embeddings, pre-norm transformer blocks under a
/// causal mask, a final norm and an output head (`torch_reference.py`'s `Lm`).
#[derive(Module, Debug)]
struct Lm {
    tokens: Embedding,
    positions: Embedding,
    blocks: TransformerEncoder,
    norm: LayerNorm,
    head: Linear,
}

const LM_VOCAB: usize = 512;
const LM_LENGTH: usize = 128;
const LM_BATCH: usize = 8;

/// Token ids, the causal mask and the next-token targets (flattened).
type LmBatch = (Tensor<2, Int>, Tensor<3, Bool>, Tensor<1, Int>);

fn make_lm(device: &Device) -> Lm {
    Lm {
        tokens: EmbeddingConfig::new(LM_VOCAB, 256).init(device),
        positions: EmbeddingConfig::new(LM_LENGTH, 256).init(device),
        blocks: TransformerEncoderConfig::new(256, 1024, 8, 2)
            .with_norm_first(true)
            .with_dropout(0.0)
            .init(device),
        norm: LayerNormConfig::new(256).init(device),
        head: LinearConfig::new(256, LM_VOCAB).init(device),
    }
}

/// The `lm` with `burn_graphed::nn`'s fused layers (token embedding, blocks, final norm and
/// head; its loss is the fused cross-entropy, [`fused_lm_loss_of`]), converted from
/// [`make_lm`]'s model: the same parameters.
#[derive(Module, Debug)]
struct FusedLm {
    tokens: burn_graphed::nn::Embedding,
    positions: Embedding,
    blocks: burn_graphed::nn::TransformerEncoder,
    norm: burn_graphed::nn::LayerNorm,
    head: burn_graphed::nn::Linear,
}

fn make_fused_lm(device: &Device) -> FusedLm {
    let lm = make_lm(device);
    FusedLm {
        tokens: lm.tokens.into(),
        positions: lm.positions,
        blocks: burn_graphed::nn::TransformerEncoder::from_burn(lm.blocks, 1e-5),
        norm: burn_graphed::nn::LayerNorm::from_burn(lm.norm, 1e-5),
        head: lm.head.into(),
    }
}

/// [`lm_forward`] of the fused model.
fn fused_lm_forward(m: &FusedLm, (ids, mask, _targets): LmBatch) -> Tensor<3> {
    let [_, length] = ids.dims();
    let positions = m.positions.weight.val().slice([0..length, 0..256]);
    let x = m.tokens.forward(ids) + positions.unsqueeze::<3>();
    let x = m
        .blocks
        .forward(burn_graphed::nn::TransformerEncoderInput::new(x).mask_attn(mask));
    m.head.forward(m.norm.forward(x))
}

/// The logits of the ids under the mask (the targets are the loss's).
fn lm_forward(m: &Lm, (ids, mask, _targets): LmBatch) -> Tensor<3> {
    let [_, length] = ids.dims();
    let positions = m.positions.weight.val().slice([0..length, 0..256]);
    let x = m.tokens.forward(ids) + positions.unsqueeze::<3>();
    let x = m
        .blocks
        .forward(TransformerEncoderInput::new(x).mask_attn(mask));
    m.head.forward(m.norm.forward(x))
}

/// Mean next-token cross-entropy of `logits` against the batch's targets.
fn lm_loss_of(logits: Tensor<3>, batch: &LmBatch) -> Tensor<1> {
    let [rows, length, vocab] = logits.dims();
    CrossEntropyLossConfig::new()
        .init(&logits.device())
        .forward(logits.reshape([rows * length, vocab]), batch.2.clone())
}

/// [`lm_loss_of`] with `burn_graphed::nn`'s fused cross-entropy (the `lm_fused` model).
fn fused_lm_loss_of(logits: Tensor<3>, batch: &LmBatch) -> Tensor<1> {
    let [rows, length, vocab] = logits.dims();
    burn_graphed::nn::loss::CrossEntropyLossConfig::new()
        .init(&logits.device())
        .forward(logits.reshape([rows * length, vocab]), batch.2.clone())
}

/// A batch of `rows` rows of random ids and targets under one causal mask shared by every batch
/// of that size and device (made once per process), so that the graphs copy it in once, as
/// PyTorch's model holds its mask.
fn lm_batch(device: &Device, rows: usize) -> LmBatch {
    type Masks = Vec<(usize, Device, Tensor<3, Bool>)>;
    thread_local! {
        static MASKS: std::cell::RefCell<Masks> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let mask = MASKS.with(|masks| {
        let mut masks = masks.borrow_mut();
        if let Some((.., mask)) = masks.iter().find(|(r, d, _)| *r == rows && d == device) {
            return mask.clone();
        }
        let mask = generate_autoregressive_mask(rows, LM_LENGTH, device);
        masks.push((rows, device.clone(), mask.clone()));
        mask
    });
    // Drawn as ints: floats drawn in bf16 and cast would round ids near the top to VOCAB.
    let ids = || {
        Tensor::<1, Int>::random(
            [rows * LM_LENGTH],
            Distribution::Uniform(0.0, LM_VOCAB as f64),
            device,
        )
    };
    (ids().reshape([rows, LM_LENGTH]), mask, ids())
}

/// [`mean_square`] as the loss of a call on a batch that holds no targets.
fn mean_square_of<const D: usize, I>(y: Tensor<D>, _batch: &I) -> Tensor<1> {
    mean_square(y)
}

/// One benchmark row, printed as a JSON line.
struct Row {
    framework: &'static str,
    model: String,
    dtype: String,
    mode: &'static str,
    median_us: f64,
    p10_us: f64,
    p90_us: f64,
    reserved_mib: f64,
    /// The fusion optimizations `BURN_GRAPHED_FUSION_REMOVE` removed (empty: none).
    fusion_removed: String,
    /// Graphed runs: the value check against eager Burn ([`check`], [`OutputCheck`]); `None`
    /// for eager runs (the reference) and with `--no-check`.
    check: Option<Check>,
    /// Whether the mode skips a copy on purpose, so that its check must fail (a negative
    /// control of the check, numbers only).
    expect_failure: bool,
    /// Autotune keys that cubecl decided unmeasured before the check ([`warn_log`]): a key
    /// first met inside a recording, where profiling is refused, gets its first candidate
    /// that launches, unmeasured, for the rest of the process.
    autotune_unmeasured: usize,
    /// A one-off measurement (`first_step`): median, p10 and p90 are the one value.
    single: bool,
    /// Data-parallel runs: the number of ranks (the row then has `samples_per_s` too).
    ranks: Option<(usize, usize)>,
    /// Graphed runs on CUDA: the kernel nodes of the graphs the timed steps replayed
    /// ([`note_graphs`]); the launches of a step outside its graphs are not counted.
    graph_kernel_nodes: Option<usize>,
}

/// The kernel nodes of the graphs of the last timed run, for its row ([`Row::timed`]).
static GRAPH_KERNEL_NODES: std::sync::Mutex<Option<usize>> = std::sync::Mutex::new(None);

/// Notes the kernel nodes of `graphs` (a timed run's `stats().graphs`) for the run's row;
/// nothing where a graph does not say (wgpu) or there are none.
fn note_graphs(graphs: &[burn_graphed::GraphContents]) {
    let kernels = graphs
        .iter()
        .map(|g| g.nodes.map(|n| n.kernels))
        .sum::<Option<usize>>()
        .filter(|_| !graphs.is_empty());
    *GRAPH_KERNEL_NODES.lock().unwrap_or_else(|e| e.into_inner()) = kernels;
}

impl Row {
    /// Why the row's values are not a result: its check failed, or (a fault-injecting mode)
    /// passed where it had to fail; `None` when the row is a result.
    fn check_failure(&self) -> Option<String> {
        let check = self.check.as_ref()?;
        match (check.passed(), self.expect_failure) {
            (false, false) => Some(format!("value check failed: {check}")),
            (true, true) => Some(format!(
                "value check passed although the mode skips copies: the check is blind to it ({check})"
            )),
            _ => None,
        }
    }

    fn print(&self) {
        if let Some(failure) = self.check_failure() {
            // No timing row for values that were not right: the failure, which the report
            // lists.
            println!(
                "{{\"framework\": \"{}\", \"model\": \"{}\", \"dtype\": \"{}\", \"tf32\": {}, \"mode\": \"{}\", \"check_passed\": false, \"error\": \"{}\"}}",
                self.framework,
                self.model,
                self.dtype,
                burn_graphed::tf32_allowed(),
                self.mode,
                failure.replace('\\', "\\\\").replace('"', "\\\"")
            );
            return;
        }
        let mut check = self.check.as_ref().map_or_else(String::new, Check::json);
        if self.check.is_some() && self.expect_failure {
            check.push_str(", \"check_must_fail\": true");
        }
        let unmeasured = if self.autotune_unmeasured == 0 {
            String::new()
        } else {
            format!(", \"autotune_unmeasured\": {}", self.autotune_unmeasured)
        };
        let removed = if self.fusion_removed.is_empty() {
            String::new()
        } else {
            format!(", \"fusion_removed\": \"{}\"", self.fusion_removed)
        };
        let single = if self.single {
            ", \"single\": true"
        } else {
            ""
        };
        let ranks = self.ranks.map_or_else(String::new, |(ranks, batch)| {
            format!(
                ", \"ranks\": {ranks}, \"samples_per_s\": {:.1}",
                (ranks * batch) as f64 * 1e6 / self.median_us
            )
        });
        let nodes = self
            .graph_kernel_nodes
            .map_or_else(String::new, |n| format!(", \"graph_kernel_nodes\": {n}"));
        println!(
            "{{\"framework\": \"{}\", \"model\": \"{}\", \"dtype\": \"{}\", \"tf32\": {}, \"mode\": \"{}\", \"median_us\": {:.1}, \"p10_us\": {:.1}, \"p90_us\": {:.1}, \"reserved_mib\": {:.1}{removed}{unmeasured}{check}{single}{ranks}{nodes}}}",
            self.framework,
            self.model,
            self.dtype,
            burn_graphed::tf32_allowed(),
            self.mode,
            self.median_us,
            self.p10_us,
            self.p90_us,
            self.reserved_mib
        );
    }
}

#[derive(Clone)]
struct Options {
    models: Vec<String>,
    dtype: String,
    steps: usize,
    reps: usize,
    modes: Vec<String>,
    /// `--host-profile FILE`: where to append each run's host profile (feature `host-profile`).
    host_profile: Option<String>,
    /// `--kernel-trace FILE`: where to append each run's kernel trace (cubecl backends).
    kernel_trace: Option<String>,
    /// Whether graphed runs are checked against eager steps (`--no-check` turns it off).
    check: bool,
    /// `--in-process`: every run in this process, one after the other (default: one process
    /// per (model, mode) run, so that the memory readings of runs do not depend on each other).
    in_process: bool,
    /// `BURN_GRAPHED_FUSION_REMOVE`: the built-in fusion optimizations to remove, comma-separated.
    fusion_removed: String,
    /// `--check-cost`: time cubecl's `ComputeClient::check` on one buffer instead of training
    /// (the lookup burn-graphed makes per copy into a graph's buffer and per fused optimizer
    /// step), and print its median.
    check_cost: bool,
    /// `--ranks N`: the GPUs of the `ddp_*` modes (default 2).
    ranks: usize,
    /// `--tf32 on|off` (default off): whether cubecl may run `f32` matrix products on TF32
    /// tensor cores (`burn_graphed::allow_tf32`), so that a row runs the arithmetic of the
    /// PyTorch row it is compared with (PyTorch's `allow_tf32`); every row records it.
    tf32: bool,
}

fn options() -> Options {
    let mut options = Options {
        models: ["mlp", "mlp256", "transformer", "cnn", "lm"]
            .map(String::from)
            .to_vec(),
        dtype: "f32".into(),
        modes: MODES[..4]
            .iter()
            .chain(&MODES[5..13])
            .map(|m| m.label().to_string())
            .collect(),
        steps: 50,
        reps: 30,
        host_profile: None,
        kernel_trace: None,
        check: true,
        in_process: false,
        fusion_removed: std::env::var("BURN_GRAPHED_FUSION_REMOVE").unwrap_or_default(),
        check_cost: false,
        ranks: 2,
        tf32: false,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        if arg == "--no-check" {
            options.check = false;
            continue;
        }
        if arg == "--in-process" {
            options.in_process = true;
            continue;
        }
        if arg == "--check-cost" {
            options.check_cost = true;
            continue;
        }
        let value = iter.next().cloned().unwrap_or_default();
        match arg.as_str() {
            "--models" => options.models = value.split(',').map(String::from).collect(),
            "--dtype" => options.dtype = value,
            "--tf32" => {
                options.tf32 = match value.as_str() {
                    "on" => true,
                    "off" => false,
                    other => panic!("--tf32 takes on or off, not {other:?}"),
                }
            }
            "--steps" => options.steps = value.parse().expect("--steps takes a number"),
            "--reps" => options.reps = value.parse().expect("--reps takes a number"),
            "--ranks" => {
                options.ranks = value.parse().expect("--ranks takes a number");
                assert!(options.ranks > 0, "--ranks takes a positive number");
            }
            "--modes" => {
                options.modes = value.split(',').map(String::from).collect();
                for mode in &options.modes {
                    assert!(
                        MODES.iter().any(|m| m.label() == mode)
                            || TORCH_ONLY_MODES.contains(&mode.as_str()),
                        "unknown mode {mode}"
                    );
                }
            }
            #[cfg(feature = "host-profile")]
            "--host-profile" => options.host_profile = Some(value),
            #[cfg(not(feature = "host-profile"))]
            "--host-profile" => panic!("--host-profile needs the `host-profile` feature"),
            #[cfg(feature = "cube")]
            "--kernel-trace" => options.kernel_trace = Some(value),
            #[cfg(not(feature = "cube"))]
            "--kernel-trace" => panic!("--kernel-trace needs a cubecl backend (`cuda` or `wgpu`)"),
            // libtest passes `--bench` to bench targets; nothing to do.
            "--bench" => {}
            other => panic!("unknown argument {other}"),
        }
    }
    options
}

fn reserved(device: &Device) -> u64 {
    device
        .memory_pool_usage()
        .map(|usage| usage.bytes_reserved)
        .unwrap_or(0)
}

/// Median, 10th and 90th percentile of per-step times over reps.
fn spread(mut per_step: Vec<f64>) -> (f64, f64, f64) {
    per_step.sort_by(f64::total_cmp);
    let at = |q: f64| per_step[((per_step.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.1), at(0.9))
}

/// A model, its call and loss, and how to make inputs of it.
struct Case<M, I, O> {
    name: String,
    make: fn(&Device) -> M,
    call: fn(&M, I) -> O,
    /// The loss of the outputs of a call on a batch (the batch holds the language model's
    /// targets).
    loss: fn(O, &I) -> Tensor<1>,
    /// `loss(call(m, x), x)` as one function: the callable of the `graphed_loss_*` modes, whose
    /// graphs hold the loss too.
    call_loss: fn(&M, I) -> Tensor<1>,
    /// A batch of the given size.
    input: fn(&Device, usize) -> I,
    /// The training batch size.
    batch: usize,
    /// Appended to every row's mode: `_fused_layers` for the models whose layers are
    /// `burn_graphed::nn`'s fused ones (`--models transformer_fused,lm_fused`), so that their
    /// rows pair with the same model's burn-nn rows and PyTorch's; empty otherwise.
    variant: &'static str,
}

/// Every run, in the order they are timed (the default: all but `graphed_static`).
const MODES: [Mode; 27] = [
    Mode::Eager(Optim::Adam),
    Mode::Graphed(FaultInjection::None, Optim::Adam),
    Mode::Graphed(FaultInjection::SkipInputCopy, Optim::Adam),
    Mode::Graphed(FaultInjection::SkipParamCopy, Optim::Adam),
    Mode::GraphedStatic(Optim::Adam),
    Mode::Eager(Optim::FusedAdam),
    Mode::Graphed(FaultInjection::None, Optim::FusedAdam),
    Mode::GraphedStatic(Optim::FusedAdam),
    Mode::GraphedGuarded(Optim::FusedAdam),
    Mode::Eager(Optim::MultiAdam),
    Mode::Graphed(FaultInjection::None, Optim::MultiAdam),
    Mode::GraphedStatic(Optim::MultiAdam),
    Mode::GraphedLoss(Optim::MultiAdam),
    Mode::Graphed(FaultInjection::SkipWriteCheck, Optim::MultiAdam),
    Mode::Graphed(FaultInjection::SkipInputCopy, Optim::MultiAdam),
    Mode::WholeStep(false),
    Mode::WholeStep(true),
    Mode::FirstStep,
    Mode::Inference {
        graphed: false,
        one: false,
    },
    Mode::Inference {
        graphed: true,
        one: false,
    },
    Mode::Inference {
        graphed: false,
        one: true,
    },
    Mode::Inference {
        graphed: true,
        one: true,
    },
    Mode::InferenceFault(FaultInjection::SkipWriteCheck),
    Mode::InferenceFault(FaultInjection::SkipInputCopy),
    Mode::Ddp(DdpStep::Eager),
    Mode::Ddp(DdpStep::Graphed),
    Mode::Ddp(DdpStep::WholeStep),
];

/// Modes of `torch_reference.py` alone: `run.sh bench` passes one `--modes` to both sides, and
/// each side runs the modes it has.
const TORCH_ONLY_MODES: [&str; 4] = [
    "graphed_loss_fused_adam",
    "whole_step_fused_adam",
    "whole_step_floor_fused_adam",
    "first_step_graphed",
];

/// The optimizer of a run: burn's `Adam`, `burn_graphed::FusedAdam` (one kernel per
/// parameter, updating the graphs' parameter buffers in place), or
/// `burn_graphed::MultiTensorAdam` (the same, one fusion operation for all parameters).
#[derive(Clone, Copy, PartialEq)]
enum Optim {
    Adam,
    FusedAdam,
    MultiAdam,
}

/// A module optimizer of either kind.
enum Optimizer {
    Module(ModuleOptimizer),
    Multi(MultiTensorAdam),
}

impl Optimizer {
    fn step<M: Module>(&mut self, lr: f64, module: M, grads: GradientsParams) -> M {
        match self {
            Optimizer::Module(optim) => optim.step(lr, module, grads),
            Optimizer::Multi(optim) => optim.step(lr, module, grads),
        }
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Eager(Optim),
    Graphed(FaultInjection, Optim),
    /// `OutputPolicy::Static`: outputs and gradients handed out as the static buffers (no
    /// hand-out copies), as PyTorch does.
    GraphedStatic(Optim),
    /// `OutputPolicy::Guarded`: static buffers handed out, calls that would overwrite one
    /// still held run eagerly (none in this loop).
    GraphedGuarded(Optim),
    /// `OutputPolicy::Static`, with the loss inside the graphed callable
    /// ([`Case::call_loss`]): the forward graph ends in the loss, and the backward graph starts
    /// from it. PyTorch's counterpart is `graphed_loss_fused_adam`.
    GraphedLoss(Optim),
    /// `GraphedStep` with burn's Adam: forward, loss, backward and update in one graph, the
    /// learning rate written before every replay (a schedule); `true`: the device floor, the
    /// same graph replayed with no input copy (wrong values, timing only) and one learning
    /// rate. PyTorch's counterparts: `whole_step` and `whole_step_floor`.
    WholeStep(bool),
    /// Time from making the model to the end of its first whole step (capture included), once
    /// per process: cold or warm as cubecl's persistent cache is (`BURN_GRAPHED_CUBECL_ENV`).
    /// PyTorch's counterpart: `first_step`.
    FirstStep,
    /// Forward calls of the model on the device without autodiff, a new batch each call, no
    /// loss: eagerly, or replaying `Graphed::inference`'s graph (default output policy,
    /// `Guarded`); at the training batch size or (`one`) at batch size 1. PyTorch's
    /// counterparts (eval mode, no grad): `inference*`, graphed with `torch.cuda.graph`.
    Inference {
        graphed: bool,
        one: bool,
    },
    /// `inference_graphed_b1` with a fault built into the graph, to tell what the call's parts
    /// cost (numbers only): `SkipWriteCheck` (`inference_graphed_b1_no_check`: no question to
    /// cubecl before the replay) and `SkipInputCopy` (`inference_graphed_b1_floor`: nothing
    /// copied or asked, the graph replayed on the capture's input; wrong values, no check).
    InferenceFault(FaultInjection),
    /// Data-parallel training on `--ranks` GPUs (one thread per GPU, each on a batch of the
    /// model's size: the global batch grows with the ranks), the gradients averaged by
    /// `burn_graphed::DataParallel` (one bucketed NCCL all-reduce per step) before
    /// `MultiTensorAdam`: eagerly (`ddp_eager`), or graphed with `OutputPolicy::Static`
    /// (`ddp_graphed`, the captures one rank at a time); or `GraphedStep::data_parallel` with
    /// burn's Adam (`ddp_whole_step`: a gradient graph, the bucket's all-reduce, an update
    /// graph). Their one-GPU counterparts: `eager_multi_adam`, `graphed_static_multi_adam` and
    /// `whole_step`. PyTorch's: `ddp_eager`, `ddp_graphed` (`make_graphed_callables` under DDP)
    /// and `ddp_whole_step` (the whole step in one graph, its all-reduces inside).
    Ddp(DdpStep),
}

/// The step of a `ddp_*` mode ([`Mode::Ddp`]).
#[derive(Clone, Copy, PartialEq)]
enum DdpStep {
    Eager,
    Graphed,
    WholeStep,
}

impl Mode {
    fn label(self) -> &'static str {
        use FaultInjection::{None, SkipInputCopy, SkipParamCopy, SkipWriteCheck};
        use Optim::{Adam, FusedAdam, MultiAdam};
        match self {
            Mode::Eager(Adam) => "eager",
            Mode::Graphed(None, Adam) => "graphed",
            Mode::Graphed(SkipInputCopy, MultiAdam) => "graphed_multi_adam_no_input_copy",
            Mode::Graphed(SkipInputCopy, _) => "graphed_no_input_copy",
            Mode::Graphed(SkipParamCopy, _) => "graphed_no_param_copy",
            Mode::Graphed(SkipWriteCheck, Adam) => "graphed_no_check",
            Mode::Graphed(SkipWriteCheck, FusedAdam) => "graphed_fused_adam_no_check",
            Mode::Graphed(SkipWriteCheck, MultiAdam) => "graphed_multi_adam_no_check",
            Mode::GraphedStatic(Adam) => "graphed_static",
            Mode::Eager(FusedAdam) => "eager_fused_adam",
            Mode::Graphed(_, FusedAdam) => "graphed_fused_adam",
            Mode::GraphedStatic(FusedAdam) => "graphed_static_fused_adam",
            Mode::GraphedGuarded(Adam) => "graphed_guarded",
            Mode::GraphedGuarded(FusedAdam) => "graphed_guarded_fused_adam",
            Mode::Eager(MultiAdam) => "eager_multi_adam",
            Mode::Graphed(_, MultiAdam) => "graphed_multi_adam",
            Mode::GraphedStatic(MultiAdam) => "graphed_static_multi_adam",
            Mode::GraphedGuarded(MultiAdam) => "graphed_guarded_multi_adam",
            Mode::GraphedLoss(Adam) => "graphed_loss_static",
            Mode::GraphedLoss(FusedAdam) => "graphed_loss_static_fused_adam",
            Mode::GraphedLoss(MultiAdam) => "graphed_loss_static_multi_adam",
            // Faults of whole steps: no `Graphed` mode injects them.
            Mode::Graphed(FaultInjection::SkipUpdate | FaultInjection::FreezeLr, _) => {
                "graphed_whole_step_fault"
            }
            Mode::WholeStep(false) => "whole_step",
            Mode::WholeStep(true) => "whole_step_floor",
            Mode::FirstStep => "first_step",
            Mode::Inference {
                graphed: false,
                one: false,
            } => "inference",
            Mode::Inference {
                graphed: true,
                one: false,
            } => "inference_graphed",
            Mode::Inference {
                graphed: false,
                one: true,
            } => "inference_b1",
            Mode::Inference {
                graphed: true,
                one: true,
            } => "inference_graphed_b1",
            Mode::InferenceFault(FaultInjection::SkipInputCopy) => "inference_graphed_b1_floor",
            Mode::InferenceFault(_) => "inference_graphed_b1_no_check",
            Mode::Ddp(DdpStep::Eager) => "ddp_eager",
            Mode::Ddp(DdpStep::Graphed) => "ddp_graphed",
            Mode::Ddp(DdpStep::WholeStep) => "ddp_whole_step",
        }
    }

    /// The fault the graphed model's capture builds in (graphed modes).
    fn fault(self) -> FaultInjection {
        match self {
            Mode::Graphed(fault, _) | Mode::InferenceFault(fault) => fault,
            Mode::WholeStep(true) => FaultInjection::SkipInputCopy,
            _ => FaultInjection::None,
        }
    }

    /// The graphed model's configuration (graphed modes).
    fn config(self) -> GraphedConfig {
        match self {
            Mode::Graphed(..) => GraphedConfig::new().with_outputs(OutputPolicy::Copy),
            Mode::GraphedGuarded(_) => GraphedConfig::new().with_outputs(OutputPolicy::Guarded),
            _ => GraphedConfig::new().with_outputs(OutputPolicy::Static),
        }
    }

    /// Whether the mode skips a copy on purpose, so that its values are wrong and its check
    /// must fail. Skipping the check of written buffers does not: every tensor of the bench is
    /// written. The inference floor (`inference_graphed_b1_floor`) does: it replays on what its
    /// input buffer held after the capture (the replay validation's draw, not a batch the
    /// bench holds), so its outputs must differ from the eager call's on the batch it is given.
    fn injects_fault(self) -> bool {
        matches!(
            self,
            Mode::Graphed(
                FaultInjection::SkipInputCopy | FaultInjection::SkipParamCopy,
                _
            ) | Mode::InferenceFault(FaultInjection::SkipInputCopy)
        )
    }

    /// Whether the mode's graph trains on the batch it was captured on, whatever it is given
    /// (the whole step's floor skips the input copy to time the device's floor, and its
    /// capture leaves that batch in its input buffer): its check trains both runs on that batch
    /// alone, and must pass.
    fn replays_capture_batch(self) -> bool {
        matches!(self, Mode::WholeStep(true))
    }

    fn optimizer(self) -> Optimizer {
        let optim = match self {
            Mode::Eager(optim)
            | Mode::Graphed(_, optim)
            | Mode::GraphedStatic(optim)
            | Mode::GraphedGuarded(optim)
            | Mode::GraphedLoss(optim) => optim,
            Mode::WholeStep(_)
            | Mode::FirstStep
            | Mode::Inference { .. }
            | Mode::InferenceFault(_) => Optim::Adam,
            Mode::Ddp(_) => Optim::MultiAdam,
        };
        match optim {
            Optim::Adam => Optimizer::Module(AdamConfig::new().init()),
            Optim::FusedAdam => Optimizer::Module(FusedAdamConfig::new().init()),
            Optim::MultiAdam => Optimizer::Multi(FusedAdamConfig::new().init_multi_tensor()),
        }
    }
}

/// Times `reps` x `steps` training steps in `mode`, from a fresh model.
fn run<M, I, O>(case: &Case<M, I, O>, mode: Mode, device: &Device, options: &Options) -> Row
where
    M: Module,
    I: TensorGroup + Clone,
    O: TensorGroup,
{
    device.memory_cleanup();
    let before = reserved(device);
    let label = format!("{} {}{}", case.name, mode.label(), case.variant);
    trace_phase("setup");
    let unmeasured_before = warn_log::unmeasured();
    #[cfg(feature = "cube")]
    let _trace = options
        .kernel_trace
        .as_deref()
        .map(|file| kernel_trace::Trace::start(file, &label));
    if mode == Mode::FirstStep {
        return first_step(case, &label, device, options, before);
    }
    if let Mode::Ddp(ddp) = mode {
        return data_parallel(case, ddp, device, options, before, unmeasured_before);
    }
    if let Mode::Inference { .. } | Mode::InferenceFault(_) = mode {
        let (graphed, batch) = match mode {
            Mode::Inference { graphed, one } => (graphed, if one { 1 } else { case.batch }),
            _ => (true, 1),
        };
        let (per_step, check) =
            timed_inference(case, graphed, batch, mode.fault(), &label, device, options);
        let mut row = Row::timed(
            case,
            mode,
            per_step,
            device,
            before,
            options,
            unmeasured_before,
        );
        row.check = check.map(Check::Outputs);
        return row;
    }
    let model = (case.make)(device);
    let inputs: Vec<I> = (0..4).map(|_| (case.input)(device, case.batch)).collect();
    let mut optimizer = mode.optimizer();
    // The model moves through the optimizer (`model = optim.step(lr, model, grads)`, no
    // clone), as in a training loop: a clone would keep the old parameters alive during the
    // step, and `FusedAdam` could then not update the graphs' buffers in place.
    let per_step = match mode {
        Mode::Eager(_) => {
            let (per_step, model) = train_steps(
                model,
                case.call,
                case.loss,
                &inputs,
                &mut optimizer,
                &label,
                device,
                options,
                None,
            );
            if let Some(model) = &model {
                assert_ran(model, &label);
            }
            per_step
        }
        Mode::GraphedLoss(_) => timed_graphed(
            model,
            case.call_loss,
            |loss, _| loss,
            mode,
            &inputs,
            &mut optimizer,
            &label,
            device,
            options,
        ),
        Mode::FirstStep | Mode::Inference { .. } | Mode::InferenceFault(_) | Mode::Ddp(_) => {
            unreachable!("measured above")
        }
        Mode::WholeStep(floor) => timed_whole_step(
            model,
            case.call_loss,
            floor,
            &inputs,
            &label,
            device,
            options,
        ),
        Mode::Graphed(..) | Mode::GraphedStatic(_) | Mode::GraphedGuarded(_) => timed_graphed(
            model,
            case.call,
            case.loss,
            mode,
            &inputs,
            &mut optimizer,
            &label,
            device,
            options,
        ),
    };
    let mut row = Row::timed(
        case,
        mode,
        per_step,
        device,
        before,
        options,
        unmeasured_before,
    );
    // After the timed run and its memory reading: the check's models and pools are not in them.
    // Eager runs are the reference the checks compare with (`assert_ran` read them back).
    row.check = (options.check && !matches!(mode, Mode::Eager(_)))
        .then(|| Check::Steps(check(case, mode, &label, device, options)));
    if let Some(check) = &row.check {
        eprintln!("# {label}: value check {check}");
    }
    row
}

impl Row {
    /// The row of a timed run of `case` in `mode` (no value check yet): the spread of
    /// `per_step`, the memory reserved since `before`, the autotune keys decided unmeasured
    /// since `unmeasured_before`.
    fn timed<M, I, O>(
        case: &Case<M, I, O>,
        mode: Mode,
        per_step: Vec<f64>,
        device: &Device,
        before: u64,
        options: &Options,
        unmeasured_before: usize,
    ) -> Row {
        let (median_us, p10_us, p90_us) = spread(per_step);
        let reserved_mib = reserved(device).saturating_sub(before) as f64 / (1024.0 * 1024.0);
        let autotune_unmeasured = warn_log::unmeasured() - unmeasured_before;
        if autotune_unmeasured > 0 {
            eprintln!(
                "# {} {}: autotune decided {autotune_unmeasured} key(s) unmeasured (warnings above)",
                case.name,
                mode.label()
            );
        }
        Row {
            framework: "burn",
            model: case.name.clone(),
            dtype: options.dtype.clone(),
            mode: mode.label(),
            median_us,
            p10_us,
            p90_us,
            reserved_mib,
            fusion_removed: options.fusion_removed.clone(),
            check: None,
            expect_failure: mode.injects_fault(),
            autotune_unmeasured,
            single: false,
            ranks: None,
            graph_kernel_nodes: GRAPH_KERNEL_NODES
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take(),
        }
    }
}

/// Every parameter's values, by id ([`param_values`]).
type ParamValues = Vec<(ParamId, TensorData)>;

/// A `ddp_*` run ([`Mode::Ddp`]) of `case` on `options.ranks` GPUs, the first being `device`;
/// `None` (with a `skipped:` line) where the machine has fewer. Every rank trains a replica of
/// one model on batches of its own; after the timed steps the replicas must be bitwise equal.
/// The row is rank 0's step time (every rep starts at a barrier of all ranks), with the ranks
/// and the samples per second of all of them.
fn data_parallel<M, I, O>(
    case: &Case<M, I, O>,
    ddp: DdpStep,
    device: &Device,
    options: &Options,
    before: u64,
    unmeasured_before: usize,
) -> Row
where
    M: Module,
    I: TensorGroup + Clone,
    O: TensorGroup,
{
    let mode = Mode::Ddp(ddp);
    let label = format!("{} {}", case.name, mode.label());
    let (devices, collective) = ddp_devices(device, options);
    let group = DataParallel::group(devices.len(), Duration::from_secs(600), collective)
        .expect("a data-parallel group");
    let model = (case.make)(device);
    let ranks: Vec<(Vec<f64>, ParamValues)> = std::thread::scope(|scope| {
        let ranks: Vec<_> = group
            .into_iter()
            .zip(&devices)
            .map(|(dp, device)| {
                let (model, label) = (model.clone(), &label);
                scope.spawn(move || {
                    // One host profile per run (`--host-profile`): rank 0's, which samples
                    // every thread of the process, the other ranks' too.
                    let options = &Options {
                        host_profile: options
                            .host_profile
                            .clone()
                            .filter(|_| dp.ranks().rank() == 0),
                        ..options.clone()
                    };
                    let replica = replica_on(&model, device);
                    let inputs: Vec<I> = (0..4).map(|_| (case.input)(device, case.batch)).collect();
                    let rank_label = format!("{label}, rank {}", dp.ranks().rank());
                    let (per_step, values) = match ddp {
                        DdpStep::WholeStep => {
                            let (per_step, step) = timed_ddp_whole_step(
                                &dp,
                                replica,
                                case.call_loss,
                                &inputs,
                                &rank_label,
                                device,
                                options,
                            );
                            (per_step, param_values(&step.module()))
                        }
                        DdpStep::Graphed => {
                            let config = GraphedConfig::new().with_outputs(OutputPolicy::Static);
                            let replica = dp
                                .in_turn("capture", device, || {
                                    Graphed::new(replica, case.call, inputs[0].clone(), &config)
                                })
                                .expect("every rank captures");
                            let call = |model: &Graphed<M, I, O>, input: I| {
                                model.forward(input).expect("graphed call")
                            };
                            let (per_step, replica) = train_steps(
                                replica,
                                call,
                                case.loss,
                                &inputs,
                                &mut Optimizer::Multi(FusedAdamConfig::new().init_multi_tensor()),
                                &rank_label,
                                device,
                                options,
                                Some(&dp),
                            );
                            let replica = replica.expect("the trained replica");
                            let stats = replica.stats();
                            eprintln!("# {rank_label}: {stats:?}");
                            assert!(
                                stats.eager.is_empty(),
                                "{label}: a step ran eagerly: {stats:?}"
                            );
                            (per_step, param_values(replica.module()))
                        }
                        DdpStep::Eager => {
                            let (per_step, replica) = train_steps(
                                replica,
                                case.call,
                                case.loss,
                                &inputs,
                                &mut Optimizer::Multi(FusedAdamConfig::new().init_multi_tensor()),
                                &rank_label,
                                device,
                                options,
                                Some(&dp),
                            );
                            let replica = replica.expect("the trained replica");
                            (per_step, param_values(&replica))
                        }
                    };
                    let values = values.unwrap_or_else(|error| {
                        panic!("{label}: not a result: parameters do not read back ({error})")
                    });
                    require_finite(&values)
                        .unwrap_or_else(|error| panic!("{label}: not a result: {error}"));
                    (per_step, values)
                })
            })
            .collect();
        ranks
            .into_iter()
            .map(|rank| rank.join().expect("a rank's thread"))
            .collect()
    });
    let identical = ranks.windows(2).all(|pair| pair[0].1 == pair[1].1);
    eprintln!("# {label}: replicas bitwise equal after the run: {identical}");
    assert!(identical, "{label}: the replicas' parameters differ");
    let per_step = ranks.into_iter().next().map(|(t, _)| t).unwrap_or_default();
    let mut row = Row::timed(
        case,
        mode,
        per_step,
        device,
        before,
        options,
        unmeasured_before,
    );
    row.ranks = Some((devices.len(), case.batch));
    row
}

/// The autodiff devices of a `ddp_*` run, rank 0 being `device`, and their collective: with
/// `cuda`, the first `options.ranks` GPUs (each in the run's float type) and burn's NCCL
/// all-reduce; without (a smoke run of the bench), `device` for every rank, averaging through
/// the host. Exits the process with a `skipped:` line where there are fewer GPUs.
fn ddp_devices(device: &Device, options: &Options) -> (Vec<Device>, Collective) {
    #[cfg(feature = "cuda")]
    {
        let count = cudarc::driver::result::init()
            .and_then(|()| cudarc::driver::result::device::get_count())
            .unwrap_or(0) as usize;
        if count < options.ranks {
            println!(
                "# skipped: the ddp modes need {} GPUs, this machine has {count}",
                options.ranks
            );
            std::process::exit(0);
        }
        let inner: Vec<Device> = (0..options.ranks)
            .map(|rank| {
                if rank == 0 {
                    return device.clone().inner();
                }
                let mut gpu = Device::cuda(rank);
                if options.dtype == "bf16" {
                    gpu.configure(FloatDType::BF16)
                        .expect("bf16 before any tensor");
                }
                gpu
            })
            .collect();
        let devices = inner.iter().map(|d| d.clone().autodiff()).collect();
        (devices, Collective::AllReduce { devices: inner })
    }
    #[cfg(not(feature = "cuda"))]
    (vec![device.clone(); options.ranks], Collective::Host)
}

/// The timed forward calls of an inference mode at `batch` rows, on the device without
/// autodiff: eagerly, or (`graphed`) through `Graphed::inference` with its default
/// configuration, whose outputs are first checked against the eager call's (through the
/// case's loss, on a batch other than the capture's; not under `SkipInputCopy`, whose values
/// are wrong), with `fault` built into its graph. Prints the graphed model's counters and the
/// host's time per call (from the call to its return, the device's work queued).
fn timed_inference<M, I, O>(
    case: &Case<M, I, O>,
    graphed: bool,
    batch: usize,
    fault: FaultInjection,
    label: &str,
    device: &Device,
    options: &Options,
) -> (Vec<f64>, Option<OutputCheck>)
where
    M: Module,
    I: TensorGroup + Clone,
    O: TensorGroup,
{
    let device = device.clone().inner();
    let model = (case.make)(&device);
    let inputs: Vec<I> = (0..4).map(|_| (case.input)(&device, batch)).collect();
    if !graphed {
        let mut call = |i: usize| drop((case.call)(&model, inputs[i % inputs.len()].clone()));
        return (time(&device, options, label, &mut call), None);
    }
    trace_phase("capture");
    // The check's eager reference, computed before the graphs exist: the outputs of the batch
    // the check feeds the graph (not the capture's) and, as the control, of the capture's.
    let (checked, control) = (1, 0);
    let reference = options.check.then(|| {
        let outputs = |i: usize| output_values((case.call)(&model, inputs[i].clone()));
        (outputs(checked), outputs(control))
    });
    let injected = burn_graphed::testing::inject(fault);
    let graphed = Graphed::inference(
        model,
        case.call,
        vec![inputs[0].clone()],
        &GraphedConfig::new(),
    )
    .expect("capture");
    drop(injected);
    let (mut host, mut count) = (Duration::ZERO, 0u32);
    let mut call = |i: usize| {
        let clock = Instant::now();
        let output = graphed
            .forward(inputs[i % inputs.len()].clone())
            .expect("graphed call");
        host += clock.elapsed();
        count += 1;
        drop(output);
    };
    burn_graphed::testing::time_phases(true);
    let per_step = time(&device, options, label, &mut call);
    eprintln!(
        "# {label}: host {:.1} us per call (queueing: copy, check, replay)",
        host.as_secs_f64() * 1e6 / f64::from(count.max(1))
    );
    if let Some((calls, phases)) = burn_graphed::testing::phase_times() {
        let phases: Vec<String> = phases
            .iter()
            .map(|(phase, time)| {
                let per_call = time.as_secs_f64() * 1e6 / calls.max(1) as f64;
                format!("{phase:?} {per_call:.1}")
            })
            .collect();
        eprintln!(
            "# {label}: host us per call by phase ({calls} calls): {}",
            phases.join(", ")
        );
    }
    burn_graphed::testing::time_phases(false);
    let stats = graphed.stats();
    assert_eq!(stats.total_eager(), 0, "{stats:?}");
    note_graphs(&stats.graphs);
    if graphed.summary().graphed {
        let calls = (WARM_UP + options.reps * options.steps) as u64;
        assert!(stats.forward_replays >= calls, "{label}: {stats:?}");
    }
    eprintln!("# {label}: {stats:?}");
    // After the timed calls, on the graphs they timed.
    trace_phase("check");
    let check = reference.map(|(eager, stale)| {
        let replayed = output_values(
            graphed
                .forward(inputs[checked].clone())
                .expect("graphed call"),
        );
        let check = OutputCheck::new(&options.dtype, &eager, &replayed, &stale);
        eprintln!("# {label}: value check {check}");
        check
    });
    (per_step, check)
}

/// The timed steps of a graphed `mode`, `call` graphed: per-step times; prints the graphed
/// model's counters and memory.
#[allow(clippy::too_many_arguments)]
fn timed_graphed<M, I, O>(
    model: M,
    call: fn(&M, I) -> O,
    loss: fn(O, &I) -> Tensor<1>,
    mode: Mode,
    inputs: &[I],
    optimizer: &mut Optimizer,
    label: &str,
    device: &Device,
    options: &Options,
) -> Vec<f64>
where
    M: Module,
    I: TensorGroup + Clone,
    O: TensorGroup,
{
    trace_phase("capture");
    let fault = burn_graphed::testing::inject(mode.fault());
    let graphed = Graphed::new(model, call, inputs[0].clone(), &mode.config()).expect("capture");
    drop(fault);
    let call = |model: &Graphed<M, I, O>, input: I| model.forward(input).expect("graphed call");
    let (per_step, model) = train_steps(
        graphed, call, loss, inputs, optimizer, label, device, options, None,
    );
    let stats = model.as_ref().map(|m| m.stats()).unwrap_or_default();
    assert_eq!(stats.total_eager(), 0, "{stats:?}");
    note_graphs(&stats.graphs);
    eprintln!("# {label}: {stats:?}");
    // What the capture added to the pools and what its static buffers take: the graphed part
    // of the memory column.
    if let Some(model) = &model {
        eprintln!("# {label}: {:?}", model.memory());
        assert_ran(model, label);
    }
    per_step
}

/// The timed steps of a whole-step `mode` (`floor`: no input copy, one learning rate): one
/// `GraphedStep::run` per step; prints its counters.
fn timed_whole_step<M, I>(
    model: M,
    loss: fn(&M, I) -> Tensor<1>,
    floor: bool,
    inputs: &[I],
    label: &str,
    device: &Device,
    options: &Options,
) -> Vec<f64>
where
    M: Module,
    I: TensorGroup + Clone,
{
    trace_phase("capture");
    let started = Instant::now();
    let mut step = whole_step(model, loss, &inputs[0], Mode::WholeStep(floor));
    eprintln!(
        "# {label}: capture {:.0} ms",
        started.elapsed().as_secs_f64() * 1e3
    );
    let mut host = std::time::Duration::ZERO;
    let mut count = 0u32;
    let mut run = |i: usize| {
        // A schedule changes the rate every step (a write before each replay); the floor
        // keeps one rate.
        let lr = if floor {
            1e-4
        } else {
            1e-4 * (1.0 - 1e-7 * i as f64)
        };
        let clock = Instant::now();
        let loss = step
            .run(inputs[i % inputs.len()].clone(), lr)
            .expect("whole step");
        host += clock.elapsed();
        count += 1;
        drop(loss);
    };
    let per_step = time(device, options, label, &mut run);
    eprintln!(
        "# {label}: host {:.1} us per step (queueing: copy, lr write, replay, loss copy)",
        host.as_secs_f64() * 1e6 / f64::from(count.max(1))
    );
    let stats = step.stats();
    assert_eq!(stats.total_eager(), 0, "{stats:?}");
    note_graphs(&stats.graphs);
    eprintln!("# {label}: {stats:?}");
    assert_ran(&step.module(), label);
    per_step
}

/// Times a rank's data-parallel whole steps (`GraphedStep::data_parallel` with burn's Adam, a
/// learning rate changing every step as in [`timed_whole_step`]), every rep starting at a
/// barrier of all ranks; returns the per-step times and the trained step.
fn timed_ddp_whole_step<M, I>(
    dp: &DataParallel,
    model: M,
    loss: fn(&M, I) -> Tensor<1>,
    inputs: &[I],
    label: &str,
    device: &Device,
    options: &Options,
) -> (Vec<f64>, GraphedStep<M, I>)
where
    M: Module,
    I: TensorGroup + Clone,
{
    trace_phase("capture");
    let started = Instant::now();
    let mut step = GraphedStep::data_parallel(
        dp,
        model,
        loss,
        &AdamConfig::new(),
        vec![inputs[0].clone()],
        &GraphedConfig::new(),
    )
    .expect("every rank captures");
    eprintln!(
        "# {label}: capture {:.0} ms",
        started.elapsed().as_secs_f64() * 1e3
    );
    // Per call, for the median: the first calls also set NCCL's communicator up.
    let mut host = Vec::new();
    let mut run = |i: usize| {
        let clock = Instant::now();
        let loss = step
            .run(
                inputs[i % inputs.len()].clone(),
                1e-4 * (1.0 - 1e-7 * i as f64),
            )
            .expect("data-parallel whole step");
        host.push(clock.elapsed().as_secs_f64() * 1e6);
        drop(loss);
    };
    let before_rep = || {
        dp.ranks()
            .barrier("a rep's start")
            .expect("every rank starts the rep");
    };
    let per_step = time_with(device, options, label, &before_rep, &mut run);
    host.sort_by(f64::total_cmp);
    eprintln!(
        "# {label}: host {:.1} us per step, median (copy, lr write, gradient replay, \
         agreement, all-reduce, update replay, loss copy)",
        host.get(host.len() / 2).copied().unwrap_or(f64::NAN)
    );
    let stats = step.stats();
    eprintln!("# {label}: {stats:?}");
    assert_eq!(
        stats.total_eager(),
        0,
        "{label}: a step ran eagerly: {stats:?}"
    );
    (per_step, step)
}

/// The time from making `case`'s model to the end of its first whole step (model, inputs,
/// capture, one step, a device sync), as a one-off row.
fn first_step<M, I, O>(
    case: &Case<M, I, O>,
    label: &str,
    device: &Device,
    options: &Options,
    before: u64,
) -> Row
where
    M: Module,
    I: TensorGroup + Clone,
    O: TensorGroup,
{
    let started = Instant::now();
    let model = (case.make)(device);
    let input = (case.input)(device, case.batch);
    let mut step = GraphedStep::new(
        model,
        case.call_loss,
        &AdamConfig::new(),
        input.clone(),
        &GraphedConfig::new(),
    )
    .expect("capture");
    let loss = step.run(input, 1e-4).expect("whole step");
    device.sync().expect("sync");
    let elapsed = started.elapsed().as_secs_f64() * 1e6;
    drop((loss, step));
    eprintln!("# {label}: first step {:.2} s", elapsed / 1e6);
    // After the measurement: the whole step's value check, as `whole_step` rows have it.
    let check = options
        .check
        .then(|| Check::Steps(check(case, Mode::WholeStep(false), label, device, options)));
    Row {
        framework: "burn",
        model: case.name.clone(),
        dtype: options.dtype.clone(),
        mode: Mode::FirstStep.label(),
        median_us: elapsed,
        p10_us: elapsed,
        p90_us: elapsed,
        reserved_mib: reserved(device).saturating_sub(before) as f64 / (1024.0 * 1024.0),
        fusion_removed: options.fusion_removed.clone(),
        check,
        expect_failure: false,
        autotune_unmeasured: 0,
        single: true,
        ranks: None,
        graph_kernel_nodes: None,
    }
}

/// A `GraphedStep` of `model` with burn's Adam, captured on `sample` with `mode`'s fault.
fn whole_step<M, I>(
    model: M,
    loss: fn(&M, I) -> Tensor<1>,
    sample: &I,
    mode: Mode,
) -> GraphedStep<M, I>
where
    M: Module,
    I: TensorGroup + Clone,
{
    let _fault = burn_graphed::testing::inject(mode.fault());
    GraphedStep::new(
        model,
        loss,
        &AdamConfig::new(),
        sample.clone(),
        &GraphedConfig::new(),
    )
    .expect("capture")
}

/// [`check_steps`]'s counterpart for a whole-step `mode`: the same steps through a
/// `GraphedStep` with burn's Adam.
fn whole_step_check_steps<M, I>(
    model: M,
    loss: fn(&M, I) -> Tensor<1>,
    inputs: &[I],
    mode: Mode,
) -> (Vec<f64>, Vec<(ParamId, TensorData)>)
where
    M: Module,
    I: TensorGroup + Clone,
{
    let mut step = whole_step(model, loss, &inputs[0], mode);
    let losses = (0..CHECK_STEPS)
        .map(|i| {
            let loss = step
                .run(inputs[i % inputs.len()].clone(), CHECK_LR)
                .expect("whole step");
            loss.into_data().iter::<f64>().next().expect("a loss")
        })
        .collect();
    (losses, param_values(&step.module()).expect("read back"))
}

/// Panics unless the timed steps' trained parameters read back, all finite: a row whose steps
/// did not run is not a result.
///
/// cubecl 0.11 skips a launch whose input buffer carries an earlier launch's failure and
/// passes the failure on to what it writes (cubecl-cuda `ExecuteScope`), and a read of such a
/// buffer fails. The skipped launches still return at once, so a run whose kernels were
/// skipped times nothing but the host's queueing: on an H100 the eager bf16 CNN's steps
/// launched 126 kernels of which 114 came back without a measurement, which is what a
/// skipped launch leaves (BENCHMARKS.md, "The CNN in bf16"). This read is where such a run shows.
///
/// Its own phase: the kernels the read launches belong to no timed step.
fn assert_ran<M: Module>(model: &M, label: &str) {
    trace_phase("read back");
    let values = match param_values(model) {
        Ok(values) => values,
        Err(error) => panic!(
            "{label}: not a result: the trained parameters do not read back ({error}); \
             cubecl skipped or failed launches that wrote them, so the timed steps did not run"
        ),
    };
    if let Err(error) = require_finite(&values) {
        panic!("{label}: not a result: after the timed steps, {error}");
    }
}

/// Steps of the value check.
const CHECK_STEPS: usize = 4;
/// The value check's learning rate: large enough that one Adam step (about `lr` per element)
/// moves a `bf16` parameter of magnitude 1 by a few units in the last place (the timed runs'
/// 1e-4 would not move it at all).
const CHECK_LR: f64 = 1e-2;

/// The seed of the value check's model and batches: every process starts its check from the
/// same draws, so a failure can be run again, and a bf16 run can be set beside an f32 run of the
/// same model (`BURN_GRAPHED_CHECK_DUMP`).
const CHECK_SEED: u64 = 0x5eed;

/// Gives every float parameter that holds one value throughout (a layer norm's gain of ones and
/// bias of zeros) random values around it (uniform, within half the value's magnitude or 0.5,
/// whichever is larger), from the device's seeded generator. At that start the transformer's loss, the mean
/// square of a layer norm's output with unit gain and zero bias, is 1 for any input: its first
/// step's gradients upstream of that norm are rounding noise, which Adam scales to whole steps,
/// so two runs that round differently part by a step where the check needs them to agree.
/// Random gains and biases make the loss depend on the input.
struct Unconstant;

impl ModuleMapper for Unconstant {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let require_grad = param.is_require_grad();
        param.map(|tensor| {
            let values: Vec<f32> = tensor.to_data().iter::<f32>().collect();
            if values.len() < 2 || values.iter().any(|&v| v != values[0]) {
                return tensor;
            }
            let spread = f64::from(values[0].abs().max(1.0)) * 0.5;
            let noise = Tensor::random(
                tensor.shape(),
                Distribution::Uniform(-spread, spread),
                &tensor.device(),
            );
            let fresh = Tensor::from_inner((tensor + noise).inner());
            if require_grad {
                fresh.require_grad()
            } else {
                fresh
            }
        })
    }
}

/// The value check of a graphed `mode` (the timed runs check counters, not values): from one
/// fresh model and four batches, drawn after seeding the device with [`CHECK_SEED`],
/// [`CHECK_STEPS`] steps eagerly and in `mode`, with the mode's optimizer and the same batches,
/// compared by [`StepCheck`] (parameters after the steps, every step's loss). Catches a wrong
/// update (a kernel that indexed a padded buffer as dense updated other elements), a missed
/// one, and a forward that read stale parameters or a stale batch. With
/// `BURN_GRAPHED_CHECK_DUMP=DIR`, both runs' losses and small parameters go to a file in `DIR`
/// ([`dump_check`]).
fn check<M, I, O>(
    case: &Case<M, I, O>,
    mode: Mode,
    label: &str,
    device: &Device,
    options: &Options,
) -> StepCheck
where
    M: Module,
    I: TensorGroup + Clone,
    O: TensorGroup,
{
    device.seed(CHECK_SEED);
    let initial = (case.make)(device).map(&mut Unconstant);
    let inputs: Vec<I> = (0..4).map(|_| (case.input)(device, case.batch)).collect();
    let inputs = if mode.replays_capture_batch() {
        &inputs[..1]
    } else {
        inputs.as_slice()
    };
    let (eager_losses, eager) = check_steps(
        deep_copy(&initial),
        case.call,
        case.loss,
        inputs,
        mode.optimizer(),
    );
    let (graphed_losses, graphed) = match mode {
        Mode::WholeStep(_) => {
            whole_step_check_steps(deep_copy(&initial), case.call_loss, inputs, mode)
        }
        Mode::GraphedLoss(_) => graphed_check_steps(
            deep_copy(&initial),
            case.call_loss,
            |loss, _| loss,
            inputs,
            mode,
        ),
        _ => graphed_check_steps(deep_copy(&initial), case.call, case.loss, inputs, mode),
    };
    let values = |params: Vec<(ParamId, TensorData)>| -> Vec<TensorData> {
        params.into_iter().map(|(_, data)| data).collect()
    };
    let eager = values(param_values(&eager).expect("read back"));
    let graphed = values(graphed);
    if let Some(dir) = std::env::var_os("BURN_GRAPHED_CHECK_DUMP") {
        let start = values(param_values(&initial).expect("read back"));
        dump_check(
            std::path::Path::new(&dir),
            label,
            &options.dtype,
            (&eager_losses, &graphed_losses),
            (&start, &eager, &graphed),
        );
    }
    // f32 matrix products may run on TF32 tensor cores (relative error about 1e-3) in one run
    // and not the other; bf16 rounds at 2^-8.
    let noise_rel = if options.dtype == "bf16" { 2e-2 } else { 2e-3 };
    StepCheck::new(
        CHECK_LR,
        noise_rel,
        (&eager_losses, &graphed_losses),
        (&eager, &graphed),
    )
}

/// A row's value check.
enum Check {
    /// Training steps against eager steps ([`check`]).
    Steps(StepCheck),
    /// Inference outputs against eager calls ([`OutputCheck`]).
    Outputs(OutputCheck),
}

impl Check {
    fn passed(&self) -> bool {
        match self {
            Check::Steps(check) => check.passed(),
            Check::Outputs(check) => check.passed(),
        }
    }

    /// The row's JSON fields of the check (a leading comma; JSON has no infinity).
    fn json(&self) -> String {
        match self {
            Check::Steps(check) => format!(
                ", \"check_passed\": {}, \"check_param_off\": {:.4}, \"check_loss_off\": {:.3}",
                check.passed(),
                check.param_off,
                check.loss_off.min(1e9)
            ),
            Check::Outputs(check) => format!(
                ", \"check_passed\": {}, \"check_output_off\": {:.4}, \"check_output_rel\": {:.3e}, \"check_control_off\": {:.1}",
                check.passed(),
                check.off.min(1e9),
                check.max_rel.min(1e9),
                check.control_off.min(1e9)
            ),
        }
    }
}

impl std::fmt::Display for Check {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Check::Steps(check) => check.fmt(f),
            Check::Outputs(check) => check.fmt(f),
        }
    }
}

/// The value check of an inference graph: its outputs on a batch against the eager call's on
/// the same batch, element by element, each allowed [`OutputCheck::bound`] of its tensor's
/// largest magnitude; and, as the control that the bound can see a stale batch (what a graph
/// that skipped its input copy returns), the eager outputs of another batch, which must be off.
struct OutputCheck {
    /// The largest element distance, in units of its allowance (1.0 is the limit; a NaN or a
    /// count or shape mismatch is infinitely far).
    off: f64,
    /// The largest element distance relative to its tensor's largest magnitude.
    max_rel: f64,
    /// The control's largest element distance, in allowances (must be above 1.0).
    control_off: f64,
}

impl OutputCheck {
    /// The bound of an element's distance, relative to its tensor's largest magnitude. The
    /// eager call and the replay may run other kernels: the recorded call's fused blocks are
    /// autotune keys of their own, and on CUDA a key's winner may be a TF32 tensor-core
    /// candidate or a plain f32 one (the MLP's 24 f32 matmul keys on an H100: 19 tensor-core
    /// winners, 5 `gemm_None`; `benches/results/h100_smoke_96cd40d.txt`). f32: a TF32 product
    /// rounds its operands at u = 2^-11, so two such products differ by up to 2u of the
    /// magnitude of their terms; 4u = 2^-9 of the output's largest magnitude (measured on an
    /// H100: 1.7e-4, 0.09 of it). bf16: every op rounds to 2^-8 of its value, so two paths that
    /// round differently part by a unit or two, 2^-7. The control, a stale batch, is reported
    /// per row: the bench MLP's outputs of two batches differ by 1.6e-2 of their magnitude
    /// (their biases dominate), 8 times the f32 bound.
    fn bound(dtype: &str) -> f64 {
        if dtype == "bf16" {
            1.0 / 128.0
        } else {
            1.0 / 512.0
        }
    }

    fn new(
        dtype: &str,
        eager: &[TensorData],
        graphed: &[TensorData],
        stale: &[TensorData],
    ) -> Self {
        let bound = Self::bound(dtype);
        let (off, max_rel) = outputs_off(bound, eager, graphed);
        let (control_off, _) = outputs_off(bound, eager, stale);
        Self {
            off,
            max_rel,
            control_off,
        }
    }

    fn passed(&self) -> bool {
        self.off <= 1.0 && self.control_off > 1.0
    }
}

impl std::fmt::Display for OutputCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let verdict = if self.passed() { "ok" } else { "FAILED" };
        write!(
            f,
            "{verdict}: outputs off {:.3} of their allowance (largest distance {:.2e} of the \
             tensor's magnitude); a stale batch is off {:.1} (must be above 1)",
            self.off, self.max_rel, self.control_off
        )
    }
}

/// The largest element distance of `graphed` from `eager` in units of `bound` times the eager
/// tensor's largest magnitude, and relative to that magnitude: infinite for a NaN, a count, a
/// shape or a dtype that differ.
fn outputs_off(bound: f64, eager: &[TensorData], graphed: &[TensorData]) -> (f64, f64) {
    if eager.len() != graphed.len() {
        return (f64::INFINITY, f64::INFINITY);
    }
    let (mut off, mut max_rel) = (0.0f64, 0.0f64);
    for (e, g) in eager.iter().zip(graphed) {
        let values = |data: &TensorData| data.clone().try_to_vec_as::<f32>().ok();
        let (Some(ev), Some(gv)) = (values(e), values(g)) else {
            return (f64::INFINITY, f64::INFINITY);
        };
        if e.shape() != g.shape() || ev.len() != gv.len() {
            return (f64::INFINITY, f64::INFINITY);
        }
        let scale = ev.iter().fold(0.0f64, |m, &v| m.max(f64::from(v).abs()));
        // An all-zero output allows the smallest normal f32 rather than nothing.
        let scale = scale.max(f64::from(f32::MIN_POSITIVE));
        for (&a, &b) in ev.iter().zip(&gv) {
            let distance = (f64::from(a) - f64::from(b)).abs() / scale;
            let distance = if distance.is_nan() {
                f64::INFINITY
            } else {
                distance
            };
            max_rel = max_rel.max(distance);
            off = off.max(distance / bound);
        }
    }
    (off, max_rel)
}

/// The values of a call's outputs, read back (every tensor of the group, in order).
fn output_values<O: TensorGroup>(outputs: O) -> Vec<TensorData> {
    outputs
        .flatten()
        .iter()
        .map(|flat| read_flat(flat, "an output").expect("outputs read back"))
        .collect()
}

/// Parameters of at most this many elements go into a check's dump: biases and norms, where
/// a gradient's sign flipped by rounding shows first, in files that stay small.
const DUMP_MAX_ELEMENTS: usize = 4096;

/// Writes the value check of `label` in `dtype` to `DIR/check_<label>_<dtype>.json`: both runs'
/// losses and every parameter of at most [`DUMP_MAX_ELEMENTS`] elements at the start and after
/// each run (visiting order, as `f32`; a value that is not finite as `null`).
/// `benches/check_dump_compare.py` sets a bf16 dump beside an f32 one of the same model. Panics
/// where the file cannot be written: the caller asked for it.
fn dump_check(
    dir: &std::path::Path,
    label: &str,
    dtype: &str,
    (eager_losses, graphed_losses): (&[f64], &[f64]),
    (start, eager, graphed): (&[TensorData], &[TensorData], &[TensorData]),
) {
    fn numbers<T: Copy + Into<f64>>(values: impl IntoIterator<Item = T>) -> String {
        let items: Vec<String> = values
            .into_iter()
            .map(|value| {
                let value: f64 = value.into();
                if value.is_finite() {
                    format!("{value:e}")
                } else {
                    "null".to_string()
                }
            })
            .collect();
        format!("[{}]", items.join(","))
    }
    let as_f32 = |data: &TensorData| data.clone().try_to_vec_as::<f32>().expect("float values");
    let params: Vec<String> = start
        .iter()
        .zip(eager.iter().zip(graphed))
        .enumerate()
        .filter(|(_, (s, _))| s.shape().iter().product::<usize>() <= DUMP_MAX_ELEMENTS)
        .map(|(index, (s, (e, g)))| {
            format!(
                "{{\"index\":{index},\"shape\":{:?},\"start\":{},\"eager\":{},\"graphed\":{}}}",
                s.shape().iter().collect::<Vec<_>>(),
                numbers(as_f32(s)),
                numbers(as_f32(e)),
                numbers(as_f32(g))
            )
        })
        .collect();
    let json = format!(
        "{{\"label\":{label:?},\"dtype\":{dtype:?},\"lr\":{CHECK_LR:e},\"eager_losses\":{},\"graphed_losses\":{},\"params\":[{}]}}\n",
        numbers(eager_losses.iter().copied()),
        numbers(graphed_losses.iter().copied()),
        params.join(",")
    );
    std::fs::create_dir_all(dir).expect("the dump folder");
    let name = format!("check_{}_{dtype}.json", label.replace(' ', "_"));
    let path = dir.join(name);
    std::fs::write(&path, json).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    eprintln!("# {label}: check dumped to {}", path.display());
}

/// [`check_steps`] of `model` graphed with `call` in `mode`: the losses and the trained
/// parameters.
fn graphed_check_steps<M, I, O>(
    model: M,
    call: fn(&M, I) -> O,
    loss: fn(O, &I) -> Tensor<1>,
    inputs: &[I],
    mode: Mode,
) -> (Vec<f64>, Vec<(ParamId, TensorData)>)
where
    M: Module,
    I: TensorGroup + Clone,
    O: TensorGroup,
{
    let fault = burn_graphed::testing::inject(mode.fault());
    let graphed = Graphed::new(model, call, inputs[0].clone(), &mode.config()).expect("capture");
    drop(fault);
    let (losses, graphed) = check_steps(
        graphed,
        |m: &Graphed<M, I, O>, x| m.forward(x).expect("graphed call"),
        loss,
        inputs,
        mode.optimizer(),
    );
    (losses, param_values(&graphed).expect("read back"))
}

/// [`CHECK_STEPS`] untimed steps at [`CHECK_LR`]: every step's loss and the trained model.
fn check_steps<M: Module, I: Clone, O>(
    model: M,
    call: impl Fn(&M, I) -> O,
    loss_of: fn(O, &I) -> Tensor<1>,
    inputs: &[I],
    mut optimizer: Optimizer,
) -> (Vec<f64>, M) {
    let mut model = model;
    let mut losses = Vec::with_capacity(CHECK_STEPS);
    for i in 0..CHECK_STEPS {
        let input = &inputs[i % inputs.len()];
        let loss = loss_of(call(&model, input.clone()), input);
        losses.push(
            loss.clone()
                .into_data()
                .iter::<f64>()
                .next()
                .expect("a loss"),
        );
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optimizer.step(CHECK_LR, model, grads);
    }
    (losses, model)
}

/// Times training steps of `model`, called through `call`: the model moves through the
/// optimizer (`model = optim.step(lr, model, grads)`, no clone), as in a training loop. Prints
/// the host time per phase; returns the per-step times and the trained model. With
/// `data_parallel` (the `ddp_*` modes, one call per rank), the gradients are averaged across
/// the ranks before the optimizer, and every rep starts at a barrier of all ranks.
#[allow(clippy::too_many_arguments)]
fn train_steps<M: Module, I: Clone, O>(
    model: M,
    call: impl Fn(&M, I) -> O,
    loss_of: fn(O, &I) -> Tensor<1>,
    inputs: &[I],
    optimizer: &mut Optimizer,
    label: &str,
    device: &Device,
    options: &Options,
    data_parallel: Option<&DataParallel>,
) -> (Vec<f64>, Option<M>) {
    let mut model = Some(model);
    let mut phases = Phases::new(if data_parallel.is_some() {
        &DDP_PHASES
    } else {
        &STEP_PHASES
    });
    let mut step = |i: usize| {
        let Some(current) = model.take() else { return };
        let mut clock = phases.start();
        let input = &inputs[i % inputs.len()];
        let out = call(&current, input.clone());
        clock.lap(0);
        let loss = loss_of(out, input);
        clock.lap(1);
        let grads = loss.backward();
        clock.lap(2);
        let mut grads = GradientsParams::from_grads(grads, &current);
        clock.lap(3);
        if let Some(dp) = data_parallel {
            grads = dp
                .average(&current, grads)
                .expect("gradients averaged across the ranks");
            clock.lap(4);
        }
        model = Some(optimizer.step(1e-4, current, grads));
        clock.lap(clock.laps.len() - 1);
        phases.add(clock);
    };
    // Data parallel: every rank starts each rep together.
    let before_rep = || {
        if let Some(dp) = data_parallel {
            dp.ranks()
                .barrier("a rep's start")
                .expect("every rank starts the rep");
        }
    };
    let per_step = time_with(device, options, label, &before_rep, &mut step);
    eprintln!("# {label}: {phases}");
    (per_step, model)
}

/// Host time spent in each phase of a step (forward call, loss, `backward()`,
/// `GradientsParams`, optimizer step; the `ddp_*` modes add the gradient average), averaged over
/// the timed steps: where the host's time goes when a step is launch-bound. Not synchronized: a
/// phase that waits for the device (a graph replay drains fusion's queue first) also shows that
/// wait.
struct Phases {
    names: &'static [&'static str],
    total: Vec<std::time::Duration>,
    /// Steps counted (the warm-up's are not: they include kernel compilation).
    steps: u32,
    seen: usize,
}

/// The phases of a one-GPU step.
const STEP_PHASES: [&str; 5] = ["forward", "loss", "backward", "grads", "optimizer"];
/// The phases of a data-parallel step.
const DDP_PHASES: [&str; 6] = [
    "forward",
    "loss",
    "backward",
    "grads",
    "average",
    "optimizer",
];

/// The laps of one step.
struct Clock {
    last: Instant,
    laps: Vec<std::time::Duration>,
}

impl Clock {
    fn lap(&mut self, phase: usize) {
        let now = Instant::now();
        self.laps[phase] += now - self.last;
        self.last = now;
    }
}

impl Phases {
    fn new(names: &'static [&'static str]) -> Self {
        Phases {
            names,
            total: vec![std::time::Duration::ZERO; names.len()],
            steps: 0,
            seen: 0,
        }
    }

    fn start(&self) -> Clock {
        Clock {
            last: Instant::now(),
            laps: vec![std::time::Duration::ZERO; self.names.len()],
        }
    }

    fn add(&mut self, clock: Clock) {
        self.seen += 1;
        if self.seen <= WARM_UP {
            return;
        }
        for (total, lap) in self.total.iter_mut().zip(clock.laps) {
            *total += lap;
        }
        self.steps += 1;
    }
}

impl std::fmt::Display for Phases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "host us per step:")?;
        for (name, total) in self.names.iter().zip(&self.total) {
            let us = total.as_secs_f64() * 1e6 / f64::from(self.steps.max(1));
            write!(f, " {name} {us:.0}")?;
        }
        Ok(())
    }
}

/// Untimed steps before the timed reps.
const WARM_UP: usize = 20;

/// Warm-up ([`WARM_UP`] steps), then `reps` timed reps of `steps` steps; per-step microseconds
/// per rep.
fn time(device: &Device, options: &Options, label: &str, step: &mut dyn FnMut(usize)) -> Vec<f64> {
    time_with(device, options, label, &|| {}, step)
}

/// [`time`], calling `before_rep` before each rep's clock starts.
fn time_with(
    device: &Device,
    options: &Options,
    label: &str,
    before_rep: &dyn Fn(),
    step: &mut dyn FnMut(usize),
) -> Vec<f64> {
    trace_phase("warm-up");
    for i in 0..WARM_UP {
        step(i);
    }
    device.sync().expect("sync");
    #[cfg(feature = "host-profile")]
    let _profile = options
        .host_profile
        .as_deref()
        .map(|file| host_profile::Profile::start(file, label));
    #[cfg(not(feature = "host-profile"))]
    let _ = (label, &options.host_profile);
    // The timed steps are the profiler's range (`ncu --profile-from-start off`, `nsys
    // --capture-range=cudaProfilerApi`): warm-up, capture and value check stay outside.
    let _range = profiler_range::Range::start();
    trace_phase("timed");
    (0..options.reps)
        .map(|_| {
            before_rep();
            let start = Instant::now();
            for i in 0..options.steps {
                step(i);
            }
            device.sync().expect("sync");
            start.elapsed().as_secs_f64() * 1e6 / options.steps as f64
        })
        .collect()
}

fn bench<M, I, O>(case: Case<M, I, O>, device: &Device, options: &Options)
where
    M: Module,
    I: TensorGroup + Clone,
    O: TensorGroup,
{
    for &mode in selected_modes(options) {
        let mut row = run(&case, mode, device, options);
        if !case.variant.is_empty() {
            // One short string per run (a run is a process of its own): leaked for the row's
            // `&'static str`.
            row.mode = Box::leak(format!("{}{}", row.mode, case.variant).into_boxed_str());
        }
        row.print();
        if let Some(failure) = row.check_failure() {
            eprintln!("# {} {}: {failure}", row.model, row.mode);
            std::process::exit(CHECK_FAILED_EXIT);
        }
    }
}

/// The exit status of a run whose value check failed (it printed its failure row).
const CHECK_FAILED_EXIT: i32 = 3;

/// The Burn modes `--modes` names, in its order and as often as it names them (PyTorch-only
/// modes are skipped): an A/B of two modes can alternate them (`a,b,b,a`) so that the drift
/// of the machine's speed during a run falls on both alike.
fn selected_modes(options: &Options) -> impl Iterator<Item = &'static Mode> + '_ {
    options
        .modes
        .iter()
        .filter_map(|label| MODES.iter().find(|mode| mode.label() == label))
}

/// Runs every (model, mode) pair of `options` in a child process of its own (this binary with
/// `--in-process`, one model and one mode), its output passed through; exits with the first
/// failing child's status after the remaining runs.
fn run_isolated(options: &Options) {
    let exe = std::env::current_exe().expect("the bench binary's own path");
    let mut failed = None;
    for model in &options.models {
        for mode in selected_modes(options) {
            let mut command = std::process::Command::new(&exe);
            command.args(["--in-process", "--models", model, "--modes", mode.label()]);
            command.args(["--dtype", &options.dtype]);
            command.args(["--steps", &options.steps.to_string()]);
            command.args(["--reps", &options.reps.to_string()]);
            command.args(["--ranks", &options.ranks.to_string()]);
            command.args(["--tf32", if options.tf32 { "on" } else { "off" }]);
            if !options.check {
                command.arg("--no-check");
            }
            if let Some(file) = &options.host_profile {
                command.args(["--host-profile", file]);
            }
            if let Some(file) = &options.kernel_trace {
                command.args(["--kernel-trace", file]);
            }
            let status = command.status().expect("spawning a bench run");
            if !status.success() {
                eprintln!("# {model} {}: run failed ({status})", mode.label());
                if status.code() != Some(CHECK_FAILED_EXIT) {
                    // A run that ended before its row: a failure row, so that the report shows
                    // it (the model as `--models` names it).
                    println!(
                        "{{\"framework\": \"burn\", \"model\": \"{model}\", \"dtype\": \"{}\", \"tf32\": {}, \"mode\": \"{}\", \"error\": \"run failed ({status}) before its row: see the log\"}}",
                        options.dtype,
                        options.tf32,
                        mode.label()
                    );
                }
                failed.get_or_insert(status.code().unwrap_or(1));
            }
        }
    }
    if let Some(code) = failed {
        std::process::exit(code);
    }
}

/// Names the phase of the run that the next kernel launches (`--kernel-trace`) and warnings
/// ([`warn_log`]) belong to. Inside `capture`, burn-graphed's own announcements name its
/// phases (`capture: forward warm-up`, `capture: forward capture`, ...).
fn trace_phase(name: &'static str) {
    warn_log::set_phase(name);
}

/// Removes the built-in fusion optimizations named in `names` (comma-separated), before the
/// first tensor operation starts burn's fusion service. Panics on a name burn does not know.
fn remove_fusion_optimizations(names: &str) {
    for name in names.split(',').filter(|name| !name.is_empty()) {
        #[cfg(feature = "cube")]
        {
            assert!(
                burn_cubecl::fusion::BUILTIN_NAMES.contains(&name),
                "BURN_GRAPHED_FUSION_REMOVE: {name} is none of burn's fusion optimizations {:?}",
                burn_cubecl::fusion::BUILTIN_NAMES
            );
            burn_cubecl::fusion::remove(name)
                .expect("fusion optimizations removed before the first tensor operation");
        }
        #[cfg(not(feature = "cube"))]
        panic!("BURN_GRAPHED_FUSION_REMOVE={name}: this build has no fusion backend");
    }
}

/// `--check-cost`: the host time of one `ComputeClient::check` on a written buffer (what
/// burn-graphed asks after each copy into a graph's buffer and after each fused optimizer
/// step): 30 batches of 2000 calls after 2000 warm-up calls, printed as the median, lowest and
/// highest batch's time per call.
fn check_cost() {
    #[cfg(feature = "cube")]
    {
        use burn::backend::Cube;
        #[cfg(feature = "cuda")]
        let device = Device::cuda(0);
        #[cfg(not(feature = "cuda"))]
        let device = Device::default();
        let tensor = Tensor::<1>::ones([1024], &device);
        let fused = tensor
            .try_into_primitive::<Cube>()
            .expect("a tensor of burn's cubecl backend");
        let cube = fused
            .client
            .resolve_tensor_float::<burn_cubecl::CubeBackend>(fused.clone());
        let check = || {
            cube.client
                .check([&cube.handle])
                .expect("a written buffer checks");
        };
        (0..2000).for_each(|_| check());
        let mut per_call: Vec<f64> = (0..30)
            .map(|_| {
                let start = Instant::now();
                (0..2000).for_each(|_| check());
                start.elapsed().as_nanos() as f64 / 2000.0
            })
            .collect();
        per_call.sort_by(f64::total_cmp);
        println!(
            "# ComputeClient::check on one written buffer: median {:.0} ns per call [{:.0}-{:.0}] \
             (30 batches of 2000)",
            per_call[per_call.len() / 2],
            per_call[0],
            per_call[per_call.len() - 1]
        );
    }
    #[cfg(not(feature = "cube"))]
    panic!("--check-cost needs a cubecl backend (`cuda` or `wgpu`)");
}

fn main() {
    warn_log::install();
    let options = options();
    // Before any device exists: cubecl fixes the setting when it creates the CUDA device.
    burn_graphed::allow_tf32(options.tf32).expect("--tf32 before any device");
    if options.check_cost {
        check_cost();
        return;
    }
    let runs = options.models.len() * selected_modes(&options).count();
    if !options.in_process && runs > 1 {
        run_isolated(&options);
        return;
    }
    remove_fusion_optimizations(&options.fusion_removed);
    if let Some(dir) = std::env::var_os("BURN_GRAPHED_DOT_DIR") {
        burn_graphed::write_graphs_as_dot(Some(dir.into()));
    }
    // Built without `cuda` (a smoke run of the bench itself), the default device.
    #[cfg(feature = "cuda")]
    let mut base = Device::cuda(0);
    #[cfg(not(feature = "cuda"))]
    let mut base = Device::default();
    if options.dtype == "bf16" {
        base.configure(FloatDType::BF16)
            .expect("bf16 before any tensor");
    }
    let device = base.autodiff();
    for model in &options.models {
        match model.as_str() {
            // `mlpcol`: every weight stored as PyTorch stores it, `[d_output, d_input]`
            // (`LinearLayout::Col`): a batch-1 call is a vector times a column-major matrix,
            // which cubecl's gemv kernels take best, where the row-major default has no good
            // kernel (burn-cubecl's matmul autotune priorities).
            "mlp" | "mlp256" | "mlpcol" => {
                let batch = if model == "mlp256" { 256 } else { 32 };
                let (name, make): (String, fn(&Device) -> Mlp) = if model == "mlpcol" {
                    ("mlp 8x256 col b32".into(), |d| mlp_of(LinearLayout::Col, d))
                } else {
                    (format!("mlp 8x256 b{batch}"), |d| {
                        mlp_of(LinearLayout::Row, d)
                    })
                };
                bench(
                    Case {
                        name,
                        make,
                        call: mlp_forward,
                        loss: mean_square_of,
                        call_loss: |m, x| mean_square(mlp_forward(m, x)),
                        input: |d, rows| Tensor::random([rows, 256], Distribution::Default, d),
                        batch,
                        variant: "",
                    },
                    &device,
                    &options,
                );
            }
            "mlp_fused" => bench(
                Case {
                    name: "mlp 8x256 b32".into(),
                    make: |d| FusedMlp {
                        layers: mlp_of(LinearLayout::Row, d)
                            .layers
                            .into_iter()
                            .map(Into::into)
                            .collect(),
                    },
                    call: fused_mlp_forward,
                    loss: mean_square_of,
                    call_loss: |m, x| mean_square(fused_mlp_forward(m, x)),
                    input: |d, rows| Tensor::random([rows, 256], Distribution::Default, d),
                    batch: 32,
                    variant: "_fused_layers",
                },
                &device,
                &options,
            ),
            "transformer" => bench(
                Case {
                    name: "transformer 2x256 s128 b8".into(),
                    make: |d| Encoder {
                        encoder: TransformerEncoderConfig::new(256, 1024, 8, 2)
                            .with_dropout(0.0)
                            .init(d),
                    },
                    call: encoder_forward,
                    loss: mean_square_of,
                    call_loss: |m, x| mean_square(encoder_forward(m, x)),
                    input: |d, rows| Tensor::random([rows, 128, 256], Distribution::Default, d),
                    batch: 8,
                    variant: "",
                },
                &device,
                &options,
            ),
            "transformer_fused" => bench(
                Case {
                    name: "transformer 2x256 s128 b8".into(),
                    make: |d| FusedEncoder {
                        encoder: burn_graphed::nn::TransformerEncoder::from_burn(
                            TransformerEncoderConfig::new(256, 1024, 8, 2)
                                .with_dropout(0.0)
                                .init(d),
                            1e-5,
                        ),
                    },
                    call: fused_encoder_forward,
                    loss: mean_square_of,
                    call_loss: |m, x| mean_square(fused_encoder_forward(m, x)),
                    input: |d, rows| Tensor::random([rows, 128, 256], Distribution::Default, d),
                    batch: 8,
                    variant: "_fused_layers",
                },
                &device,
                &options,
            ),
            "cnn" => bench(
                Case {
                    name: "cnn 2conv b32 32x32".into(),
                    make: make_cnn,
                    call: cnn_forward,
                    loss: mean_square_of,
                    call_loss: |m, x| mean_square(cnn_forward(m, x)),
                    input: cnn_input,
                    batch: 32,
                    variant: "",
                },
                &device,
                &options,
            ),
            "cnn_fused" => bench(
                Case {
                    name: "cnn 2conv b32 32x32".into(),
                    make: |d| {
                        let Cnn {
                            conv1,
                            conv2,
                            pool,
                            head,
                        } = make_cnn(d);
                        FusedCnn {
                            conv1: conv1.into(),
                            conv2: conv2.into(),
                            pool,
                            head: head.into(),
                        }
                    },
                    call: fused_cnn_forward,
                    loss: mean_square_of,
                    call_loss: |m, x| mean_square(fused_cnn_forward(m, x)),
                    input: cnn_input,
                    batch: 32,
                    variant: "_fused_layers",
                },
                &device,
                &options,
            ),
            "lm" => bench(
                Case {
                    name: format!("lm 2x256 s{LM_LENGTH} b{LM_BATCH} v{LM_VOCAB}"),
                    make: make_lm,
                    call: lm_forward,
                    loss: lm_loss_of,
                    call_loss: |m, batch| {
                        let targets = (batch.0.clone(), batch.1.clone(), batch.2.clone());
                        lm_loss_of(lm_forward(m, batch), &targets)
                    },
                    input: lm_batch,
                    batch: LM_BATCH,
                    variant: "",
                },
                &device,
                &options,
            ),
            "lm_fused" => bench(
                Case {
                    name: format!("lm 2x256 s{LM_LENGTH} b{LM_BATCH} v{LM_VOCAB}"),
                    make: make_fused_lm,
                    call: fused_lm_forward,
                    loss: fused_lm_loss_of,
                    call_loss: |m, batch| {
                        let targets = (batch.0.clone(), batch.1.clone(), batch.2.clone());
                        fused_lm_loss_of(fused_lm_forward(m, batch), &targets)
                    },
                    input: lm_batch,
                    batch: LM_BATCH,
                    variant: "_fused_layers",
                },
                &device,
                &options,
            ),
            other => panic!("unknown model {other}"),
        }
    }
}

/// The CUDA profiler's range around the timed steps, so that `ncu` and `nsys` profile the
/// steady state of any model without counting launches to skip (`run.sh profile`).
mod profiler_range {
    /// `cuProfilerStart` on creation, `cuProfilerStop` on drop; nothing without a profiler
    /// attached, and nothing at all off CUDA.
    pub struct Range {
        #[cfg(feature = "cuda")]
        device: Option<cudarc::driver::sys::CUdevice>,
    }

    impl Range {
        /// Starts the range on CUDA device 0's primary context (the one cubecl uses). Failures
        /// (no driver, no device) are reported and leave the run unprofiled, not failed.
        #[cfg(feature = "cuda")]
        pub fn start() -> Self {
            use cudarc::driver::{result, sys};
            let device = (|| {
                let device = result::device::get(0)?;
                // SAFETY: `device` comes from `device::get`, as `retain` requires; the
                // reference it takes is released in `drop`.
                let context = unsafe { result::primary_ctx::retain(device) }?;
                // SAFETY: `context` is the device's primary context, initialized by the
                // `retain` above (and by cubecl before it) and alive until that `release`.
                unsafe { result::ctx::set_current(context) }?;
                // SAFETY: the calling thread has a current context (set above), the one
                // requirement of `cuProfilerStart`.
                unsafe { sys::cuProfilerStart() }.result()?;
                Ok::<_, result::DriverError>(device)
            })();
            match device {
                Ok(device) => Self {
                    device: Some(device),
                },
                Err(error) => {
                    eprintln!("# profiler range not started: {error:?}");
                    Self { device: None }
                }
            }
        }

        #[cfg(not(feature = "cuda"))]
        pub fn start() -> Self {
            Self {}
        }
    }

    #[cfg(feature = "cuda")]
    impl Drop for Range {
        fn drop(&mut self) {
            use cudarc::driver::{result, sys};
            if let Some(device) = self.device {
                // SAFETY: same thread and context as `start`, which set the context current
                // and started the range.
                let _ = unsafe { sys::cuProfilerStop() }.result();
                // SAFETY: releases the reference `start` retained on this `device`, which
                // came from `device::get`.
                let _ = unsafe { result::primary_ctx::release(device) };
            }
        }
    }
}

/// The host's stacks sampled during the timed reps of one run (`--host-profile FILE`): an
/// in-process sampling profiler, because the GPU machine has no `perf`. Appends to `FILE`, per
/// run, the functions with the most samples on the stack (inclusive) and on top (self).
#[cfg(feature = "host-profile")]
mod host_profile {
    use std::collections::{HashMap, HashSet};
    use std::io::Write;

    /// Samples per second asked of the process timer (on the H100 machine's VM it delivered
    /// about 250: the timer's resolution).
    const FREQUENCY: i32 = 4999;
    /// Functions listed per table.
    const TOP: usize = 60;

    pub struct Profile {
        guard: Option<pprof::ProfilerGuard<'static>>,
        file: String,
        label: String,
    }

    impl Profile {
        pub fn start(file: &str, label: &str) -> Self {
            let guard = pprof::ProfilerGuardBuilder::default()
                .frequency(FREQUENCY)
                .blocklist(&["libc", "libgcc", "pthread", "vdso"])
                .build()
                .expect("host profiler");
            Self {
                guard: Some(guard),
                file: file.into(),
                label: label.into(),
            }
        }
    }

    /// A symbol's name without its hash suffix, cut to a readable length.
    fn short(name: &str) -> String {
        let name = match name.rfind("::h") {
            Some(at) if name.len() - at == 19 => &name[..at],
            _ => name,
        };
        name.chars().take(150).collect()
    }

    impl Drop for Profile {
        fn drop(&mut self) {
            let Some(guard) = self.guard.take() else {
                return;
            };
            let report = guard.report().build().expect("host profile report");
            drop(guard);
            let mut total = 0isize;
            let mut inclusive: HashMap<String, isize> = HashMap::new();
            let mut own: HashMap<String, isize> = HashMap::new();
            let mut threads: HashMap<String, isize> = HashMap::new();
            for (frames, count) in &report.data {
                total += count;
                *threads.entry(frames.thread_name.clone()).or_default() += count;
                // Frames run from the sampled function (first) to `main` (last); each frame
                // lists its inlined functions innermost first.
                let names: Vec<String> = frames
                    .frames
                    .iter()
                    .flat_map(|frame| frame.iter().map(|symbol| short(&symbol.name())))
                    .collect();
                if let Some(top) = names.first() {
                    *own.entry(top.clone()).or_default() += count;
                }
                let mut seen = HashSet::new();
                for name in names {
                    if seen.insert(name.clone()) {
                        *inclusive.entry(name).or_default() += count;
                    }
                }
            }
            let table = |counts: HashMap<String, isize>| {
                let mut rows: Vec<_> = counts.into_iter().collect();
                rows.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
                rows.truncate(TOP);
                rows.into_iter()
                    .map(|(name, count)| {
                        let share = 100.0 * count as f64 / total.max(1) as f64;
                        format!("{share:6.2}% {count:7} {name}\n")
                    })
                    .collect::<String>()
            };
            let text = format!(
                "## {}: {total} samples ({FREQUENCY} Hz asked; the process timer may deliver fewer)\n### threads\n{}### inclusive\n{}### self\n{}\n",
                self.label,
                table(threads),
                table(inclusive),
                table(own)
            );
            let mut file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.file)
                .expect("host profile file");
            file.write_all(text.as_bytes()).expect("host profile write");
        }
    }
}

/// Warnings of the libraries under the bench (cubecl, burn) on stderr, each with the phase of
/// the run it came in (`# WARN [capture] target: first line`).
///
/// Why: cubecl's autotuner says only there that it "measured no candidate" for a key and
/// decided one unmeasured: what happens to a key first met inside a graph recording, where
/// profiling is refused. The decision (the first candidate that launches, often the slowest,
/// e.g. the direct convolution for a weight gradient) is kept for the rest of the process, and
/// its autotune log (`BURN_GRAPHED_AUTOTUNE_LOG`) leaves it out. Each row counts them
/// (`autotune_unmeasured`).
mod warn_log {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// The run's phase: set by `trace_phase`, refined by burn-graphed's capture announcements.
    static PHASE: Mutex<String> = Mutex::new(String::new());
    static UNMEASURED: AtomicUsize = AtomicUsize::new(0);
    /// burn-graphed announces each capture phase with a debug event of this target.
    const CAPTURE_TARGET: &str = "burn_graphed::capture";

    struct Warnings;

    impl log::Log for Warnings {
        fn enabled(&self, metadata: &log::Metadata) -> bool {
            metadata.level() <= log::Level::Warn || metadata.target() == CAPTURE_TARGET
        }

        fn log(&self, record: &log::Record) {
            if !self.enabled(record.metadata()) {
                return;
            }
            let message = record.args().to_string();
            if record.target() == CAPTURE_TARGET {
                *PHASE.lock().unwrap_or_else(|e| e.into_inner()) = format!("capture: {message}");
                return;
            }
            if message.contains("measured no candidate") {
                UNMEASURED.fetch_add(1, Ordering::Relaxed);
            }
            // One per launch `--kernel-trace` could not time (its report counts them).
            if message.starts_with("Skipped timing a launch") {
                return;
            }
            // An unmeasured decision's message goes on with every candidate's outcome (its
            // error names why it was not measured): kept whole, on one line. (A cap of 6000
            // characters cut the matmul sets' lists, about 30 candidates, short.)
            let (lines, width) = if message.contains("measured no candidate") {
                (usize::MAX, 50_000)
            } else {
                (1, 400)
            };
            let text: String = message
                .lines()
                .take(lines)
                .collect::<Vec<_>>()
                .join(" | ")
                .chars()
                .take(width)
                .collect();
            eprintln!(
                "# {} [{}] {}: {text}",
                record.level(),
                phase(),
                record.target()
            );
        }

        fn flush(&self) {}
    }

    /// Installs the logger (once per process; a second call changes nothing).
    pub fn install() {
        if log::set_logger(&Warnings).is_ok() {
            log::set_max_level(log::LevelFilter::Warn);
        }
    }

    /// Starts phase `name`. Debug events reach the logger only in `setup` and `capture` (where
    /// burn-graphed announces its phases): every `log::debug!` of the libraries asks the logger
    /// whether it is enabled while the level allows it, which the timed steps should not pay.
    pub fn set_phase(name: &str) {
        *PHASE.lock().unwrap_or_else(|e| e.into_inner()) = name.to_string();
        log::set_max_level(match name {
            "setup" | "capture" => log::LevelFilter::Debug,
            _ => log::LevelFilter::Warn,
        });
    }

    /// The current phase.
    pub fn phase() -> String {
        PHASE.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Autotune decisions taken unmeasured so far in this process.
    pub fn unmeasured() -> usize {
        UNMEASURED.load(Ordering::Relaxed)
    }
}

/// Every kernel a run launches, with its device time (`--kernel-trace FILE`, backends with
/// cubecl): a cubecl launch observer that asks for each launch to be timed on the device
/// without waiting (events in the stream, read after the run). Appends per run: the kernels
/// launched while a graph recorded (in order; burn-graphed announces its capture phases, see
/// [`warn_log`]), and per phase (setup, the capture's warm-ups, recordings and validation,
/// warm-up, timed, read back, check) each kernel's launches and device time. Launches without
/// a time are counted apart: a recorded launch cannot be timed, nor one that failed or that cubecl
/// skipped because an input carries an earlier failure (an H100's eager bf16 CNN: 114 of the
/// 126 launches of its timed steps; see [`assert_ran`](super::assert_ran)), so "untimed" does
/// not mean "recorded". The timing events cost the host a round trip per launch: a traced
/// run's step times are not results.
#[cfg(feature = "cube")]
mod kernel_trace {
    use std::collections::HashMap;
    use std::io::Write;
    use std::sync::{Arc, Mutex, OnceLock};

    use burn_cubecl::cubecl::config::{TypeNameFormatLevel, type_name_format};
    use burn_cubecl::cubecl::future::block_on;
    use burn_cubecl::cubecl::logging::{
        Duration, LaunchObservation, LaunchObserver, ProfileDuration, TimingMethod, TimingRequest,
    };

    /// One launch: the phase it happened in, the kernel, and its measurement if one was taken.
    struct Launch {
        phase: String,
        kernel: &'static str,
        profile: Option<ProfileDuration>,
        duration: Option<Duration>,
    }

    #[derive(Default)]
    struct Recorder {
        launches: Mutex<Vec<Launch>>,
    }

    impl Recorder {
        /// Applies `f` to the last launch of `kernel` that has no measurement yet.
        fn with_untimed(&self, kernel: &str, f: impl FnOnce(&mut Launch)) {
            let mut launches = self.launches.lock().unwrap();
            if let Some(launch) = launches
                .iter_mut()
                .rev()
                .find(|l| l.kernel == kernel && l.profile.is_none() && l.duration.is_none())
            {
                f(launch);
            }
        }
    }

    impl LaunchObserver for Recorder {
        fn launched(&self, kernel: &'static str) {
            let phase = super::warn_log::phase();
            self.launches.lock().unwrap().push(Launch {
                phase,
                kernel,
                profile: None,
                duration: None,
            });
        }

        fn timing(&self) -> TimingRequest {
            TimingRequest::Deferred
        }

        // Called on the launching thread right after `launched`: the measurement belongs to
        // the last launch of that kernel that has none.
        fn profiled(&self, kernel: &'static str, profile: ProfileDuration) {
            self.with_untimed(kernel, |launch| launch.profile = Some(profile));
        }

        fn timed(&self, kernel: &'static str, duration: Duration, _method: TimingMethod) {
            self.with_untimed(kernel, |launch| launch.duration = Some(duration));
        }
    }

    static RECORDER: OnceLock<Arc<Recorder>> = OnceLock::new();
    /// The phases (as burn-graphed announces them) in which launches are recorded, not run.
    const RECORDINGS: [&str; 2] = ["capture: forward capture", "capture: backward capture"];

    /// Traces launches until dropped, then appends the report of run `label` to `file`.
    pub struct Trace {
        _observation: LaunchObservation,
        file: String,
        label: String,
    }

    impl Trace {
        pub fn start(file: &str, label: &str) -> Self {
            let recorder = RECORDER.get_or_init(Default::default).clone();
            recorder.launches.lock().unwrap().clear();
            Self {
                _observation: LaunchObservation::new(recorder),
                file: file.into(),
                label: label.into(),
            }
        }
    }

    /// A kernel's type name without module paths (cubecl's `Balanced` format) nor the element
    /// type placeholders every matmul carries, cut to a readable length.
    fn short(kernel: &str) -> String {
        type_name_format(kernel, TypeNameFormatLevel::Balanced)
            .split(" | ")
            .filter(|part| !part.starts_with("Dynamic") && !part.starts_with("__"))
            .collect::<Vec<_>>()
            .join(" | ")
            .chars()
            .take(200)
            .collect()
    }

    impl Drop for Trace {
        fn drop(&mut self) {
            let Some(recorder) = RECORDER.get() else {
                return;
            };
            let launches = std::mem::take(&mut *recorder.launches.lock().unwrap());
            let mut out = format!("## {}: {} launches\n", self.label, launches.len());
            // (phase, kernel) -> (launches, device microseconds, launches without a time)
            let mut table: HashMap<(String, String), (usize, f64, usize)> = HashMap::new();
            let mut phases: Vec<String> = Vec::new();
            let mut recorded: Vec<(String, usize)> = Vec::new();
            for launch in launches {
                let us = match (launch.profile, launch.duration) {
                    (Some(profile), _) => block_on(profile.resolve())
                        .map(|ticks| ticks.duration().as_secs_f64() * 1e6),
                    (None, Some(duration)) => Some(duration.as_secs_f64() * 1e6),
                    (None, None) => None,
                };
                if !phases.contains(&launch.phase) {
                    phases.push(launch.phase.clone());
                }
                let kernel = short(launch.kernel);
                let is_recorded = RECORDINGS.contains(&launch.phase.as_str());
                if is_recorded {
                    match recorded.last_mut() {
                        Some((last, n)) if *last == kernel => *n += 1,
                        _ => recorded.push((kernel.clone(), 1)),
                    }
                }
                let entry = table.entry((launch.phase, kernel)).or_default();
                entry.0 += 1;
                entry.1 += us.unwrap_or(0.0);
                if us.is_none() {
                    entry.2 += 1;
                }
            }
            let count: usize = recorded.iter().map(|(_, n)| n).sum();
            out += &format!("### recorded (launched while a graph recorded): {count}\n");
            for (kernel, n) in &recorded {
                out += &format!("    {n:>4}x  {kernel}\n");
            }
            for phase in phases {
                let mut rows: Vec<_> = table.iter().filter(|((p, _), _)| *p == phase).collect();
                rows.sort_by(|a, b| b.1.1.total_cmp(&a.1.1));
                let total: f64 = rows.iter().map(|(_, v)| v.1).sum();
                let n: usize = rows.iter().map(|(_, v)| v.0).sum();
                out += &format!("### {phase}: {n} launches, {total:.1} us timed\n");
                for ((_, kernel), (n, us, untimed)) in rows {
                    out += &format!("    {us:>10.1} us  {n:>5}x  ({untimed} untimed)  {kernel}\n");
                }
            }
            let mut file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.file)
                .expect("kernel trace file");
            file.write_all(out.as_bytes())
                .expect("kernel trace written");
        }
    }
}
