//! A coarse check that a few training steps of a graphed model did what eager steps do: for a
//! benchmark, which must not time wrong math, where the per-element tolerances of
//! [`crate::compare_training`] are too strict to hold over steps on every kernel the
//! autotuner may pick.
//!
//! Both runs start from the same parameters and see the same batches. The check is built on
//! the size of one update: with Adam every parameter moves by about the learning rate per step
//! (its first steps are close to `lr * sign(grad)`), whatever the gradient's scale. So
//! - a parameter element is *off* when the two runs' values differ by more than half a step
//!   plus the dtype's rounding noise of its value: a missed update, an update of another
//!   element or a stale gradient is off by a step or more; rounding and a gradient's sign
//!   flipped by TF32 on a near-zero element are rare. The check allows 1% of a parameter's
//!   elements off.
//! - the losses of every step may differ by a tenth of the eager loss's change over the steps
//!   plus the noise: a forward pass that read stale parameters or a stale batch is off by the
//!   change itself.

use std::fmt;

use burn::tensor::TensorData;

/// Largest fraction of a parameter's elements allowed off.
const PARAM_OFF_ALLOWED: f64 = 0.01;
/// Part of the eager loss's change over the steps allowed as a loss difference.
const LOSS_PROGRESS_ALLOWED: f64 = 0.1;

/// The result of [`StepCheck::new`]: how far a graphed run strayed from an eager one.
#[derive(Debug, Clone, PartialEq)]
pub struct StepCheck {
    /// Largest fraction, over parameters, of a parameter's elements off (1.0 where the
    /// parameters' counts, shapes or dtypes differ).
    pub param_off: f64,
    /// The parameter (visiting order) with that fraction.
    pub worst_param: Option<usize>,
    /// In that parameter, the element farthest from its eager value (in units of its
    /// allowance), when one is off: where a failure starts to be read.
    pub farthest: Option<ElementOff>,
    /// Largest loss difference over the steps, in units of its allowance (1.0 is the limit).
    pub loss_off: f64,
}

/// One parameter element that a graphed run left off from an eager run.
#[derive(Debug, Clone, PartialEq)]
pub struct ElementOff {
    /// Its index in the parameter's elements (row-major).
    pub index: usize,
    /// The parameter's shape.
    pub shape: Vec<usize>,
    /// Its value after the eager steps.
    pub eager: f32,
    /// Its value after the graphed steps.
    pub graphed: f32,
}

impl StepCheck {
    /// Compares a graphed run with an eager one: `losses` of every step and the parameters
    /// after the steps (visiting order), both runs with learning rate `lr` from the same
    /// parameters and batches. `noise_rel` is the rounding noise allowed relative to a value
    /// (e.g. 2e-3 for f32 matrix products on TF32 tensor cores, 2e-2 for bf16).
    pub fn new(
        lr: f64,
        noise_rel: f64,
        (eager_losses, graphed_losses): (&[f64], &[f64]),
        (eager_params, graphed_params): (&[TensorData], &[TensorData]),
    ) -> Self {
        let mut check = Self {
            param_off: 0.0,
            worst_param: None,
            farthest: None,
            loss_off: 0.0,
        };
        if eager_params.len() != graphed_params.len() {
            check.param_off = 1.0;
        }
        for (index, (eager, graphed)) in eager_params.iter().zip(graphed_params).enumerate() {
            let (off, farthest) = fraction_off(lr, noise_rel, eager, graphed);
            if off > check.param_off || check.worst_param.is_none() && off == check.param_off {
                check.param_off = off;
                check.worst_param = Some(index);
                check.farthest = farthest;
            }
        }
        let progress = match (eager_losses.first(), eager_losses.last()) {
            (Some(first), Some(last)) => (first - last).abs(),
            _ => 0.0,
        };
        if eager_losses.len() != graphed_losses.len() {
            check.loss_off = f64::INFINITY;
        }
        for (eager, graphed) in eager_losses.iter().zip(graphed_losses) {
            let allowed = LOSS_PROGRESS_ALLOWED * progress + noise_rel * eager.abs();
            let off = if (eager - graphed).abs() == 0.0 {
                0.0
            } else {
                (eager - graphed).abs() / allowed
            };
            // NaN (a NaN loss, or 0/0) fails.
            check.loss_off = if off.is_nan() {
                f64::INFINITY
            } else {
                check.loss_off.max(off)
            };
        }
        check
    }

    /// Whether at most 1% of every parameter's elements are off and every loss is within its
    /// allowance.
    pub fn passed(&self) -> bool {
        self.param_off <= PARAM_OFF_ALLOWED && self.loss_off <= 1.0
    }
}

/// The fraction of `graphed`'s elements off from `eager`'s by more than half a step plus
/// `noise_rel` of the value (1.0 where shapes or dtypes differ), and the element farthest off
/// in units of that allowance, when one is off.
fn fraction_off(
    lr: f64,
    noise_rel: f64,
    eager: &TensorData,
    graphed: &TensorData,
) -> (f64, Option<ElementOff>) {
    if eager.shape() != graphed.shape() || eager.dtype() != graphed.dtype() {
        return (1.0, None);
    }
    let (Ok(eager_values), Ok(graphed_values)) = (
        eager.clone().try_to_vec_as::<f32>(),
        graphed.clone().try_to_vec_as::<f32>(),
    ) else {
        return (1.0, None);
    };
    if eager_values.is_empty() {
        return (0.0, None);
    }
    let mut off = 0usize;
    // (index, distance in allowances); NaN counts as infinitely far.
    let mut farthest: Option<(usize, f64)> = None;
    for (index, (&e, &g)) in eager_values.iter().zip(&graphed_values).enumerate() {
        let (e, g) = (f64::from(e), f64::from(g));
        let allowed = 0.5 * lr + noise_rel * e.abs();
        // A NaN on either side is off: the comparison is false for it.
        if (e - g).abs() <= allowed {
            continue;
        }
        off += 1;
        let distance = (e - g).abs() / allowed;
        let distance = if distance.is_nan() {
            f64::INFINITY
        } else {
            distance
        };
        if farthest.is_none_or(|(_, far)| distance > far) {
            farthest = Some((index, distance));
        }
    }
    let farthest = farthest.map(|(index, _)| ElementOff {
        index,
        shape: eager.shape().to_vec(),
        eager: eager_values[index],
        graphed: graphed_values[index],
    });
    (off as f64 / eager_values.len() as f64, farthest)
}

impl fmt::Display for StepCheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let verdict = if self.passed() { "ok" } else { "FAILED" };
        write!(
            f,
            "{verdict}: {:.2}% of parameter {} off by more than half a step (1% allowed), losses off {:.2} of their allowance",
            self.param_off * 100.0,
            self.worst_param
                .map_or_else(|| "-".to_string(), |p| p.to_string()),
            self.loss_off
        )?;
        if let Some(element) = &self.farthest {
            write!(
                f,
                "; farthest: element {} of {:?}, eager {} graphed {}",
                element.index, element.shape, element.eager, element.graphed
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(values: &[f32]) -> TensorData {
        TensorData::new(values.to_vec(), [values.len()])
    }

    const LR: f64 = 1e-2;

    fn check(eager: &[f32], graphed: &[f32], losses: (&[f64], &[f64])) -> StepCheck {
        StepCheck::new(LR, 2e-3, losses, (&[data(eager)], &[data(graphed)]))
    }

    const LOSSES: [f64; 4] = [1.0, 0.9, 0.8, 0.7];

    #[test]
    fn identical_runs_pass() {
        let params = [0.5, -0.25, 0.125];
        let result = check(&params, &params, (&LOSSES, &LOSSES));
        assert_eq!(result.param_off, 0.0);
        assert_eq!(result.loss_off, 0.0);
        assert!(result.passed(), "{result}");
    }

    #[test]
    fn rounding_noise_passes() {
        let eager: Vec<f32> = (0..200).map(|i| i as f32 / 100.0 - 1.0).collect();
        // A quarter of a step and a little relative noise on every element.
        let graphed: Vec<f32> = eager
            .iter()
            .map(|&e| e + 0.25 * LR as f32 + e * 1e-3)
            .collect();
        let losses = [1.0, 0.9 + 1e-3, 0.8 - 5e-3, 0.7];
        let result = check(&eager, &graphed, (&LOSSES, &losses));
        assert_eq!(result.param_off, 0.0);
        assert!(result.passed(), "{result}");
    }

    #[test]
    fn a_missed_update_fails() {
        // Graphed stayed at the initial values where eager moved by three steps.
        let eager: Vec<f32> = (0..100)
            .map(|i| i as f32 / 100.0 + 3.0 * LR as f32)
            .collect();
        let graphed: Vec<f32> = (0..100).map(|i| i as f32 / 100.0).collect();
        let result = check(&eager, &graphed, (&LOSSES, &LOSSES));
        assert_eq!(result.param_off, 1.0);
        assert_eq!(result.worst_param, Some(0));
        assert!(!result.passed());
    }

    #[test]
    fn the_farthest_element_is_named() {
        let eager = vec![0.0f32; 100];
        let mut graphed = eager.clone();
        graphed[3] = 2.0 * LR as f32;
        graphed[41] = -5.0 * LR as f32;
        let result = check(&eager, &graphed, (&LOSSES, &LOSSES));
        let farthest = result.farthest.clone().expect("two elements are off");
        assert_eq!((farthest.index, farthest.shape), (41, vec![100]));
        assert_eq!((farthest.eager, farthest.graphed), (0.0, -5.0 * LR as f32));
        assert!(
            result.to_string().contains("farthest: element 41 of [100]"),
            "{result}"
        );
        assert_eq!(check(&eager, &eager, (&LOSSES, &LOSSES)).farthest, None);
    }

    #[test]
    fn one_element_in_a_hundred_is_allowed_two_are_not() {
        let eager = vec![0.0f32; 100];
        let mut graphed = eager.clone();
        graphed[7] = 2.0 * LR as f32;
        assert!(check(&eager, &graphed, (&LOSSES, &LOSSES)).passed());
        graphed[8] = 2.0 * LR as f32;
        let result = check(&eager, &graphed, (&LOSSES, &LOSSES));
        assert!((result.param_off - 0.02).abs() < 1e-12);
        assert!(!result.passed(), "{result}");
    }

    #[test]
    fn shuffled_elements_fail() {
        // What an update indexing a padded buffer as dense did: values moved to other elements.
        let eager: Vec<f32> = (0..12).map(|i| i as f32 * 0.1).collect();
        let mut graphed = eager.clone();
        graphed.rotate_left(3);
        assert!(!check(&eager, &graphed, (&LOSSES, &LOSSES)).passed());
    }

    #[test]
    fn a_stale_forward_fails_on_the_losses() {
        // Parameters within tolerance, but the losses did not move: the forward read stale
        // parameters or a stale batch.
        let params = [0.5f32; 4];
        let stale = [1.0, 1.0, 1.0, 1.0];
        let result = check(&params, &params, (&LOSSES, &stale));
        assert!(result.loss_off > 1.0);
        assert!(!result.passed(), "{result}");
    }

    #[test]
    fn nan_fails() {
        let result = check(&[0.5], &[f32::NAN], (&LOSSES, &LOSSES));
        assert!(!result.passed());
        let result = check(&[0.5], &[0.5], (&LOSSES, &[1.0, f64::NAN, 0.8, 0.7]));
        assert!(!result.passed());
    }

    #[test]
    fn mismatched_shapes_or_counts_fail() {
        let result = StepCheck::new(
            LR,
            2e-3,
            (&LOSSES, &LOSSES),
            (
                &[data(&[0.0; 4])],
                &[TensorData::new(vec![0.0f32; 4], [2, 2])],
            ),
        );
        assert_eq!(result.param_off, 1.0);
        let result = StepCheck::new(LR, 2e-3, (&LOSSES, &LOSSES), (&[data(&[0.0])], &[]));
        assert!(!result.passed());
        let result = StepCheck::new(LR, 2e-3, (&LOSSES, &LOSSES[..2]), (&[], &[]));
        assert!(!result.passed());
    }
}
