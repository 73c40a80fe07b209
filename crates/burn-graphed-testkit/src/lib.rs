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

mod step_check;
mod whole_step;
pub use step_check::{ElementOff, StepCheck};
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

/// How close graphed values must be to eager ones, element by element.
///
/// An element passes when `|graphed - eager| <= max(abs + rel * |eager|, norm_rel * scale)`
/// or when the two are within `ulps` units in the last place; a NaN on either side never
/// passes (two NaNs agree on nothing). `scale` is the magnitude that the rounding which may
/// differ is relative to, and the comparison picks it ([`TensorComparison::new`]: the eager
/// tensor's largest magnitude, for outputs, losses, gradients and optimizer moments, which are
/// sums of products; [`ParamMovement`]: the path the eager parameter travelled, the sum over
/// steps of each step's largest change, for parameters, which the rounding of products reaches
/// only through their updates). With `norm_rel` 0, `scale` plays no part.
///
/// Each constructor states the arithmetic that may differ, the bound it gives, and the
/// smallest real error the bound must still see. `tests/scenarios/controls.rs` injects those
/// errors into every regime (SGD, Adam at lr 1e-4 and 1e-3, `bf16`, `f16`, inference) and
/// prints each margin (the injected error in units of its allowance).
///
/// - [`Tolerance::exact`]: the same kernels on the same values (wgpu's graphs against eager,
///   measured bitwise; the whole step's update against burn's, `whole_step_update_is_burns_in`).
///   Any difference is an error.
/// - [`Tolerance::default`] (`abs` 1e-6, `rel` 1e-5, 4 ulps): f32, where the graph's kernels
///   may be cut differently from eager's (burn-fusion sees other blocks), which changes the
///   order of a sum. Two orders of an `n`-term f32 sum differ by at most
///   `2 (n - 1) 2^-24 sum|terms|`, i.e. `2 (n - 1) 2^-24 kappa` of the value
///   (`kappa = sum|terms| / |sum|`): `rel` 1e-5 covers `(n - 1) kappa` up to 83 (the suite's
///   models sum at most 64 products per element); `abs` 1e-6 covers a value that cancels to
///   near zero, for `sum|terms|` up to 0.13 at `n` = 64. (On wgpu the suite's graphed and
///   eager runs measure bitwise equal: the bound is a margin.) It must see one Adam step at
///   lr 1e-4, which moves every element whose gradient is well above epsilon by about 1e-4:
///   more than `1e-6 + 1e-5 |p|` for `|p| < 9.9` (the suite's parameters are below 1: margin
///   about 9). A stale batch or a wrong row is off by the values themselves.
/// - [`Tolerance::tensor_cores`] (adds `norm_rel` 1e-2 and `abs` 4e-6): f32 matrix products
///   that may run on TF32 tensor cores in one path and not the other. On CUDA, burn's matmul
///   autotuner times candidate kernels, some of which round f32 operands to TF32 (10-bit
///   mantissa, unit roundoff u = 2^-11 ≈ 4.9e-4); the kernel recorded in a graph can differ
///   from the one a later eager call picks. A TF32 dot product is off by up to about
///   2u·Σ|aᵢbᵢ|, which is 2u·κ of its value. Measured on an H100: a gradient element off by
///   3.4e-3 of its value at step 0 from identical parameters and inputs; behind a width-1 layer
///   6.6e-3 of a one-element bias gradient (κ ≈ 7). 1e-2 of the tensor's largest value accepts
///   κ up to about 10 there. `abs` 4e-6 covers tensors whose every value is small next to the
///   products summed into them (measured on an H200: a 32-element first-layer weight gradient
///   off by 1.4e-6 where its largest value was below 1.4e-4; 2u·Σ|aᵢbᵢ| for Σ|aᵢbᵢ| ≈ 4e-3).
///   What it sees in products (outputs, losses, gradients, moments): a stale batch and a wrong
///   row, off by the values themselves (order 1 of the scale: margin about 100); not one step
///   at lr 1e-3 or below, whose effect on a product can be under 1e-2 of the tensor's largest
///   value, so the parameters must see that. Parameters are compared relative to the path
///   they travelled ([`ParamMovement`]: the sum over steps of each step's largest change): TF32
///   reaches a parameter only through its updates. Adam's step `lr m̂/(√v̂ + ε)` changes by at
///   most the relative change of its gradient where `|g| >> ε` (under 1e-2 of the step while
///   the gradient is within its bound) and by at most `lr |Δg| / ε` near zero (4e-3 lr for
///   `|Δg|` = 4e-6 and the suite's ε = 1e-3); SGD's step `lr v` by `lr |Δv|`, under 1e-2 of
///   the step. Summed over steps, that is 1e-2 of the path, unless every gradient of the
///   tensor is near zero: then the near-zero term is the whole step (a key projection's bias,
///   whose gradient is rounding noise), which [`TrainingComparison::noise_step`] states and
///   [`ParamMovement`] allows for. A skipped update leaves the element
///   that moved farthest in that step off by the whole step (about lr for Adam), against a
///   bound of `max(4e-6 + 1e-5 |p|, 1e-2 k lr)` after `k` steps of Adam: seen for
///   lr >= 1e-4, `|p| <= 1` and `k` below 100 (margin 7 at lr 1e-4 and `|p|` = 1, `100 / k`
///   where the path term is the larger). Measured on an H100 (the controls and the CUDA
///   scenarios): clean runs within 0.24 of this bound; injected errors 15 to 337 times it.
/// - [`Tolerance::ulps_of`]: `n` units in the last place of a narrower float, for two
///   computations in that dtype that round differently.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance {
    /// Absolute error allowed.
    pub abs: f64,
    /// Relative error allowed.
    pub rel: f64,
    /// Distance in units in the last place (f32) allowed.
    pub ulps: u64,
    /// Error allowed relative to the comparison's scale (see the type's docs).
    pub norm_rel: f64,
}

impl Default for Tolerance {
    fn default() -> Self {
        Self {
            abs: 1e-6,
            rel: 1e-5,
            ulps: 4,
            norm_rel: 0.0,
        }
    }
}

impl Tolerance {
    /// Bitwise equality.
    pub fn exact() -> Self {
        Self {
            abs: 0.0,
            rel: 0.0,
            ulps: 0,
            norm_rel: 0.0,
        }
    }

    /// `n` units in the last place of `dtype` (`bf16`, `f16` or `f32`): values of a narrower
    /// float widen to `f32` exactly, with the low mantissa bits zero, so one unit of theirs is
    /// `2^(23 - mantissa bits)` units of `f32`. For comparing two computations in that dtype
    /// that round differently (one rounding against several).
    pub fn ulps_of(dtype: burn::tensor::DType, n: u64) -> Self {
        Self {
            abs: 0.0,
            rel: 0.0,
            ulps: n << (23 - mantissa_bits(dtype)),
            norm_rel: 0.0,
        }
    }

    /// The default plus a norm-based bound for f32 matrix products that may run on TF32
    /// tensor cores in one path and not the other (see the type's docs).
    pub fn tensor_cores() -> Self {
        Self {
            abs: 4e-6,
            norm_rel: 1e-2,
            ..Self::default()
        }
    }

    /// How far `graphed` is from `eager` in units of what this tolerance allows there (at most
    /// 1.0 passes): 0 where they are bitwise equal, infinite where either is NaN or where
    /// nothing is allowed and they differ. `scale` is the comparison's (see the type's docs).
    pub fn distance(&self, eager: f32, graphed: f32, scale: f64) -> f64 {
        if eager.is_nan() || graphed.is_nan() {
            return f64::INFINITY;
        }
        if eager.to_bits() == graphed.to_bits() {
            return 0.0;
        }
        let diff = (f64::from(eager) - f64::from(graphed)).abs();
        let allowed = (self.abs + self.rel * f64::from(eager).abs()).max(self.norm_rel * scale);
        let by_value = if diff == 0.0 {
            // +0 against -0.
            0.0
        } else if allowed > 0.0 {
            diff / allowed
        } else {
            f64::INFINITY
        };
        let by_ulps = if self.ulps > 0 {
            ulp_distance(eager, graphed) as f64 / self.ulps as f64
        } else if ulp_distance(eager, graphed) == 0 {
            0.0
        } else {
            f64::INFINITY
        };
        by_value.min(by_ulps)
    }

    /// Whether `graphed` is close enough to `eager` ([`Tolerance::distance`] at most 1).
    pub fn accepts(&self, eager: f32, graphed: f32, scale: f64) -> bool {
        self.distance(eager, graphed, scale) <= 1.0
    }
}

/// Bits of mantissa (stored) of a float dtype: 7 for `bf16`, 10 for `f16`, 23 otherwise.
pub fn mantissa_bits(dtype: burn::tensor::DType) -> u32 {
    use burn::tensor::DType;
    match dtype {
        DType::BF16 => 7,
        DType::F16 => 10,
        _ => 23,
    }
}

/// Distance between two f32 values in units in the last place.
pub fn ulp_distance(a: f32, b: f32) -> u64 {
    fn ordered(x: f32) -> i64 {
        let bits = i64::from(x.to_bits() as i32);
        if bits < 0 {
            i64::from(i32::MIN) - bits
        } else {
            bits
        }
    }
    if a.is_nan() || b.is_nan() {
        return u64::MAX;
    }
    ordered(a).abs_diff(ordered(b))
}

/// The comparison of one tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorComparison {
    /// What was compared, e.g. `step 3 grad param 2`.
    pub name: String,
    /// Number of elements.
    pub len: usize,
    /// Largest absolute difference.
    pub max_abs: f64,
    /// Largest relative difference (to the eager value).
    pub max_rel: f64,
    /// Largest ULP distance.
    pub max_ulps: u64,
    /// The largest element distance in units of its allowance ([`Tolerance::distance`]): at
    /// most 1.0 passes; for a comparison that must fail, how far beyond its bound it is.
    pub worst: f64,
    /// The scale the tolerance's `norm_rel` was applied to.
    pub scale: f64,
    /// First element outside the tolerance.
    pub first_mismatch: Option<usize>,
    /// Whether the shapes or the dtypes differ (then nothing else was compared).
    pub shape_mismatch: bool,
}

impl TensorComparison {
    /// Compares `graphed` to `eager` under `tolerance`, the scale of its `norm_rel` the eager
    /// tensor's largest finite magnitude: for values that are sums of products (outputs,
    /// losses, gradients, optimizer moments).
    pub fn new(
        name: impl Into<String>,
        eager: &TensorData,
        graphed: &TensorData,
        tolerance: Tolerance,
    ) -> Self {
        let scale = values_of(eager)
            .map(|values| largest(values.iter().map(|&v| f64::from(v))))
            .unwrap_or(0.0);
        Self::with_scale(name, eager, graphed, tolerance, scale)
    }

    /// Compares `graphed` to `eager` under `tolerance`, its `norm_rel` applied to `scale`.
    pub fn with_scale(
        name: impl Into<String>,
        eager: &TensorData,
        graphed: &TensorData,
        tolerance: Tolerance,
        scale: f64,
    ) -> Self {
        let mut comparison = Self {
            name: name.into(),
            len: 0,
            max_abs: 0.0,
            max_rel: 0.0,
            max_ulps: 0,
            worst: 0.0,
            scale,
            first_mismatch: None,
            shape_mismatch: eager.shape() != graphed.shape() || eager.dtype() != graphed.dtype(),
        };
        if comparison.shape_mismatch {
            comparison.worst = f64::INFINITY;
            return comparison;
        }
        let (Some(eager), Some(graphed)) = (values_of(eager), values_of(graphed)) else {
            comparison.shape_mismatch = true;
            comparison.worst = f64::INFINITY;
            return comparison;
        };
        comparison.len = eager.len();
        for (index, (&e, &g)) in eager.iter().zip(&graphed).enumerate() {
            let abs = (f64::from(e) - f64::from(g)).abs();
            let rel = if e == 0.0 {
                abs
            } else {
                abs / f64::from(e).abs()
            };
            // NaN differences count as infinite.
            let (abs, rel) = if abs.is_nan() {
                (f64::INFINITY, f64::INFINITY)
            } else {
                (abs, rel)
            };
            comparison.max_abs = comparison.max_abs.max(abs);
            comparison.max_rel = comparison.max_rel.max(rel);
            comparison.max_ulps = comparison.max_ulps.max(ulp_distance(e, g));
            let distance = tolerance.distance(e, g, scale);
            comparison.worst = comparison.worst.max(distance);
            if comparison.first_mismatch.is_none() && distance > 1.0 {
                comparison.first_mismatch = Some(index);
            }
        }
        comparison
    }

    /// Whether the tensor is within tolerance.
    pub fn passed(&self) -> bool {
        !self.shape_mismatch && self.first_mismatch.is_none()
    }

    /// Whether the two tensors are bitwise equal.
    pub fn bitwise(&self) -> bool {
        self.passed() && self.max_ulps == 0
    }
}

/// A tensor's values as `f32` (lower-precision floats widen exactly), or `None` where they do
/// not convert.
fn values_of(data: &TensorData) -> Option<Vec<f32>> {
    data.try_to_vec_as::<f32>().ok()
}

/// The largest finite magnitude of `values` (0 for none).
fn largest(values: impl Iterator<Item = f64>) -> f64 {
    values
        .filter(|v| v.is_finite())
        .fold(0.0f64, |max, v| max.max(v.abs()))
}

impl fmt::Display for TensorComparison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.shape_mismatch {
            return write!(f, "{}: shapes or dtypes differ", self.name);
        }
        write!(
            f,
            "{}: {} elements, max abs {:.3e}, max rel {:.3e}, max ulps {}, worst {:.3} of its allowance{}",
            self.name,
            self.len,
            self.max_abs,
            self.max_rel,
            self.max_ulps,
            self.worst,
            match self.first_mismatch {
                Some(index) => format!(", FIRST MISMATCH at {index}"),
                None => String::new(),
            }
        )
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

/// A comparison that fails: something present on one side only.
pub(crate) fn failed(name: String) -> TensorComparison {
    TensorComparison {
        name,
        len: 0,
        max_abs: f64::INFINITY,
        max_rel: f64::INFINITY,
        max_ulps: u64::MAX,
        worst: f64::INFINITY,
        scale: 0.0,
        first_mismatch: Some(0),
        shape_mismatch: true,
    }
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

/// The distance each eager parameter travelled over the steps so far: the sum, over steps, of
/// the step's largest change of any of its elements. Rounding that differs in the products
/// (TF32 on one side) reaches a parameter only through its updates, each changed by at most
/// a fraction of its size, so the parameters' bound scales with this path
/// ([`ParamMovement::compare`], [`Tolerance`]). The path, not the net distance from the
/// start: where steps go back and forth, their differences still add up.
///
/// A parameter whose gradient is rounding noise (a key projection's bias, whose gradient is
/// zero in exact arithmetic: softmax ignores a constant added to every score of a query) moves
/// by what each side's noise makes of it, and the two sides' noises differ by their whole size:
/// the gradient comparison cannot constrain them (they are under its absolute floor), so no
/// fraction of the path can bound the parameters. Such parameters, marked step by step with
/// [`ParamMovement::gradients_at_floor`], are allowed in addition the largest move each side's
/// optimizer can make from such a gradient, twice per marked step (Adam: `lr abs / epsilon`,
/// since `|m̂| <= abs`; plain SGD: `lr abs`). A wrong row or a stale value is still seen where
/// it exceeds these moves; a skipped update of such a parameter cannot be seen by any bound
/// (its update is noise).
#[derive(Debug, Clone)]
pub struct ParamMovement {
    /// The eager parameters after the last step (before the first: the start).
    previous: Vec<TensorData>,
    /// Per parameter, the path so far.
    path: Vec<f64>,
    /// Per parameter, what both sides may have moved over the steps its gradient was at the
    /// floor.
    free: Vec<f64>,
}

impl ParamMovement {
    /// Starts from `start`, the parameters before the first step (visiting order).
    pub fn new(start: Vec<TensorData>) -> Self {
        let path = vec![0.0; start.len()];
        Self {
            free: path.clone(),
            previous: start,
            path,
        }
    }

    /// Marks parameter `index` of each `true` in `flags`: its eager gradient of this step was
    /// no larger than the gradient comparison's absolute floor (`Tolerance::abs`), so that its
    /// update is rounding noise on both sides (see the type's docs), each side's move at most
    /// `largest_step`: the two sides may differ by twice that more.
    pub fn gradients_at_floor(&mut self, flags: &[bool], largest_step: f64) {
        for (free, &flag) in self.free.iter_mut().zip(flags) {
            if flag {
                *free += 2.0 * largest_step;
            }
        }
    }

    /// What parameter `index` may be off in addition, for the moves of both sides while its
    /// gradient was at the floor (0 for an index past the parameters).
    pub fn free(&self, index: usize) -> f64 {
        self.free.get(index).copied().unwrap_or(0.0)
    }

    /// The path of parameter `index` so far (0 for an index past the parameters).
    pub fn path(&self, index: usize) -> f64 {
        self.path.get(index).copied().unwrap_or(0.0)
    }

    /// Adds the step from the previous eager parameters to `eager` to each path, then compares
    /// `graphed` with `eager` parameter by parameter (visiting order), the scale of
    /// `tolerance`'s `norm_rel` each parameter's path: one comparison per parameter named
    /// `"{what} param {index}"`, and a failing one where the counts of the start, `eager` and
    /// `graphed` differ, or where a parameter changed shape.
    pub fn compare(
        &mut self,
        what: &str,
        eager: &[TensorData],
        graphed: &[TensorData],
        tolerance: Tolerance,
    ) -> Vec<TensorComparison> {
        let mut comparisons = Vec::with_capacity(eager.len() + 1);
        for (index, (changed, (e, g))) in self
            .advance(eager)
            .into_iter()
            .zip(eager.iter().zip(graphed))
            .enumerate()
        {
            let name = format!("{what} param {index}");
            if changed {
                comparisons.push(failed(format!("{name}: changed shape")));
                continue;
            }
            // The free allowance in units of the path's: `norm_rel` scales both. Without a
            // `norm_rel` the tolerance states the same kernels on both sides, whose noise is
            // the same too.
            let free = if tolerance.norm_rel > 0.0 {
                self.free(index) / tolerance.norm_rel
            } else {
                0.0
            };
            let scale = self.path(index) + free;
            comparisons.push(TensorComparison::with_scale(name, e, g, tolerance, scale));
        }
        if self.previous.len() != graphed.len() || eager.len() != graphed.len() {
            comparisons.push(failed(format!(
                "{what} params: {} at the start, {} eager, {} graphed",
                self.path.len(),
                eager.len(),
                graphed.len()
            )));
        }
        comparisons
    }

    /// Adds the step from the previous eager parameters to `eager` to each path, comparing
    /// nothing (for steps between comparisons). Returns, per parameter of `eager` (up to the
    /// count at the start), whether it changed shape (its path then stays as it was).
    pub fn advance(&mut self, eager: &[TensorData]) -> Vec<bool> {
        let mut changed = Vec::with_capacity(eager.len());
        for ((previous, path), e) in self.previous.iter().zip(self.path.iter_mut()).zip(eager) {
            if previous.shape() != e.shape() {
                changed.push(true);
                continue;
            }
            changed.push(false);
            *path += moved_by(previous, e);
        }
        if self.previous.len() == eager.len() {
            self.previous = eager.to_vec();
        }
        changed
    }
}

/// The largest change of any element from `before` to `after` (0 where either cannot be read
/// as floats or their lengths differ).
fn moved_by(before: &TensorData, after: &TensorData) -> f64 {
    match (values_of(before), values_of(after)) {
        (Some(b), Some(a)) if b.len() == a.len() => {
            largest(b.iter().zip(&a).map(|(&b, &a)| f64::from(a) - f64::from(b)))
        }
        _ => 0.0,
    }
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
    let mut comparisons: Vec<TensorComparison> = e_grads
        .iter()
        .zip(&g_grads)
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
    Ok(comparisons)
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
        tensors.extend(compare_grads(
            &format!("step {step}"),
            (&eager, &eager_grads),
            (&graphed, &graphed_grads),
            tolerance,
        )?);
        if noise_step > 0.0 {
            let flags = at_floor(&eager, &eager_grads, tolerance)?;
            movement.gradients_at_floor(&flags, noise_step);
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
        shape_cache: graphed.shape_cache(),
    })
}

/// Per parameter of `module`, whether its gradient in `grads` is no larger than
/// `tolerance.abs` anywhere, the floor under which the gradient comparison allows any value
/// ([`ParamMovement::gradients_at_floor`]); `false` without a gradient.
fn at_floor<M: Module>(
    module: &M,
    grads: &GradientsParams,
    tolerance: Tolerance,
) -> Result<Vec<bool>, HarnessError> {
    Ok(grad_values(module, grads)?
        .iter()
        .map(|grad| {
            grad.as_ref()
                .and_then(values_of)
                .is_some_and(|g| largest(g.iter().map(|&v| f64::from(v))) <= tolerance.abs)
        })
        .collect())
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

    #[test]
    fn ulp_distance_counts_representable_steps() {
        assert_eq!(ulp_distance(1.0, 1.0), 0);
        assert_eq!(ulp_distance(1.0, f32::from_bits(1.0f32.to_bits() + 3)), 3);
        // Across zero: +0 and -0 are the same point, the smallest subnormals one step away.
        assert_eq!(ulp_distance(0.0, -0.0), 0);
        assert_eq!(ulp_distance(f32::from_bits(1), -f32::from_bits(1)), 2);
        assert_eq!(ulp_distance(f32::NAN, 1.0), u64::MAX);
    }

    #[test]
    fn exact_tolerance_rejects_one_ulp() {
        let next = f32::from_bits(2.0f32.to_bits() + 1);
        assert!(Tolerance::exact().accepts(2.0, 2.0, 2.0));
        assert!(!Tolerance::exact().accepts(2.0, next, 2.0));
        assert!(Tolerance::default().accepts(2.0, next, 2.0));
        assert!(!Tolerance::default().accepts(2.0, 2.1, 2.0));
        assert!(Tolerance::exact().accepts(0.0, -0.0, 2.0));
        // Two NaNs agree on nothing, under any tolerance.
        assert!(!Tolerance::exact().accepts(f32::NAN, f32::NAN, 2.0));
        assert!(!Tolerance::tensor_cores().accepts(f32::NAN, f32::NAN, 2.0));
        assert!(!Tolerance::tensor_cores().accepts(1.0, f32::NAN, 2.0));
    }

    #[test]
    fn distance_counts_allowances() {
        let tolerance = Tolerance {
            abs: 1e-3,
            rel: 0.0,
            ulps: 0,
            norm_rel: 1e-2,
        };
        // The larger of abs (1e-3) and norm_rel * scale (1e-2 * 0.5) allows 5e-3.
        assert!((tolerance.distance(1.0, 1.01, 0.5) - 2.0).abs() < 1e-4);
        assert!((tolerance.distance(1.0, 1.0025, 0.5) - 0.5).abs() < 1e-4);
        assert_eq!(Tolerance::exact().distance(1.0, 1.5, 1.0), f64::INFINITY);
        assert_eq!(Tolerance::exact().distance(1.0, 1.0, 1.0), 0.0);
        // Units in the last place, where they allow more.
        let next = f32::from_bits(1.0f32.to_bits() + 2);
        assert!(
            (Tolerance::ulps_of(burn::tensor::DType::F32, 4).distance(1.0, next, 1.0) - 0.5).abs()
                < 1e-12
        );
    }

    #[test]
    fn noise_gradients_allow_both_moves() {
        // A key bias: its gradient is rounding noise on both sides, and Adam (lr 1e-2, eps
        // 1e-3) turns noise under the floor of 4e-6 into steps of at most 4e-5 whose signs
        // differ. Marked at the floor, the two may differ by 8e-5 more per step; unmarked, the
        // path (the eager moves) bounds them to 1e-2 of those moves, and they fail.
        let data = |values: &[f32]| TensorData::new(values.to_vec(), [values.len()]);
        let tolerance = Tolerance::tensor_cores();
        let largest_step = 1e-2 * tolerance.abs / 1e-3;
        let mut marked = ParamMovement::new(vec![data(&[0.0, 0.3])]);
        let mut unmarked = marked.clone();
        let (mut e, mut g) = ([0.0f32, 0.3], [0.0f32, 0.3]);
        for _ in 0..20 {
            e[0] += 1e-7;
            g[0] -= 1e-6;
            marked.gradients_at_floor(&[true, false], largest_step);
            let m = marked.compare("p", &[data(&e)], &[data(&g)], tolerance);
            assert!(m.iter().all(TensorComparison::passed), "{}", m[0]);
            unmarked.compare("p", &[data(&e)], &[data(&g)], tolerance);
        }
        // 20 steps apart by 1.1e-6 each: 2.2e-5, past the absolute floor of 4e-6.
        let last = unmarked.compare("p", &[data(&e)], &[data(&g)], tolerance);
        assert!(!last[0].passed(), "{}", last[0]);
        assert!((marked.free(0) - 1.6e-3).abs() < 1e-9, "{}", marked.free(0));
        assert_eq!(marked.free(1), 0.0);
        // A wrong value beyond the moves (a stale 0.01 of a bias of 0.3) still fails, and NaN
        // always does.
        let wrong = marked.compare("p", &[data(&e)], &[data(&[1e-2, 0.3])], tolerance);
        assert!(!wrong[0].passed(), "{}", wrong[0]);
        let nan = marked.compare("p", &[data(&e)], &[data(&[f32::NAN, 0.3])], tolerance);
        assert!(!nan[0].passed(), "{}", nan[0]);
    }

    #[test]
    fn parameters_are_bounded_by_their_path() {
        // A weight of magnitude 0.2 after three Adam steps at lr 1e-3 (path 3e-3), graphed one
        // step short on one element: under 1e-2 of its value (1e-3 < 1.97e-3), so a
        // value-relative bound accepts it; the path-relative bound, max(4e-6 + 1e-5 |p|,
        // 1e-2 of 3e-3) = 3e-5, does not.
        let data = |values: &[f32]| TensorData::new(values.to_vec(), [values.len()]);
        let tolerance = Tolerance::tensor_cores();
        let mut movement = ParamMovement::new(vec![data(&[0.2, -0.05, 0.02])]);
        for step in [[0.199f32, -0.049, 0.021], [0.198, -0.048, 0.022]] {
            let passed = movement.compare("p", &[data(&step)], &[data(&step)], tolerance);
            assert!(passed.iter().all(TensorComparison::passed));
        }
        let eager = data(&[0.197, -0.047, 0.023]);
        let graphed = data(&[0.198, -0.047, 0.023]);
        let by_value = TensorComparison::new("p", &eager, &graphed, tolerance);
        assert!(by_value.passed(), "{by_value}");
        let by_path = movement.compare("p", std::slice::from_ref(&eager), &[graphed], tolerance);
        assert_eq!(by_path.len(), 1);
        assert!(!by_path[0].passed(), "{}", by_path[0]);
        assert!(
            (movement.path(0) - 3e-3).abs() < 1e-6,
            "{}",
            movement.path(0)
        );
        // 1e-3 off against 3e-5 allowed: about 33 allowances.
        assert!(
            by_path[0].worst > 30.0 && by_path[0].worst < 36.0,
            "{}",
            by_path[0]
        );

        // Steps that go back and forth: the path adds them (2e-3), the net distance is 0.
        let mut movement = ParamMovement::new(vec![data(&[0.5])]);
        movement.compare("p", &[data(&[0.501])], &[data(&[0.501])], tolerance);
        movement.compare("p", &[data(&[0.5])], &[data(&[0.5])], tolerance);
        assert!(
            (movement.path(0) - 2e-3).abs() < 1e-6,
            "{}",
            movement.path(0)
        );
        // Steps seen without a comparison (`advance`) add to the path as compared ones do; a
        // second comparison against the same eager values adds nothing.
        let mut movement = ParamMovement::new(vec![data(&[0.5])]);
        assert_eq!(movement.advance(&[data(&[0.501])]), vec![false]);
        movement.advance(&[data(&[0.5])]);
        movement.compare("p", &[data(&[0.5])], &[data(&[0.5])], tolerance);
        assert!(
            (movement.path(0) - 2e-3).abs() < 1e-6,
            "{}",
            movement.path(0)
        );
        assert_eq!(movement.advance(&[data(&[0.5, 0.5])]), vec![true]);
        assert!(
            (movement.path(0) - 2e-3).abs() < 1e-6,
            "{}",
            movement.path(0)
        );

        // One step at lr 1e-4 (path 1e-4) on |p| = 0.5, skipped: 1e-4 off against
        // max(4e-6 + 5e-6, 1e-6) allowed, about 11 allowances.
        let mut movement = ParamMovement::new(vec![data(&[0.5])]);
        let skipped = movement.compare("p", &[data(&[0.4999])], &[data(&[0.5])], tolerance);
        assert!(
            !skipped[0].passed() && skipped[0].worst > 9.0,
            "{}",
            skipped[0]
        );

        // Another shape, or another count, fails.
        let mut movement = ParamMovement::new(vec![data(&[0.5, 0.5])]);
        assert!(!movement.compare("p", &[data(&[0.5])], &[data(&[0.5])], tolerance)[0].passed());
        let mut movement = ParamMovement::new(vec![data(&[0.5])]);
        let counted = movement.compare("p", &[data(&[0.5])], &[], tolerance);
        assert!(counted.iter().any(|c| !c.passed()));
    }

    #[test]
    fn norm_bound_scales_with_the_largest_value() {
        // 1e-3 off a small element: too much for the element-wise bounds, within 1e-2 of a
        // tensor whose largest value is 1, not of one whose largest value is 0.05.
        assert!(!Tolerance::default().accepts(0.002, 0.003, 1.0));
        assert!(Tolerance::tensor_cores().accepts(0.002, 0.003, 1.0));
        assert!(!Tolerance::tensor_cores().accepts(0.002, 0.003, 0.05));
    }

    #[test]
    fn tensor_cores_floor_is_absolute() {
        // The H200 case: 1.4e-6 off a near-zero element of a tensor whose largest value is
        // 1.3e-4 (norm bound 1.3e-6): within the 4e-6 floor; twice the floor is not.
        let eager = 1.1e-7f32;
        assert!(!Tolerance::default().accepts(eager, eager + 1.4e-6, 1.3e-4));
        assert!(Tolerance::tensor_cores().accepts(eager, eager + 1.4e-6, 1.3e-4));
        assert!(!Tolerance::tensor_cores().accepts(eager, eager + 8e-6, 1.3e-4));
    }

    #[test]
    fn comparison_reports_first_mismatch_and_shape_errors() {
        let eager = TensorData::new(vec![1.0f32, 2.0, 3.0, 4.0], [2, 2]);
        let graphed = TensorData::new(vec![1.0f32, 2.0, 3.5, 4.5], [2, 2]);
        let comparison = TensorComparison::new("t", &eager, &graphed, Tolerance::default());
        assert_eq!(comparison.first_mismatch, Some(2));
        assert!((comparison.max_abs - 0.5).abs() < 1e-12);
        assert!(!comparison.passed());

        let other_shape = TensorData::new(vec![1.0f32, 2.0, 3.0, 4.0], [4]);
        let comparison = TensorComparison::new("t", &eager, &other_shape, Tolerance::default());
        assert!(comparison.shape_mismatch);
        assert!(!comparison.passed());

        let same = TensorComparison::new("t", &eager, &eager.clone(), Tolerance::exact());
        assert!(same.bitwise());
    }
}
