//! `burn_graphed::nn::Embedding` and `embedding` against burn's lookup (the output: the same
//! gather, bit for bit) and the exact table gradient (host `f64` from the very values the
//! device holds), in `f32`, `f16` and `bf16`: ids repeated many times, rows no id names, a
//! dimension over several blocks of the kernel, tokens over several blocks of ids; inside a
//! graphed call; burn-nn's records both ways.
//!
//! Tolerance, derived per element: row `v`'s gradient at `d` is the sum of the `n` output
//! gradients of the tokens with id `v`, each a value the device holds exactly. The kernel adds
//! them in `f32` in token order, so the computed sum differs from the exact one by at most
//! `gamma_n S`, `gamma_n = n u / (1 - n u)`, `u = 2^-24`, `S` the sum of the terms' magnitudes
//! (Higham 4.2), and the one rounding to the dtype adds at most one unit roundoff of the result:
//! `|got - exact| <= gamma_n S + u_dtype (|exact| + gamma_n S)` (0 for a row no token names,
//! which must be exactly 0). Negative control: one token's gradient counted in the next row (a
//! wrong id) must break that bound tenfold. Off cubecl backends the function is burn's, bit for
//! bit.

use super::exact::{host, seeded, unit_roundoff};
use super::*;
use burn::nn::EmbeddingConfig;
use burn::tensor::{DType, FloatDType, Int};

/// One case: table `[rows, dim]`, ids `[batch, length]` from `id(token)`.
struct Case {
    rows: usize,
    dim: usize,
    batch: usize,
    length: usize,
    id: fn(usize) -> usize,
}

fn cases() -> [Case; 4] {
    [
        // Repeats, and rows 0, 5 and 6 that no token names.
        Case {
            rows: 7,
            dim: 5,
            batch: 2,
            length: 3,
            id: |t| [1, 3, 1, 4, 2, 1][t],
        },
        // A dimension over two blocks of 256 (the second partial); 600 tokens over three blocks
        // of ids; id 0 for every third token, the others spread.
        Case {
            rows: 50,
            dim: 300,
            batch: 4,
            length: 150,
            id: |t| if t % 3 == 0 { 0 } else { (t * 7) % 49 + 1 },
        },
        // One token, one dimension.
        Case {
            rows: 3,
            dim: 1,
            batch: 1,
            length: 1,
            id: |_| 2,
        },
        // Every token the same id: one owner sums all of them.
        Case {
            rows: 4,
            dim: 64,
            batch: 3,
            length: 100,
            id: |_| 3,
        },
    ]
}

/// The exact table gradient: `grad` (`[tokens, dim]`) summed into the rows `ids` name, and
/// each element's sum of magnitudes and term count.
fn exact(rows: usize, dim: usize, ids: &[usize], grad: &[f64]) -> (Vec<f64>, Vec<f64>, Vec<usize>) {
    let mut sum = vec![0.0; rows * dim];
    let mut magnitude = vec![0.0; rows * dim];
    let mut terms = vec![0usize; rows * dim];
    for (t, &id) in ids.iter().enumerate() {
        for d in 0..dim {
            sum[id * dim + d] += grad[t * dim + d];
            magnitude[id * dim + d] += grad[t * dim + d].abs();
            terms[id * dim + d] += 1;
        }
    }
    (sum, magnitude, terms)
}

/// The largest ratio of `|got - exact|` to the element's bound (a row no token names: any
/// difference from 0 is infinitely over).
fn worst_ratio(got: &[f64], exact: &[f64], magnitude: &[f64], terms: &[usize], u: f64) -> f64 {
    let order = 2f64.powi(-24);
    got.iter()
        .zip(exact)
        .zip(magnitude.iter().zip(terms))
        .map(|((g, e), (s, &n))| {
            let n = n as f64;
            let gamma = n * order / (1.0 - n * order);
            let bound = gamma * s + u * (e.abs() + gamma * s);
            let off = (g - e).abs();
            if off == 0.0 {
                0.0
            } else if bound == 0.0 {
                f64::INFINITY
            } else {
                off / bound
            }
        })
        .fold(0.0, f64::max)
}

/// Each case in `dtype`: the output equal to burn's gather, the table gradient within the bound
/// of the exact one, the control outside it tenfold; the fused kernels run on cubecl backends
/// (elsewhere burn's lookup and gradient, bit for bit). A device without the dtype skips them,
/// and says so.
pub fn embedding_matches_exact(device: &Device, dtype: FloatDType) {
    let device = device.clone().autodiff();
    if !device.supports_dtype(DType::from(dtype)) {
        super::skip::skip(&format!("{device:?} has no {dtype:?}"));
        return;
    }
    let u = unit_roundoff(dtype);
    for (seed, case) in cases().iter().enumerate() {
        let Case {
            rows,
            dim,
            batch,
            length,
            id,
        } = *case;
        let tokens = batch * length;
        let ids: Vec<usize> = (0..tokens).map(id).collect();
        let seed = 500 + 10 * seed as u64;
        let table = Tensor::<1>::from_data(
            TensorData::new(seeded(rows * dim, seed, -1.0, 1.0), [rows * dim]),
            &device,
        )
        .cast(dtype)
        .reshape([rows, dim]);
        let w = Tensor::<1>::from_data(
            TensorData::new(seeded(tokens * dim, seed + 1, -1.0, 1.0), [tokens * dim]),
            &device,
        )
        .cast(dtype)
        .reshape([batch, length, dim]);
        let index = Tensor::<1, Int>::from_data(
            TensorData::new(ids.iter().map(|&i| i as i64).collect(), [tokens]),
            &device,
        )
        .reshape([batch, length]);
        let run = |lookup: &dyn Fn(Tensor<2>, Tensor<2, Int>) -> Tensor<3>| {
            let table = table.clone().detach().require_grad();
            let out = lookup(table.clone(), index.clone());
            let grads = (out.clone() * w.clone()).sum().backward();
            let grad = table.grad(&grads).expect("the table's gradient");
            (out.into_data(), grad.into_data())
        };
        let before = burn_graphed::testing::fused_ops();
        let (out, grad) = run(&|t, i| burn_graphed::nn::embedding(t, i));
        let fused_ran = burn_graphed::testing::fused_ops() > before;
        let (burn_out, burn_grad) = run(&|t, i| burn::tensor::module::embedding(t, i));
        let label = format!("embedding {dtype:?} [{rows}, {dim}] x {tokens} tokens");
        assert_eq!(out, burn_out, "{label}: the output is not burn's gather");
        if !supports_graphs(&device) {
            assert!(!fused_ran, "{label}: a fused kernel ran off cubecl");
            assert_eq!(
                grad, burn_grad,
                "{label}: the fallback's gradient is not burn's"
            );
            continue;
        }
        assert!(fused_ran, "{label}: the fused kernels did not run");
        let (truth, magnitude, terms) = exact(rows, dim, &ids, &host(w.clone().into_data()));
        let got = host(grad);
        let ratio = worst_ratio(&got, &truth, &magnitude, &terms, u);
        // The control: the last token counted in the next row.
        let mut wrong = ids.clone();
        let last = tokens - 1;
        wrong[last] = (wrong[last] + 1) % rows;
        let (missed, _, _) = exact(rows, dim, &wrong, &host(w.into_data()));
        let control = worst_ratio(&missed, &truth, &magnitude, &terms, u);
        println!("{label}: gradient at {ratio:.3} of the bound, control {control:.3e}");
        assert!(ratio <= 1.0, "{label}: gradient {ratio:.3}x its bound");
        assert!(
            control > 10.0,
            "control {label}: a wrong id is only {control:.3}x the bound"
        );
    }
}

/// A model with the fused embedding, graphed, against the same model eager: outputs and the
/// table's gradient equal (bit for bit where one formula runs one way). The ids, `[2, 9]`,
/// lie in a graph's static buffer, which CUDA pads past the last token; tokens name row 0 at
/// steps 2 and 4, so a backward that counted tokens by the buffer's length (it once did, the
/// spare ids reading 0) adds spare rows into row 0 there.
pub fn embedding_graphed_matches_eager(device: &Device) {
    let device = device.clone().autodiff();
    #[derive(Module, Debug)]
    struct Lookup {
        tokens: burn_graphed::nn::Embedding,
    }
    let model = Lookup {
        tokens: EmbeddingConfig::new(40, 24).init(&device).into(),
    };
    let eager = burn_graphed_testkit::deep_copy(&model);
    let input = |step: u64| {
        let ids: Vec<i64> = (0..2 * 9)
            .map(|t| ((t as u64 * 13 + step * 7) % 40) as i64)
            .collect();
        Tensor::<1, Int>::from_data(TensorData::new(ids, [18]), &device).reshape([2, 9])
    };
    let forward = |m: &Lookup, x: Tensor<2, Int>| m.tokens.forward(x).tanh();
    let graphed = burn_graphed::Graphed::new(model, forward, input(0), &GraphedConfig::new())
        .expect("capture");
    super::exact::assert_graphed_equals_eager(
        &graphed,
        &eager,
        forward,
        (1..4).map(input),
        |m, grads| {
            m.tokens
                .weight
                .val()
                .grad(grads)
                .expect("the table's gradient")
                .into_data()
        },
    );
    if supports_graphs(&device) {
        assert_eq!(graphed.stats().forward_replays, 3, "{:?}", graphed.stats());
    }
}

/// burn-nn's file loads into the fused module and the fused module's into burn-nn's.
pub fn embedding_records_load_both_ways(device: &Device) {
    let config = EmbeddingConfig::new(11, 6);
    records_load_both_ways(
        "embedding",
        || config.init(device),
        || -> burn_graphed::nn::Embedding { config.init(device).into() },
    );
}
