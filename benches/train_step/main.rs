//! Train-step benchmark: eager Burn against graphed Burn on the same models, the counterpart of
//! `benches/torch_reference.py` (same models, math, dtype, optimizer, input rotation and timing
//! method). Built and bundled by `cargo xtask gpu-test` (or `cargo xtask bench`); run on a GPU
//! machine with `bash target/gpu-bundle/run.sh bench`, which runs both sides and writes the
//! JSON lines that `benches/report.py` turns into BENCHMARKS.md's table and plot.
//! (Long: this doc is the bench's manual, every mode and flag; the modes themselves are in
//! `modes.rs`, their timing in `timed.rs`, the value checks in `checks.rs`.)
//!
//! ```text
//! train_step [--models mlp,mlp256,mlpcol,transformer,cnn,lm,mlp_fused,mlp256_fused,transformer_fused,
//!                     lm_fused,cnn_fused]
//!            [--dtype f32|bf16] [--steps 50] [--reps 30]
//!            [--modes eager,graphed,graphed_no_input_copy,graphed_no_param_copy,graphed_static,
//!                     eager_fused_adam,graphed_fused_adam,graphed_static_fused_adam,
//!                     graphed_guarded_fused_adam,eager_multi_adam,graphed_multi_adam,
//!                     graphed_static_multi_adam,graphed_loss_static_multi_adam,
//!                     graphed_multi_adam_no_check,graphed_multi_adam_no_input_copy,
//!                     ddp_eager,ddp_graphed,ddp_whole_step,ddp_whole_step_in_graph,
//!                     ddp_whole_step_in_graph_overlap,ddp_whole_step_processes,
//!                     ddp_whole_step_in_graph_sockets,ddp_whole_step_threads_in_graph,
//!                     ddp_whole_step_threads_in_graph_overlap,
//!                     ddp_whole_step_threads_in_graph_overlap_one_stream]
//!            [--host-profile FILE] [--kernel-trace FILE] [--no-check] [--in-process]
//!            [--check-cost] [--ranks 2] [--tf32 off|on] [--conv-tiling 4x8] [--attention-blocks 16x16]
//!            [--bucket-caps 1048576x26214400]
//! ```
//!
//! `mlp_fused`, `mlp256_fused`, `transformer_fused`, `lm_fused` and `cnn_fused` are `mlp`,
//! `mlp256`, `transformer`, `lm` and `cnn` with
//! `burn_graphed::nn`'s fused layers (the same parameters); their rows carry the model's name and the mode with
//! `_fused_layers` appended (`whole_step_fused_layers`, ...), PyTorch having no such variant.
//!
//! Each (model, mode) run happens in a process of its own (this binary runs itself once per
//! pair, `--in-process` turns that off): cubecl's pools only return whole empty pages, so in one
//! process a run's reserved bytes would depend on the runs before it. Kernels and autotune
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
//! the wait for the replay's task on the device thread, the task itself (copies launched, check,
//! replay enqueued), hand-out); `inference_graphed_b1_no_check` and `inference_graphed_b1_floor`
//! are their A/B modes (no check of written buffers; nothing copied or checked, so the floor's
//! outputs are not the batch's and its value check must fail). `--host-profile FILE` (feature
//! `host-profile`, bundled by `cargo xtask gpu-test`) samples the host's stacks during each
//! run's timed steps and appends the most frequent functions to `FILE`: where the host's time
//! goes when a step is launch-bound. Sampling slows the run: its timings are not results.
//! `--kernel-trace FILE` (cubecl backends) appends every kernel each run launches, per phase
//! (setup, each phase of the capture as burn-graphed announces it, warm-up, timed, read back,
//! check) with its device time where cubecl returned one, and the kernels launched while a
//! graph recorded: eager's kernels beside the graph's, without a profiler (which does not see
//! the launches cubecl skips: see `assert_ran`). Timing every launch
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
//! operation, and each row records them as `fusion_removed`: removing one tells whether its
//! kernel is what a step waits for (BENCHMARKS.md).
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

mod checks;
mod ddp_check;
mod first_step;
#[cfg(feature = "host-profile")]
mod host_profile;
#[cfg(feature = "cube")]
mod kernel_trace;
mod models;
mod modes;
mod processes;
mod profiler_range;
mod rows;
mod timed;
mod timing;
mod warn_log;

use checks::*;
use ddp_check::*;
use first_step::*;
use models::*;
use modes::*;
use rows::*;
use timed::*;
use timing::*;

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
    /// `--conv-tiling PIXELSxCHANNELS`: every fused convolution at that tiling (diagnostic).
    conv_tiling: Option<String>,
    /// `--attention-blocks KEYSxROWS`: the attention backward's blocks on tensor cores
    /// (diagnostic).
    attention_blocks: Option<String>,
    /// `--bucket-caps FIRSTxREST`: the `_overlap` modes' buckets cut at those bytes
    /// (diagnostic).
    bucket_caps: Option<String>,
}

/// The numbers of a flag's `AxB[x...]` value (`--conv-tiling`, `--attention-blocks`,
/// `--bucket-caps`).
fn numbers(value: &str, flag: &str) -> Vec<usize> {
    value
        .split('x')
        .map(|p| {
            p.parse()
                .unwrap_or_else(|_| panic!("{flag} takes numbers, got {value}"))
        })
        .collect()
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
        conv_tiling: None,
        attention_blocks: None,
        bucket_caps: None,
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
            // Diagnostic: every fused convolution's forward and input gradient at one tiling
            // (`PIXELSxCHANNELS[xSPLITS]` per unit; the forward's summed channels split in
            // SPLITS parts, 1 if not given), to compare tilings; its rows name no tiling, so
            // keep each tiling's rows apart.
            "--conv-tiling" => {
                let parts = numbers(&value, "--conv-tiling");
                let (pixels, channels, splits) = match parts[..] {
                    [p, c] => (p, c, 1),
                    [p, c, s] => (p, c, s),
                    _ => {
                        panic!("--conv-tiling takes PIXELSxCHANNELS[xSPLITS], such as 4x8 or 1x4x8")
                    }
                };
                burn_graphed::testing::force_conv_tiling(Some((pixels, channels, splits)));
                eprintln!(
                    "# conv tiling forced: {pixels} pixels x {channels} channels per unit, {splits} splits"
                );
                options.conv_tiling = Some(value);
            }
            // Diagnostic: the attention backward's blocks on tensor cores (`KEYSxROWS`: keys per
            // block of a dQ plane, query rows per block of a dK/dV plane), where they fit; its
            // rows name no blocks, so keep each choice's rows apart.
            "--attention-blocks" => {
                let parts = numbers(&value, "--attention-blocks");
                let [keys, rows] = parts[..] else {
                    panic!("--attention-blocks takes KEYSxROWS, such as 16x16")
                };
                burn_graphed::testing::force_attention_blocks(Some((keys, rows)));
                eprintln!("# attention backward blocks forced: {keys} keys x {rows} rows");
                options.attention_blocks = Some(value);
            }
            // Diagnostic: the `_overlap` modes' buckets cut at FIRST bytes (the first bucket)
            // and REST (the others) instead of PyTorch DDP's 1 MiB and 25 MiB; its rows name no
            // caps, so keep each choice's rows apart.
            "--bucket-caps" => {
                let parts = numbers(&value, "--bucket-caps");
                let [first, rest] = parts[..] else {
                    panic!("--bucket-caps takes FIRSTxREST bytes, such as 1048576x26214400")
                };
                burn_graphed::testing::overlap_bucket_caps(Some((first, rest)));
                eprintln!("# overlap buckets cut at {first} bytes, then {rest}");
                options.bucket_caps = Some(value);
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
            if let Some(tiling) = &options.conv_tiling {
                command.args(["--conv-tiling", tiling]);
            }
            if let Some(blocks) = &options.attention_blocks {
                command.args(["--attention-blocks", blocks]);
            }
            if let Some(caps) = &options.bucket_caps {
                command.args(["--bucket-caps", caps]);
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
                        forward_input: Some(mlp_forward_batch),
                        shard: negate_odd,
                        batch,
                        variant: "",
                    },
                    &device,
                    &options,
                );
            }
            "mlp_fused" | "mlp256_fused" => {
                let batch = if model == "mlp256_fused" { 256 } else { 32 };
                bench(
                    Case {
                        name: format!("mlp 8x256 b{batch}"),
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
                        forward_input: Some(mlp_forward_batch),
                        shard: negate_odd,
                        batch,
                        variant: "_fused_layers",
                    },
                    &device,
                    &options,
                );
            }
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
                    forward_input: None,
                    shard: negate_odd,
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
                    forward_input: None,
                    shard: negate_odd,
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
                    forward_input: Some(cnn_forward_batch),
                    shard: negate_odd,
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
                    forward_input: Some(cnn_forward_batch),
                    shard: negate_odd,
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
                    forward_input: Some(lm_forward_batch),
                    shard: lm_shard,
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
                    forward_input: Some(lm_forward_batch),
                    shard: lm_shard,
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
