use burn::backend::{Backend, Dispatch};
use burn::prelude::*;
use burn::tensor::Distribution;

fn main() {
    let device = match std::env::args().nth(1).as_deref() {
        #[cfg(feature = "cuda")]
        Some("cuda") => Device::cuda(0),
        Some("flex") => Device::flex(),
        _ => Device::wgpu(Default::default()),
    };
    println!("device {device:?}");
    let d = device.as_dispatch();
    let w = Tensor::<2>::random([64, 64], Distribution::Default, &device);
    let x = Tensor::<2>::random([8, 64], Distribution::Default, &device);
    let f = || burn::tensor::activation::relu(x.clone().matmul(w.clone())).sum_dim(1);
    let eager = f().into_data();
    println!("prepare {:?}", Dispatch::graph_prepare(d));
    for _ in 0..3 {
        let o = f();
        device.sync().unwrap();
        drop(o);
    }
    println!("start {:?}", Dispatch::graph_start_capture(d));
    let out = f();
    let g = Dispatch::graph_stop_capture(d);
    println!("stop {:?}", g.as_ref().map(|_| ()));
    if let Ok(g) = g {
        for _ in 0..3 {
            println!("replay {:?}", unsafe { Dispatch::graph_replay(d, &g) });
        }
        let got = out.clone().into_data();
        println!("max diff {:?}", got.assert_approx_eq::<f32>(&eager, Default::default()));
    }
}
