//! What the row-wise fused kernels share (`norm_op.rs`, `cross_entropy_op.rs`,
//! `linear_op.rs`, `embedding_op.rs`): one cube per row, its thread count, sums and maxima
//! over a cube in a fixed tree order (so that a replay computes what the eager call computed,
//! bit for bit), and the count of fused ops queued (the `testing` feature's proof that a fused
//! path ran).

use cubecl::prelude::*;

/// The most threads of a row's cube; a wider row takes several elements per thread.
pub(in crate::cube) const MAX_THREADS: usize = 256;
/// The fewest threads of a row's cube (one plane on every GPU here).
const MIN_THREADS: usize = 32;
/// Cubes along x before a grid takes a second dimension (wgpu's limit per dimension).
const MAX_CUBES_X: usize = 65_535;

/// The threads of a row's cube for rows of `width` elements: the next power of two, within
/// [`MIN_THREADS`, `MAX_THREADS`].
pub(in crate::cube) fn threads_for(width: usize) -> usize {
    width.next_power_of_two().clamp(MIN_THREADS, MAX_THREADS)
}

/// One cube per row: a grid of `rows` cubes, in two dimensions past [`MAX_CUBES_X`].
pub(in crate::cube) fn row_grid(rows: usize) -> CubeCount {
    row_grid_by(rows, 1)
}

/// [`row_grid`] with `z` cubes along z per row (a row's blocks).
pub(in crate::cube) fn row_grid_by(rows: usize, z: usize) -> CubeCount {
    let x = rows.clamp(1, MAX_CUBES_X);
    CubeCount::Static(x as u32, rows.div_ceil(x).max(1) as u32, z.max(1) as u32)
}

/// The sum of every unit's `value` over the cube, in a fixed tree order; every unit gets it.
/// Every unit of the cube must call it (it meets the cube at barriers).
#[cube]
pub(in crate::cube) fn cube_sum(value: f32, #[comptime] threads: usize) -> f32 {
    cube_reduce(value, threads, false)
}

/// The largest of every unit's `value` over the cube; every unit gets it. Every unit of the
/// cube must call it.
#[cube]
pub(in crate::cube) fn cube_max(value: f32, #[comptime] threads: usize) -> f32 {
    cube_reduce(value, threads, true)
}

/// Every unit's `value` combined over the cube of `threads` (a power of two) units in a fixed
/// order: by `max` with `largest`, else by `+`. Where the device's planes are exactly
/// [`PLANE`] units with plane operations (CUDA; wgpu on such a GPU), each plane combines its
/// units by shuffles and every unit then combines the planes' results in plane order (the
/// planes and lanes as the device numbers them, `PLANE_POS` and `UNIT_POS_PLANE`): one barrier.
/// Elsewhere (lavapipe's planes are narrower) a tree over a shared array: one barrier per
/// level. Either way the order is fixed for a device, so a replay computes what the eager call
/// computed, bit for bit. The result is read from a shared array of this call's own, so a next
/// call needs no barrier before it writes.
#[cube]
fn cube_reduce(value: f32, #[comptime] threads: usize, #[comptime] largest: bool) -> f32 {
    let properties = comptime::device_properties();
    let planes = comptime!(by_planes(&properties, threads));
    if planes {
        plane_reduce(value, threads, largest)
    } else {
        tree_reduce(value, threads, largest)
    }
}

/// [`cube_reduce`] by planes: shuffles within each plane, then the planes' results in order.
#[cube]
fn plane_reduce(value: f32, #[comptime] threads: usize, #[comptime] largest: bool) -> f32 {
    let part = if largest {
        plane_max(value)
    } else {
        plane_sum(value)
    };
    let count = comptime!(threads / PLANE);
    let mut shared = Shared::<[f32]>::new_slice(count);
    if UNIT_POS_PLANE == 0 {
        shared[PLANE_POS as usize] = part;
    }
    sync_cube();
    let mut result = shared[0];
    #[unroll]
    for p in 1..count {
        if largest {
            result = f32::max(result, shared[p]);
        } else {
            result += shared[p];
        }
    }
    result
}

/// [`cube_reduce`] by a tree over a shared array.
#[cube]
fn tree_reduce(value: f32, #[comptime] threads: usize, #[comptime] largest: bool) -> f32 {
    let mut shared = Shared::<[f32]>::new_slice(threads);
    let unit = UNIT_POS as usize;
    shared[unit] = value;
    sync_cube();
    let mut active = threads.runtime();
    while active > 1 {
        active /= 2;
        if unit < active {
            let other = shared[unit + active];
            if largest {
                shared[unit] = f32::max(shared[unit], other);
            } else {
                shared[unit] += other;
            }
        }
        sync_cube();
    }
    shared[0]
}

/// Units of a plane where [`cube_reduce`] combines by planes.
const PLANE: usize = 32;

/// Whether [`cube_reduce`] over `threads` units combines by planes on a device with
/// `properties`: planes of exactly [`PLANE`] units (so that a plane's shuffles cover the same
/// units on every launch), plane operations, and at least one whole plane.
pub(in crate::cube) fn by_planes(
    properties: &cubecl::ir::DeviceProperties,
    threads: usize,
) -> bool {
    let hardware = &properties.hardware;
    properties
        .features
        .plane
        .contains(cubecl::ir::features::Plane::Ops)
        && hardware.plane_size_min == PLANE as u32
        && hardware.plane_size_max == PLANE as u32
        && threads.is_multiple_of(PLANE)
}

/// The row this cube normalizes (cubes past the last row have none).
#[cube]
pub(in crate::cube) fn row_of_cube() -> usize {
    (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize
}

/// Fused ops (norms, cross-entropies) queued in this process (the `testing` feature's proof
/// that the fused path ran).
static FORWARDS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many fused ops this process queued.
#[cfg(feature = "testing")]
pub(crate) fn forwards() -> usize {
    FORWARDS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Counts one fused op's forward.
pub(in crate::cube) fn count_forward() {
    FORWARDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}
