//! Parameters compared relative to how far they moved: the path of each eager parameter over
//! the steps, and the allowance of parameters whose gradient is rounding noise.

use burn::tensor::TensorData;

use crate::tolerance::{TensorComparison, Tolerance, failed, largest, values_of};

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
