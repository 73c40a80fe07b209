//! # burn-graphed-testkit
//!
//! A numerical-equivalence harness for [`burn_graphed::Graphed`]: train an eager model and a
//! graphed copy side by side, from identical parameters and batches, and compare every step's
//! outputs, loss, parameter gradients and updated parameters. Put it in your own CI to prove
//! that graphing your model changes nothing.
//!
//! ```no_run
//! use burn::nn::{Linear, LinearConfig};
//! use burn::optim::AdamConfig;
//! use burn::prelude::*;
//! use burn_graphed::GraphedConfig;
//! use burn_graphed_testkit::{Tolerance, TrainingComparison, compare_training};
//!
//! #[derive(Module, Debug)]
//! struct Net {
//!     layer: Linear,
//! }
//!
//! fn forward(net: &Net, x: Tensor<2>) -> Tensor<2> {
//!     net.layer.forward(x)
//! }
//!
//! let device = Device::default().autodiff();
//! let report = compare_training(TrainingComparison {
//!     model: Net { layer: LinearConfig::new(8, 8).init(&device) },
//!     call: forward,
//!     optimizer: AdamConfig::new().init(),
//!     learning_rate: 1e-3,
//!     batch: &mut |_step| Tensor::<2>::ones([4, 8], &device),
//!     loss: |y: Tensor<2>| y.powi_scalar(2).mean(),
//!     steps: 5,
//!     graphed: GraphedConfig::new(),
//!     tolerance: Tolerance::default(),
//!     noise_step: 0.0,
//! })
//! .unwrap();
//! assert!(report.passed(), "{report}");
//! ```
#![warn(missing_docs)]

use std::fmt;

mod movement;
mod step_check;
mod tolerance;
mod whole_step;
pub use movement::ParamMovement;
pub use step_check::{ElementOff, StepCheck};
pub use tolerance::{TensorComparison, Tolerance, mantissa_bits, ulp_distance};
use tolerance::{failed, largest, values_of};
pub use whole_step::{WholeStepComparison, WholeStepReport, compare_whole_step};

use burn::module::{Module, ModuleMapper, Param};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::{Tensor, TensorData};
use burn_graphed::{Graphed, GraphedConfig, GraphedError, MultiTensorAdam, TensorGroup};

/// A whole-module optimizer step: burn's [`ModuleOptimizer`] and
/// [`burn_graphed::MultiTensorAdam`], so that one harness trains with either.
pub trait ModuleStep: Clone {
    /// `module` after one step with `grads` at learning rate `lr`.
    fn step_module<M: Module>(&mut self, lr: f64, module: M, grads: GradientsParams) -> M;
}

impl ModuleStep for ModuleOptimizer {
    fn step_module<M: Module>(&mut self, lr: f64, module: M, grads: GradientsParams) -> M {
        self.step(lr, module, grads)
    }
}

impl ModuleStep for MultiTensorAdam {
    fn step_module<M: Module>(&mut self, lr: f64, module: M, grads: GradientsParams) -> M {
        self.step(lr, module, grads)
    }
}

/// The result of [`compare_training`].
#[derive(Debug, Clone, PartialEq)]
pub struct EquivalenceReport {
    /// Every tensor compared, in order.
    pub tensors: Vec<TensorComparison>,
    /// The graphed model's counters at the end.
    pub stats: burn_graphed::GraphStats,
    /// The capture summary.
    pub summary: burn_graphed::CaptureSummary,
    /// The graphed model's shape cache at the end (captures of other batch sizes, evictions).
    pub shape_cache: burn_graphed::ShapeCacheStats,
}

impl EquivalenceReport {
    /// Whether every tensor is within tolerance.
    pub fn passed(&self) -> bool {
        self.tensors.iter().all(TensorComparison::passed)
    }

    /// Whether every tensor is bitwise equal.
    pub fn bitwise(&self) -> bool {
        self.tensors.iter().all(TensorComparison::bitwise)
    }

    /// The comparisons outside tolerance.
    pub fn failures(&self) -> impl Iterator<Item = &TensorComparison> {
        self.tensors.iter().filter(|t| !t.passed())
    }

    /// The largest ULP distance seen.
    pub fn max_ulps(&self) -> u64 {
        self.tensors.iter().map(|t| t.max_ulps).max().unwrap_or(0)
    }

    /// The comparison farthest from eager in units of its allowance
    /// ([`TensorComparison::worst`]): for a passing report, how close it came to its bound; for
    /// a negative control, how far beyond the bound its injected error is.
    pub fn worst(&self) -> Option<&TensorComparison> {
        self.tensors
            .iter()
            .max_by(|a, b| a.worst.total_cmp(&b.worst))
    }
}

impl fmt::Display for EquivalenceReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let failed = self.failures().count();
        writeln!(
            f,
            "{} tensors compared, {} outside tolerance, max ulps {}, bitwise {}, worst {:.3} of its allowance; {:?}",
            self.tensors.len(),
            failed,
            self.max_ulps(),
            self.bitwise(),
            self.worst().map_or(0.0, |t| t.worst),
            self.stats
        )?;
        for failure in self.failures().take(10) {
            writeln!(f, "  {failure}")?;
        }
        Ok(())
    }
}

/// Why [`compare_training`] or a read of the harness could not run, or what a read found
/// unusable (a mismatch between graphed and eager is a report, not an error).
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// Capturing or calling the graphed model failed.
    #[error("graphed model: {0}")]
    Graphed(#[from] GraphedError),
    /// A tensor could not be read back.
    #[error("reading {what} back: {reason}")]
    Read {
        /// What was read.
        what: String,
        /// The backend's reason.
        reason: String,
    },
    /// A parameter holds NaN or infinite values ([`require_finite`]).
    #[error("parameter {index} (visiting order) holds {count} non-finite value(s) of {len}")]
    NonFinite {
        /// The parameter's visiting index.
        index: usize,
        /// How many of its values are NaN or infinite.
        count: usize,
        /// How many values it has.
        len: usize,
    },
}

/// Everything [`compare_training`] needs.
pub struct TrainingComparison<'a, M, I, O> {
    /// The model, on an autodiff device, in training mode. The eager run trains a deep copy.
    pub model: M,
    /// The function that calls it.
    pub call: fn(&M, I) -> O,
    /// The optimizer; the graphed run gets a clone of it.
    pub optimizer: ModuleOptimizer,
    /// The learning rate.
    pub learning_rate: f64,
    /// The batch of each step (called once per step; the same batch feeds both runs). Step
    /// `usize::MAX` asks for the capture's sample batch.
    pub batch: &'a mut dyn FnMut(usize) -> I,
    /// The loss of the outputs.
    pub loss: fn(O) -> Tensor<1>,
    /// Number of optimizer steps.
    pub steps: usize,
    /// Configuration of the graphed model.
    pub graphed: GraphedConfig,
    /// How close values must be.
    pub tolerance: Tolerance,
    /// The largest move `optimizer` makes in one step from a gradient no larger than
    /// `tolerance.abs` anywhere (Adam: `learning_rate * abs / epsilon`; plain SGD:
    /// `learning_rate * abs`): parameters whose gradient is rounding noise (a key projection's
    /// bias) are allowed twice that per such step ([`ParamMovement`]). 0 allows nothing more:
    /// right where both runs share their kernels (`tolerance.norm_rel` 0) or no parameter's
    /// gradient is noise.
    pub noise_step: f64,
}

/// A copy of `module` whose parameters live in buffers of their own (a clone would share them).
pub fn deep_copy<M: Module>(module: &M) -> M {
    struct Copier;
    impl ModuleMapper for Copier {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let require_grad = param.is_require_grad();
            param.map(|tensor| {
                let copy = Tensor::from_inner(tensor.inner().mul_scalar(1.0));
                if require_grad {
                    copy.require_grad()
                } else {
                    copy
                }
            })
        }
    }
    module.clone().map(&mut Copier)
}

/// A copy of `module` with every float parameter cast to `dtype` (ids and `require_grad` kept),
/// e.g. to train a model in `bf16` on a device whose default float type is `f32`.
pub fn cast_params<M: Module>(module: &M, dtype: burn::tensor::FloatDType) -> M {
    struct Caster(burn::tensor::FloatDType);
    impl ModuleMapper for Caster {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let require_grad = param.is_require_grad();
            let dtype = self.0;
            param.map(|tensor| {
                let cast = Tensor::from_inner(tensor.inner().cast(dtype));
                if require_grad {
                    cast.require_grad()
                } else {
                    cast
                }
            })
        }
    }
    module.clone().map(&mut Caster(dtype))
}

pub(crate) fn read<const D: usize>(
    tensor: Tensor<D>,
    what: &str,
) -> Result<TensorData, HarnessError> {
    let data = tensor.try_into_data().map_err(|error| HarnessError::Read {
        what: what.to_string(),
        reason: error.to_string(),
    })?;
    materialize(data, what)
}

/// `data` with its values copied to the host now.
///
/// burn 0.22.1's cubecl backends (CUDA, wgpu) read lazily: `into_data` returns bytes that are
/// copied from the device on first access, and the device buffer can change in between.
/// burn-fusion writes a tensor's result into the buffer of an operand at its last use, so on
/// wgpu `let d = t.clone().into_data(); let u = t.add_scalar(1.0);` leaves `d` showing `u`'s
/// values (`lazy_reads_see_later_writes`); an optimizer step does that to the parameters it
/// replaces, and a graph replay writes its static buffers. Every value this harness keeps is
/// read with this, and a test that keeps a value across device work must be too.
///
/// # Errors
///
/// [`HarnessError::Read`] (named `what`) when the device-to-host copy fails.
pub fn materialize(data: TensorData, what: &str) -> Result<TensorData, HarnessError> {
    // The first access copies and caches the bytes; later accesses read the cached copy.
    data.bytes()
        .read(burn_std::Reader::new())
        .map_err(|error| HarnessError::Read {
            what: what.to_string(),
            reason: format!("{error:?}"),
        })?;
    Ok(data)
}

/// Reads `tensor` to the host now ([`materialize`]): a value to keep across device work.
///
/// # Errors
///
/// [`HarnessError::Read`] when the read fails.
pub fn host_data<const D: usize>(tensor: Tensor<D>) -> Result<TensorData, HarnessError> {
    read(tensor, "tensor")
}

/// Every float parameter of `module`, in visiting order, with its id and values (copied to
/// the host now: [`materialize`]).
///
/// # Errors
///
/// [`HarnessError::Read`] naming the first parameter (by visiting index) that could not be
/// read.
pub fn param_values<M: Module>(
    module: &M,
) -> Result<Vec<(burn::module::ParamId, TensorData)>, HarnessError> {
    struct Reader(Vec<Result<(burn::module::ParamId, TensorData), HarnessError>>);
    impl burn::module::ModuleVisitor for Reader {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let what = format!("param {}", self.0.len());
            self.0
                .push(read(param.val().inner(), &what).map(|data| (param.id, data)));
        }
    }
    let mut reader = Reader(Vec::new());
    module.visit(&mut reader);
    reader.0.into_iter().collect()
}

/// Checks that every value of `params` (as [`param_values`] reads them) is finite: trained
/// parameters that are NaN or infinite are no result to time or compare.
///
/// # Errors
///
/// [`HarnessError::NonFinite`] naming the first parameter that holds such values, and
/// [`HarnessError::Read`] when a parameter's values do not convert to `f32`.
pub fn require_finite(params: &[(burn::module::ParamId, TensorData)]) -> Result<(), HarnessError> {
    for (index, (_, data)) in params.iter().enumerate() {
        let values = data
            .try_to_vec_as::<f32>()
            .map_err(|error| HarnessError::Read {
                what: format!("param {index} as f32"),
                reason: format!("{error:?}"),
            })?;
        let count = values.iter().filter(|value| !value.is_finite()).count();
        if count > 0 {
            return Err(HarnessError::NonFinite {
                index,
                count,
                len: values.len(),
            });
        }
    }
    Ok(())
}

/// The gradient of every float parameter of `module` in `grads`, in visiting order (`None` where
/// there is none), copied to the host now ([`materialize`]).
///
/// # Errors
///
/// [`HarnessError::Read`] naming the first gradient (by parameter visiting index) that could
/// not be read.
pub fn grad_values<M: Module>(
    module: &M,
    grads: &GradientsParams,
) -> Result<Vec<Option<TensorData>>, HarnessError> {
    struct Reader<'a>(
        &'a GradientsParams,
        Vec<Result<Option<TensorData>, HarnessError>>,
    );
    impl burn::module::ModuleVisitor for Reader<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let what = format!("grad of param {}", self.1.len());
            let grad = self.0.get::<D>(param.id).map(|grad| read(grad, &what));
            self.1.push(grad.transpose());
        }
    }
    let mut reader = Reader(grads, Vec::new());
    module.visit(&mut reader);
    reader.1.into_iter().collect()
}

/// Compares every float parameter of `graphed` with `eager`'s, in visiting order: one
/// comparison per parameter named `"{what} param {index}"`, and a failing one where the two
/// modules have different numbers of parameters. A `norm_rel` of `tolerance` applies to each
/// parameter's largest value here, which is loose for parameters (one Adam step at lr 1e-3 is
/// under 1e-2 of a weight of magnitude 0.1): where the parameters before the steps are known,
/// [`ParamMovement`] bounds them by how far they moved instead.
///
/// # Errors
///
/// [`HarnessError::Read`] when a parameter cannot be read back.
pub fn compare_params<E: Module, G: Module>(
    what: &str,
    eager: &E,
    graphed: &G,
    tolerance: Tolerance,
) -> Result<Vec<TensorComparison>, HarnessError> {
    let (e_params, g_params) = (param_values(eager)?, param_values(graphed)?);
    let mut comparisons: Vec<TensorComparison> = e_params
        .iter()
        .zip(&g_params)
        .enumerate()
        .map(|(index, ((_, e), (_, g)))| {
            TensorComparison::new(format!("{what} param {index}"), e, g, tolerance)
        })
        .collect();
    if e_params.len() != g_params.len() {
        comparisons.push(failed(format!(
            "{what} params: {} eager, {} graphed",
            e_params.len(),
            g_params.len()
        )));
    }
    Ok(comparisons)
}

/// Compares every parameter gradient of `graphed` with `eager`'s, in visiting order: one
/// comparison per parameter named `"{what} grad param {index}"`, and a failing one where only
/// one of the two has a gradient (both without one is fine) or where the two modules have
/// different numbers of parameters.
///
/// # Errors
///
/// [`HarnessError::Read`] when a gradient cannot be read back.
pub fn compare_grads<E: Module, G: Module>(
    what: &str,
    (eager, eager_grads): (&E, &GradientsParams),
    (graphed, graphed_grads): (&G, &GradientsParams),
    tolerance: Tolerance,
) -> Result<Vec<TensorComparison>, HarnessError> {
    let e_grads = grad_values(eager, eager_grads)?;
    let g_grads = grad_values(graphed, graphed_grads)?;
    Ok(compare_grad_values(what, &e_grads, &g_grads, tolerance))
}

/// [`compare_grads`] on gradients already read back ([`grad_values`]).
fn compare_grad_values(
    what: &str,
    e_grads: &[Option<TensorData>],
    g_grads: &[Option<TensorData>],
    tolerance: Tolerance,
) -> Vec<TensorComparison> {
    let mut comparisons: Vec<TensorComparison> = e_grads
        .iter()
        .zip(g_grads)
        .enumerate()
        .filter_map(|(index, pair)| match pair {
            (Some(e), Some(g)) => Some(TensorComparison::new(
                format!("{what} grad param {index}"),
                e,
                g,
                tolerance,
            )),
            (None, None) => None,
            _ => Some(failed(format!(
                "{what} grad param {index}: present in one run only"
            ))),
        })
        .collect();
    if e_grads.len() != g_grads.len() {
        comparisons.push(failed(format!(
            "{what} grads: {} parameters eager, {} graphed",
            e_grads.len(),
            g_grads.len()
        )));
    }
    comparisons
}

/// Trains `comparison.model` eagerly and, from identical parameters, a graphed copy, on the same
/// batches, and compares each step's outputs, loss, every parameter gradient and every parameter
/// after the optimizer step, all element by element under `comparison.tolerance`: outputs,
/// losses and gradients relative to their own largest value ([`TensorComparison::new`]),
/// parameters relative to how far they moved ([`ParamMovement`]); [`Tolerance`] states what
/// each bound must see.
///
/// # Errors
///
/// [`HarnessError::Graphed`] when the capture or a graphed call fails,
/// [`HarnessError::Read`] when a tensor cannot be read back. A numerical mismatch is not an
/// error: it is in the report ([`EquivalenceReport::passed`]).
pub fn compare_training<M, I, O>(
    comparison: TrainingComparison<'_, M, I, O>,
) -> Result<EquivalenceReport, HarnessError>
where
    M: Module,
    I: TensorGroup + Clone,
    O: TensorGroup,
{
    let graphed_optimizer = comparison.optimizer.clone();
    compare_training_with_optimizer(comparison, graphed_optimizer)
}

/// [`compare_training`], with `graphed_optimizer` training the graphed model instead of a
/// clone of `comparison.optimizer` (which trains the eager one): e.g. burn's `Adam` eagerly
/// against [`burn_graphed::FusedAdam`] or [`burn_graphed::MultiTensorAdam`] on the graphed
/// model.
///
/// # Errors
///
/// As [`compare_training`].
pub fn compare_training_with_optimizer<M, I, O, S>(
    comparison: TrainingComparison<'_, M, I, O>,
    mut graphed_optimizer: S,
) -> Result<EquivalenceReport, HarnessError>
where
    S: ModuleStep,
    M: Module,
    I: TensorGroup + Clone,
    O: TensorGroup,
{
    let TrainingComparison {
        model,
        call,
        optimizer,
        learning_rate,
        batch,
        loss,
        steps,
        graphed,
        tolerance,
        noise_step,
    } = comparison;
    let mut eager = deep_copy(&model);
    let mut movement = ParamMovement::new(values_only(param_values(&model)?));
    let mut eager_optimizer = optimizer;
    let sample = batch(usize::MAX);
    let mut graphed = Graphed::new(model, call, sample, &graphed)?;
    let mut tensors = Vec::new();

    for step in 0..steps {
        let input = batch(step);
        let eager_out = call(&eager, input.clone()).flatten();
        let graphed_out = graphed.forward(input)?.flatten();
        for (index, (e, g)) in eager_out.iter().zip(&graphed_out).enumerate() {
            let e = read_flat(e, "eager output")?;
            let g = read_flat(g, "graphed output")?;
            tensors.push(TensorComparison::new(
                format!("step {step} output {index}"),
                &e,
                &g,
                tolerance,
            ));
        }
        let eager_loss = loss(O::unflatten(eager_out).expect("same structure"));
        let graphed_loss = loss(O::unflatten(graphed_out).expect("same structure"));
        tensors.push(TensorComparison::new(
            format!("step {step} loss"),
            &read(eager_loss.clone().inner(), "eager loss")?,
            &read(graphed_loss.clone().inner(), "graphed loss")?,
            tolerance,
        ));
        let eager_grads = GradientsParams::from_grads(eager_loss.backward(), &eager);
        let graphed_grads = GradientsParams::from_grads(graphed_loss.backward(), &graphed);
        let e_grads = grad_values(&eager, &eager_grads)?;
        let g_grads = grad_values(&graphed, &graphed_grads)?;
        tensors.extend(compare_grad_values(
            &format!("step {step}"),
            &e_grads,
            &g_grads,
            tolerance,
        ));
        if noise_step > 0.0 {
            movement.gradients_at_floor(&at_floor(&e_grads, tolerance), noise_step);
        }
        eager = eager_optimizer.step(learning_rate, eager, eager_grads);
        graphed = graphed_optimizer.step_module(learning_rate, graphed, graphed_grads);
        tensors.extend(movement.compare(
            &format!("step {step} updated"),
            &values_only(param_values(&eager)?),
            &values_only(param_values(&graphed)?),
            tolerance,
        ));
    }
    Ok(EquivalenceReport {
        tensors,
        stats: graphed.stats(),
        summary: graphed.summary().clone(),
        shape_cache: graphed.stats().shape_cache,
    })
}

/// Per parameter, whether its gradient (`grads`, read back) is no larger than `tolerance.abs`
/// anywhere, the floor under which the gradient comparison allows any value
/// ([`ParamMovement::gradients_at_floor`]); `false` without a gradient.
fn at_floor(grads: &[Option<TensorData>], tolerance: Tolerance) -> Vec<bool> {
    grads
        .iter()
        .map(|grad| {
            grad.as_ref()
                .and_then(values_of)
                .is_some_and(|g| largest(g.iter().map(|&v| f64::from(v))) <= tolerance.abs)
        })
        .collect()
}

/// The values of `params` as [`param_values`] reads them, without their ids.
pub fn values_only(params: Vec<(burn::module::ParamId, TensorData)>) -> Vec<TensorData> {
    params.into_iter().map(|(_, data)| data).collect()
}

/// The values of a flattened output of any kind, as floats (int and bool outputs compare
/// exactly under any tolerance: their values are whole numbers).
/// The values of one tensor of a [`burn_graphed::TensorGroup`]'s flattened list, whatever its
/// kind (ints and bools as floats), read back to the host; `what` names it in an error.
pub fn read_flat(flat: &burn_graphed::FlatTensor, what: &str) -> Result<TensorData, HarnessError> {
    use burn::tensor::{Bool, Int};
    let tensor = flat.tensor().clone();
    let values = match flat.kind() {
        burn_graphed::ElementKind::Float => Tensor::<1>::from_dispatch(tensor).inner(),
        burn_graphed::ElementKind::Int => Tensor::<1, Int>::from_dispatch(tensor).inner().float(),
        burn_graphed::ElementKind::Bool => Tensor::<1, Bool>::from_dispatch(tensor).inner().float(),
    };
    read(values, what)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn require_finite_names_the_parameter() {
        let id = burn::module::ParamId::new;
        let fine = (id(), TensorData::new(vec![1.0f32, -2.0], [2]));
        let bad = (
            id(),
            TensorData::new(vec![0.5f32, f32::NAN, f32::INFINITY], [3]),
        );
        assert!(require_finite(std::slice::from_ref(&fine)).is_ok());
        match require_finite(&[fine, bad]) {
            Err(HarnessError::NonFinite { index, count, len }) => {
                assert_eq!((index, count, len), (1, 2, 3));
            }
            other => panic!("expected NonFinite, got {other:?}"),
        }
        let half = (
            id(),
            TensorData::new(vec![burn::tensor::bf16::from_f32(f32::NAN)], [1]),
        );
        assert!(matches!(
            require_finite(&[half]),
            Err(HarnessError::NonFinite {
                index: 0,
                count: 1,
                len: 1
            })
        ));
    }
}
