//! What the captured graphs hold (`GraphStats::graphs`, `StepStats::graphs`) and their
//! Graphviz dumps (`burn_graphed::write_graphs_as_dot`).

use burn::optim::AdamConfig;
use burn::prelude::*;
use burn_graphed::{CapturePhase, GraphContents, GraphNodes, Graphed, GraphedConfig, GraphedStep};

use super::{Mlp, mlp_forward, require_graphs};

fn mse(model: &Mlp, (x, target): (Tensor<2>, Tensor<2>)) -> Tensor<1> {
    (model.forward(x) - target).powi_scalar(2).mean()
}

/// The kernel nodes of `graphs`, which must all say what they hold.
fn kernels(graphs: &[GraphContents]) -> Vec<usize> {
    graphs
        .iter()
        .map(|g| {
            g.nodes
                .unwrap_or_else(|| panic!("the {} graph has no node counts", g.phase))
                .kernels
        })
        .collect()
}

/// A graphed callable's stats list its forward and backward graphs, a whole step's its step
/// graph. With `counted` (CUDA, the carried cubecl-cuda patch), each says how many nodes of
/// each kind it holds, and the counts follow the work: a deeper MLP's graphs hold more kernel
/// nodes, and the whole step (forward, loss, backward, update) more than the forward and
/// backward together; with `write_graphs_as_dot` on, each graph's DOT file exists, is a
/// Graphviz digraph and holds as many kernel nodes as counted. Without (wgpu's software graphs):
/// no counts and no file, never made up.
pub fn graphs_say_what_they_hold(device: &Device, counted: bool) {
    require_graphs(device);
    let device = device.clone().autodiff();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let dir = std::env::temp_dir().join(format!("burn-graphed-dot-{}-{nanos}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // Process-wide: a capture of another test meanwhile may write its graphs here too; this
    // test looks only at the files its own graphs name.
    burn_graphed::write_graphs_as_dot(Some(dir.clone()));
    let callable = |depth| {
        let graphed = Graphed::new(
            Mlp::new(16, depth, 4, &device),
            mlp_forward,
            Tensor::zeros([8, 16], &device).require_grad(),
            &GraphedConfig::new(),
        )
        .expect("capture");
        assert!(graphed.summary().graphed);
        graphed.stats().graphs
    };
    let shallow = callable(1);
    let deep = callable(4);
    let step = GraphedStep::new(
        Mlp::new(16, 4, 4, &device),
        mse,
        &AdamConfig::new(),
        (
            Tensor::zeros([8, 16], &device),
            Tensor::zeros([8, 4], &device),
        ),
        &GraphedConfig::new(),
    )
    .expect("capture")
    .stats()
    .graphs;
    burn_graphed::write_graphs_as_dot(None);

    let phases = |graphs: &[GraphContents]| graphs.iter().map(|g| g.phase).collect::<Vec<_>>();
    assert_eq!(
        phases(&shallow),
        [CapturePhase::Forward, CapturePhase::Backward]
    );
    assert_eq!(
        phases(&deep),
        [CapturePhase::Forward, CapturePhase::Backward]
    );
    assert_eq!(phases(&step), [CapturePhase::Step]);
    let all = || shallow.iter().chain(&deep).chain(&step);
    if !counted {
        for graph in all() {
            assert_eq!(graph.nodes, None, "{graph:?}");
            assert_eq!(graph.dot, None, "{graph:?}");
        }
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
    let (shallow_k, deep_k, step_k) = (kernels(&shallow), kernels(&deep), kernels(&step));
    println!("kernel nodes: depth 1 {shallow_k:?}, depth 4 {deep_k:?}, whole step {step_k:?}");
    for (phase, (s, d)) in ["forward", "backward"]
        .iter()
        .zip(shallow_k.iter().zip(&deep_k))
    {
        assert!(
            *s > 0 && d > s,
            "{phase}: depth 1 holds {s} kernel nodes, depth 4 {d}: three more layers must add \
             kernels"
        );
    }
    assert!(
        step_k[0] > deep_k[0] + deep_k[1],
        "the whole step holds {} kernel nodes, the same model's forward and backward {} and {}: \
         the loss and the update must add kernels",
        step_k[0],
        deep_k[0],
        deep_k[1]
    );
    for graph in all() {
        let nodes: GraphNodes = graph.nodes.expect("counted above");
        assert!(nodes.total() >= nodes.kernels);
        let path = graph
            .dot
            .as_ref()
            .unwrap_or_else(|| panic!("the {} graph was not written as DOT", graph.phase));
        assert!(
            path.starts_with(&dir),
            "{} is not under {}",
            path.display(),
            dir.display()
        );
        let text = std::fs::read_to_string(path).expect("the DOT file");
        assert!(
            text.trim_start().starts_with("digraph") && text.trim_end().ends_with('}'),
            "{} is not a Graphviz digraph: {}",
            path.display(),
            &text[..text.len().min(200)]
        );
        // The driver's DOT writes each kernel node as a record labelled KERNEL: a second,
        // independent count of the same graph.
        assert_eq!(
            text.matches("label=\"{KERNEL").count(),
            nodes.kernels,
            "{}: the DOT file's kernel nodes against the node count",
            path.display()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
