//! A 2-D convolution in one kernel forward and one or three backward, reading and writing the
//! `[batch, channels, height, width]` layout the model holds, with its own autodiff node: what
//! [`crate::nn::conv2d`] runs on burn's cubecl backends, where burn-cubecl's convolution moves
//! the data around its products (slices, packs, copies and fills: half the bench CNN's step).
//!
//! Direct convolution: a unit computes one output pixel for a block of output channels (the
//! forward), or one input pixel for a block of input channels (the input gradient), reading
//! each input value once per block and the weights as values common to every unit of a cube.
//! The weight gradient is a sum over every output pixel: one cube per output-channel block and
//! input channel (and per chunk of pixels where there are few such cubes) sums its pixels per
//! unit, then over the cube in shared memory, then a second kernel sums the chunks in order.
//! Stride, dilation, groups and asymmetric padding as burn's `ConvOptions`.
//!
//! Arithmetic: every value is read in its dtype and summed in `f32`, rounded once to the dtype
//! (also in `bf16`, where burn-cubecl's convolutions sum in `bf16` after a failed tune:
//! BENCHMARKS.md). The sums run in a fixed order, so a replay computes what the eager call
//! computed, bit for bit; against burn's convolution they differ by the order of the sums and,
//! in `f32` on CUDA, by TF32 where burn's tune picks it (see the tests' tolerance).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Cube, backend_extension};
use burn::tensor::{DType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::adam_op::kernel_elem;
use super::buffers::FusedTensor;
use super::dense::Dense;
use super::row_kernels::count_forward;
use super::values::{ConvSpec, OpInputs};

/// The autodiff tensor of burn's cubecl backend.
type AutodiffTensor = FloatTensor<Autodiff<Cube>>;

/// Units of a cube of the forward and the input gradient (one pixel each).
const PIXEL_THREADS: usize = 256;
/// Units of a cube of the weight gradient.
const WEIGHT_THREADS: usize = 128;
/// The most kernel taps (`kernel_h * kernel_w`) the fused path takes: the weight gradient holds
/// `taps` sums per unit in registers and `taps * WEIGHT_THREADS` in shared memory.
pub(crate) const MAX_TAPS: usize = 64;
/// Sums of the weight gradient one unit holds at most: `block * taps`, the block of output
/// channels chosen so (32 KiB of shared memory with [`WEIGHT_THREADS`] units).
const WEIGHT_SUMS: usize = 64;
/// Cubes along x before a grid takes its z dimension (wgpu's limit per dimension).
const MAX_CUBES: usize = 65_535;
/// Weight-gradient cubes wanted at least (a few per multiprocessor of the largest GPUs): fewer
/// output-channel blocks times input channels split the pixels into chunks.
const WEIGHT_CUBES: usize = 1024;
/// Pixels one weight-gradient chunk sums at least (per unit: this over [`WEIGHT_THREADS`]).
const MIN_CHUNK_PIXELS: usize = 2048;
/// Pixels a unit of the weight gradient loads before it multiplies (loads in flight at once).
const WEIGHT_BATCH: usize = 4;

/// The sizes of one convolution the kernels take at run time (the kernel's size, stride and
/// dilation are compile-time constants of each kernel: [`Taps`]).
#[derive(CubeType, CubeLaunch, Clone, Copy)]
#[expand(derive(Clone))]
pub(super) struct Geometry {
    batch: u32,
    in_channels: u32,
    height: u32,
    width: u32,
    out_channels: u32,
    out_height: u32,
    out_width: u32,
    pad_top: u32,
    pad_left: u32,
    /// Input channels per group.
    group_in: u32,
    /// Output channels per group.
    group_out: u32,
}

/// A kernel's size, stride and dilation (height, width): compile-time constants of the
/// kernels, so that their loops over the taps unroll and their divisions are by constants.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct Taps {
    kernel: [usize; 2],
    stride: [usize; 2],
    dilation: [usize; 2],
}

/// Channels whose weights a cube stages at once in shared memory, for `per_channel` values each
/// (a block's taps): at most 2048 values (8 KiB), at least one channel.
fn chunk_channels(per_channel: usize) -> usize {
    (2048 / per_channel.max(1)).max(1)
}

/// Rows (or columns) of a padded input that no tap of a kernel reaches: a pixel past the last
/// one gets this row, so that every bounds check of its loads fails.
const OUTSIDE: u32 = 1 << 30;

/// The pixels of this unit: `count` pixels `PIXEL_THREADS` apart, starting at the cube's tile,
/// as `(plane, row, column)` of `[batch, rows, columns]`, where `plane` is the batch index; a
/// pixel past `batch * rows * columns` gets row [`OUTSIDE`].
#[cube]
fn unit_pixels(
    batch: u32,
    rows: u32,
    columns: u32,
    planes: &mut Array<u32>,
    ys: &mut Array<u32>,
    xs: &mut Array<u32>,
    #[comptime] count: usize,
) {
    let tile = (CUBE_POS_Z * CUBE_COUNT_X + CUBE_POS_X) * comptime!((PIXEL_THREADS * count) as u32);
    let total = batch * rows * columns;
    #[unroll]
    for i in 0..count {
        let p = tile + UNIT_POS_X + (i * PIXEL_THREADS) as u32;
        if p < total {
            xs[i] = p % columns;
            ys[i] = (p / columns) % rows;
            planes[i] = p / (columns * rows);
        } else {
            xs[i] = 0;
            ys[i] = OUTSIDE;
            planes[i] = 0;
        }
    }
}

/// Forward: `pixels` output pixels per unit (`PIXEL_THREADS` apart) for the `block` output
/// channels of cube row `CUBE_POS_Y` (blocks within each group), plus the bias with `has_bias`.
/// The block's weights are staged in shared memory, `chunk` input channels at a time, and read
/// by every unit at the same address.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn forward_kernel<F: Float>(
    input: &[F],
    weight: &[F],
    bias: &[F],
    output: &mut [F],
    g: Geometry,
    #[comptime] taps: Taps,
    #[comptime] block: usize,
    #[comptime] pixels: usize,
    #[comptime] has_bias: bool,
    #[define(F)] _dtype: ElemType,
) {
    let kh = comptime!(taps.kernel[0]);
    let kw = comptime!(taps.kernel[1]);
    let sh = comptime!(taps.stride[0] as u32);
    let sw = comptime!(taps.stride[1] as u32);
    let dh = comptime!(taps.dilation[0]);
    let dw = comptime!(taps.dilation[1]);
    let kernel_taps = comptime!(kh * kw);
    let chunk = comptime!(chunk_channels(kernel_taps * block));
    let staged = comptime!(chunk * kernel_taps * block);
    let group_in = g.group_in;
    let group_out = g.group_out;
    let blocks = (group_out + block as u32 - 1) / block as u32;
    let group = CUBE_POS_Y / blocks;
    let first = (CUBE_POS_Y % blocks) * block as u32;
    let mut planes = Array::<u32>::new(pixels);
    let mut ys = Array::<u32>::new(pixels);
    let mut xs = Array::<u32>::new(pixels);
    unit_pixels(
        g.batch,
        g.out_height,
        g.out_width,
        &mut planes,
        &mut ys,
        &mut xs,
        pixels,
    );
    // Each pixel's first input row and column (`- padding`, wrapping below 0 to values no
    // bounds check passes until a tap brings them back), and its batch's first input channel.
    let mut rows = Array::<u32>::new(pixels);
    let mut columns = Array::<u32>::new(pixels);
    #[unroll]
    for i in 0..pixels {
        rows[i] = OUTSIDE;
        columns[i] = 0;
        if ys[i] != OUTSIDE {
            rows[i] = ys[i] * sh - g.pad_top;
            columns[i] = xs[i] * sw - g.pad_left;
        }
        planes[i] = planes[i] * g.in_channels + group * group_in;
    }
    let mut acc = Array::<f32>::new(comptime!(pixels * block));
    #[unroll]
    for a in 0..comptime!(pixels * block) {
        acc[a] = 0.0f32;
    }
    let mut shared = Shared::<[f32]>::new_slice(staged);
    let unit = UNIT_POS_X as usize;
    let mut ci0 = 0u32;
    while ci0 < group_in {
        sync_cube();
        let mut idx = unit;
        while idx < staged {
            let j = (idx % block) as u32;
            let tap = (idx / block) % kernel_taps;
            let c = (idx / comptime!(block * kernel_taps)) as u32;
            let mut value = 0.0f32;
            if ci0 + c < group_in && first + j < group_out {
                let channel = group * group_out + first + j;
                let at = ((channel * group_in + ci0 + c) as usize) * kernel_taps + tap;
                value = f32::cast_from(weight[at]);
            }
            shared[idx] = value;
            idx += PIXEL_THREADS;
        }
        sync_cube();
        let mut count = group_in - ci0;
        if count > chunk as u32 {
            count = chunk as u32;
        }
        for c in 0..count {
            let mut bases = Array::<u32>::new(pixels);
            #[unroll]
            for i in 0..pixels {
                bases[i] = (planes[i] + ci0 + c) * g.height;
            }
            #[unroll]
            for ky in 0..kh {
                #[unroll]
                for kx in 0..kw {
                    let mut values = Array::<f32>::new(pixels);
                    #[unroll]
                    for i in 0..pixels {
                        let iy = rows[i] + (ky * dh) as u32;
                        let ix = columns[i] + (kx * dw) as u32;
                        let mut value = 0.0f32;
                        if iy < g.height && ix < g.width {
                            value =
                                f32::cast_from(input[((bases[i] + iy) * g.width + ix) as usize]);
                        }
                        values[i] = value;
                    }
                    let base = ((c as usize) * kernel_taps + ky * kw + kx) * block;
                    #[unroll]
                    for j in 0..block {
                        let w = shared[base + j];
                        #[unroll]
                        for i in 0..pixels {
                            acc[i * block + j] += values[i] * w;
                        }
                    }
                }
            }
        }
        ci0 += chunk as u32;
    }
    #[unroll]
    for i in 0..pixels {
        if ys[i] != OUTSIDE {
            let oy = ys[i];
            let ox = xs[i];
            let n = (planes[i] - group * group_in) / g.in_channels;
            #[unroll]
            for j in 0..block {
                if first + (j as u32) < group_out {
                    let channel = group * group_out + first + j as u32;
                    let mut y = acc[i * block + j];
                    if has_bias {
                        y += f32::cast_from(bias[channel as usize]);
                    }
                    let at =
                        ((n * g.out_channels + channel) * g.out_height + oy) * g.out_width + ox;
                    output[at as usize] = F::cast_from(y);
                }
            }
        }
    }
}

/// Input gradient: `pixels` input pixels per unit for the `block` input channels of cube row
/// `CUBE_POS_Y` (blocks within each group), from the output gradient `grad`. The block's
/// weights are staged in shared memory, `chunk` output channels at a time.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn input_grad_kernel<F: Float>(
    grad: &[F],
    weight: &[F],
    dx: &mut [F],
    g: Geometry,
    #[comptime] taps: Taps,
    #[comptime] block: usize,
    #[comptime] pixels: usize,
    #[define(F)] _dtype: ElemType,
) {
    let kh = comptime!(taps.kernel[0]);
    let kw = comptime!(taps.kernel[1]);
    let sh = comptime!(taps.stride[0] as u32);
    let sw = comptime!(taps.stride[1] as u32);
    let dh = comptime!(taps.dilation[0]);
    let dw = comptime!(taps.dilation[1]);
    let kernel_taps = comptime!(kh * kw);
    let chunk = comptime!(chunk_channels(kernel_taps * block));
    let staged = comptime!(chunk * kernel_taps * block);
    let group_in = g.group_in;
    let group_out = g.group_out;
    let blocks = (group_in + block as u32 - 1) / block as u32;
    let group = CUBE_POS_Y / blocks;
    let first = (CUBE_POS_Y % blocks) * block as u32;
    let mut planes = Array::<u32>::new(pixels);
    let mut ys = Array::<u32>::new(pixels);
    let mut xs = Array::<u32>::new(pixels);
    unit_pixels(
        g.batch,
        g.height,
        g.width,
        &mut planes,
        &mut ys,
        &mut xs,
        pixels,
    );
    // Each pixel's padded row and column, and its batch's first output channel of the group.
    #[unroll]
    for i in 0..pixels {
        if ys[i] != OUTSIDE {
            ys[i] += g.pad_top;
            xs[i] += g.pad_left;
        }
        planes[i] = planes[i] * g.out_channels + group * group_out;
    }
    let mut acc = Array::<f32>::new(comptime!(pixels * block));
    #[unroll]
    for a in 0..comptime!(pixels * block) {
        acc[a] = 0.0f32;
    }
    let mut shared = Shared::<[f32]>::new_slice(staged);
    let unit = UNIT_POS_X as usize;
    let mut co0 = 0u32;
    while co0 < group_out {
        sync_cube();
        let mut idx = unit;
        while idx < staged {
            let j = (idx % block) as u32;
            let tap = (idx / block) % kernel_taps;
            let c = (idx / comptime!(block * kernel_taps)) as u32;
            let mut value = 0.0f32;
            if co0 + c < group_out && first + j < group_in {
                let channel = group * group_out + co0 + c;
                let at = ((channel * group_in + first + j) as usize) * kernel_taps + tap;
                value = f32::cast_from(weight[at]);
            }
            shared[idx] = value;
            idx += PIXEL_THREADS;
        }
        sync_cube();
        let mut count = group_out - co0;
        if count > chunk as u32 {
            count = chunk as u32;
        }
        for c in 0..count {
            #[unroll]
            for ky in 0..kh {
                #[unroll]
                for kx in 0..kw {
                    let reach_y = (ky * dh) as u32;
                    let reach_x = (kx * dw) as u32;
                    let mut values = Array::<f32>::new(pixels);
                    #[unroll]
                    for i in 0..pixels {
                        // The output row and column this tap came from: `(padded - reach) /
                        // stride` where that divides (a difference below 0 wraps to a value no
                        // bounds check passes).
                        let ty = ys[i] - reach_y;
                        let tx = xs[i] - reach_x;
                        let mut oy = ty;
                        let mut ox = tx;
                        let mut divides = true;
                        if comptime!(sh != 1 || sw != 1) {
                            oy = ty / sh;
                            ox = tx / sw;
                            divides = oy * sh == ty && ox * sw == tx;
                        }
                        let mut value = 0.0f32;
                        if divides && oy < g.out_height && ox < g.out_width {
                            let row = (planes[i] + co0 + c) * g.out_height + oy;
                            value = f32::cast_from(grad[(row * g.out_width + ox) as usize]);
                        }
                        values[i] = value;
                    }
                    let base = ((c as usize) * kernel_taps + ky * kw + kx) * block;
                    #[unroll]
                    for j in 0..block {
                        let w = shared[base + j];
                        #[unroll]
                        for i in 0..pixels {
                            acc[i * block + j] += values[i] * w;
                        }
                    }
                }
            }
        }
        co0 += chunk as u32;
    }
    #[unroll]
    for i in 0..pixels {
        if ys[i] != OUTSIDE {
            let y = ys[i] - g.pad_top;
            let x = xs[i] - g.pad_left;
            let n = (planes[i] - group * group_out) / g.out_channels;
            #[unroll]
            for j in 0..block {
                if first + (j as u32) < group_in {
                    let channel = group * group_in + first + j as u32;
                    let at = ((n * g.in_channels + channel) * g.height + y) * g.width + x;
                    dx[at as usize] = F::cast_from(acc[i * block + j]);
                }
            }
        }
    }
}

/// Every unit's `sums` values (`shared[s * threads + unit]`) summed over the cube into
/// `shared[s * threads]`, in a fixed tree order. Every unit of the cube must call it.
#[cube]
fn cube_sums(shared: &mut Shared<[f32]>, #[comptime] sums: usize, #[comptime] threads: usize) {
    let unit = UNIT_POS_X as usize;
    sync_cube();
    let mut active = threads.runtime();
    while active > 1 {
        active /= 2;
        if unit < active {
            #[unroll]
            for s in 0..sums {
                let other = shared[s * threads + unit + active];
                shared[s * threads + unit] += other;
            }
        }
        sync_cube();
    }
}

/// Weight and bias gradients in partial sums: cube `(b, ci, k)` sums, over the output pixels of
/// chunk `k` (`chunk` pixels each), `grad * input` for every tap of the weights of output
/// channels `b * block ..` (within a group) and input channel `ci` of the group, into row `k` of
/// `partial` (`[chunks, out_channels * group_in * taps]`, `f32`); the cubes of `ci == 0` also
/// sum `grad` per output channel into row `k` of `bias_partial` (`[chunks, out_channels]`).
/// A unit walks its pixels `threads` apart, [`WEIGHT_BATCH`] at a time, carrying column, row
/// and batch index from one to the next (no division per pixel).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn weight_grad_kernel<F: Float>(
    grad: &[F],
    input: &[F],
    partial: &mut [f32],
    bias_partial: &mut [f32],
    g: Geometry,
    chunk: u32,
    #[comptime] taps: Taps,
    #[comptime] block: usize,
    #[comptime] threads: usize,
    #[define(F)] _dtype: ElemType,
) {
    let kh = comptime!(taps.kernel[0]);
    let kw = comptime!(taps.kernel[1]);
    let sh = comptime!(taps.stride[0] as u32);
    let sw = comptime!(taps.stride[1] as u32);
    let dh = comptime!(taps.dilation[0]);
    let dw = comptime!(taps.dilation[1]);
    let kernel_taps = comptime!(kh * kw);
    let sums = comptime!(block * kernel_taps);
    let group_in = g.group_in;
    let group_out = g.group_out;
    let blocks = (group_out + block as u32 - 1) / block as u32;
    let group = CUBE_POS_X / blocks;
    let first = (CUBE_POS_X % blocks) * block as u32;
    let ci = CUBE_POS_Y;
    let chunk_index = CUBE_POS_Z;
    let out_h = g.out_height;
    let out_w = g.out_width;
    let pixels = g.batch * out_h * out_w;
    let unit = UNIT_POS_X;
    let mut acc = Array::<f32>::new(sums);
    #[unroll]
    for s in 0..sums {
        acc[s] = 0.0f32;
    }
    let mut bias_acc = Array::<f32>::new(block);
    // The grad rows of this block's output channels, past the group's last one clamped to it
    // (their sums are not written).
    let mut channels = Array::<u32>::new(block);
    #[unroll]
    for j in 0..block {
        bias_acc[j] = 0.0f32;
        let mut channel = first + j as u32;
        if channel >= group_out {
            channel = group_out - 1;
        }
        channels[j] = group * group_out + channel;
    }
    let start = chunk_index * chunk;
    let mut end = start + chunk;
    if end > pixels {
        end = pixels;
    }
    // The first pixel, and the step to the next as (columns, rows, batches) with carries.
    let mut p = start + unit;
    let mut ox = p % out_w;
    let mut oy = (p / out_w) % out_h;
    let mut n = p / (out_w * out_h);
    let step = threads as u32;
    let step_x = step % out_w;
    let step_y = (step / out_w) % out_h;
    let step_n = step / (out_w * out_h);
    let in_plane = group * group_in + ci;
    while p < end {
        // `WEIGHT_BATCH` pixels' loads first (independent of each other), then their products.
        let mut dys = Array::<f32>::new(comptime!(WEIGHT_BATCH * block));
        let mut xs = Array::<f32>::new(comptime!(WEIGHT_BATCH * kernel_taps));
        #[unroll]
        for b in 0..WEIGHT_BATCH {
            let valid = p < end;
            let grad_base = n * g.out_channels;
            #[unroll]
            for j in 0..block {
                let mut dy = 0.0f32;
                if valid {
                    let at = ((grad_base + channels[j]) * out_h + oy) * out_w + ox;
                    dy = f32::cast_from(grad[at as usize]);
                }
                dys[b * block + j] = dy;
                bias_acc[j] += dy;
            }
            let plane = (n * g.in_channels + in_plane) * g.height;
            let row0 = oy * sh;
            let col0 = ox * sw;
            #[unroll]
            for ky in 0..kh {
                let iy = row0 + (ky * dh) as u32;
                let row_inside = valid && iy >= g.pad_top && iy - g.pad_top < g.height;
                let line = (plane + iy - g.pad_top) * g.width;
                #[unroll]
                for kx in 0..kw {
                    let ix = col0 + (kx * dw) as u32;
                    let mut x = 0.0f32;
                    if row_inside && ix >= g.pad_left && ix - g.pad_left < g.width {
                        x = f32::cast_from(input[(line + ix - g.pad_left) as usize]);
                    }
                    xs[b * kernel_taps + ky * kw + kx] = x;
                }
            }
            p += step;
            ox += step_x;
            if ox >= out_w {
                ox -= out_w;
                oy += 1;
            }
            oy += step_y;
            if oy >= out_h {
                oy -= out_h;
                n += 1;
            }
            n += step_n;
        }
        #[unroll]
        for b in 0..WEIGHT_BATCH {
            #[unroll]
            for j in 0..block {
                #[unroll]
                for t in 0..kernel_taps {
                    acc[j * kernel_taps + t] += dys[b * block + j] * xs[b * kernel_taps + t];
                }
            }
        }
    }
    // Over the cube, every sum at once.
    let unit = unit as usize;
    let mut shared = Shared::<[f32]>::new_slice(comptime!(sums * threads));
    #[unroll]
    for s in 0..sums {
        shared[s * threads + unit] = acc[s];
    }
    cube_sums(&mut shared, sums, threads);
    let weights = (g.out_channels * group_in) as usize * kernel_taps;
    if unit < sums {
        let j = (unit / kernel_taps) as u32;
        if first + j < group_out {
            let channel = group * group_out + first + j;
            let at = ((channel * group_in + ci) as usize) * kernel_taps + unit % kernel_taps;
            partial[chunk_index as usize * weights + at] = shared[unit * threads];
        }
    }
    // The bias: the same tree over the bias sums, in the cubes of the group's first input
    // channel (uniform over the cube).
    if ci == 0 {
        sync_cube();
        #[unroll]
        for j in 0..block {
            shared[j * threads + unit] = bias_acc[j];
        }
        cube_sums(&mut shared, block, threads);
        if unit < block && first + (unit as u32) < group_out {
            let channel = group * group_out + first + unit as u32;
            let at = chunk_index * g.out_channels + channel;
            bias_partial[at as usize] = shared[unit * threads];
        }
    }
}

/// The weight and bias gradients from their partial sums: element `i` of `weight_grad` (and of
/// `bias_grad`, for `i < out_channels`) summed over the chunks' rows in order, rounded once.
#[cube(launch_unchecked)]
fn chunk_sum_kernel<F: Float>(
    partial: &[f32],
    bias_partial: &[f32],
    weight_grad: &mut [F],
    bias_grad: &mut [F],
    chunks: u32,
    #[define(F)] _dtype: ElemType,
) {
    let i = ABSOLUTE_POS;
    let weights = weight_grad.len();
    let out_channels = bias_grad.len();
    if i < weights {
        let mut sum = 0.0f32;
        for k in 0..chunks as usize {
            sum += partial[k * weights + i];
        }
        weight_grad[i] = F::cast_from(sum);
    }
    if i < out_channels {
        let mut sum = 0.0f32;
        for k in 0..chunks as usize {
            sum += bias_partial[k * out_channels + i];
        }
        bias_grad[i] = F::cast_from(sum);
    }
}

/// The kernels as lazy fusion operations on burn's cubecl backend.
#[backend_extension(Cube, Fusion)]
pub(crate) trait ConvKernels: Backend {
    /// The forward: `[batch, out_channels, out_h, out_w]` in the input's dtype. `bias` is read
    /// only with `spec.has_bias` (pass the weight otherwise). Shapes, dtypes and the spec were
    /// checked by the caller ([`conv2d`]).
    #[fusion(meta = |input, weight, _bias, spec| {
        burn::backend::fusion::custom::TensorSpec::new(
            Shape::new(spec.output_shape(&input.shape.dims::<4>(), &weight.shape.dims::<4>())),
            input.dtype,
        )
    })]
    fn conv_forward(
        input: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        spec: ConvSpec,
    ) -> FloatTensor<Self>;

    /// The input gradient, of `input`'s shape and dtype (its values are not read).
    #[fusion(meta = |_grad, input, _weight, _spec| input.clone())]
    fn conv_input_grad(
        grad: FloatTensor<Self>,
        input: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        spec: ConvSpec,
    ) -> FloatTensor<Self>;

    /// `(weight gradient, bias gradient)`: of the weight's shape, and `[out_channels]`, in the
    /// weight's dtype (the bias gradient is computed with or without a bias).
    #[fusion(meta = |_grad, _input, weight, _spec| {
        let out_channels = weight.shape[0];
        (
            weight.clone(),
            burn::backend::fusion::custom::TensorSpec::new(Shape::new([out_channels]), weight.dtype),
        )
    })]
    fn conv_weight_grad(
        grad: FloatTensor<Self>,
        input: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        spec: ConvSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}

/// The element type of a float tensor the kernels take; checked by the caller (`nn`), so another
/// one here breaks this module's invariant.
fn elem_of(tensor: &CubeTensor) -> ElemType {
    kernel_elem(tensor.dtype).unwrap_or_else(|| {
        panic!(
            "burn-graphed: convolution kernel given {:?} (the caller checks the dtype)",
            tensor.dtype
        )
    })
}

/// The launch's sizes from the input's and the weight's shapes, the kernel's compile-time
/// constants, and the output's shape.
fn geometry(
    input: &CubeTensor,
    weight: &CubeTensor,
    spec: &ConvSpec,
) -> (Geometry, Taps, [usize; 4]) {
    let x = input.meta.shape().dims::<4>();
    let w = weight.meta.shape().dims::<4>();
    let out = spec.output_shape(&x, &w);
    let u = |v: usize| v as u32;
    let g = Geometry {
        batch: u(x[0]),
        in_channels: u(x[1]),
        height: u(x[2]),
        width: u(x[3]),
        out_channels: u(w[0]),
        out_height: u(out[2]),
        out_width: u(out[3]),
        pad_top: u(spec.padding[0].0),
        pad_left: u(spec.padding[1].0),
        group_in: u(w[1]),
        group_out: u(w[0] / spec.groups),
    };
    let taps = Taps {
        kernel: [w[2], w[3]],
        stride: spec.stride,
        dilation: spec.dilation,
    };
    (g, taps, out)
}

impl Geometry {
    fn launch(&self) -> GeometryLaunch {
        GeometryLaunch::new(
            self.batch,
            self.in_channels,
            self.height,
            self.width,
            self.out_channels,
            self.out_height,
            self.out_width,
            self.pad_top,
            self.pad_left,
            self.group_in,
            self.group_out,
        )
    }
}

/// `(pixels per unit, channels per unit)` of the forward and the input gradient, over `pixels`
/// pixels of `groups` groups of `channels` channels: the most products per staged weight read
/// and per input read (pixels times channels) that still gives [`PIXEL_CUBES`] cubes, so that a
/// small convolution still spreads over the whole GPU; the fewest otherwise.
fn pixel_tiling(pixels: usize, groups: usize, channels: usize) -> (usize, usize) {
    #[cfg(feature = "testing")]
    if let Some((per_unit, block)) = forced_tiling() {
        return (per_unit, block.min(channels.max(1)));
    }
    const TILINGS: [(usize, usize); 7] = [(4, 8), (4, 4), (2, 8), (2, 4), (1, 8), (1, 4), (1, 2)];
    let cubes = |(per_unit, block): (usize, usize)| {
        let block = block.min(channels.max(1));
        pixels.div_ceil(PIXEL_THREADS * per_unit) * groups * channels.div_ceil(block)
    };
    let (per_unit, block) = TILINGS
        .into_iter()
        .find(|&tiling| cubes(tiling) >= PIXEL_CUBES)
        .unwrap_or((1, 1));
    (per_unit, block.min(channels.max(1)))
}

/// A tiling every forward and input gradient takes, `per_unit << 8 | block`, or 0 (chosen by
/// size): `burn_graphed::testing::force_conv_tiling`, so that small test shapes run every
/// tiling (each computes every sum in the same order: the values do not depend on it).
#[cfg(feature = "testing")]
static FORCED_TILING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Sets (or with `None` clears) the tiling of [`FORCED_TILING`].
#[cfg(feature = "testing")]
pub(crate) fn force_tiling(tiling: Option<(usize, usize)>) {
    let code = tiling.map_or(0, |(per_unit, block)| {
        (per_unit.clamp(1, 255) << 8) | block.clamp(1, 255)
    });
    FORCED_TILING.store(code, std::sync::atomic::Ordering::Relaxed);
}

#[cfg(feature = "testing")]
fn forced_tiling() -> Option<(usize, usize)> {
    match FORCED_TILING.load(std::sync::atomic::Ordering::Relaxed) {
        0 => None,
        code => Some((code >> 8, code & 0xff)),
    }
}

/// Cubes of the forward and the input gradient wanted at least: two per multiprocessor of the
/// largest GPUs here (132 on an H100 or H200).
const PIXEL_CUBES: usize = 256;

/// A grid of `pixels` pixels, `per_unit` per unit in cubes of [`PIXEL_THREADS`], `blocks` cubes
/// along y.
fn pixel_grid(pixels: usize, per_unit: usize, blocks: usize) -> CubeCount {
    let cubes = pixels.div_ceil(PIXEL_THREADS * per_unit).max(1);
    let x = cubes.min(MAX_CUBES);
    CubeCount::Static(x as u32, blocks as u32, cubes.div_ceil(x) as u32)
}

/// Output channels per weight-gradient cube for `taps` kernel taps: at most 4, within
/// [`WEIGHT_SUMS`] sums per unit and the group's output channels.
fn weight_block(taps: usize, group_out: usize) -> usize {
    (WEIGHT_SUMS / taps).clamp(1, 4).min(group_out.max(1))
}

/// `(chunks, pixels per chunk)` of the weight gradient's sums over `pixels` output pixels, for
/// `cubes` cubes per chunk.
fn weight_chunks(pixels: usize, cubes: usize) -> (usize, usize) {
    let wanted = WEIGHT_CUBES.div_ceil(cubes.max(1));
    let most = pixels.div_ceil(MIN_CHUNK_PIXELS).max(1);
    let chunks = wanted.clamp(1, most.min(MAX_CUBES));
    let per_chunk = pixels.div_ceil(chunks).max(1);
    (pixels.div_ceil(per_chunk).max(1), per_chunk)
}

impl ConvKernels for CubeBackend {
    fn conv_forward(
        input: CubeTensor,
        weight: CubeTensor,
        bias: CubeTensor,
        spec: ConvSpec,
    ) -> CubeTensor {
        let (g, taps, out) = geometry(&input, &weight, &spec);
        let elem = elem_of(&input);
        let client = input.client.clone();
        let output = Dense::new_empty(
            client.clone(),
            input.device.clone(),
            Shape::new(out),
            input.dtype,
        );
        let (input, weight, bias) = (Dense::of(&input), Dense::of(&weight), Dense::of(&bias));
        let pixels = out[0] * out[2] * out[3];
        let (per_unit, block) = pixel_tiling(pixels, spec.groups, g.group_out as usize);
        let blocks = spec.groups * (g.group_out as usize).div_ceil(block);
        // SAFETY: the kernel is instantiated for `elem`, the dtype of the input, the weight and
        // the bias (one dtype, checked by the caller) and of the output (made with it). A unit
        // with pixel `p < batch * out_h * out_w` reads input elements `(n, c, iy, ix)` with
        // `c < in_channels`, `iy < height`, `ix < width` (checked), weight rows of channels
        // below `out_channels` (clamped into its group) at taps below `group_in * taps`, bias
        // elements below `out_channels` (the bias has `out_channels` elements, checked by the
        // caller; not read without it), and writes output `(n, co, oy, ox)` inside `out`. The
        // output is a new allocation, distinct from the read buffers.
        unsafe {
            forward_kernel::launch_unchecked(
                &client,
                pixel_grid(pixels, per_unit, blocks),
                CubeDim::new_1d(PIXEL_THREADS as u32),
                input.arg(),
                weight.arg(),
                bias.arg(),
                output.arg(),
                g.launch(),
                taps,
                block,
                per_unit,
                spec.has_bias,
                elem,
            );
        }
        output.into_tensor()
    }

    fn conv_input_grad(
        grad: CubeTensor,
        input: CubeTensor,
        weight: CubeTensor,
        spec: ConvSpec,
    ) -> CubeTensor {
        let (g, taps, _) = geometry(&input, &weight, &spec);
        let elem = elem_of(&input);
        let client = input.client.clone();
        let dx = Dense::empty_like(&input);
        let (grad, weight) = (Dense::of(&grad), Dense::of(&weight));
        let pixels = (g.batch * g.height * g.width) as usize;
        let (per_unit, block) = pixel_tiling(pixels, spec.groups, g.group_in as usize);
        let blocks = spec.groups * (g.group_in as usize).div_ceil(block);
        // SAFETY: one dtype `elem` for grad, weight and dx (checked by the caller). A unit with
        // input pixel `p < batch * height * width` reads grad elements `(n, co, oy, ox)` with
        // `co < out_channels`, `oy < out_h`, `ox < out_w` (checked; grad has the forward's
        // output shape), weight elements of channel `co` at input-channel offsets clamped into
        // `group_in` and taps below `taps`, and writes dx `(n, ci, y, x)` inside the input's
        // shape. dx is a new allocation, distinct from the read buffers.
        unsafe {
            input_grad_kernel::launch_unchecked(
                &client,
                pixel_grid(pixels, per_unit, blocks),
                CubeDim::new_1d(PIXEL_THREADS as u32),
                grad.arg(),
                weight.arg(),
                dx.arg(),
                g.launch(),
                taps,
                block,
                per_unit,
                elem,
            );
        }
        dx.into_tensor()
    }

    fn conv_weight_grad(
        grad: CubeTensor,
        input: CubeTensor,
        weight: CubeTensor,
        spec: ConvSpec,
    ) -> (CubeTensor, CubeTensor) {
        let (g, taps, out) = geometry(&input, &weight, &spec);
        let elem = elem_of(&input);
        let client = input.client.clone();
        let device = input.device.clone();
        let new = |shape: Shape, dtype: DType| {
            Dense::new_empty(client.clone(), device.clone(), shape, dtype)
        };
        let [out_channels, group_in, kernel_h, kernel_w] = weight.meta.shape().dims::<4>();
        let kernel_taps = kernel_h * kernel_w;
        let group_out = g.group_out as usize;
        let block = weight_block(kernel_taps, group_out);
        let cube_blocks = spec.groups * group_out.div_ceil(block);
        let pixels = out[0] * out[2] * out[3];
        let (chunks, per_chunk) = weight_chunks(pixels, cube_blocks * group_in);
        let weights = out_channels * group_in * kernel_taps;
        let partial = new(Shape::new([chunks, weights]), DType::F32);
        let bias_partial = new(Shape::new([chunks, out_channels]), DType::F32);
        let weight_grad = new(weight.meta.shape().clone(), weight.dtype);
        let bias_grad = new(Shape::new([out_channels]), weight.dtype);
        let (grad, input) = (Dense::of(&grad), Dense::of(&input));
        // SAFETY: one dtype `elem` for grad, input and the two gradients (checked by the
        // caller), f32 for the partial sums. A cube `(b, ci, k)` (`b` below the output-channel
        // blocks, `ci < group_in`, `k < chunks`) reads grad at output pixels below `pixels` of
        // channels clamped below `out_channels`, input at `(n, c, iy, ix)` inside its shape
        // (checked), indexes its shared array below `block * taps * WEIGHT_THREADS` (its size),
        // and writes row `k < chunks` of the partial sums at weights below `weights` and output
        // channels below `out_channels`. Every element of the partial sums is written by exactly
        // one cube (each weight of each chunk; each bias of each chunk by its block's `ci == 0`
        // cube) before the second kernel, on the same stream, reads it; that kernel writes
        // element `i` of the two new gradients, `i` below their lengths. The written buffers are
        // new allocations, distinct from each other and from the read ones.
        unsafe {
            weight_grad_kernel::launch_unchecked(
                &client,
                CubeCount::Static(cube_blocks as u32, group_in as u32, chunks as u32),
                CubeDim::new_1d(WEIGHT_THREADS as u32),
                grad.arg(),
                input.arg(),
                partial.arg(),
                bias_partial.arg(),
                g.launch(),
                per_chunk as u32,
                taps,
                block,
                WEIGHT_THREADS,
                elem,
            );
            chunk_sum_kernel::launch_unchecked(
                &client,
                CubeCount::Static(weights.div_ceil(PIXEL_THREADS).max(1) as u32, 1, 1),
                CubeDim::new_1d(PIXEL_THREADS as u32),
                partial.arg(),
                bias_partial.arg(),
                weight_grad.arg(),
                bias_grad.arg(),
                chunks as u32,
                elem,
            );
        }
        (weight_grad.into_tensor(), bias_grad.into_tensor())
    }
}

/// The convolution with its own backward, reached from `Tensor` through burn's dispatch.
#[backend_extension(Cube, Autodiff)]
pub(crate) trait FusedConvOps: Backend {
    /// `input` (`[batch, in_channels, height, width]`) convolved with `weight`
    /// (`[out_channels, in_channels / groups, kernel_h, kernel_w]`), plus `bias`
    /// (`[out_channels]`) where `spec.has_bias` (otherwise `bias` is not read and gets no
    /// gradient: pass the weight). An optional tensor does not cross burn 0.22's generated
    /// dispatch (UPSTREAM.md 14), hence the flag.
    fn fused_conv2d(
        input: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        spec: ConvSpec,
    ) -> FloatTensor<Self>;
}

/// Without autodiff: the forward alone.
impl FusedConvOps for Cube {
    fn fused_conv2d(
        input: FusedTensor,
        weight: FusedTensor,
        bias: FusedTensor,
        spec: ConvSpec,
    ) -> FusedTensor {
        count_forward();
        <Cube as ConvKernels>::conv_forward(input, weight, bias, spec)
    }
}

/// What the backward keeps of the forward.
#[derive(Debug, Clone)]
struct Saved {
    input: FusedTensor,
    weight: FusedTensor,
    spec: ConvSpec,
}

/// The backward node: parents input, weight and bias (an untracked stand-in without a bias).
#[derive(Debug)]
struct ConvBackward;

impl Backward<Cube, 3> for ConvBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Saved, 3>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_input, node_weight, node_bias] = ops.parents;
        let grad = grads.consume::<Cube>(&ops.node);
        let Saved {
            input,
            weight,
            spec,
        } = ops.state;
        if node_weight.is_some() || node_bias.is_some() {
            let (dweight, dbias) = <Cube as ConvKernels>::conv_weight_grad(
                grad.clone(),
                input.clone(),
                weight.clone(),
                spec,
            );
            if let Some(node) = node_weight {
                grads.register::<Cube>(node.id, dweight);
            }
            if let Some(node) = node_bias {
                grads.register::<Cube>(node.id, dbias);
            }
        }
        if let Some(node) = node_input {
            let dx = <Cube as ConvKernels>::conv_input_grad(grad, input, weight, spec);
            grads.register::<Cube>(node.id, dx);
        }
    }
}

impl<C: CheckpointStrategy> FusedConvOps for Autodiff<Cube, C> {
    fn fused_conv2d(
        input: AutodiffTensor,
        weight: AutodiffTensor,
        bias: AutodiffTensor,
        spec: ConvSpec,
    ) -> AutodiffTensor {
        let (input, input_node) = input.into_parts();
        let (weight, weight_node) = weight.into_parts();
        let (bias, bias_node) = bias.into_parts();
        // Without a bias, an untracked parent in its place: it asks for no gradient.
        let bias_node = if spec.has_bias {
            bias_node
        } else {
            AutodiffTensor::new(weight.clone()).node()
        };
        let prepared = ConvBackward
            .prepare::<C>([input_node, weight_node, bias_node])
            .compute_bound()
            .stateful();
        count_forward();
        let output = <Cube as ConvKernels>::conv_forward(input.clone(), weight.clone(), bias, spec);
        match prepared {
            OpsKind::Tracked(prep) => prep.finish(
                Saved {
                    input,
                    weight,
                    spec,
                },
                output,
            ),
            OpsKind::UnTracked(prep) => prep.finish(output),
        }
    }
}

/// The fused convolution of tensors of burn's cubecl backend (autodiff or not), through
/// burn's dispatch. The caller checked the device (a cubecl one), the dtypes (one of `f32`,
/// `f16`, `bf16` for all), the shapes (`spec.fits`) and whether a bias is given.
/// Never `Err` here (see the stand-in, which hands the tensors back).
pub(crate) fn conv2d(
    (input, weight, bias): OpInputs,
    spec: ConvSpec,
) -> Result<burn::backend::DispatchTensor, Box<OpInputs>> {
    let bias = bias.unwrap_or_else(|| weight.clone());
    Ok(<burn::backend::Dispatch as FusedConvOps>::fused_conv2d(
        input, weight, bias, spec,
    ))
}
