//! How the fused convolution's launches cover their work (`conv_op.rs` launches them): the
//! forward's and the input gradient's pixels and channels per unit, a small forward's split of
//! its summed channels, and the grid (`pixel_tiling`); the weight gradient's output-channel
//! blocks and chunks of pixels (`weight_block`, `weight_chunks`). Chosen by size, so that a
//! small convolution still spreads over the whole GPU; a test can force a tiling
//! (`testing::force_conv_tiling`).

use cubecl::prelude::CubeCount;

use super::super::kernels::conv_kernels::PIXEL_THREADS;

/// Sums of the weight gradient one unit holds at most: `block * taps`, the block of output
/// channels chosen so (32 KiB of shared memory with `WEIGHT_THREADS` units).
const WEIGHT_SUMS: usize = 64;
/// Cubes along x before a grid takes its z dimension (wgpu's limit per dimension).
const MAX_CUBES: usize = 65_535;
/// Weight-gradient cubes wanted at least (a few per multiprocessor of the largest GPUs): fewer
/// output-channel blocks times input channels split the pixels into chunks.
const WEIGHT_CUBES: usize = 1024;
/// Pixels one weight-gradient chunk sums at least (per unit: this over `WEIGHT_THREADS`).
const MIN_CHUNK_PIXELS: usize = 2048;

/// How the forward or the input gradient covers `pixels` pixels of `groups` groups of
/// `channels` channels: pixels and channels per unit, the parts the summed channels are split
/// into (the forward only; 1 otherwise: `conv_forward_kernel`), and the grid.
pub(super) struct PixelTiling {
    pub(super) per_unit: usize,
    pub(super) block: usize,
    pub(super) splits: usize,
    pub(super) grid: CubeCount,
}

/// The most products per staged weight read and per input read (pixels times channels per
/// unit) that still gives [`PIXEL_CUBES`] cubes, so that a small convolution still spreads over
/// the whole GPU. The forward (`summed`: the input channels a unit sums over, per group) first
/// tries [`WIDE_FORWARD`]: two pixels of up to 16 channels, each input value read once per 16
/// channels, where that gives [`WIDE_FORWARD_CUBES`] cubes; where not even one pixel of two
/// channels per unit gives [`PIXEL_CUBES`], it splits the summed channels
/// ([`split_forward`]). The input gradient (`summed` 0) takes one pixel of one channel there.
pub(super) fn pixel_tiling(
    pixels: usize,
    groups: usize,
    channels: usize,
    summed: usize,
) -> PixelTiling {
    const TILINGS: [(usize, usize); 7] = [(4, 8), (4, 4), (2, 8), (2, 4), (1, 8), (1, 4), (1, 2)];
    let channels = channels.max(1);
    let forward = summed > 0;
    // Pixel cubes along x and channel blocks along y for a tiling and a split.
    let cubes = |(per_unit, block): (usize, usize), splits: usize| {
        let block = block.min(channels);
        (
            pixels.div_ceil(PIXEL_THREADS / splits * per_unit).max(1),
            groups * channels.div_ceil(block),
        )
    };
    // The cubes of a tiling and a split, all told.
    let count = |tiling, splits| {
        let (x, y) = cubes(tiling, splits);
        x * y
    };
    let chosen = Some((WIDE_FORWARD, 1))
        .filter(|&(tiling, splits)| forward && count(tiling, splits) >= WIDE_FORWARD_CUBES)
        .or_else(|| {
            TILINGS
                .into_iter()
                .map(|tiling| (tiling, 1))
                .find(|&(tiling, splits)| count(tiling, splits) >= PIXEL_CUBES)
        })
        .or_else(|| split_forward(summed, |splits| count(SPLIT_TILING, splits)))
        .unwrap_or(((1, 1), 1));
    #[cfg(feature = "testing")]
    let chosen = forced_tiling().map_or(chosen, |(per_unit, block, splits)| {
        // A split adds `PIXEL_THREADS * per_unit * block` sums of shared memory (`add_parts`)
        // beside the staged weights (8 KiB): a forced split past [`SPLIT_SUMS`] runs unsplit.
        let fits = per_unit * block.min(channels) <= SPLIT_SUMS;
        let split = forward && fits;
        ((per_unit, block), if split { splits } else { 1 })
    });
    let ((per_unit, block), splits) = chosen;
    let block = block.min(channels);
    let (x, blocks) = cubes((per_unit, block), splits);
    let across = x.min(MAX_CUBES);
    PixelTiling {
        per_unit,
        block,
        splits,
        grid: CubeCount::Static(across as u32, blocks as u32, x.div_ceil(across) as u32),
    }
}

/// The forward's tiling where it splits the summed channels: one pixel of up to four channels
/// per unit.
const SPLIT_TILING: (usize, usize) = (1, 4);

/// The parts a small forward splits its `summed` input channels into (a power of two, at most
/// [`MAX_SPLITS`] and no more than the channels, so that no part is idle): the fewest that give
/// [`PIXEL_CUBES`] cubes by `cubes` (the grid's cubes at a split), the most otherwise; `None`
/// with one channel.
fn split_forward(summed: usize, cubes: impl Fn(usize) -> usize) -> Option<((usize, usize), usize)> {
    let candidates: Vec<usize> = std::iter::successors(Some(2), |s| Some(s * 2))
        .take_while(|&s| s <= MAX_SPLITS && s <= summed)
        .collect();
    let splits = candidates
        .iter()
        .copied()
        .find(|&s| cubes(s) >= PIXEL_CUBES)
        .or(candidates.last().copied())?;
    Some((SPLIT_TILING, splits))
}

/// Parts of a split forward at most: a cube keeps 16 pixels of [`PIXEL_THREADS`] units.
const MAX_SPLITS: usize = 16;

/// Sums per unit a split forward may hold (pixels times channels): its parts' sums take
/// `PIXEL_THREADS` times this in shared memory, 32 KiB at 32, which with the staged weights' 8
/// KiB stays within CUDA's 48 KiB a cube. The split chosen by size holds 4 ([`SPLIT_TILING`]).
#[cfg(feature = "testing")]
const SPLIT_SUMS: usize = 32;

/// A tiling every forward and input gradient takes, `splits << 16 | per_unit << 8 | block`, or
/// 0 (chosen by size): `burn_graphed::testing::force_conv_tiling`, so that small test shapes run
/// every tiling (the input gradient takes no split).
#[cfg(feature = "testing")]
static FORCED_TILING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Sets (or with `None` clears) the tiling of [`FORCED_TILING`]: `(pixels, channels, splits)`
/// per unit; `splits` is taken down to a power of two of at most [`MAX_SPLITS`].
#[cfg(feature = "testing")]
pub(crate) fn force_tiling(tiling: Option<(usize, usize, usize)>) {
    let code = tiling.map_or(0, |(per_unit, block, splits)| {
        let splits = 1 << splits.clamp(1, MAX_SPLITS).ilog2();
        (splits << 16) | (per_unit.clamp(1, 255) << 8) | block.clamp(1, 255)
    });
    FORCED_TILING.store(code, std::sync::atomic::Ordering::Relaxed);
}

#[cfg(feature = "testing")]
fn forced_tiling() -> Option<(usize, usize, usize)> {
    match FORCED_TILING.load(std::sync::atomic::Ordering::Relaxed) {
        0 => None,
        code => Some(((code >> 8) & 0xff, code & 0xff, code >> 16)),
    }
}

/// Cubes of the forward and the input gradient wanted at least: two per multiprocessor of the
/// largest GPUs here (132 on an H100 or H200).
const PIXEL_CUBES: usize = 256;

/// The forward's first choice of tiling: 2 pixels of 16 channels per unit (32 sums). Fewer,
/// wider units than [`PIXEL_CUBES`] asks for read each input value for more channels at once:
/// on the bench CNN (3 -> 16 -> 32 channels, 32 x 32, batch 32; H200) the inference call took
/// 63.5 us in `f32` and 68.0 in `bf16` with every convolution at this tiling, against 77.8 and
/// 84.0 at the tilings chosen by [`PIXEL_CUBES`] (docs/decisions.md, "Convolutions").
const WIDE_FORWARD: (usize, usize) = (2, 16);

/// Cubes the forward's [`WIDE_FORWARD`] tiling must still give (about half the multiprocessors
/// of an H100 or H200): smaller convolutions take the tilings of [`PIXEL_CUBES`].
const WIDE_FORWARD_CUBES: usize = 64;

/// Output channels per weight-gradient cube for `taps` kernel taps: at most 4, within
/// [`WEIGHT_SUMS`] sums per unit and the group's output channels.
pub(super) fn weight_block(taps: usize, group_out: usize) -> usize {
    (WEIGHT_SUMS / taps).clamp(1, 4).min(group_out.max(1))
}

/// `(chunks, pixels per chunk)` of the weight gradient's sums over `pixels` output pixels, for
/// `cubes` cubes per chunk.
pub(super) fn weight_chunks(pixels: usize, cubes: usize) -> (usize, usize) {
    let wanted = WEIGHT_CUBES.div_ceil(cubes.max(1));
    let most = pixels.div_ceil(MIN_CHUNK_PIXELS).max(1);
    let chunks = wanted.clamp(1, most.min(MAX_CUBES));
    let per_chunk = pixels.div_ceil(chunks).max(1);
    (pixels.div_ceil(per_chunk).max(1), per_chunk)
}

#[cfg(test)]
mod tests {
    use super::{PIXEL_CUBES, pixel_tiling};

    /// `(pixels, channels, splits)` per unit of a tiling of `summed` input channels (0: the
    /// input gradient), forced tilings aside.
    fn chosen(pixels: usize, channels: usize, summed: usize) -> (usize, usize, usize) {
        let tiling = pixel_tiling(pixels, 1, channels, summed);
        (tiling.per_unit, tiling.block, tiling.splits)
    }

    #[test]
    fn the_forward_takes_wide_units_where_they_still_fill_the_gpu() {
        // The bench CNN at batch 32: 32 x 32 x 32 output pixels of 16, then 32 channels.
        assert_eq!(chosen(32 * 32 * 32, 16, 3), (2, 16, 1));
        assert_eq!(chosen(32 * 32 * 32, 32, 16), (2, 16, 1));
        // Its input gradients keep the tilings that give 256 cubes.
        assert_eq!(chosen(32 * 32 * 32, 16, 0), (2, 4, 1));
    }

    #[test]
    fn a_small_forward_splits_its_summed_channels_to_fill_the_gpu() {
        // The bench CNN at batch 1: 32 x 32 pixels of 16 channels from 3, of 32 from 16. No
        // unsplit tiling gives PIXEL_CUBES cubes (one pixel of two channels: 4 x 16 cubes).
        const { assert!(PIXEL_CUBES > (32 * 32 / 256) * 16) };
        // 16 channels in 8 parts of 2: 32 x 8 cubes.
        assert_eq!(chosen(32 * 32, 32, 16), (1, 4, 8));
        // No more parts than channels, even short of PIXEL_CUBES.
        assert_eq!(chosen(32 * 32, 16, 3), (1, 4, 2));
        // One input channel: nothing to split, one pixel of one channel per unit.
        assert_eq!(chosen(32 * 32, 32, 1), (1, 1, 1));
        // The input gradient never splits.
        assert_eq!(chosen(32 * 32, 16, 0), (1, 1, 1));
    }
}
