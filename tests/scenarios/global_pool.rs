//! burn's adaptive average pool after a fused elementwise producer (a CNN's last ReLU before its
//! head), against the exact values (host `f64` from the very values the device holds): to
//! `1x1`, the global average that the carried burn-cubecl-fusion (`vendor/README.md`) leaves in
//! the producer's NCHW layout, and to `2x3`, which it still relays out to NHWC.
//!
//! Tolerance, derived per element: the producer (`relu(x) * 2`) is exact in binary floating
//! point, so each pooled value is the mean of `K` non-negative values the device holds exactly.
//! Summed in `f32` in any order, the sum is off the exact one by at most `gamma_K S`
//! (`gamma_K = K u / (1 - K u)`, `u = 2^-24`, `S` the sum of the terms: Higham, 4.2), and the
//! division by `K` and the store each add at most one rounding: `|got - exact| <= (gamma_K +
//! 3u) * exact` (the terms are non-negative, so `S = K * exact`). Negative control: the exact
//! values of the neighbouring channel (a channel off by one, a transposed layout read as
//! another) must break that bound tenfold somewhere.

use super::exact::{host, seeded};
use burn::prelude::*;
use burn::tensor::TensorData;
use burn::tensor::module::adaptive_avg_pool2d;

/// `[batch, channels, out_h, out_w]` means of `y` (`[batch, channels, h, w]`, row-major) over
/// adaptive pooling's regions (rows `floor(i h / out_h) .. ceil((i + 1) h / out_h)`, columns
/// alike), with the number of terms of each.
fn exact_pool(y: &[f64], dims: [usize; 4], out: [usize; 2]) -> (Vec<f64>, Vec<usize>) {
    let [batch, channels, h, w] = dims;
    let [oh, ow] = out;
    let mut means = Vec::new();
    let mut terms = Vec::new();
    for plane in 0..batch * channels {
        for i in 0..oh {
            for j in 0..ow {
                let rows = (i * h / oh)..((i + 1) * h).div_ceil(oh);
                let cols = (j * w / ow)..((j + 1) * w).div_ceil(ow);
                let count = rows.len() * cols.len();
                let sum: f64 = rows
                    .flat_map(|r| cols.clone().map(move |c| (r, c)))
                    .map(|(r, c)| y[plane * h * w + r * w + c])
                    .sum();
                means.push(sum / count as f64);
                terms.push(count);
            }
        }
    }
    (means, terms)
}

/// The largest ratio of `|got - exact|` to the bound of the module's doc (an element whose
/// bound is zero, an all-zero region, must be exactly zero).
fn worst_ratio(got: &[f64], exact: &[f64], terms: &[usize]) -> f64 {
    let u = 2f64.powi(-24);
    got.iter()
        .zip(exact)
        .zip(terms)
        .map(|((g, e), &k)| {
            let gamma = k as f64 * u / (1.0 - k as f64 * u);
            let bound = (gamma + 3.0 * u) * e.abs();
            let off = (g - e).abs();
            if bound > 0.0 {
                off / bound
            } else if off == 0.0 {
                0.0
            } else {
                f64::INFINITY
            }
        })
        .fold(0.0, f64::max)
}

/// `relu(x) * 2` pooled to `1x1` and to `2x3` in `f32` on `device`, each within the bound of
/// the module's doc of the exact means, and the neighbouring channel's exact means (the
/// control) at least ten bounds off somewhere.
pub fn global_pool_after_elementwise_matches_exact(device: &Device) {
    for (seed, dims, out) in [
        (0, [3, 5, 7, 9], [1, 1]),
        (1, [2, 32, 16, 16], [1, 1]),
        (2, [2, 4, 6, 10], [2, 3]),
    ] {
        let count = dims.iter().product();
        let x = Tensor::<1>::from_data(
            TensorData::new(seeded(count, 300 + seed, -1.0, 1.0), [count]),
            device,
        )
        .reshape(dims);
        let pooled = adaptive_avg_pool2d(
            burn::tensor::activation::relu(x.clone()).mul_scalar(2.0),
            out,
        );
        let got = host(pooled.into_data());
        let y: Vec<f64> = host(x.into_data())
            .into_iter()
            .map(|v| v.max(0.0) * 2.0)
            .collect();
        let (exact, terms) = exact_pool(&y, dims, out);
        let ratio = worst_ratio(&got, &exact, &terms);
        println!("{dims:?} pooled to {out:?}: off {ratio:.3} of the bound");
        assert!(
            ratio <= 1.0,
            "{dims:?} pooled to {out:?}: off {ratio} bounds of the exact means"
        );
        // The control: each plane's means against the next channel's (the last against the
        // first).
        let plane = out[0] * out[1];
        let planes = exact.len() / plane;
        let shifted: Vec<f64> = (0..exact.len())
            .map(|i| exact[((i / plane + 1) % planes) * plane + i % plane])
            .collect();
        let control = worst_ratio(&shifted, &exact, &terms);
        assert!(
            control >= 10.0,
            "{dims:?} pooled to {out:?}: the neighbouring channel is only {control} bounds off"
        );
    }
}
