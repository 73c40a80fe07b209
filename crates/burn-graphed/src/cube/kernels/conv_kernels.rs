//! The kernels of the fused 2-D convolution (`conv_op.rs` launches them): direct convolution
//! on the `[batch, channels, height, width]` layout, a unit computing a few pixels for a block
//! of channels with the block's weights staged in shared memory (forward, input gradient), and
//! the weight gradient's partial sums per chunk of pixels with the sum over the chunks. The
//! kernel's size, stride and dilation are compile-time constants of each kernel ([`Taps`]).
//! Every sum runs in an order fixed by the shape (the forward's split of its summed channels
//! changes it; the pixels and channels per unit do not): a replay equals the eager call bit for
//! bit.
//!
//! Over 600 lines: the four kernels of one op, the two helpers the forward and the input
//! gradient share, and the weight gradient's in-cube sum.

// (`div_ceil` is not a kernel operation here, as in `attention_kernels.rs`).
#![allow(clippy::manual_div_ceil)]

use cubecl::prelude::*;

/// Units of a cube of the forward and the input gradient (one pixel each).
pub(in crate::cube) const PIXEL_THREADS: usize = 256;
/// Units of a cube of the weight gradient.
pub(in crate::cube) const WEIGHT_THREADS: usize = 128;
/// Pixels a unit of the weight gradient loads before it multiplies (loads in flight at once).
pub(in crate::cube) const WEIGHT_BATCH: usize = 4;

/// The sizes of one convolution the kernels take at run time (the kernel's size, stride and
/// dilation are compile-time constants of each kernel: [`Taps`]).
#[derive(CubeType, CubeLaunch, Clone, Copy)]
#[expand(derive(Clone))]
pub(in crate::cube) struct Geometry {
    pub(in crate::cube) batch: u32,
    pub(in crate::cube) in_channels: u32,
    pub(in crate::cube) height: u32,
    pub(in crate::cube) width: u32,
    pub(in crate::cube) out_channels: u32,
    pub(in crate::cube) out_height: u32,
    pub(in crate::cube) out_width: u32,
    pub(in crate::cube) pad_top: u32,
    pub(in crate::cube) pad_left: u32,
    /// Input channels per group.
    pub(in crate::cube) group_in: u32,
    /// Output channels per group.
    pub(in crate::cube) group_out: u32,
}

/// A kernel's size, stride and dilation (height, width): compile-time constants of the
/// kernels, so that their loops over the taps unroll and their divisions are by constants.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(in crate::cube) struct Taps {
    pub(in crate::cube) kernel: [usize; 2],
    pub(in crate::cube) stride: [usize; 2],
    pub(in crate::cube) dilation: [usize; 2],
}

/// Channels whose weights a cube stages at once in shared memory, for `per_channel` values each
/// (a block's taps): at most 2048 values (8 KiB), at least one channel.
fn chunk_channels(per_channel: usize) -> usize {
    (2048 / per_channel.max(1)).max(1)
}

/// Rows (or columns) of a padded input that no tap of a kernel reaches: a pixel past the last
/// one gets this row, so that every bounds check of its loads fails.
const OUTSIDE: u32 = 1 << 30;

/// The pixels of this unit: `count` pixels `slots` apart, starting at the cube's tile of
/// `slots * count` pixels at the unit's `slot` (`slot < slots`), as `(plane, row, column)` of
/// `[batch, rows, columns]`, where `plane` is the batch index; a pixel past
/// `batch * rows * columns` gets row [`OUTSIDE`].
#[cube]
#[allow(clippy::too_many_arguments)]
fn unit_pixels(
    batch: u32,
    rows: u32,
    columns: u32,
    slot: u32,
    planes: &mut Array<u32>,
    ys: &mut Array<u32>,
    xs: &mut Array<u32>,
    #[comptime] slots: usize,
    #[comptime] count: usize,
) {
    let tile = (CUBE_POS_Z * CUBE_COUNT_X + CUBE_POS_X) * comptime!((slots * count) as u32);
    let total = batch * rows * columns;
    #[unroll]
    for i in 0..count {
        let p = tile + slot + (i * slots) as u32;
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

/// Stages into `shared` (`[chunk, taps, block]`, zero past either end) the weights of a
/// cube's block of `block` channels (`first + j` of group `group`) against `chunk` channels of
/// the other side from `start`: without `transposed` the block is output channels and the chunk
/// input channels (the forward), with it the other way round (the input gradient). Meets the
/// cube at a barrier before and after; every unit of the cube must call it.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_weights<F: Float>(
    weight: &[F],
    shared: &mut Shared<[f32]>,
    group_in: u32,
    group_out: u32,
    group: u32,
    first: u32,
    start: u32,
    #[comptime] block: usize,
    #[comptime] taps: usize,
    #[comptime] staged: usize,
    #[comptime] transposed: bool,
) {
    sync_cube();
    let mut idx = UNIT_POS_X as usize;
    while idx < staged {
        let j = (idx % block) as u32;
        let tap = (idx / block) % taps;
        let c = (idx / comptime!(block * taps)) as u32;
        let mut out_channel = first + j;
        let mut in_channel = start + c;
        if transposed {
            out_channel = start + c;
            in_channel = first + j;
        }
        let mut value = 0.0f32;
        if out_channel < group_out && in_channel < group_in {
            let row = (group * group_out + out_channel) * group_in + in_channel;
            value = f32::cast_from(weight[(row as usize) * taps + tap]);
        }
        shared[idx] = value;
        idx += PIXEL_THREADS;
    }
    sync_cube();
}

/// `acc[i * block + j] += values[i] * shared[base + j]` for each of `pixels` pixels `i` and
/// `block` channels `j`: one staged weight read for `pixels` products.
#[cube]
fn accumulate(
    acc: &mut Array<f32>,
    values: &Array<f32>,
    shared: &Shared<[f32]>,
    base: usize,
    #[comptime] block: usize,
    #[comptime] pixels: usize,
) {
    #[unroll]
    for j in 0..block {
        let w = shared[base + j];
        #[unroll]
        for i in 0..pixels {
            acc[i * block + j] += values[i] * w;
        }
    }
}

/// Adds the `splits` parts' `sums` values per slot into part 0's `acc`, in part order (part
/// 0's own first), through shared memory; the other parts' `acc` are left as they were. Meets
/// the cube at a barrier; every unit of the cube must call it.
#[cube]
fn add_parts(
    acc: &mut Array<f32>,
    slot: u32,
    part: u32,
    #[comptime] slots: usize,
    #[comptime] sums: usize,
    #[comptime] splits: usize,
) {
    let mut parts = Shared::<[f32]>::new_slice(comptime!(PIXEL_THREADS * sums));
    let own = ((part as usize) * slots + slot as usize) * sums;
    #[unroll]
    for a in 0..sums {
        parts[own + a] = acc[a];
    }
    sync_cube();
    if part == 0 {
        #[unroll]
        for q in 1..splits {
            let other = (q * slots + slot as usize) * sums;
            #[unroll]
            for a in 0..sums {
                acc[a] += parts[other + a];
            }
        }
    }
}

/// Forward: `pixels` output pixels per unit for the `block` output channels of cube row
/// `CUBE_POS_Y` (blocks within each group), plus the bias with `has_bias`. The block's weights
/// are staged in shared memory, `chunk` input channels at a time, and read by every unit at the
/// same address.
///
/// With `splits` above 1 the cube's units are `splits` parts of `PIXEL_THREADS / splits` pixel
/// slots: part `q` sums the input channels `c` with `c % splits == q` within each staged
/// chunk, for its slot's pixels, and part 0 adds the parts' sums in order `0, 1, ...,
/// splits - 1` from shared memory and writes. So a small convolution's unit walks `1 / splits`
/// of the input channels (a shorter chain of dependent loads) where too few pixels would leave
/// the GPU idle. The sums' order is fixed by the split, which the shape fixes: a replay
/// computes what the eager call computed.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(in crate::cube) fn conv_forward_kernel<F: Float>(
    input: &[F],
    weight: &[F],
    bias: &[F],
    output: &mut [F],
    g: Geometry,
    #[comptime] taps: Taps,
    #[comptime] block: usize,
    #[comptime] pixels: usize,
    #[comptime] splits: usize,
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
    let slots = comptime!(PIXEL_THREADS / splits);
    let slot = UNIT_POS_X % slots as u32;
    let part = UNIT_POS_X / slots as u32;
    unit_pixels(
        g.batch,
        g.out_height,
        g.out_width,
        slot,
        &mut planes,
        &mut ys,
        &mut xs,
        slots,
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
    let mut ci0 = 0u32;
    while ci0 < group_in {
        stage_weights(
            weight,
            &mut shared,
            group_in,
            group_out,
            group,
            first,
            ci0,
            block,
            kernel_taps,
            staged,
            false,
        );
        let mut count = group_in - ci0;
        if count > chunk as u32 {
            count = chunk as u32;
        }
        let mut c = part;
        while c < count {
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
                    accumulate(&mut acc, &values, &shared, base, block, pixels);
                }
            }
            c += splits as u32;
        }
        ci0 += chunk as u32;
    }
    if comptime!(splits > 1) {
        add_parts(
            &mut acc,
            slot,
            part,
            slots,
            comptime!(pixels * block),
            splits,
        );
    }
    #[unroll]
    for i in 0..pixels {
        if ys[i] != OUTSIDE && part == 0 {
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
pub(in crate::cube) fn conv_input_grad_kernel<F: Float>(
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
        UNIT_POS_X,
        &mut planes,
        &mut ys,
        &mut xs,
        PIXEL_THREADS,
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
    let mut co0 = 0u32;
    while co0 < group_out {
        stage_weights(
            weight,
            &mut shared,
            group_in,
            group_out,
            group,
            first,
            co0,
            block,
            kernel_taps,
            staged,
            true,
        );
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
                    accumulate(&mut acc, &values, &shared, base, block, pixels);
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
pub(in crate::cube) fn conv_weight_grad_kernel<F: Float>(
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
pub(in crate::cube) fn conv_chunk_sum_kernel<F: Float>(
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
