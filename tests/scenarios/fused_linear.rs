//! `burn_graphed::nn::Linear` against the exact product (host `f64` from the very values the
//! device holds) and against burn-nn's, the output and every gradient, in `f32`, `f16` and
//! `bf16`: 1 to 8 rows (the small kernel, rank 2 and 3), odd widths, with and without bias, a
//! weight held transposed; more rows run cuBLASLt on CUDA and burn-nn's computation
//! elsewhere; inside graphed calls on one row and on many.
//!
//! Tolerance, derived as for the norms (`fused_norm.rs`): the kernel and burn's matmul compute
//! the same sums in another order, each in `f32` and rounded once to the dtype (on CUDA burn's
//! f32 matmul may also run in TF32: its error then sets the bound, which only widens it). So the
//! fused error against the exact values must be at most twice burn-nn's own error plus one
//! rounding of the dtype, relative to the largest exact magnitude. Negative control: the exact
//! output of the neighbouring row (a stale or shifted row) must exceed the bound tenfold.

use super::exact::{
    assert_graphed_equals_eager, host, relative_error as error, seeded, unit_roundoff,
};
use super::skip::skip;
use super::*;
use burn::module::Param;
use burn::tensor::{DType, FloatDType};
use std::cell::OnceCell;

/// Deterministic values in [-1.0, 1.0).
fn values(count: usize, seed: u64) -> Vec<f32> {
    seeded(count, seed, -1.0, 1.0)
}

/// `values(count, seed)` as a 1-D tensor of `dtype` on `device`.
fn seeded_tensor(device: &Device, dtype: FloatDType, count: usize, seed: u64) -> Tensor<1> {
    Tensor::<1>::from_data(TensorData::new(values(count, seed), [count]), device).cast(dtype)
}

/// burn-nn's `Linear` `[d_in, d_out]` in `dtype` with seeded values: the weight from `seed`,
/// the bias (where `with_bias`) from `seed + 1`.
fn seeded_linear(
    device: &Device,
    dtype: FloatDType,
    (d_in, d_out): (usize, usize),
    with_bias: bool,
    seed: u64,
) -> burn::nn::Linear {
    let mut linear = burn::nn::LinearConfig::new(d_in, d_out)
        .with_bias(with_bias)
        .init(device);
    let weight = seeded_tensor(device, dtype, d_in * d_out, seed).reshape([d_in, d_out]);
    linear.weight = Param::from_tensor(weight);
    if with_bias {
        linear.bias = Some(Param::from_tensor(seeded_tensor(
            device,
            dtype,
            d_out,
            seed + 1,
        )));
    }
    linear
}

/// `[y, dx, dW, db]` read back, the gradients from `grads` (`db` empty without a bias).
fn output_and_grads(
    y: Tensor<2>,
    x: &Tensor<2>,
    (weight, bias): (&Param<Tensor<2>>, Option<&Param<Tensor<1>>>),
    grads: &burn::tensor::Gradients,
) -> [Vec<f64>; 4] {
    [
        host(y.into_data()),
        host(x.grad(grads).expect("the input's gradient").into_data()),
        host(
            weight
                .val()
                .grad(grads)
                .expect("the weight's gradient")
                .into_data(),
        ),
        bias.map_or_else(Vec::new, |b| {
            host(
                b.val()
                    .grad(grads)
                    .expect("the bias's gradient")
                    .into_data(),
            )
        }),
    ]
}

/// A linear layer's values read back to the host (`x` `[rows, d_in]`, `w` `[d_in, d_out]`, the
/// bias), for the exact values the tests compare with.
struct HostLayer {
    x: Vec<f64>,
    w: Vec<f64>,
    b: Option<Vec<f64>>,
    rows: usize,
    d_in: usize,
    d_out: usize,
}

impl HostLayer {
    /// `linear`'s weight and bias, and its input `x` of `rows` rows, read back.
    fn read(linear: &burn::nn::Linear, x: TensorData, rows: usize) -> Self {
        let [d_in, d_out] = linear.weight.val().dims();
        Self {
            x: host(x),
            w: host(linear.weight.val().into_data()),
            b: linear.bias.as_ref().map(|b| host(b.val().into_data())),
            rows,
            d_in,
            d_out,
        }
    }

    /// `x W`, with `bias` plus the bias where the layer has one, exactly.
    fn output(&self, bias: bool) -> Vec<f64> {
        let (d_in, d_out) = (self.d_in, self.d_out);
        let b = self.b.as_deref().filter(|_| bias);
        let mut y = vec![0.0; self.rows * d_out];
        for r in 0..self.rows {
            for c in 0..d_out {
                let mut sum = b.map_or(0.0, |b| b[c]);
                for k in 0..d_in {
                    sum += self.x[r * d_in + k] * self.w[k * d_out + c];
                }
                y[r * d_out + c] = sum;
            }
        }
        y
    }

    /// `(y, dx, dW, db)` exactly, for the output gradient `dy`.
    fn exact(&self, dy: &[f64]) -> [Vec<f64>; 4] {
        let (d_in, d_out) = (self.d_in, self.d_out);
        let mut dx = vec![0.0; self.rows * d_in];
        let mut dw = vec![0.0; d_in * d_out];
        let mut db = vec![0.0; d_out];
        for r in 0..self.rows {
            for c in 0..d_out {
                for k in 0..d_in {
                    dx[r * d_in + k] += dy[r * d_out + c] * self.w[k * d_out + c];
                    dw[k * d_out + c] += self.x[r * d_in + k] * dy[r * d_out + c];
                }
                db[c] += dy[r * d_out + c];
            }
        }
        [self.output(true), dx, dw, db]
    }

    /// [`Self::exact`] of the magnitudes: each value's sum of its terms' magnitudes.
    fn magnitudes(&self, dy: &[f64]) -> [Vec<f64>; 4] {
        let abs = |v: &[f64]| v.iter().map(|x| x.abs()).collect::<Vec<_>>();
        let layer = HostLayer {
            x: abs(&self.x),
            w: abs(&self.w),
            b: self.b.as_deref().map(abs),
            ..*self
        };
        layer.exact(&abs(dy))
    }
}

/// The compared values by index (output, input, weight and, with a bias, the bias gradient)
/// and their names.
fn checked_parts(with_bias: bool) -> impl Iterator<Item = (usize, &'static str)> {
    [
        "output",
        "input gradient",
        "weight gradient",
        "bias gradient",
    ]
    .into_iter()
    .enumerate()
    .filter(move |&(k, _)| k < 3 || with_bias)
}

/// The bound of a value summed in `f32` from `K` terms, then rounded once to the dtype: what our
/// kernel and cuBLASLt compute (derived in [`linear_relu_matches_exact`]'s doc: `gamma_K S`,
/// TF32's `(2 t + t^2) S` where `f32` products may round, one rounding of the dtype, `f16`'s
/// subnormal spacing). Where cuBLASLt's epilogue adds a bias, one rounding more: its kernels
/// may round the product to the dtype before they add the bias (in `bf16` at `[9]x16 -> 12`
/// the error is `round(round(x W) + b)`'s to five digits, calls CT and CU), `u (|P| + gamma_K
/// S)` with `P` the exact value before the bias.
struct F32Sums {
    products: f64,
    u: f64,
    subnormal: f64,
}

impl F32Sums {
    fn new(device: &Device, dtype: FloatDType) -> Self {
        let t = 2f64.powi(-11);
        let tf32 = dtype == FloatDType::F32 && super::tf32_products(device);
        Self {
            products: if tf32 { 2.0 * t + t * t } else { 0.0 },
            u: unit_roundoff(dtype),
            subnormal: if dtype == FloatDType::F16 {
                2f64.powi(-25)
            } else {
                0.0
            },
        }
    }

    /// The largest `|got - exact|` over its element's bound (`magnitude`: the sum of the terms'
    /// magnitudes; `before_bias`: the exact values before a bias that cuBLASLt's epilogue adds,
    /// `None` where none does).
    fn worst(
        &self,
        got: &[f64],
        exact: &[f64],
        magnitude: &[f64],
        terms: usize,
        before_bias: Option<&[f64]>,
    ) -> f64 {
        let k = terms as f64 * 2f64.powi(-24);
        got.iter()
            .zip(exact)
            .zip(magnitude)
            .enumerate()
            .map(|(i, ((g, e), m))| {
                let sums = (self.products + k / (1.0 - k)) * m;
                let epilogue = before_bias.map_or(0.0, |p| self.u * (p[i].abs() + sums));
                let bound = sums + self.u * (e.abs() + sums) + epilogue + self.subnormal;
                (g - e).abs() / bound.max(f64::MIN_POSITIVE)
            })
            .fold(0.0f64, f64::max)
    }

    /// Asserts each part of `got` within its bound of `exact`, printing each (`before_bias`: the
    /// output's, as [`Self::worst`]'s).
    #[allow(clippy::too_many_arguments)]
    fn assert_within(
        &self,
        label: &str,
        got: &[Vec<f64>],
        exact: &[&Vec<f64>],
        magnitudes: &[Vec<f64>],
        terms: [usize; 4],
        with_bias: bool,
        before_bias: Option<&[f64]>,
    ) {
        for (k, what) in checked_parts(with_bias) {
            let pre = if k == 0 { before_bias } else { None };
            let ratio = self.worst(&got[k], exact[k], &magnitudes[k], terms[k], pre);
            println!("{label} {what}: off {ratio:.3} of the f32 sums' bound");
            assert!(
                ratio <= 1.0,
                "{label} {what}: off {ratio:.3e} bounds of the exact values"
            );
        }
    }
}

/// Whether cuBLASLt's epilogue adds the output's bias (on CUDA, where the caller checked
/// cuBLASLt): a bias, and more rows than the small kernel takes (8).
fn epilogue_bias(with_bias: bool, rows: usize) -> bool {
    with_bias && rows > 8
}

/// Asserts that each of `ours`' output and gradients (output, input, weight, and with a bias
/// the bias's) is within twice burn's error plus one rounding `u` of the exact `truth`, printing
/// each; returns the output's bound.
fn within_bound(
    label: &str,
    ours: &[Vec<f64>],
    theirs: &[Vec<f64>],
    truth: &[Vec<f64>],
    with_bias: bool,
    u: f64,
) -> f64 {
    let mut output_bound = 0.0;
    for (k, what) in checked_parts(with_bias) {
        let (fused_error, burn_error) = (error(&ours[k], &truth[k]), error(&theirs[k], &truth[k]));
        let bound = 2.0 * burn_error + u;
        println!(
            "{label} {what}: fused error {fused_error:.3e}, burn's {burn_error:.3e}, bound {bound:.3e}"
        );
        assert!(
            fused_error <= bound,
            "{label} {what}: fused error {fused_error:.3e} above {bound:.3e} (burn's {burn_error:.3e})"
        );
        if k == 0 {
            output_bound = bound;
        }
    }
    output_bound
}

/// The cases of one dtype; a device without the dtype skips them, and says so.
pub fn linear_matches_exact(device: &Device, dtype: FloatDType) {
    linear_matches_exact_in(device, dtype, 0..9);
}

/// The cases `chosen` of [`linear_matches_exact`] (each seeded by its index): on CUDA burn-nn's
/// reference tunes its matmuls per shape (a minute or more a case in `f16` and `bf16`), so the
/// GPU suite runs them in parts that fit its processes' time.
pub fn linear_matches_exact_in(device: &Device, dtype: FloatDType, chosen: std::ops::Range<usize>) {
    let device = device.clone().autodiff();
    if !device.supports_dtype(DType::from(dtype)) {
        skip(&format!("{device:?} has no {dtype:?}"));
        return;
    }
    // (leading dims, d_in, d_out, bias, weight held transposed): 1, 3 and 8 rows (the small
    // kernel), 9 and more (cuBLASLt on CUDA, burn-nn's path elsewhere).
    let cases_all: [(&[usize], usize, usize, bool, bool); 9] = [
        (&[1], 256, 256, true, false),
        (&[3], 7, 5, false, false),
        (&[8], 300, 33, true, false),
        (&[2, 4], 64, 40, true, false),
        (&[1], 1000, 3, false, false),
        (&[9], 16, 12, true, false),
        (&[64], 256, 256, true, false),
        (&[4, 33], 70, 130, false, true),
        (&[2, 40], 96, 10, true, true),
    ];
    let vendor = burn_graphed::testing::vendor_matmul_available(&device);
    for (seed, (lead, d_in, d_out, with_bias, transposed)) in cases_all.into_iter().enumerate() {
        if !chosen.contains(&seed) {
            continue;
        }
        let seed = seed as u64 * 10;
        let rows: usize = lead.iter().product();
        let made = |values: Vec<f32>| {
            let count = values.len();
            Tensor::<1>::from_data(TensorData::new(values, [count]), &device).cast(dtype)
        };
        let mut burn_linear = burn::nn::LinearConfig::new(d_in, d_out)
            .with_bias(with_bias)
            .init(&device);
        // A weight held transposed is a `[d_out, d_in]` buffer seen through its transpose (the
        // products read it in place, column-major).
        let weight = if transposed {
            made(values(d_in * d_out, seed))
                .reshape([d_out, d_in])
                .transpose()
        } else {
            made(values(d_in * d_out, seed)).reshape([d_in, d_out])
        };
        burn_linear.weight = Param::from_tensor(weight);
        if with_bias {
            burn_linear.bias = Some(Param::from_tensor(made(values(d_out, seed + 1))));
        }
        let fused: burn_graphed::nn::Linear = burn_linear.clone().into();
        let x2 = made(values(rows * d_in, seed + 2)).reshape([rows, d_in]);
        let dy2 = made(values(rows * d_out, seed + 3)).reshape([rows, d_out]);
        let layer = HostLayer::read(&burn_linear, x2.clone().into_data(), rows);
        let dys = host(dy2.clone().into_data());
        let truth = layer.exact(&dys);
        let sizes = layer.magnitudes(&dys);
        // Both layers on the input in its own rank (2 or 3), gradients through `sum(y * dy)`.
        let run = |forward: &dyn Fn(Tensor<3>) -> Tensor<3>,
                   weight: &Param<Tensor<2>>,
                   bias: Option<&Param<Tensor<1>>>| {
            let lead3 = if lead.len() == 1 {
                [1, rows]
            } else {
                [lead[0], lead[1]]
            };
            let x = x2
                .clone()
                .reshape([lead3[0], lead3[1], d_in])
                .require_grad();
            let y = forward(x.clone());
            let grads = (y.clone() * dy2.clone().reshape([lead3[0], lead3[1], d_out]))
                .sum()
                .backward();
            [
                host(y.into_data()),
                host(x.grad(&grads).expect("the input's gradient").into_data()),
                host(
                    weight
                        .val()
                        .grad(&grads)
                        .expect("the weight's gradient")
                        .into_data(),
                ),
                bias.map_or_else(Vec::new, |b| {
                    host(
                        b.val()
                            .grad(&grads)
                            .expect("the bias's gradient")
                            .into_data(),
                    )
                }),
            ]
        };
        let (before, products_before) = (
            burn_graphed::testing::fused_ops(),
            burn_graphed::testing::vendor_matmuls(),
        );
        let ours = run(&|x| fused.forward(x), &fused.weight, fused.bias.as_ref());
        let ran_fused = burn_graphed::testing::fused_ops() > before;
        let products = burn_graphed::testing::vendor_matmuls() - products_before;
        // burn-nn's values, computed where a check reads them (off cuBLASLt): on CUDA they
        // would cost a tuning of burn's matmul per shape and check nothing.
        let burn_values = OnceCell::new();
        let theirs = || {
            burn_values.get_or_init(|| {
                run(
                    &|x| burn_linear.forward(x),
                    &burn_linear.weight,
                    burn_linear.bias.as_ref(),
                )
            })
        };
        let label = format!(
            "linear {dtype:?} {lead:?}x{d_in} -> {d_out} bias {with_bias} transposed {transposed}"
        );
        let u = unit_roundoff(dtype);
        let shifted: Vec<f64> = truth[0][d_out..]
            .iter()
            .chain(&truth[0][..d_out])
            .copied()
            .collect();
        if vendor {
            // Every product through our kernel or cuBLASLt, summing in `f32`: the derived
            // bound (burn's error, one run's luck, can sit below cuBLASLt's order of sums).
            let sums = F32Sums::new(&device, dtype);
            let terms = [d_in + usize::from(with_bias), d_out, rows, rows];
            let want = [&truth[0], &truth[1], &truth[2], &truth[3]];
            let before_bias = epilogue_bias(with_bias, rows).then(|| layer.output(false));
            let before = before_bias.as_deref();
            sums.assert_within(&label, &ours, &want, &sizes, terms, with_bias, before);
            let control = sums.worst(&shifted, &truth[0], &sizes[0], terms[0], before);
            assert!(
                rows == 1 || control >= 10.0,
                "control {label}: the neighbouring row is off {control:.3e} bounds, not 10"
            );
        } else {
            within_bound(&label, &ours, theirs(), &truth, with_bias, u);
            let control = error(&shifted, &truth[0]);
            let bound = 2.0 * error(&theirs()[0], &truth[0]) + u;
            assert!(
                rows == 1 || control > 10.0 * bound,
                "control {label}: the neighbouring row is off {control:.3e}, not 10x the bound {bound:.3e}"
            );
        }
        // The fused path ran where it should (the counters are the process's: tests beside this
        // one may raise them too, so only a rise is evidence): the forward's, and with cuBLASLt
        // the backward's two products at least (three with the forward's on more than 8 rows);
        // elsewhere the layer computes burn-nn's values bit for bit.
        if supports_graphs(&device) && (rows <= 8 || vendor) {
            assert!(ran_fused, "{label}: the fused layer did not run");
            let least = if rows > 8 { 3 } else { 2 };
            if vendor {
                assert!(
                    products >= least,
                    "{label}: {products} products through cuBLASLt, expected {least} at least"
                );
            }
        } else {
            assert_eq!(
                &ours,
                theirs(),
                "{label}: burn-nn's path is not burn-nn's computation"
            );
        }
    }
}

/// `Linear::forward_add` (`x W + b + r`, the residual added before the output's one rounding:
/// in the small kernel on at most 8 rows, as cuBLASLt's `C` on more rows on CUDA, burn's
/// `forward(x) + r` elsewhere) against the exact values, output and every gradient; the
/// residual's gradient is the output gradient itself, bit for bit.
///
/// Tolerance, derived as for [`linear_matches_exact`]: the fused layer and burn's composition
/// compute the same sums in another order in `f32` (the fused layer rounds once, burn's twice:
/// after the product and after the addition), so the fused error must be at most twice burn's
/// composition's plus one rounding of the dtype. The residual is drawn at the output's
/// magnitude, so that the negative control, the output without the residual (a residual never
/// added), is off by about the whole magnitude: it must exceed the bound tenfold.
pub fn linear_add_matches_exact(device: &Device, dtype: FloatDType) {
    linear_add_matches_exact_in(device, dtype, 0..4);
}

/// The cases `chosen` of [`linear_add_matches_exact`] (each seeded by its index), for the GPU
/// suite's parts: burn-nn's reference tunes its products per shape there, minutes for the four
/// cases in `bf16` (as [`linear_matches_exact_in`]).
pub fn linear_add_matches_exact_in(
    device: &Device,
    dtype: FloatDType,
    chosen: std::ops::Range<usize>,
) {
    let device = device.clone().autodiff();
    if !device.supports_dtype(DType::from(dtype)) {
        skip(&format!("{device:?} has no {dtype:?}"));
        return;
    }
    // (leading dims, d_in, d_out, bias): the small kernel (1, 3 and 8 rows, rank 2 and 3) and
    // 64 rows (cuBLASLt on CUDA), shapes of `linear_matches_exact`'s cases.
    let cases: [(&[usize], usize, usize, bool); 4] = [
        (&[1], 256, 256, true),
        (&[3], 7, 5, false),
        (&[2, 4], 64, 40, true),
        (&[64], 256, 256, true),
    ];
    let vendor = burn_graphed::testing::vendor_matmul_available(&device);
    for (seed, (lead, d_in, d_out, with_bias)) in cases.into_iter().enumerate() {
        if !chosen.contains(&seed) {
            continue;
        }
        let seed = 500 + seed as u64 * 10;
        let rows: usize = lead.iter().product();
        // Rank 3 throughout: `[1, rows, width]` for one leading dimension.
        let lead3 = if lead.len() == 1 {
            [1, rows]
        } else {
            [lead[0], lead[1]]
        };
        let made = |values: Vec<f32>| {
            let count = values.len();
            Tensor::<1>::from_data(TensorData::new(values, [count]), &device).cast(dtype)
        };
        let three = |t: Tensor<1>, width: usize| t.reshape([lead3[0], lead3[1], width]);
        let burn_linear = seeded_linear(&device, dtype, (d_in, d_out), with_bias, seed);
        let fused: burn_graphed::nn::Linear = burn_linear.clone().into();
        let x = seeded_tensor(&device, dtype, rows * d_in, seed + 2);
        let dy = seeded_tensor(&device, dtype, rows * d_out, seed + 3);
        let layer = HostLayer::read(&burn_linear, x.clone().into_data(), rows);
        let dy_host = host(dy.clone().into_data());
        let [y, dx, dw, db] = layer.exact(&dy_host);
        let magnitude = y.iter().fold(0.0f64, |m, v| m.max(v.abs())) as f32;
        let r_values: Vec<f32> = values(rows * d_out, seed + 4)
            .into_iter()
            .map(|v| v * magnitude)
            .collect();
        let residual = made(r_values);
        let r_host = host(residual.clone().into_data());
        let with_residual: Vec<f64> = y.iter().zip(&r_host).map(|(y, r)| y + r).collect();

        // Output and gradients (input, weight, bias, residual) through `sum(y * dy)`.
        let run = |forward: &dyn Fn(Tensor<3>, Tensor<3>) -> Tensor<3>,
                   weight: &Param<Tensor<2>>,
                   bias: Option<&Param<Tensor<1>>>| {
            let x = three(x.clone(), d_in).require_grad();
            let r = three(residual.clone(), d_out).require_grad();
            let y = forward(x.clone(), r.clone());
            let grads = (y.clone() * three(dy.clone(), d_out)).sum().backward();
            let grad = |t: Option<Tensor<2>>| t.map_or_else(Vec::new, |t| host(t.into_data()));
            [
                host(y.into_data()),
                host(x.grad(&grads).expect("the input's gradient").into_data()),
                grad(weight.val().grad(&grads)),
                grad(
                    bias.and_then(|b| b.val().grad(&grads))
                        .map(|b| b.unsqueeze()),
                ),
                host(r.grad(&grads).expect("the residual's gradient").into_data()),
            ]
        };
        let (before, products_before) = (
            burn_graphed::testing::fused_ops(),
            burn_graphed::testing::vendor_matmuls(),
        );
        let ours = run(
            &|x, r| fused.forward_add(x, r),
            &fused.weight,
            fused.bias.as_ref(),
        );
        let ran_fused = burn_graphed::testing::fused_ops() > before;
        let products = burn_graphed::testing::vendor_matmuls() - products_before;
        // burn-nn's values where a check reads them (off cuBLASLt), as above.
        let burn_values = OnceCell::new();
        let theirs = || {
            burn_values.get_or_init(|| {
                run(
                    &|x, r| burn_linear.forward(x) + r,
                    &burn_linear.weight,
                    burn_linear.bias.as_ref(),
                )
            })
        };
        let label =
            format!("linear + residual {dtype:?} {lead:?}x{d_in} -> {d_out} bias {with_bias}");
        let u = unit_roundoff(dtype);
        let truth = [with_residual.clone(), dx, dw, db];
        if vendor {
            // As in `linear_matches_exact`: the derived bound of `f32` sums, the residual one
            // more term of the output's.
            let sums = F32Sums::new(&device, dtype);
            let mut sizes = layer.magnitudes(&dy_host);
            for (size, r) in sizes[0].iter_mut().zip(&r_host) {
                *size += r.abs();
            }
            let terms = [d_in + usize::from(with_bias) + 1, d_out, rows, rows];
            let want = [&truth[0], &truth[1], &truth[2], &truth[3]];
            let before_bias = epilogue_bias(with_bias, rows).then(|| {
                let product = layer.output(false);
                product
                    .iter()
                    .zip(&r_host)
                    .map(|(p, r)| p + r)
                    .collect::<Vec<_>>()
            });
            let before = before_bias.as_deref();
            sums.assert_within(&label, &ours, &want, &sizes, terms, with_bias, before);
            let control = sums.worst(&y, &with_residual, &sizes[0], terms[0], before);
            assert!(
                control >= 10.0,
                "control {label}: the output without its residual is off {control:.3e} bounds, not 10"
            );
        } else {
            let bound = within_bound(&label, &ours, theirs(), &truth, with_bias, u);
            let control = error(&y, &with_residual);
            assert!(
                control > 10.0 * bound,
                "control {label}: the output without its residual is off {control:.3e}, not 10x the bound {bound:.3e}"
            );
        }
        assert_eq!(
            ours[4], dy_host,
            "{label}: the residual's gradient is not the output gradient"
        );
        if supports_graphs(&device) && (rows <= 8 || vendor) {
            assert!(ran_fused, "{label}: the fused layer did not run");
            if vendor && rows > 8 {
                assert!(
                    products >= 3,
                    "{label}: {products} products through cuBLASLt, expected 3 at least"
                );
            }
        } else {
            assert_eq!(
                &ours,
                theirs(),
                "{label}: off the fused path, not burn's composition"
            );
        }
    }
}

/// A graphed call of two fused linear layers on one row (the small kernel) and on 48 rows
/// (cuBLASLt on CUDA) equals its eager call, bit for bit, output and weight gradients, over
/// several calls.
pub fn linear_graphed_matches_eager(device: &Device) {
    for rows in [1, 48] {
        linear_graphed_matches_eager_on(device, rows);
    }
}

fn linear_graphed_matches_eager_on(device: &Device, rows: usize) {
    let device = device.clone().autodiff();
    #[derive(Module, Debug)]
    struct TwoLayers {
        first: burn_graphed::nn::Linear,
        second: burn_graphed::nn::Linear,
    }
    let model = TwoLayers {
        first: burn::nn::LinearConfig::new(48, 64).init(&device).into(),
        second: burn::nn::LinearConfig::new(64, 10).init(&device).into(),
    };
    let eager = burn_graphed_testkit::deep_copy(&model);
    let input = |step: u64| {
        Tensor::<1>::from_data(
            TensorData::new(values(rows * 48, 100 + step), [rows * 48]),
            &device,
        )
        .reshape([rows, 48])
    };
    let forward = |m: &TwoLayers, x: Tensor<2>| m.second.forward(m.first.forward(x).tanh());
    let graphed = burn_graphed::Graphed::new(model, forward, input(0), &GraphedConfig::new())
        .expect("capture");
    assert_graphed_equals_eager(&graphed, &eager, forward, (1..4).map(input), |m, grads| {
        m.first
            .weight
            .val()
            .grad(grads)
            .expect("the weight's gradient")
            .into_data()
    });
    if supports_graphs(&device) {
        assert_eq!(graphed.stats().forward_replays, 3, "{:?}", graphed.stats());
    }
}

/// `Linear::forward_relu` (`relu(x W + b)` in one launch where the layer runs fused: the small
/// kernel on at most 8 rows, cuBLASLt's `RELU_BIAS` epilogue on more on CUDA, burn's
/// `relu(forward(x))` elsewhere) against the exact values, the output and every gradient.
///
/// Tolerance, derived per element as for the convolutions (`fused_conv.rs`): each value is a sum
/// of `K` terms (the output: `d_in` products and the bias; the input gradient: `d_out`; the
/// weight gradient: one per row; the bias gradient: `rows`), summed in `f32` in any order, so
/// it is off the exact sum by at most `gamma_K S` (`S` the sum of the terms' magnitudes,
/// Higham 4.2), plus, for `f32` products on TF32 tensor cores, `(2 t + t^2) S` with `t =
/// 2^-11`, plus one rounding of the dtype `u (|exact| + that)` (in `f16` below its normal
/// range, half its subnormal spacing, `2^-25`: a weight gradient of one row is one product of
/// two values below 1, often that small). The ReLU moves no value
/// further (`|relu(a) - relu(b)| <= |a - b|`). Its gradient passes where the fused output is
/// above zero: the exact gradients are taken with that mask (the forward's own decision, which
/// the backward must reuse). That bound holds where every product sums in `f32`: on CUDA with
/// cuBLASLt. Elsewhere the backward's products are burn's matmuls, which may sum in the dtype
/// (Flex in `f16`/`bf16` failed the `f32` bound), so the bound there is twice burn-nn's
/// composition's error plus one rounding, as [`linear_matches_exact`]'s, and off the fused path
/// the values must be burn-nn's bit for bit. Negative controls, each at least ten bounds off:
/// the output without its ReLU, and the input gradient of an unmasked output gradient (a
/// backward that forgot the ReLU).
pub fn linear_relu_matches_exact(device: &Device, dtype: FloatDType) {
    let device = device.clone().autodiff();
    if !device.supports_dtype(DType::from(dtype)) {
        skip(&format!("{device:?} has no {dtype:?}"));
        return;
    }
    let u = unit_roundoff(dtype);
    let sums = F32Sums::new(&device, dtype);
    // (rows, d_in, d_out, bias): the small kernel (1, 3 rows), then cuBLASLt on CUDA.
    let cases: [(usize, usize, usize, bool); 4] = [
        (1, 256, 256, true),
        (3, 70, 33, false),
        (48, 96, 130, true),
        (64, 256, 256, false),
    ];
    for (seed, (rows, d_in, d_out, with_bias)) in cases.into_iter().enumerate() {
        let seed = 700 + seed as u64 * 10;
        let burn_linear = seeded_linear(&device, dtype, (d_in, d_out), with_bias, seed);
        let fused: burn_graphed::nn::Linear = burn_linear.clone().into();
        let x = seeded_tensor(&device, dtype, rows * d_in, seed + 2)
            .reshape([rows, d_in])
            .require_grad();
        let dy = seeded_tensor(&device, dtype, rows * d_out, seed + 3).reshape([rows, d_out]);
        let before = burn_graphed::testing::fused_ops();
        let y = fused.forward_relu(x.clone());
        let grads = (y.clone() * dy.clone()).sum().backward();
        let got = output_and_grads(y, &x, (&fused.weight, fused.bias.as_ref()), &grads);
        let ran_fused = burn_graphed::testing::fused_ops() > before;
        // burn-nn's composition on the same values: the reference off cuBLASLt, computed where
        // a check reads it.
        let burn_values = OnceCell::new();
        let theirs = || {
            burn_values.get_or_init(|| {
                let burn_y = burn::tensor::activation::relu(burn_linear.forward(x.clone()));
                let burn_grads = (burn_y.clone() * dy.clone()).sum().backward();
                let burn_params = (&burn_linear.weight, burn_linear.bias.as_ref());
                output_and_grads(burn_y, &x, burn_params, &burn_grads)
            })
        };
        let vendor = burn_graphed::testing::vendor_matmul_available(&device);
        let layer = HostLayer::read(&burn_linear, x.clone().into_data(), rows);
        let dys = host(dy.clone().into_data());
        // The output gradient through the fused output's mask, and unmasked (the control).
        let masked: Vec<f64> = dys
            .iter()
            .zip(&got[0])
            .map(|(d, y)| if *y > 0.0 { *d } else { 0.0 })
            .collect();
        let truth = layer.exact(&masked);
        let unmasked = layer.exact(&dys);
        let magnitudes = layer.magnitudes(&masked);
        let relu_out: Vec<f64> = truth[0].iter().map(|v| v.max(0.0)).collect();
        let label = format!("linear relu {dtype:?} {rows}x{d_in} -> {d_out} bias {with_bias}");
        let terms = [d_in + usize::from(with_bias), d_out, rows, rows];
        if vendor {
            // Every product through our kernel or cuBLASLt, each summing in `f32`.
            let want = [&relu_out, &truth[1], &truth[2], &truth[3]];
            let before_bias = epilogue_bias(with_bias, rows).then(|| layer.output(false));
            let before = before_bias.as_deref();
            sums.assert_within(&label, &got, &want, &magnitudes, terms, with_bias, before);
            let no_relu = sums.worst(&truth[0], &relu_out, &magnitudes[0], terms[0], before);
            let unmasked_dx = sums.worst(&unmasked[1], &truth[1], &magnitudes[1], terms[1], None);
            assert!(
                no_relu >= 10.0 && unmasked_dx >= 10.0,
                "control {label}: without the ReLU off {no_relu:.3e} bounds, unmasked input \
                 gradient {unmasked_dx:.3e}: both must be 10 or more"
            );
        } else {
            // The backward's products (and off the fused path everything) are burn's, whose
            // matmul may sum in the dtype: twice burn's error plus one rounding, as
            // [`linear_matches_exact`].
            let truth = [
                relu_out.clone(),
                truth[1].clone(),
                truth[2].clone(),
                truth[3].clone(),
            ];
            let bound = within_bound(&label, &got, theirs(), &truth, with_bias, u);
            let no_relu = error(&unmasked[0], &truth[0]);
            let dx_bound = 2.0 * error(&theirs()[1], &truth[1]) + u;
            let unmasked_dx = error(&unmasked[1], &truth[1]);
            assert!(
                no_relu > 10.0 * bound && unmasked_dx > 10.0 * dx_bound,
                "control {label}: without the ReLU off {no_relu:.3e} (bound {bound:.3e}), \
                 unmasked input gradient {unmasked_dx:.3e} (bound {dx_bound:.3e}): both must \
                 be 10x"
            );
        }
        if supports_graphs(&device) && (rows <= 8 || vendor) {
            assert!(ran_fused, "{label}: the fused layer did not run");
        } else {
            assert_eq!(
                &got,
                theirs(),
                "{label}: off the fused path, not burn-nn's composition"
            );
        }
    }
}
