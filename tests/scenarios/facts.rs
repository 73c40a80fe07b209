//! Structural facts, snapshotted with insta: what a capture holds, what a scripted sequence of
//! calls did and why, and the text of the errors users see. Never raw floats.
//!
//! Snapshots live in `tests/scenarios/snapshots/`, shared by the CPU suite (wgpu) and the GPU
//! suite (CUDA): both capture graphs, so their facts must be the same. Flex, which captures
//! nothing, has its own. CI (`CI=true`) fails on any drift; `INSTA_UPDATE=always cargo test`
//! rewrites them for review. The GPU bundle's runner sets `INSTA_WORKSPACE_ROOT` so that the
//! files are found there too.

use std::fmt::Write;

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::prelude::*;
use burn_graphed::{Graphed, GraphedConfig, MismatchPolicy};

use super::prop::{Arch, PropNet};
use super::recovery::unwritten;
use super::{Mlp, TwoHeads, batch, mlp_forward, square_mean, two_heads_forward, two_heads_loss};

pub fn snapshot(name: &str, facts: &str) {
    let mut settings = insta::Settings::clone_current();
    settings.set_prepend_module_to_snapshot(false);
    settings.set_snapshot_path("snapshots");
    settings.set_omit_expression(true);
    settings.bind(|| insta::assert_snapshot!(name, facts));
}

fn error_text<T>(result: Result<T, impl std::fmt::Display>) -> String {
    match result {
        Ok(_) => "no error".to_string(),
        Err(error) => error.to_string(),
    }
}

/// Replaces what differs between backends and runs (device names, random parameter ids).
fn redact(text: String, device: &Device, ids: &[ParamId]) -> String {
    let mut text = text.replace(&format!("{device:?}"), "<device>");
    for id in ids {
        text = text.replace(&id.to_string(), "<id>");
    }
    text
}

fn first_param_id<M: Module>(module: &M) -> ParamId {
    burn_graphed_testkit::param_values(module).expect("read back")[0].0
}

/// Gives the first float parameter a new id, as replacing a layer after capture would.
struct NewIdForFirst(bool);

impl ModuleMapper for NewIdForFirst {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if std::mem::replace(&mut self.0, false) {
            Param::initialized(ParamId::new(), param.val())
        } else {
            param
        }
    }
}

/// Captures the two-headed model, runs a scripted sequence of calls, and snapshots what the
/// capture holds, what each call did, and the errors of bad uses.
pub fn structural_facts(device: &Device) {
    let device = device.clone().autodiff();
    let mut facts = String::new();
    let sample = || {
        (
            batch([4, 16], 0, &device).require_grad(),
            batch([4, 8], 1, &device),
            batch([4, 3], 2, &device),
        )
    };
    // One graph only (PyTorch's behaviour), so that other signatures fall back; the shape
    // cache has its own facts below.
    let config = GraphedConfig::new()
        .with_allow_unused_input(true)
        .with_max_graphs(1);
    let graphed = Graphed::new(TwoHeads::new(&device), two_heads_forward, sample(), &config)
        .expect("capture");
    let graphs = graphed.summary().graphed;
    writeln!(facts, "capture: {:#?}", graphed.summary()).unwrap();

    // Two training calls with the same input tensors: the second copies nothing.
    let inputs = (
        batch([4, 16], 10, &device).require_grad(),
        batch([4, 8], 11, &device),
        batch([4, 3], 12, &device),
    );
    for _ in 0..2 {
        let loss = two_heads_loss(graphed.forward(inputs.clone()).expect("call"));
        let _ = loss.backward();
    }
    writeln!(
        facts,
        "after two calls with the same inputs: {:?}",
        super::counters(graphed.stats())
    )
    .unwrap();
    let held: Vec<_> = graphed.stats().graphs.iter().map(|g| g.phase).collect();
    writeln!(facts, "graphs held: {held:?}").unwrap();
    // Eval: eager on the inner device.
    let inner = device.clone().inner();
    let _ = graphed
        .valid()
        .forward((
            batch([4, 16], 0, &inner),
            batch([4, 8], 0, &inner),
            batch([4, 3], 0, &inner),
        ))
        .expect("eval call");
    // Another batch size: eager.
    let _ = graphed
        .forward((
            batch([2, 16], 0, &device).require_grad(),
            batch([2, 8], 0, &device),
            batch([2, 3], 0, &device),
        ))
        .expect("fallback call");
    // require_grad differs: eager.
    let _ = graphed
        .forward((
            batch([4, 16], 0, &device),
            batch([4, 8], 0, &device),
            batch([4, 3], 0, &device),
        ))
        .expect("fallback call");
    // Two calls before one backward: the second is eager.
    let first = graphed.forward(inputs.clone()).expect("call");
    let second = graphed.forward(inputs.clone()).expect("call");
    let _ = (two_heads_loss(first) + two_heads_loss(second)).backward();
    writeln!(facts, "after eval, shape, require_grad and pending calls:").unwrap();
    writeln!(
        facts,
        "  replays: forward {}, backward {}",
        graphed.stats().forward_replays,
        graphed.stats().backward_replays
    )
    .unwrap();
    writeln!(
        facts,
        "  copies: inputs {}, params {}",
        graphed.stats().input_copies,
        graphed.stats().param_copies
    )
    .unwrap();
    for (reason, count) in &graphed.stats().eager {
        writeln!(facts, "  eager {count} x {reason}").unwrap();
    }

    writeln!(facts, "errors:").unwrap();
    // Without graphs (Flex) "no error": a capture finds an unused input in the backward it
    // records; on Flex nothing runs at construction, and running the forward and backward
    // there only to look would be a training step's work, and would draw from the forward's
    // generators, moving the eager run it must equal. Eager calls leave that input without
    // a gradient, as burn does. The strict shape mismatch and the replaced parameter below
    // need no graphs: Flex refuses them too.
    let unused = Graphed::new(
        TwoHeads::new(&device),
        two_heads_forward,
        (
            batch([4, 16], 0, &device),
            batch([4, 8], 0, &device),
            batch([4, 3], 0, &device).require_grad(),
        ),
        &GraphedConfig::new(),
    );
    writeln!(facts, "  unused input: {}", error_text(unused)).unwrap();
    let frozen = Graphed::new(
        Mlp::new(8, 1, 2, &device).no_grad(),
        mlp_forward,
        batch([4, 8], 0, &device),
        &GraphedConfig::new(),
    );
    writeln!(facts, "  non-trainable parameter: {}", error_text(frozen)).unwrap();
    let on_inner = Graphed::new(
        Mlp::new(8, 1, 2, &inner),
        mlp_forward,
        batch([4, 8], 0, &inner),
        &GraphedConfig::new(),
    );
    writeln!(
        facts,
        "  module without autodiff: {}",
        redact(error_text(on_inner), &inner, &[])
    )
    .unwrap();
    let strict = Graphed::new(
        Mlp::new(8, 1, 2, &device),
        mlp_forward,
        batch([4, 8], 0, &device),
        &GraphedConfig::new()
            .with_on_mismatch(MismatchPolicy::Error)
            .with_max_graphs(1),
    )
    .expect("capture");
    writeln!(
        facts,
        "  strict shape mismatch: {}",
        error_text(strict.forward(batch([3, 8], 0, &device)))
    )
    .unwrap();
    let arch = Arch {
        inputs: vec![4, 4],
        unused: 0,
        unused_grad: false,
        first_grad: false,
        hidden: vec![4],
        outputs: vec![2],
        activation: 0,
        bias: true,
        batch: 2,
        optimizer: 0,
        learning_rate: 1e-3,
        seed: 0,
        steps: 1,
        tokens: None,
        masked: false,
    };
    let vec_inputs = Graphed::new(
        PropNet::new(&arch, &device),
        |net: &PropNet, xs: Vec<Tensor<2>>| net.forward(xs),
        vec![batch([2, 4], 0, &device), batch([2, 4], 1, &device)],
        &GraphedConfig::new(),
    )
    .expect("capture");
    writeln!(
        facts,
        "  wrong input count: {}",
        error_text(vec_inputs.forward(vec![batch([2, 4], 0, &device)]))
    )
    .unwrap();
    assert_eq!(
        super::counters(vec_inputs.stats()),
        Default::default(),
        "a call refused for its input count runs nothing"
    );
    // A small MLP captured with the default configuration.
    let captured_mlp = || {
        Graphed::new(
            Mlp::new(8, 1, 2, &device),
            mlp_forward,
            batch([4, 8], 0, &device),
            &GraphedConfig::new(),
        )
        .expect("capture")
    };
    let captured = captured_mlp();
    let old_id = first_param_id(&captured);
    let replaced = captured.map(&mut NewIdForFirst(true));
    let new_id = first_param_id(&replaced);
    writeln!(
        facts,
        "  parameter replaced after capture: {}",
        redact(
            error_text(replaced.forward(batch([4, 8], 0, &device)).map(square_mean)),
            &device,
            &[old_id, new_id]
        )
    )
    .unwrap();

    if graphs {
        // A tensor the device never wrote (cubecl's own account of it, which names memory
        // ids, is cut off): refused at capture and at a call.
        let account = |text: String| match text.split_once(" The backend's account: ") {
            Some((message, _)) => format!("{message} The backend's account: <reason>"),
            None => text,
        };
        let at_capture = Graphed::new(
            Mlp::new(8, 1, 2, &device),
            mlp_forward,
            unwritten([4, 8], &device),
            &GraphedConfig::new(),
        );
        writeln!(
            facts,
            "  unwritten sample input: {}",
            account(error_text(at_capture))
        )
        .unwrap();
        let captured = captured_mlp();
        writeln!(
            facts,
            "  unwritten input at a call: {}",
            account(error_text(captured.forward(unwritten([4, 8], &device))))
        )
        .unwrap();
    }

    group_facts(&device, &mut facts);
    shape_cache_facts(&device, &mut facts);

    let name = if graphs {
        "facts_graphed"
    } else {
        "facts_eager"
    };
    snapshot(name, &facts);
}

/// What the shape cache does over a scripted sequence of batch sizes: captures, hits, LRU
/// evictions, and the fallback when a byte limit leaves no room.
fn shape_cache_facts(device: &Device, facts: &mut String) {
    let step = |graphed: &Graphed<Mlp, Tensor<2>, Tensor<2>>, rows: usize| {
        let y = graphed
            .forward(batch([rows, 8], rows, device))
            .expect("call");
        let _ = square_mean(y).backward();
    };
    let graphed = Graphed::new(
        Mlp::new(8, 1, 2, device),
        mlp_forward,
        batch([4, 8], 0, device),
        &GraphedConfig::new().with_max_graphs(2),
    )
    .expect("capture");
    writeln!(
        facts,
        "shape cache (max_graphs 2), batch sizes 4 2 4 3 2 2:"
    )
    .unwrap();
    for rows in [4, 2, 4, 3, 2, 2] {
        step(&graphed, rows);
    }
    let cache = graphed.stats().shape_cache;
    let stats = graphed.stats();
    writeln!(
        facts,
        "  graphs {}, hits {}, captures {}, evictions {}, failed {}, holds bytes: {}",
        cache.graphs,
        cache.hits,
        cache.captures,
        cache.evictions,
        cache.failed_captures,
        cache.held_bytes > 0
    )
    .unwrap();
    writeln!(
        facts,
        "  replays: forward {}, backward {}, eager {}",
        stats.forward_replays,
        stats.backward_replays,
        stats.total_eager()
    )
    .unwrap();
    let tight = Graphed::new(
        Mlp::new(8, 1, 2, device),
        mlp_forward,
        batch([4, 8], 0, device),
        &GraphedConfig::new().with_max_graph_bytes(Some(1)),
    )
    .expect("capture");
    step(&tight, 2);
    step(&tight, 4);
    let cache = tight.stats().shape_cache;
    writeln!(
        facts,
        "shape cache (max_graph_bytes 1), batch sizes 2 4: graphs {}, captures {}, evictions {}",
        cache.graphs, cache.captures, cache.evictions
    )
    .unwrap();
    for (reason, count) in &tight.stats().eager {
        writeln!(facts, "  eager {count} x {reason}").unwrap();
    }
}

/// What a chain of three callables captured together holds, what one training step copied,
/// and the errors of bad chains.
fn group_facts(device: &Device, facts: &mut String) {
    use super::group::{Decoder, Encoder, Mixer};
    use burn_graphed::{Callable, make_graphed_callables};

    let (encoder, mixer, decoder) = make_graphed_callables(
        (
            Callable::new(
                Encoder::new(device),
                Encoder::forward,
                batch([8, 16], 0, device),
            ),
            Callable::chained(Mixer::new(device), Mixer::forward),
            Callable::chained(Decoder::new(device), Decoder::forward),
        ),
        &GraphedConfig::new(),
    )
    .expect("capture");
    writeln!(facts, "group of three (encoder -> mixer -> decoder):").unwrap();
    for (name, summary) in [
        ("encoder", encoder.summary()),
        ("mixer", mixer.summary()),
        ("decoder", decoder.summary()),
    ] {
        writeln!(
            facts,
            "  {name}: graphed {}, inputs {} ({} require grad), outputs {}, params {}, static bytes {}",
            summary.graphed,
            summary.inputs,
            summary.inputs_requiring_grad,
            summary.outputs,
            summary.params,
            summary.static_bytes
        )
        .unwrap();
    }
    writeln!(
        facts,
        "  group static bytes: {}",
        decoder.memory().group_static_bytes
    )
    .unwrap();
    let x = batch([8, 16], 1, device);
    let (h, s) = encoder.forward(x.clone()).expect("encoder");
    let y = decoder
        .forward(mixer.forward((h, s.clone())).expect("mixer"))
        .expect("decoder");
    let _ = ((y - x).powi_scalar(2).mean() + s.powi_scalar(2).mean()).backward();
    for (name, stats) in [
        ("encoder", encoder.stats()),
        ("mixer", mixer.stats()),
        ("decoder", decoder.stats()),
    ] {
        writeln!(
            facts,
            "  after one step, {name}: replays {}/{}, copies: inputs {}, params {}, grads {}, eager {}",
            stats.forward_replays,
            stats.backward_replays,
            stats.input_copies,
            stats.param_copies,
            stats.grad_copies,
            stats.total_eager()
        )
        .unwrap();
    }
    let first_chained = make_graphed_callables(
        (
            Callable::<Mixer, (Tensor<2>, Tensor<2>), Tensor<2>>::chained(
                Mixer::new(device),
                Mixer::forward,
            ),
        ),
        &GraphedConfig::new(),
    );
    writeln!(
        facts,
        "  first callable chained: {}",
        error_text(first_chained)
    )
    .unwrap();
    let misfit = make_graphed_callables(
        (
            Callable::new(
                Encoder::new(device),
                Encoder::forward,
                batch([8, 16], 0, device),
            ),
            Callable::chained(Decoder::new(device), Decoder::forward),
        ),
        &GraphedConfig::new(),
    );
    writeln!(facts, "  inputs do not fit: {}", error_text(misfit)).unwrap();
}
