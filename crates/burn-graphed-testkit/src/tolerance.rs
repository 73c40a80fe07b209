//! Element-by-element comparison of graphed values with eager ones: the tolerance (what may
//! differ, and why), units in the last place, and the comparison of one tensor.

use std::fmt;

use burn::tensor::TensorData;

#[cfg(doc)]
use crate::{ParamMovement, TrainingComparison};

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
///   eager runs measure bitwise equal: the bound is a margin. On CUDA with TF32 off,
///   `burn_graphed::allow_tf32(false)` as the GPU suite runs, autotune may still pick other
///   `f32` kernels for the two runs: other orders of the same sums, within this bound.) It
///   must see one Adam step at lr 1e-4, which moves every element whose gradient is well
///   above epsilon by about 1e-4: more than `1e-6 + 1e-5 |p|` for `|p| < 9.9` (the suite's parameters are below 1: margin
///   about 9). A stale batch or a wrong row is off by the values themselves.
/// - [`Tolerance::tensor_cores`] (adds `norm_rel` 1e-2 and `abs` 4e-6): f32 matrix products
///   that may run on TF32 tensor cores in one path and not the other (CUDA with TF32 allowed,
///   burn-graphed's default; the GPU suite runs this regime in a child process of its own,
///   `tf32_regime_trains_within_the_tensor_core_bound`). On CUDA, burn's matmul
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
///   Not a proof: the absolute floor (4e-6) and the Adam term near a zero gradient are
///   measured samples, not derived from the products summed. With eight test processes per
///   GPU (2 x H200), where picks differ most (docs/decisions.md, "Under contention"), two
///   whole-training comparisons exceeded the bound once each, 2.3 and 6.5 times (a
///   one-element bias gradient 9.2e-6 off; Adam parameters after a 1e-5 gradient difference
///   near zero), and passed when rerun under the same load.
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
pub(crate) fn values_of(data: &TensorData) -> Option<Vec<f32>> {
    data.try_to_vec_as::<f32>().ok()
}

/// The largest finite magnitude of `values` (0 for none).
pub(crate) fn largest(values: impl Iterator<Item = f64>) -> f64 {
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

#[cfg(test)]
mod tests {
    use super::*;

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
