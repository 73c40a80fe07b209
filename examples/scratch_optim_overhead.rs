use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamState, GradientsParams, LearningRate, ModuleOptimizer, Optimizer};
use burn::prelude::*;
use std::time::Instant;

#[derive(Module, Debug)]
struct Mlp {
    layers: Vec<Linear>,
}

#[derive(Clone)]
struct Noop;
impl Optimizer for Noop {
    type State<const D: usize> = AdamState<D>;
    fn step<const D: usize>(
        &self,
        _lr: LearningRate,
        t: Tensor<D>,
        _g: Tensor<D>,
        s: Option<AdamState<D>>,
    ) -> (Tensor<D>, Option<AdamState<D>>) {
        (t, s)
    }
    fn to_device<const D: usize>(s: AdamState<D>, _d: &Device) -> AdamState<D> {
        s
    }
}

fn main() {
    let device = Device::default().autodiff();
    println!("{device:?}");
    let mut model = Mlp {
        layers: (0..8)
            .map(|_| LinearConfig::new(256, 256).init(&device))
            .collect(),
    };
    let mut optim = ModuleOptimizer::from(Noop);
    let x = Tensor::<2>::ones([32, 256], &device);
    for (k, n) in [(0, 5), (1, 200)] {
        let (mut t_grads, mut t_step) = (0.0, 0.0);
        for _ in 0..n {
            let mut y = x.clone();
            for l in &model.layers {
                y = Relu::new().forward(l.forward(y));
            }
            let loss = y.powi_scalar(2).mean();
            let g = loss.backward();
            let t0 = Instant::now();
            let grads = GradientsParams::from_grads(g, &model);
            let t1 = Instant::now();
            model = optim.step(1e-3, model, grads);
            let t2 = Instant::now();
            t_grads += (t1 - t0).as_secs_f64();
            t_step += (t2 - t1).as_secs_f64();
        }
        if k == 1 {
            println!(
                "grads {:.1} us, noop step {:.1} us per step",
                t_grads / n as f64 * 1e6,
                t_step / n as f64 * 1e6
            );
        }
    }
}
