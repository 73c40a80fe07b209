//! `burn_graphed::nn::Conv2d` and `conv2d` against the exact convolution (host `f64` from the
//! very values the device holds), the output and every gradient, in `f32`, `f16` and `bf16`:
//! odd sizes, stride, asymmetric padding, dilation, groups (depthwise too), a 1x1 and a 5x5
//! kernel, channel counts that leave a partial block or take the staged weights in several
//! chunks, an input held in another memory order;
//! against burn-nn's `Conv2d` in `f32`; inside graphed calls.
//!
//! Tolerance, derived per element: each value is a sum of `K` products of values the device
//! holds exactly (the output and the input gradient: `channels / groups * taps` terms, plus the
//! bias; the weight gradient: one term per output pixel; the bias gradient: the output
//! gradient's elements). The kernels multiply and add in `f32`, in an order of their own (a
//! sequence, a tree, partial sums); whatever the order, the computed sum differs from the exact
//! one by at most `gamma_K * S`, `gamma_K = K u / (1 - K u)` with `u = 2^-24` and `S` the sum of
//! the terms' magnitudes (Higham, Accuracy and Stability of Numerical Algorithms, 4.2), and the
//! rounding to the dtype adds at most one unit roundoff of the result (in `f16` below its normal
//! range, half its subnormal spacing, `2^-25`). So each element must satisfy `|got - exact| <=
//! gamma_K S + u_dtype (|exact| + gamma_K S)`. Off cubecl backends the module is burn-nn's
//! computation and must equal it bit for bit. Negative control: the
//! exact values of the neighbouring output pixel (a shifted row, a padding off by one) must
//! break that bound tenfold somewhere.

use super::exact::{host, seeded, unit_roundoff};
use super::skip::skip;
use super::*;
use burn::module::Param;
use burn::nn::PaddingConfig2d;
use burn::nn::conv::Conv2dConfig;
use burn::tensor::{DType, FloatDType};

/// One case: input `[n, c, h, w]`, `out_channels`, kernel, stride, padding
/// `(top, left, bottom, right)`, dilation, groups, bias, input held channels-last.
struct Case {
    input: [usize; 4],
    out_channels: usize,
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: (usize, usize, usize, usize),
    dilation: [usize; 2],
    groups: usize,
    bias: bool,
    channels_last: bool,
}

fn cases() -> Vec<Case> {
    let case = |input, out_channels, kernel, stride, padding, dilation, groups, bias| Case {
        input,
        out_channels,
        kernel,
        stride,
        padding,
        dilation,
        groups,
        bias,
        channels_last: false,
    };
    vec![
        case(
            [2, 3, 9, 7],
            4,
            [3, 3],
            [1, 1],
            (1, 1, 1, 1),
            [1, 1],
            1,
            true,
        ),
        case(
            [2, 4, 8, 8],
            6,
            [3, 3],
            [2, 2],
            (1, 0, 0, 1),
            [1, 1],
            2,
            false,
        ),
        case(
            [1, 3, 10, 9],
            5,
            [3, 2],
            [1, 2],
            (2, 1, 2, 1),
            [2, 2],
            1,
            true,
        ),
        case(
            [3, 16, 6, 5],
            9,
            [1, 1],
            [1, 1],
            (0, 0, 0, 0),
            [1, 1],
            1,
            true,
        ),
        case(
            [2, 6, 7, 7],
            6,
            [3, 3],
            [1, 1],
            (1, 1, 1, 1),
            [1, 1],
            6,
            true,
        ),
        // More input and output channels than the kernels stage at once (weights in chunks
        // of channels), blocks of channels that end partway.
        case(
            [1, 12, 6, 5],
            11,
            [5, 5],
            [1, 1],
            (2, 2, 2, 2),
            [1, 1],
            1,
            false,
        ),
        Case {
            channels_last: true,
            ..case(
                [2, 5, 6, 7],
                3,
                [5, 5],
                [1, 1],
                (2, 2, 2, 2),
                [1, 1],
                1,
                true,
            )
        },
    ]
}

/// The exact convolution and its gradients for output gradient `dy`, with, per element, the
/// number of terms `K` and the sum of their magnitudes `S`: `[(values, terms, magnitudes); 4]`
/// for the output, the input gradient, the weight gradient and the bias gradient.
struct Exact {
    values: [Vec<f64>; 4],
    magnitudes: [Vec<f64>; 4],
    terms: [usize; 4],
}

#[allow(clippy::too_many_arguments)]
fn exact(
    case: &Case,
    x: &[f64],
    w: &[f64],
    b: Option<&[f64]>,
    dy: &[f64],
    out: [usize; 4],
) -> Exact {
    let [n, c, h, wd] = case.input;
    let [_, co, oh, ow] = out;
    let [kh, kw] = case.kernel;
    let (gi, go) = (c / case.groups, co / case.groups);
    let (top, left) = (case.padding.0, case.padding.1);
    let mut y = vec![0.0; n * co * oh * ow];
    let mut ys = vec![0.0; y.len()];
    let mut dx = vec![0.0; x.len()];
    let mut dxs = vec![0.0; x.len()];
    let mut dw = vec![0.0; w.len()];
    let mut dws = vec![0.0; w.len()];
    let mut db = vec![0.0; co];
    let mut dbs = vec![0.0; co];
    for b_ in 0..n {
        for o in 0..co {
            let g = o / go;
            for oy in 0..oh {
                for ox in 0..ow {
                    let at = ((b_ * co + o) * oh + oy) * ow + ox;
                    let mut sum = b.map_or(0.0, |b| b[o]);
                    let mut mag = sum.abs();
                    for ci in 0..gi {
                        for ky in 0..kh {
                            for kx in 0..kw {
                                let iy = (oy * case.stride[0] + ky * case.dilation[0]) as isize
                                    - top as isize;
                                let ix = (ox * case.stride[1] + kx * case.dilation[1]) as isize
                                    - left as isize;
                                if iy < 0 || ix < 0 || iy as usize >= h || ix as usize >= wd {
                                    continue;
                                }
                                let xi =
                                    ((b_ * c + g * gi + ci) * h + iy as usize) * wd + ix as usize;
                                let wi = ((o * gi + ci) * kh + ky) * kw + kx;
                                sum += x[xi] * w[wi];
                                mag += (x[xi] * w[wi]).abs();
                                dx[xi] += dy[at] * w[wi];
                                dxs[xi] += (dy[at] * w[wi]).abs();
                                dw[wi] += dy[at] * x[xi];
                                dws[wi] += (dy[at] * x[xi]).abs();
                            }
                        }
                    }
                    y[at] = sum;
                    ys[at] = mag;
                    db[o] += dy[at];
                    dbs[o] += dy[at].abs();
                }
            }
        }
    }
    let pixels = n * oh * ow;
    Exact {
        values: [y, dx, dw, db],
        magnitudes: [ys, dxs, dws, dbs],
        terms: [gi * kh * kw + 1, go * kh * kw, pixels, pixels],
    }
}

/// The largest `|got - exact|` over the element's bound (above 1: the bound is broken).
fn worst_ratio(
    got: &[f64],
    exact: &[f64],
    magnitudes: &[f64],
    terms: usize,
    dtype: FloatDType,
) -> f64 {
    let u = 2f64.powi(-24);
    let k = terms as f64;
    let gamma = k * u / (1.0 - k * u);
    let ud = unit_roundoff(dtype);
    // Below f16's normal range (6.1e-5) its rounding is absolute: half its subnormal spacing.
    let floor = if matches!(dtype, FloatDType::F16) {
        2f64.powi(-25)
    } else {
        0.0
    };
    assert_eq!(got.len(), exact.len(), "lengths");
    got.iter()
        .zip(exact)
        .zip(magnitudes)
        .map(|((g, e), s)| {
            let bound = gamma * s + ud * (e.abs() + gamma * s) + floor;
            let miss = (g - e).abs();
            if miss == 0.0 {
                0.0
            } else {
                miss / bound.max(f64::MIN_POSITIVE)
            }
        })
        .fold(0.0, f64::max)
}

/// The cases of one dtype; a device without the dtype skips them, and says so.
pub fn conv_matches_exact(device: &Device, dtype: FloatDType) {
    let device = device.clone().autodiff();
    if !device.supports_dtype(DType::from(dtype)) {
        skip(&format!("{device:?} has no {dtype:?}"));
        return;
    }
    // The kernels' tilings (pixels and channels per unit, and the forward's split of the
    // summed channels), one per case (by size, a small shape would always take a split one):
    // the splits meet cases with fewer input channels per group than parts (3 in 8; grouped, 1
    // in 4) and one with more (12 in 4, 8 output channels a unit, over two staged chunks of 10
    // and 2 input channels), and the choice by size a channels-last case (5 in 4).
    let tilings = [
        Some((4, 8, 1)),
        Some((2, 16, 1)),
        Some((1, 4, 8)),
        Some((2, 4, 1)),
        Some((2, 2, 4)),
        Some((1, 8, 4)),
        None,
    ];
    for (seed, case) in cases().into_iter().enumerate() {
        check_case(
            &device,
            dtype,
            &case,
            seed as u64 * 10,
            tilings[seed % tilings.len()],
        );
    }
}

fn check_case(
    device: &Device,
    dtype: FloatDType,
    case: &Case,
    seed: u64,
    tiling: Option<(usize, usize, usize)>,
) {
    let [n, c, h, w] = case.input;
    let made = |values: Vec<f32>| {
        let count = values.len();
        Tensor::<1>::from_data(TensorData::new(values, [count]), device).cast(dtype)
    };
    let mut burn_conv = Conv2dConfig::new([c, case.out_channels], case.kernel)
        .with_stride(case.stride)
        .with_dilation(case.dilation)
        .with_groups(case.groups)
        .with_padding(PaddingConfig2d::Explicit(
            case.padding.0,
            case.padding.1,
            case.padding.2,
            case.padding.3,
        ))
        .with_bias(case.bias)
        .init(device);
    let gi = c / case.groups;
    let [kh, kw] = case.kernel;
    burn_conv.weight = Param::from_tensor(
        made(seeded(case.out_channels * gi * kh * kw, seed, -1.0, 1.0)).reshape([
            case.out_channels,
            gi,
            kh,
            kw,
        ]),
    );
    if case.bias {
        burn_conv.bias = Some(Param::from_tensor(made(seeded(
            case.out_channels,
            seed + 1,
            -1.0,
            1.0,
        ))));
    }
    let fused: burn_graphed::nn::Conv2d = burn_conv.clone().into();
    // The input, held channels-last where the case says so: a `[n, h, w, c]` buffer seen as
    // `[n, c, h, w]`.
    let x = if case.channels_last {
        made(seeded(n * c * h * w, seed + 2, -1.0, 1.0))
            .reshape([n, h, w, c])
            .permute([0, 3, 1, 2])
    } else {
        made(seeded(n * c * h * w, seed + 2, -1.0, 1.0)).reshape([n, c, h, w])
    };
    let out = fused.forward(x.clone()).dims();
    let dy = made(seeded(out.iter().product(), seed + 3, -1.0, 1.0)).reshape(out);
    let label = format!(
        "conv {dtype:?} tiling {tiling:?} {:?} -> {} kernel {:?} stride {:?} padding {:?} dilation {:?} groups {} bias {} channels-last {}",
        case.input,
        case.out_channels,
        case.kernel,
        case.stride,
        case.padding,
        case.dilation,
        case.groups,
        case.bias,
        case.channels_last,
    );
    let truth = exact(
        case,
        &host(x.clone().into_data()),
        &host(burn_conv.weight.val().into_data()),
        burn_conv
            .bias
            .as_ref()
            .map(|b| host(b.val().into_data()))
            .as_deref(),
        &host(dy.clone().into_data()),
        out,
    );
    // Output and gradients through `sum(y * dy)`.
    let run = |forward: &dyn Fn(Tensor<4>) -> Tensor<4>,
               weight: &Param<Tensor<4>>,
               bias: Option<&Param<Tensor<1>>>| {
        let x = x.clone().require_grad();
        let y = forward(x.clone());
        let grads = (y.clone() * dy.clone()).sum().backward();
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
    let before = burn_graphed::testing::fused_ops();
    burn_graphed::testing::force_conv_tiling(tiling);
    let ours = run(&|x| fused.forward(x), &fused.weight, fused.bias.as_ref());
    burn_graphed::testing::force_conv_tiling(None);
    let ran_fused = burn_graphed::testing::fused_ops() > before;
    // Off cubecl backends the module is burn-nn's computation (checked below, bit for bit),
    // whose sums may run in the dtype: the bound is the fused kernels'.
    let fused_path = supports_graphs(device);
    for (k, what) in [
        "output",
        "input gradient",
        "weight gradient",
        "bias gradient",
    ]
    .into_iter()
    .enumerate()
    {
        if !fused_path || (k == 3 && !case.bias) {
            continue;
        }
        let ratio = worst_ratio(
            &ours[k],
            &truth.values[k],
            &truth.magnitudes[k],
            truth.terms[k],
            dtype,
        );
        println!("{label} {what}: worst error / bound {ratio:.3e}");
        assert!(
            ratio <= 1.0,
            "{label} {what}: an element is {ratio:.3e} times its bound"
        );
    }
    // Negative control: the neighbouring output pixel's exact values break the bound.
    let shifted: Vec<f64> = truth.values[0][1..]
        .iter()
        .chain(&truth.values[0][..1])
        .copied()
        .collect();
    let control = worst_ratio(
        &shifted,
        &truth.values[0],
        &truth.magnitudes[0],
        truth.terms[0],
        dtype,
    );
    assert!(
        control > 10.0,
        "control {label}: the neighbouring pixel is only {control:.3e} times the bound"
    );
    if fused_path {
        assert!(ran_fused, "{label}: the fused convolution did not run");
    } else {
        // Elsewhere the module is burn-nn's computation, bit for bit.
        let theirs = run(
            &|x| burn_conv.forward(x),
            &burn_conv.weight,
            burn_conv.bias.as_ref(),
        );
        assert_eq!(
            ours, theirs,
            "{label}: burn-nn's path is not burn-nn's computation"
        );
    }
}

/// The fused module against burn-nn's `Conv2d` on the same parameters, `f32`, with burn-nn's
/// `Same` padding and a stride (the module's own padding arithmetic against burn-nn's): per
/// element, `|ours - burn-nn's| <= 2 gamma_K S` (each within `gamma_K S` of the exact sum, as
/// derived above) plus, on CUDA, `2^-10 S` (burn's convolution may round both factors of each
/// product to TF32: 2^-11 each). Negative control: the neighbouring pixel breaks it tenfold.
pub fn conv_matches_burn_nn(device: &Device) {
    let device = device.clone().autodiff();
    // `Same` on 12 x 11 with a 3 x 3 kernel and stride (2, 1): 6 x 11 outputs, padding
    // (top 0, bottom 1) and (left 1, right 1), as burn-nn computes it.
    let case = Case {
        input: [2, 3, 12, 11],
        out_channels: 16,
        kernel: [3, 3],
        stride: [2, 1],
        padding: (0, 1, 1, 1),
        dilation: [1, 1],
        groups: 1,
        bias: true,
        channels_last: false,
    };
    let x = Tensor::<1>::from_data(
        TensorData::new(seeded(2 * 3 * 12 * 11, 7, -1.0, 1.0), [2 * 3 * 12 * 11]),
        &device,
    )
    .reshape([2, 3, 12, 11]);
    let burn_conv = Conv2dConfig::new([3, 16], [3, 3])
        .with_padding(PaddingConfig2d::Same)
        .with_stride([2, 1])
        .init(&device);
    let fused: burn_graphed::nn::Conv2d = burn_conv.clone().into();
    let out = [2, 16, 6, 11];
    let count: usize = out.iter().product();
    let dy = Tensor::<1>::from_data(
        TensorData::new(seeded(count, 8, -1.0, 1.0), [count]),
        &device,
    )
    .reshape(out);
    let grads_of = |forward: &dyn Fn(Tensor<4>) -> Tensor<4>, weight: &Param<Tensor<4>>| {
        let x = x.clone().require_grad();
        let y = forward(x.clone());
        assert_eq!(y.dims(), out, "the output's shape");
        let grads = (y.clone() * dy.clone()).sum().backward();
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
        ]
    };
    let ours = grads_of(&|x| fused.forward(x), &fused.weight);
    let theirs = grads_of(&|x| burn_conv.forward(x), &burn_conv.weight);
    let truth = exact(
        &case,
        &host(x.clone().into_data()),
        &host(burn_conv.weight.val().into_data()),
        burn_conv
            .bias
            .as_ref()
            .map(|b| host(b.val().into_data()))
            .as_deref(),
        &host(dy.clone().into_data()),
        out,
    );
    let u = 2f64.powi(-24);
    let tf32 = if kernels_may_differ(&device) {
        2f64.powi(-10)
    } else {
        0.0
    };
    let worst = |got: &[f64], reference: &[f64], k: usize| {
        let terms = truth.terms[k] as f64;
        let gamma = terms * u / (1.0 - terms * u);
        got.iter()
            .zip(reference)
            .zip(&truth.magnitudes[k])
            .map(|((a, b), s)| (a - b).abs() / ((2.0 * gamma + tf32) * s).max(f64::MIN_POSITIVE))
            .fold(0.0f64, f64::max)
    };
    for (k, what) in ["output", "input gradient", "weight gradient"]
        .into_iter()
        .enumerate()
    {
        let ratio = worst(&ours[k], &theirs[k], k);
        println!("conv vs burn-nn {what}: worst difference / bound {ratio:.3e}");
        assert!(
            ratio <= 1.0,
            "conv vs burn-nn {what}: an element differs by {ratio:.3e} times its bound"
        );
    }
    let shifted: Vec<f64> = theirs[0][1..]
        .iter()
        .chain(&theirs[0][..1])
        .copied()
        .collect();
    let control = worst(&shifted, &theirs[0], 0);
    assert!(
        control > 10.0,
        "control: burn-nn's neighbouring pixel is only {control:.3e} times the bound"
    );
}

/// A graphed call of a small CNN with the fused convolutions equals its eager call, bit for
/// bit, output and the first layer's weight gradient, over several calls.
pub fn conv_graphed_matches_eager(device: &Device) {
    let device = device.clone().autodiff();
    #[derive(Module, Debug)]
    struct Cnn {
        first: burn_graphed::nn::Conv2d,
        second: burn_graphed::nn::Conv2d,
    }
    let model = Cnn {
        first: Conv2dConfig::new([3, 8], [3, 3])
            .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
            .init(&device)
            .into(),
        second: Conv2dConfig::new([8, 4], [3, 3])
            .with_stride([2, 2])
            .init(&device)
            .into(),
    };
    let eager = burn_graphed_testkit::deep_copy(&model);
    let input = |step: u64| {
        Tensor::<1>::from_data(
            TensorData::new(seeded(2 * 3 * 10 * 10, 100 + step, -1.0, 1.0), [600]),
            &device,
        )
        .reshape([2, 3, 10, 10])
    };
    let forward = |m: &Cnn, x: Tensor<4>| m.second.forward(m.first.forward(x).tanh());
    let graphed = burn_graphed::Graphed::new(model, forward, input(0), &GraphedConfig::new())
        .expect("capture");
    super::exact::assert_graphed_equals_eager(
        &graphed,
        &eager,
        forward,
        (1..4).map(input),
        |m, grads| {
            m.first
                .weight
                .val()
                .grad(grads)
                .expect("the weight's gradient")
                .into_data()
        },
    );
    if supports_graphs(&device) {
        assert_eq!(graphed.stats().forward_replays, 3, "{:?}", graphed.stats());
    }
}

/// burn-nn's file loads into the fused module and the fused module's into burn-nn's: a
/// checkpoint of one is a checkpoint of the other.
pub fn conv_records_load_both_ways(device: &Device) {
    let config = Conv2dConfig::new([3, 5], [3, 3]).with_padding(PaddingConfig2d::Same);
    records_load_both_ways(
        "conv",
        || config.init(device),
        || -> burn_graphed::nn::Conv2d { config.init(device).into() },
    );
}
