//! The value checks of the timed runs: training steps against eager steps, inference outputs
//! against eager calls, and the read-back that shows a run's steps ran.

use super::*;

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
pub(crate) fn assert_ran<M: Module>(model: &M, label: &str) {
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
pub(crate) const CHECK_STEPS: usize = 4;
/// The value check's learning rate: large enough that one Adam step (about `lr` per element)
/// moves a `bf16` parameter of magnitude 1 by a few units in the last place (the timed runs'
/// 1e-4 would not move it at all).
pub(crate) const CHECK_LR: f64 = 1e-2;

/// The seed of the value check's model and batches: every process starts its check from the
/// same draws, so a failure can be run again, and a bf16 run can be set beside an f32 run of the
/// same model (`BURN_GRAPHED_CHECK_DUMP`).
pub(crate) const CHECK_SEED: u64 = 0x5eed;

/// Gives every float parameter that holds one value throughout (a layer norm's gain of ones and
/// bias of zeros) random values around it (uniform, within half the value's magnitude or 0.5,
/// whichever is larger), from the device's seeded generator. At that start the transformer's loss, the mean
/// square of a layer norm's output with unit gain and zero bias, is 1 for any input: its first
/// step's gradients upstream of that norm are rounding noise, which Adam scales to whole steps,
/// so two runs that round differently part by a step where the check needs them to agree.
/// Random gains and biases make the loss depend on the input.
pub(crate) struct Unconstant;

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
pub(crate) fn check<M, I, O>(
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
pub(crate) enum Check {
    /// Training steps against eager steps ([`check`]).
    Steps(StepCheck),
    /// Inference outputs against eager calls ([`OutputCheck`]).
    Outputs(OutputCheck),
}

impl Check {
    pub(crate) fn passed(&self) -> bool {
        match self {
            Check::Steps(check) => check.passed(),
            Check::Outputs(check) => check.passed(),
        }
    }

    /// The row's JSON fields of the check (a leading comma; JSON has no infinity).
    pub(crate) fn json(&self) -> String {
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
pub(crate) struct OutputCheck {
    /// The largest element distance, in units of its allowance (1.0 is the limit; a NaN or a
    /// count or shape mismatch is infinitely far).
    pub(crate) off: f64,
    /// The largest element distance relative to its tensor's largest magnitude.
    pub(crate) max_rel: f64,
    /// The control's largest element distance, in allowances (must be above 1.0).
    pub(crate) control_off: f64,
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
    pub(crate) fn bound(dtype: &str) -> f64 {
        if dtype == "bf16" {
            1.0 / 128.0
        } else {
            1.0 / 512.0
        }
    }

    pub(crate) fn new(
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

    pub(crate) fn passed(&self) -> bool {
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
pub(crate) fn outputs_off(bound: f64, eager: &[TensorData], graphed: &[TensorData]) -> (f64, f64) {
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
pub(crate) fn output_values<O: TensorGroup>(outputs: O) -> Vec<TensorData> {
    outputs
        .flatten()
        .iter()
        .map(|flat| read_flat(flat, "an output").expect("outputs read back"))
        .collect()
}

/// Parameters of at most this many elements go into a check's dump: biases and norms, where
/// a gradient's sign flipped by rounding shows first, in files that stay small.
pub(crate) const DUMP_MAX_ELEMENTS: usize = 4096;

/// Writes the value check of `label` in `dtype` to `DIR/check_<label>_<dtype>.json`: both runs'
/// losses and every parameter of at most [`DUMP_MAX_ELEMENTS`] elements at the start and after
/// each run (visiting order, as `f32`; a value that is not finite as `null`).
/// `benches/check_dump_compare.py` sets a bf16 dump beside an f32 one of the same model. Panics
/// where the file cannot be written: the caller asked for it.
pub(crate) fn dump_check(
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
pub(crate) fn graphed_check_steps<M, I, O>(
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

/// [`check_steps`]'s counterpart for a whole-step `mode`: the same steps through a
/// `GraphedStep` with burn's Adam.
pub(crate) fn whole_step_check_steps<M, I>(
    model: M,
    loss: fn(&M, I) -> Tensor<1>,
    inputs: &[I],
    mode: Mode,
) -> (Vec<f64>, Vec<(ParamId, TensorData)>)
where
    M: Module,
    I: TensorGroup + Clone,
{
    check_whole_steps(whole_step(model, loss, &inputs[0], mode), inputs)
}

/// [`CHECK_STEPS`] runs of `step` at [`CHECK_LR`] on `inputs` in turn: every step's loss and the
/// trained parameters (a one-GPU whole step, or a rank's data-parallel one).
pub(crate) fn check_whole_steps<M, I>(
    mut step: GraphedStep<M, I>,
    inputs: &[I],
) -> (Vec<f64>, Vec<(ParamId, TensorData)>)
where
    M: Module,
    I: TensorGroup + Clone,
{
    let losses = (0..CHECK_STEPS)
        .map(|i| {
            let loss = step
                .run(inputs[i % inputs.len()].clone(), CHECK_LR)
                .expect("whole step");
            loss_value(loss)
        })
        .collect();
    (losses, param_values(&step.module()).expect("read back"))
}

/// A loss (one element) as a number.
pub(crate) fn loss_value(loss: Tensor<1>) -> f64 {
    loss.into_data().iter::<f64>().next().expect("a loss")
}

/// [`CHECK_STEPS`] untimed steps at [`CHECK_LR`]: every step's loss and the trained model.
pub(crate) fn check_steps<M: Module, I: Clone, O>(
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
        losses.push(loss_value(loss.clone()));
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optimizer.step(CHECK_LR, model, grads);
    }
    (losses, model)
}
