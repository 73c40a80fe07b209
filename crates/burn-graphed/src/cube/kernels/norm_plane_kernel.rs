//! The layer norm's and RMS norm's forward with one plane per row, where planes are 32 units
//! with plane operations (CUDA): a lane loads its share of the row in 16-byte vectors (at most
//! [`MAX_VECTORS`] of them, held in registers), the row's sums are plane sums (shuffles: no
//! shared memory, no barrier), and each value is read from memory once. The cube kernel of
//! `norm_op.rs` (one cube of up to 256 units per row, one element a load, the row read three
//! times, two cube reductions) stays for every other row width and device.
//!
//! Arithmetic as the cube kernel's (`norm_op.rs`): each element in `f32`, two passes (the mean,
//! then the squares about it), one rounding at the store; only the order of the sums differs
//! (each lane's vectors in order, then the plane's shuffle tree), fixed for a device, so a
//! replay equals the eager call bit for bit.

use cubecl::prelude::*;

use super::super::dense::Dense;
use super::row_kernels::by_planes;

/// The most rows of a cube: one per plane.
const MAX_ROWS: usize = 8;
/// Units of a plane.
pub(in crate::cube) const LANES: usize = 32;
/// The most vectors a lane holds: rows of up to `LANES * MAX_VECTORS` vectors.
const MAX_VECTORS: usize = 8;

/// The vector width (elements) the plane kernel stages rows of `width` elements of `tensors`
/// (one dtype of `size` bytes) with on a device with `properties`, or `None` where it does not
/// take them: planes of exactly [`LANES`] units with plane operations, `width` a multiple of
/// `LANES` vectors and at most [`MAX_VECTORS`] vectors a lane, every buffer starting at a
/// multiple of the vector. The widest of 16 bytes, 8, 4 or one element that fits.
pub(in crate::cube) fn vector_width(
    properties: &cubecl::ir::DeviceProperties,
    width: usize,
    size: usize,
    tensors: &[&Dense],
) -> Option<usize> {
    if !by_planes(properties, LANES) || size == 0 {
        return None;
    }
    widest(width, size, Dense::common_alignment(tensors, [width]))
}

/// The widest vector of 16 bytes, 8, 4 or one element (of `size` bytes) that divides
/// `aligned` and gives each of [`LANES`] lanes at most [`MAX_VECTORS`] whole vectors of a row of
/// `width` elements.
fn widest(width: usize, size: usize, aligned: usize) -> Option<usize> {
    [16 / size, 8 / size, 4 / size, 1]
        .into_iter()
        .filter(|&vector| vector >= 1)
        .find(|&vector| {
            aligned.is_multiple_of(vector)
                && width.is_multiple_of(LANES * vector)
                && width / (LANES * vector) <= MAX_VECTORS
        })
}

/// Rows (planes) of a cube for `rows` rows on a device of `processors` multiprocessors (0 where
/// unknown): the most, up to [`MAX_ROWS`], that still give every multiprocessor a cube; `None`
/// where even 4 rows a cube leave a multiprocessor without one. Measured on an H200 (calls AL,
/// AN, AO): at 1024 rows 4 a cube, but at 128 rows (a sequence at batch 1) the language model's
/// call took 93 us with 8 rows a cube and 102-113 with one, against 85 with the cube kernel.
pub(in crate::cube) fn rows_per_cube(rows: usize, processors: usize) -> Option<usize> {
    [MAX_ROWS, 4]
        .into_iter()
        .find(|&per_cube| rows.div_ceil(per_cube) >= processors)
}

/// Forward: row `r` (plane `UNIT_POS_Y` of cube `r / per_cube`) of `input` normalized into `output`,
/// its mean and `rstd` into `mean[r]` and `rstd[r]`; with `centered` false (RMS norm) the mean
/// is 0 and not subtracted. `beta` is read only with `has_beta`. Lane `l` holds vectors
/// `k * LANES + l` of the row (`vector` elements each).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(in crate::cube) fn norm_forward_plane_kernel<F: Float>(
    input: &[F],
    gamma: &[F],
    beta: &[F],
    output: &mut [F],
    mean: &mut [f32],
    rstd: &mut [f32],
    epsilon: f32,
    #[comptime] width: usize,
    #[comptime] vector: usize,
    #[comptime] per_cube: usize,
    #[comptime] has_beta: bool,
    #[comptime] centered: bool,
    #[define(F)] _dtype: ElemType,
) {
    let size!(W) = vector;
    let row = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize * per_cube + UNIT_POS_Y as usize;
    // Uniform over the plane: its lanes share the row, so its plane sums are met by all of
    // them or none.
    if row < mean.len() {
        let count = comptime!(width / (LANES * vector));
        let lane = UNIT_POS_X as usize;
        let first = row * comptime!(width / vector);
        let x = input.as_vectorized().with_vector_size::<W>();
        let mut values = Array::<Vector<F, W>>::new(count);
        #[unroll]
        for k in 0..count {
            values[k] = x[first + k * LANES + lane];
        }
        let n = f32::new(comptime!(width as f32));
        let mut row_mean = 0.0f32;
        if centered {
            let mut sum = 0.0f32;
            #[unroll]
            for k in 0..count {
                #[unroll]
                for j in 0..vector {
                    sum += f32::cast_from(values[k].extract(j));
                }
            }
            row_mean = plane_sum(sum) / n;
        }
        let mut squares = 0.0f32;
        #[unroll]
        for k in 0..count {
            #[unroll]
            for j in 0..vector {
                let centered = f32::cast_from(values[k].extract(j)) - row_mean;
                squares += centered * centered;
            }
        }
        let denom = (plane_sum(squares) / n + epsilon).sqrt();
        let g = gamma.as_vectorized().with_vector_size::<W>();
        let b = beta.as_vectorized().with_vector_size::<W>();
        let out = output.as_vectorized_mut().with_vector_size_mut::<W>();
        #[unroll]
        for k in 0..count {
            let at = k * LANES + lane;
            let scale = g[at];
            let mut shift = Vector::<F, W>::zeroed();
            if has_beta {
                shift = b[at];
            }
            let mut y = Vector::<F, W>::zeroed();
            #[unroll]
            for j in 0..vector {
                let normalized = (f32::cast_from(values[k].extract(j)) - row_mean) / denom;
                let mut value = normalized * f32::cast_from(scale.extract(j));
                if has_beta {
                    value += f32::cast_from(shift.extract(j));
                }
                y.insert(j, F::cast_from(value));
            }
            out[first + at] = y;
        }
        if lane == 0 {
            mean[row] = row_mean;
            rstd[row] = 1.0f32 / denom;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::dense::gcd;
    use super::*;

    #[test]
    fn vectors_fit_the_row_and_the_alignment() {
        // The bench's rows (256 wide): 16-byte vectors, one a lane in bf16, two in f32.
        assert_eq!(widest(256, 2, 256), Some(8));
        assert_eq!(widest(256, 4, 256), Some(4));
        // A buffer 4 bf16 elements off a 16-byte boundary: 8-byte vectors.
        assert_eq!(widest(256, 2, gcd(256, 4)), Some(4));
        // Narrow rows take narrower vectors; rows that are no multiple of a plane, none.
        assert_eq!(widest(64, 2, 64), Some(2));
        assert_eq!(widest(48, 4, 48), None);
        // Wide rows: at most 8 vectors a lane (2048 bf16 elements), one element otherwise
        // past it.
        assert_eq!(widest(2048, 2, 2048), Some(8));
        assert_eq!(widest(4096, 2, 4096), None);
        assert_eq!(gcd(256, 40), 8);
    }

    #[test]
    fn small_calls_take_the_cube_kernel() {
        // The bench transformer's 1024 rows on 132 multiprocessors: 4 a cube (256 cubes).
        assert_eq!(rows_per_cube(1024, 132), Some(4));
        // A sequence of 128 at batch 1: the cube kernel.
        assert_eq!(rows_per_cube(128, 132), None);
        assert_eq!(rows_per_cube(1 << 20, 132), Some(8));
        // A device that does not say: the most.
        assert_eq!(rows_per_cube(5, 0), Some(8));
        assert_eq!(gcd(0, 12), 12);
    }
}
