//! Temporary: host cost of burn's ModuleOptimizer step with a no-op optimizer vs. plain mappers.
use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamState, GradientsParams, LearningRate, ModuleOptimizer, Optimizer};
use burn::prelude::*;
use burn::tensor::kind::BridgeTensor;
use std::collections::HashMap;
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

/// Module-level no-op optimizer: consume, take the grad, keep state in a plain map.
struct PlainMapper<'a> {
    grads: &'a mut GradientsParams,
    state: &'a mut HashMap<ParamId, (BridgeTensor, BridgeTensor)>,
    /// Like burn: `inner()` the param and restore autodiff/checkpointing/require_grad.
    burn_like: bool,
    /// Keep grads alive here instead of dropping them in the mapper (drop after timing).
    keep: Option<&'a mut Vec<BridgeTensor>>,
    /// Touch the state map (remove + reinsert) like an optimizer with moments would.
    with_state: bool,
}

impl ModuleMapper for PlainMapper<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (id, tensor, mapper) = param.consume();
        let Some(grad) = self.grads.remove::<D>(id) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        if self.with_state {
            let (m, v) = match self.state.remove(&id) {
                Some((m, v)) => (Tensor::<D>::from_bridge(m), Tensor::<D>::from_bridge(v)),
                None => (grad.zeros_like(), grad.zeros_like()),
            };
            self.state.insert(id, (m.into_bridge(), v.into_bridge()));
        }
        match self.keep.as_deref_mut() {
            Some(keep) => keep.push(grad.into_bridge()),
            None => drop(grad),
        }
        let tensor = if self.burn_like {
            let require_grad = tensor.is_require_grad();
            let ckpt = tensor.gradient_checkpointing_strategy();
            let inner = tensor.inner();
            let mut p = Tensor::from_inner(inner);
            if let Some(s) = ckpt {
                p = p.with_gradient_checkpointing_strategy(s);
            }
            if require_grad {
                p = p.require_grad();
            }
            p
        } else {
            tensor
        };
        Param::from_mapped_value(id, tensor, mapper)
    }
}

fn forward_backward(model: &Mlp, x: &Tensor<2>) -> burn::tensor::Gradients {
    let mut y = x.clone();
    for l in &model.layers {
        y = Relu::new().forward(l.forward(y));
    }
    y.powi_scalar(2).mean().backward()
}

fn main() {
    let device = Device::wgpu(Default::default()).autodiff();
    println!("{device:?}");
    let steps: usize = std::env::var("STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(200);
    let sync = std::env::var("SYNC").is_ok();
    let only = std::env::var("VARIANT").ok();
    let mut model = Mlp {
        layers: (0..8)
            .map(|_| LinearConfig::new(256, 256).init(&device))
            .collect(),
    };
    let n_params = model.num_params();
    let n_tensors = 16.0;
    println!("params (scalars) {n_params}, tensors {n_tensors}, steps {steps}, sync {sync}");
    let x = Tensor::<2>::ones([32, 256], &device);

    let variants = [
        "from_grads",
        "module_optimizer",
        "mapper_plain",
        "mapper_plain_state",
        "mapper_keep_grads",
        "mapper_burn_like",
        "mapper_burn_like_state",
    ];
    for name in variants {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        let mut optim = ModuleOptimizer::from(Noop);
        let mut state = HashMap::new();
        let (mut t_grads, mut t_step) = (0.0, 0.0);
        for i in 0..(10 + steps) {
            if i == 10 {
                (t_grads, t_step) = (0.0, 0.0);
            }
            let g = forward_backward(&model, &x);
            if sync {
                device.sync().unwrap();
            }
            let t0 = Instant::now();
            let mut grads = GradientsParams::from_grads(g, &model);
            let t1 = Instant::now();
            let mut kept = Vec::new();
            model = match name {
                "from_grads" => model,
                "module_optimizer" => optim.step(1e-3, model, grads),
                _ => {
                    let mut m = PlainMapper {
                        grads: &mut grads,
                        state: &mut state,
                        burn_like: name.starts_with("mapper_burn_like"),
                        keep: (name == "mapper_keep_grads").then_some(&mut kept),
                        with_state: name.ends_with("_state"),
                    };
                    model.map(&mut m)
                }
            };
            let t2 = Instant::now();
            drop(kept);
            t_grads += (t1 - t0).as_secs_f64();
            t_step += (t2 - t1).as_secs_f64();
        }
        let n = steps as f64;
        let step_us = t_step / n * 1e6;
        println!(
            "{name:24} from_grads {:7.1} us/step ({:5.2} us/param)   step {:7.1} us/step ({:5.2} us/param)",
            t_grads / n * 1e6,
            t_grads / n * 1e6 / n_tensors,
            step_us,
            step_us / n_tensors
        );
    }
}
