//! `burn_graphed::nn::layer_norm` and `LayerNorm` against the exact norm (computed on the host
//! in `f64` from the very values the device holds) and against burn-nn's, forward and all three
//! gradients, in `f32`, `f16` and `bf16`, with and without beta, odd widths, widths above one
//! cube's threads, more rows than one grid dimension holds, a non-contiguous input; inside a
//! graphed call; and burn-nn's parameters loading into the fused module and back.
//!
//! Tolerance, derived: both the fused kernels and burn's composition compute the same formula;
//! they differ in the order of the sums (a tree per row here, burn's reductions there), in
//! where they round (the fused path computes in `f32` and rounds once to the dtype; burn-nn
//! rounds every operation in `bf16`, computes `f16` in `f32`) and in the parameter gradients'
//! summation over rows. So the fused error against the exact values must be at most twice
//! burn-nn's own error on the same data, plus one rounding of the result to its dtype (`u`,
//! half a unit in the last place, relative to the tensor's largest magnitude). The parameter
//! gradients sum over every row, and there one sample of another order's error says little
//! (on CUDA, `[66000, 3]`'s gamma gradient: burn-nn's tree 6.3e-8 from exact, the fused kernel's
//! chunks of rows 2.3e-7, measured when burn's sum added the chunks; on lavapipe burn-nn's 1.6e-2, which would hide a dropped row): in
//! `f32` their bound is twice what rounding may cost the fused kernel's own order of sums
//! (`exact`'s probabilistic allowance), plus `u`. Errors are
//! measured as the largest distance over the tensor divided by its largest exact magnitude. The
//! negative controls show the bound is far below the smallest real error it must catch: the
//! exact values of a neighbouring row (an off-by-one row, a stale row), and in `f32` a norm with
//! the wrong epsilon (`1e-3` for `1e-5`) and, for the parameter gradients, the exact gradient
//! without the last row (a row dropped at the end of a chunk or of the rows).

use super::exact::{
    assert_graphed_equals_eager, host, relative_error as error, seeded, unit_roundoff,
};
use super::skip::skip;
use super::*;
use burn::module::Param;
use burn::tensor::{DType, FloatDType};
use burn_graphed::nn::{LayerNorm, LayerNormConfig, RmsNorm, layer_norm};

/// Deterministic values in about [-2, 2], with an offset every seven elements so that the
/// mean matters.
pub(super) fn values(count: usize, seed: u64) -> Vec<f32> {
    seeded(count, seed, -2.0, 2.0)
        .into_iter()
        .enumerate()
        .map(|(i, v)| v + ((i / 7) % 5) as f32 * 0.3)
        .collect()
}

/// One case: the input's shape (normalized over its last dimension), beta or not, and whether
/// the input is a transposed (non-contiguous) view.
struct Case {
    shape: Vec<usize>,
    beta: bool,
    transposed: bool,
}

fn case(shape: &[usize], beta: bool) -> Case {
    Case {
        shape: shape.to_vec(),
        beta,
        transposed: false,
    }
}

/// Rows a chunk of the fused kernel's parameter-gradient sums runs down in order, for `rows`
/// rows (the library's own count); the chunks' sums are then added as [`lanes_sum`] adds them.
fn rows_per_chunk(rows: usize) -> usize {
    burn_graphed::testing::norm_rows_per_chunk(rows)
}

/// The chunks' sums of one parameter-gradient element added as the kernel adds them: lane `l`
/// of the library's lanes takes chunks `l, l + lanes, ...` in order, then the lanes are added
/// in order. Returns the total and the sum of the squares of every partial sum formed.
fn lanes_sum(chunks: &[f64]) -> (f64, f64) {
    let lanes = burn_graphed::testing::norm_sum_lanes();
    let (mut total, mut squares) = (0.0, 0.0);
    for lane in 0..lanes {
        let mut sum = 0.0;
        for chunk in chunks.iter().skip(lane).step_by(lanes) {
            sum += chunk;
            squares += sum * sum;
        }
        if lane == 0 {
            total = sum;
        } else {
            total += sum;
            squares += total * total;
        }
    }
    (total, squares)
}

/// The exact forward and gradients of a layer norm over rows of `width`: `(y, dx, dgamma,
/// dbeta)` for the output gradient `dy`; then, per element of `dgamma` and `dbeta`, what `f32`
/// rounding may cost their sums in the fused kernel's order (chunks of
/// [`rows_per_chunk`] rows in order, then the chunks in the kernel's lanes, [`lanes_sum`]):
/// each addition rounds its partial sum `S` by at most `u |S|`, each product `t` by `u
/// |t|`, independently, so the error is within `4 u sqrt(sum S^2 + sum t^2)` but with a
/// probability below 1e-4 (four standard deviations; Higham and Mary's probabilistic bound).
fn exact(
    x: &[f64],
    gamma: &[f64],
    beta: Option<&[f64]>,
    dy: &[f64],
    width: usize,
    epsilon: f64,
    centered: bool,
) -> [Vec<f64>; 6] {
    let rows = x.len() / width;
    let (mut y, mut dx) = (vec![0.0; x.len()], vec![0.0; x.len()]);
    let (mut dgamma, mut dbeta) = (vec![0.0; width], vec![0.0; width]);
    // Per element: the chunk's partial sums, the finished chunks' sums, and the squares the
    // allowance adds up.
    let (mut chunk_gamma, mut chunk_beta) = (vec![0.0; width], vec![0.0; width]);
    let (mut chunks_gamma, mut chunks_beta) = (vec![Vec::new(); width], vec![Vec::new(); width]);
    let (mut squares_gamma, mut squares_beta) = (vec![0.0; width], vec![0.0; width]);
    let per_chunk = rows_per_chunk(rows);
    for r in 0..rows {
        let row = &x[r * width..(r + 1) * width];
        let mean = if centered {
            row.iter().sum::<f64>() / width as f64
        } else {
            0.0
        };
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / width as f64;
        let rstd = 1.0 / (var + epsilon).sqrt();
        let xhat: Vec<f64> = row.iter().map(|v| (v - mean) * rstd).collect();
        let g: Vec<f64> = (0..width).map(|i| dy[r * width + i] * gamma[i]).collect();
        let mean_g = if centered {
            g.iter().sum::<f64>() / width as f64
        } else {
            0.0
        };
        let mean_gx = (0..width).map(|i| g[i] * xhat[i]).sum::<f64>() / width as f64;
        for i in 0..width {
            y[r * width + i] = xhat[i] * gamma[i] + beta.map_or(0.0, |b| b[i]);
            dx[r * width + i] = rstd * (g[i] - mean_g - xhat[i] * mean_gx);
            let term = dy[r * width + i] * xhat[i];
            chunk_gamma[i] += term;
            chunk_beta[i] += dy[r * width + i];
            squares_gamma[i] += chunk_gamma[i] * chunk_gamma[i] + term * term;
            squares_beta[i] += chunk_beta[i] * chunk_beta[i];
            if (r + 1) % per_chunk == 0 || r + 1 == rows {
                chunks_gamma[i].push(std::mem::take(&mut chunk_gamma[i]));
                chunks_beta[i].push(std::mem::take(&mut chunk_beta[i]));
            }
        }
    }
    for i in 0..width {
        let (total, squares) = lanes_sum(&chunks_gamma[i]);
        (dgamma[i], squares_gamma[i]) = (total, squares_gamma[i] + squares);
        let (total, squares) = lanes_sum(&chunks_beta[i]);
        (dbeta[i], squares_beta[i]) = (total, squares_beta[i] + squares);
    }
    let u = f64::from(f32::EPSILON) / 2.0;
    let allowance = |squares: Vec<f64>| squares.into_iter().map(|s| 4.0 * u * s.sqrt()).collect();
    [
        y,
        dx,
        dgamma,
        dbeta,
        allowance(squares_gamma),
        allowance(squares_beta),
    ]
}

/// Forward and gradients `(y, dx, dgamma, dbeta)` of `norm` on `x` with output gradient `dy`
/// (through `loss = sum(y * dy)`), read back.
fn run<F: Fn(Tensor<2>) -> Tensor<2>>(
    norm: F,
    x: Tensor<2>,
    dy: Tensor<2>,
    params: (&Param<Tensor<1>>, Option<&Param<Tensor<1>>>),
) -> [Vec<f64>; 4] {
    let x = x.require_grad();
    let y = norm(x.clone());
    let grads = (y.clone() * dy).sum().backward();
    let grad = |t: &Tensor<1>| host(t.grad(&grads).expect("a gradient").into_data());
    [
        host(y.into_data()),
        host(x.grad(&grads).expect("the input's gradient").into_data()),
        grad(&params.0.val()),
        params.1.map_or_else(Vec::new, |b| grad(&b.val())),
    ]
}

/// The case on `device` in `dtype`: the fused module's errors within the bound, the controls
/// far outside it; on a backend without the fused kernels the module is burn-nn's, bit for bit.
/// `centered`: the layer norm, else the RMS norm (no beta).
fn check_case(device: &Device, dtype: FloatDType, case: &Case, seed: u64, centered: bool) {
    let width = *case.shape.last().expect("a shape");
    let count: usize = case.shape.iter().product();
    let rows = count / width;
    let epsilon = 1e-5;
    let made = |values: Vec<f32>, shape: Vec<usize>| {
        Tensor::<1>::from_data(
            TensorData::new(values, [shape.iter().product::<usize>()]),
            device,
        )
        .cast(dtype)
    };
    // The input as `[rows, width]`, or a transposed view of its `[width, rows]` transpose.
    let x = if case.transposed {
        made(values(count, seed), vec![count])
            .reshape([width, rows])
            .transpose()
    } else {
        made(values(count, seed), vec![count]).reshape([rows, width])
    };
    let dy = made(values(count, seed + 1), vec![count]).reshape([rows, width]);
    let gamma: Vec<f32> = values(width, seed + 2)
        .iter()
        .map(|v| 1.0 + v * 0.25)
        .collect();
    let beta: Vec<f32> = values(width, seed + 3).iter().map(|v| v * 0.5).collect();

    let mut fused_module = LayerNormConfig::new(width)
        .with_bias(case.beta)
        .init(device);
    fused_module.gamma = Param::from_tensor(made(gamma.clone(), vec![width]));
    fused_module.beta = case
        .beta
        .then(|| Param::from_tensor(made(beta.clone(), vec![width])));
    let burn_module = fused_module.clone().into_burn();
    let rms_module = RmsNorm {
        gamma: fused_module.gamma.clone(),
        epsilon,
    };
    let burn_rms: burn::nn::RmsNorm = rms_module.clone().into();

    // The exact values from what the device holds (rounded to the dtype).
    let x_host = host(x.clone().into_data());
    let dy_host = host(dy.clone().into_data());
    let gamma_host = host(fused_module.gamma.val().into_data());
    let beta_host = fused_module
        .beta
        .as_ref()
        .map(|b| host(b.val().into_data()));
    let beta_host = beta_host.filter(|_| centered);
    let truth = exact(
        &x_host,
        &gamma_host,
        beta_host.as_deref(),
        &dy_host,
        width,
        epsilon,
        centered,
    );

    let fused_before = burn_graphed::testing::fused_ops();
    let (fused, burn) = if centered {
        (
            run(
                |x| fused_module.forward(x),
                x.clone(),
                dy.clone(),
                (&fused_module.gamma, fused_module.beta.as_ref()),
            ),
            run(
                |x| burn_module.forward(x),
                x,
                dy,
                (&burn_module.gamma, burn_module.beta.as_ref()),
            ),
        )
    } else {
        (
            run(
                |x| rms_module.forward(x),
                x.clone(),
                dy.clone(),
                (&rms_module.gamma, None),
            ),
            run(|x| burn_rms.forward(x), x, dy, (&burn_rms.gamma, None)),
        )
    };
    let case = &Case {
        beta: case.beta && centered,
        shape: case.shape.clone(),
        transposed: case.transposed,
    };
    let names = [
        "output",
        "input gradient",
        "gamma gradient",
        "beta gradient",
    ];
    let u = unit_roundoff(dtype);
    let kind = if centered { "layer norm" } else { "rms norm" };
    let label = format!(
        "{kind} {dtype:?} {:?} beta {} transposed {}",
        case.shape, case.beta, case.transposed
    );
    for k in 0..4 {
        if k == 3 && !case.beta {
            continue;
        }
        let (fused_error, burn_error) = (error(&fused[k], &truth[k]), error(&burn[k], &truth[k]));
        // The parameter gradients in `f32`, where the fused kernels run: the rounding their
        // order of sums may cost (elsewhere the module is burn-nn's, checked bit for bit below).
        let bound = if k >= 2 && dtype == FloatDType::F32 && supports_graphs(device) {
            let largest = |v: &[f64]| v.iter().fold(0.0f64, |m, x| m.max(x.abs()));
            2.0 * largest(&truth[k + 2]) / largest(&truth[k]).max(f64::MIN_POSITIVE) + u
        } else {
            2.0 * burn_error + u
        };
        println!(
            "{label} {}: fused error {fused_error:.3e}, burn-nn's {burn_error:.3e}, bound {bound:.3e}",
            names[k]
        );
        assert!(
            fused_error <= bound,
            "{label} {}: fused error {fused_error:.3e} above {bound:.3e} (burn-nn's {burn_error:.3e})",
            names[k]
        );
        // Negative controls: the exact values of the neighbouring row, and for the gradients
        // of gamma and beta the exact sums without the last row, must fail the bound by far
        // (the latter in `f32`: in `f16` and `bf16` the bound is the result's rounding to the
        // dtype, at which one row of sixteen can be under ten allowances).
        if rows > 1 && k >= 2 && dtype == FloatDType::F32 && supports_graphs(device) {
            let dropped = exact(
                &x_host[..(rows - 1) * width],
                &gamma_host,
                beta_host.as_deref(),
                &dy_host[..(rows - 1) * width],
                width,
                epsilon,
                centered,
            );
            let control = error(&dropped[k], &truth[k]);
            assert!(
                control > 10.0 * bound,
                "control {label} {}: the last row dropped is off {control:.3e}, not 10x the bound {bound:.3e}",
                names[k]
            );
        }
        if rows > 1 && k < 2 {
            let shifted: Vec<f64> = truth[k][width..]
                .iter()
                .chain(&truth[k][..width])
                .copied()
                .collect();
            let control = error(&shifted, &truth[k]);
            assert!(
                control > 10.0 * bound,
                "control {label} {}: a neighbouring row is off {control:.3e}, not 10x the bound {bound:.3e}",
                names[k]
            );
        }
    }
    if dtype == FloatDType::F32 {
        let wrong = exact(
            &x_host,
            &gamma_host,
            beta_host.as_deref(),
            &dy_host,
            width,
            1e-3,
            centered,
        );
        let control = error(&wrong[0], &truth[0]);
        let bound = 2.0 * error(&burn[0], &truth[0]) + u;
        assert!(
            control > 10.0 * bound,
            "control {label}: epsilon 1e-3 for 1e-5 is off {control:.3e}, not 10x the bound {bound:.3e}"
        );
    }
    if supports_graphs(device) {
        assert!(
            burn_graphed::testing::fused_ops() > fused_before,
            "{label}: the fused kernels did not run"
        );
    } else {
        // No fused kernels here: the module is burn-nn's, bit for bit.
        assert_eq!(
            fused, burn,
            "{label}: the fallback is not burn-nn's computation"
        );
    }
}

/// The cases of one dtype; a device without the dtype skips them, and says so.
pub fn layer_norm_matches_exact(device: &Device, dtype: FloatDType) {
    norm_matches_exact(device, dtype, true);
}

/// The RMS norm's cases (the layer norm's, without beta).
pub fn rms_norm_matches_exact(device: &Device, dtype: FloatDType) {
    norm_matches_exact(device, dtype, false);
}

fn norm_matches_exact(device: &Device, dtype: FloatDType, centered: bool) {
    let device = device.clone().autodiff();
    if !device.supports_dtype(DType::from(dtype)) {
        skip(&format!("{device:?} has no {dtype:?}"));
        return;
    }
    let mut cases = vec![
        case(&[4, 7], true),
        case(&[3, 5, 33], false),
        case(&[2, 300], true),
        case(&[16, 96], true),
        Case {
            shape: vec![6, 33],
            beta: true,
            transposed: true,
        },
    ];
    if dtype == FloatDType::F32 {
        // More rows than one grid dimension holds (65535 cubes), and a wide row.
        cases.push(case(&[66_000, 3], true));
        cases.push(case(&[8, 1000], false));
    }
    for (seed, case) in cases.iter().enumerate() {
        let shape = case.shape.clone();
        // Rank 3 and above: the module normalizes the last dimension of any rank; the cases
        // run as `[rows, width]`, which is the same computation.
        let flat = Case {
            shape: vec![
                shape[..shape.len() - 1].iter().product(),
                shape[shape.len() - 1],
            ],
            beta: case.beta,
            transposed: case.transposed,
        };
        check_case(&device, dtype, &flat, seed as u64 * 10, centered);
    }
    // Rank 3 through the function: the same values as rank 2.
    let x = Tensor::<1>::from_data(TensorData::new(values(60, 77), [60]), &device).cast(dtype);
    let gamma = Tensor::<1>::from_data(TensorData::new(values(5, 78), [5]), &device).cast(dtype);
    let rank_3 = layer_norm(x.clone().reshape([3, 4, 5]), gamma.clone(), None, 1e-5);
    let rank_2 = layer_norm(x.reshape([12, 5]), gamma, None, 1e-5);
    assert_eq!(
        rank_3.reshape([12, 5]).into_data(),
        rank_2.into_data(),
        "rank 3 and rank 2 normalize alike"
    );
}

/// The fused module inside a graphed call equals the same module called eagerly (same kernels,
/// fixed summation order: bit for bit), forward and gradients, over several calls.
pub fn layer_norm_graphed_matches_eager(device: &Device) {
    let device = device.clone().autodiff();
    let mut module = LayerNormConfig::new(48).init(&device);
    module.gamma = Param::from_tensor(Tensor::<1>::from_data(
        TensorData::new(values(48, 5), [48]),
        &device,
    ));
    let eager = burn_graphed_testkit::deep_copy(&module);
    let input = |step: u64| {
        Tensor::<1>::from_data(
            TensorData::new(values(8 * 48, 100 + step), [8 * 48]),
            &device,
        )
        .reshape([8, 48])
    };
    let forward = |m: &LayerNorm, x: Tensor<2>| m.forward(x).tanh();
    let graphed = burn_graphed::Graphed::new(
        module,
        forward,
        input(0),
        &burn_graphed::GraphedConfig::new(),
    )
    .expect("capture");
    assert_graphed_equals_eager(&graphed, &eager, forward, (1..4).map(input), |m, grads| {
        m.gamma
            .val()
            .grad(grads)
            .expect("gamma's gradient")
            .into_data()
    });
    if supports_graphs(&device) {
        assert_eq!(graphed.stats().forward_replays, 3, "{:?}", graphed.stats());
        assert!(
            burn_graphed::testing::fused_ops() > 0,
            "the fused kernels did not run"
        );
    }
}

/// A checkpoint loads both ways: burn-nn's `LayerNorm` saved to a file loads into the fused
/// module, and the fused module's file into burn-nn's, parameters equal; both then compute
/// the same norm within the bound of `layer_norm_matches_exact` (here: equal on Flex, where
/// the fused module is burn-nn's composition). A module of another width refuses the file.
pub fn layer_norm_checkpoints_load_both_ways(device: &Device) {
    let dir = std::env::temp_dir().join(format!(
        "burn-graphed-layer-norm-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&dir).expect("a temporary folder");
    let width = 24;
    let mut burn_module = burn::nn::LayerNormConfig::new(width).init(device);
    burn_module.gamma = Param::from_tensor(Tensor::from_data(
        TensorData::new(values(width, 1), [width]),
        device,
    ));
    burn_module.beta = Some(Param::from_tensor(Tensor::from_data(
        TensorData::new(values(width, 2), [width]),
        device,
    )));
    let burn_file = dir.join("burn_nn.bpk");
    burn_module
        .clone()
        .save_file(&burn_file)
        .expect("burn-nn's module saves");
    let fused = LayerNormConfig::new(width)
        .init(device)
        .load_file(&burn_file);
    let values_of = |gamma: &Param<Tensor<1>>, beta: Option<&Param<Tensor<1>>>| {
        (gamma.val().into_data(), beta.map(|b| b.val().into_data()))
    };
    assert_eq!(
        values_of(&fused.gamma, fused.beta.as_ref()),
        values_of(&burn_module.gamma, burn_module.beta.as_ref()),
        "burn-nn's file in the fused module"
    );

    let mut fused = fused;
    fused.gamma = Param::from_tensor(Tensor::from_data(
        TensorData::new(values(width, 3), [width]),
        device,
    ));
    let fused_file = dir.join("fused.bpk");
    fused
        .clone()
        .save_file(&fused_file)
        .expect("the fused module saves");
    let back = burn::nn::LayerNormConfig::new(width)
        .init(device)
        .load_file(&fused_file);
    assert_eq!(
        values_of(&back.gamma, back.beta.as_ref()),
        values_of(&fused.gamma, fused.beta.as_ref()),
        "the fused module's file in burn-nn's"
    );
    let x = Tensor::<2>::from_data(TensorData::new(values(5 * width, 4), [5, width]), device);
    let (ours, theirs) = (fused.forward(x.clone()), back.forward(x));
    let distance = error(&host(ours.into_data()), &host(theirs.into_data()));
    assert!(
        distance < 1e-6,
        "the loaded modules compute apart: {distance:.3e}"
    );

    let wrong = LayerNormConfig::new(width + 1)
        .init(device)
        .try_load_file(&burn_file);
    assert!(wrong.is_err(), "a module of another width took the file");
    let _ = std::fs::remove_dir_all(&dir);
}
