//! The engine's front door without the `cube` feature: no backend can capture, so nothing here
//! is ever reached but the answers that say so.

use std::sync::Arc;

use burn::backend::DispatchTensor;
use burn::optim::{AdamState, LearningRate};
use burn::tensor::{Device, Tensor};

use super::values::{CapturedGroup, Unfused};
use crate::callable::Member;
use crate::config::GraphedConfig;
use crate::counter_rng::Draw;
use crate::error::GraphedError;
use crate::stats::{EagerReason, GraphStats};
use crate::step_optim::StepOptimizer;
use crate::tensors::FlatTensor;

/// Without cubecl no kernel is compiled or tuned: the work runs unwatched.
pub(crate) fn report_while<T>(_what: &str, work: impl FnOnce() -> T) -> T {
    work()
}

/// No backend captures graphs without the `cube` feature.
pub(crate) fn supports_graphs(_device: &Device) -> bool {
    false
}

/// Bytes of an NCCL unique id.
pub(crate) const NCCL_ID_BYTES: usize = 128;

/// No CUDA device without the `cuda` feature.
pub(crate) fn is_cuda(_device: &Device) -> bool {
    false
}

/// NCCL needs the `cuda` feature.
pub(crate) fn nccl_unique_id() -> Result<Vec<u8>, String> {
    Err("NCCL needs burn-graphed's cuda feature".into())
}

/// NCCL needs the `cuda` feature.
pub(crate) fn nccl_join(
    _id: &[u8],
    _rank: usize,
    _size: usize,
    _on_error: Box<dyn Fn(String) + Send + Sync>,
) -> Result<usize, String> {
    Err("NCCL needs burn-graphed's cuda feature".into())
}

/// Never reached: no group joins without the `cuda` feature.
pub(crate) fn nccl_end(_group: usize, _reason: &str) {}

/// Nothing to turn off without the `cuda` feature.
#[cfg(feature = "testing")]
pub(crate) fn nccl_set_abort(_on: bool) {}

/// Nothing records without cubecl.
#[cfg(feature = "testing")]
pub(crate) fn set_capture_global_mode(_on: bool) {}

/// No communicator to fail without the `cuda` feature.
#[cfg(feature = "testing")]
pub(crate) fn nccl_inject_error(_reason: &str) {}

/// Nothing records without cubecl.
#[cfg(feature = "testing")]
pub(crate) fn set_overlap(_on: bool) {}

/// Nothing records without cubecl.
#[cfg(feature = "testing")]
pub(crate) fn nccl_set_side_stream(_on: bool) {}

/// Nothing records without cubecl.
#[cfg(feature = "testing")]
pub(crate) fn set_overlap_caps(_caps: Option<(usize, usize)>) {}

/// Nothing records without cubecl.
#[cfg(feature = "testing")]
pub(crate) fn overlap_starts() -> (usize, usize) {
    (0, 0)
}

/// No all-reduce runs without the `cuda` feature.
#[cfg(feature = "testing")]
pub(crate) fn nccl_reductions() -> (usize, usize) {
    (0, 0)
}

/// Never reached: no group joins without the `cuda` feature.
pub(crate) fn nccl_mean(bucket: Tensor<1>, _group: usize) -> Tensor<1> {
    bucket
}

/// Never reached: no group joins without the `cuda` feature.
pub(crate) fn nccl_failure(_group: usize) -> Option<String> {
    None
}

/// Without cubecl no launch is skipped: every tensor holds values.
pub(crate) fn check_written(_tensor: &burn::backend::DispatchTensor) -> Result<(), String> {
    Ok(())
}

/// Without cubecl the collective takes the bucket as it is.
pub(crate) fn collective_buffer(bucket: burn::tensor::Tensor<1>) -> burn::tensor::Tensor<1> {
    bucket
}

/// Refuses: see [`supports_graphs`].
pub(crate) fn capture_group(
    members: &[Member<'_>],
    _config: &GraphedConfig,
) -> Result<CapturedGroup<Graphs>, GraphedError> {
    let device = members
        .first()
        .and_then(|m| m.sample.as_ref())
        .and_then(|s| s.first())
        .map(|t| format!("{:?}", t.device))
        .unwrap_or_default();
    Err(GraphedError::Unsupported { device })
}

/// Refuses as [`capture_group`] does: no graphs without the `cube` feature.
pub(crate) fn capture_inference(
    member: &Member<'_>,
    config: &GraphedConfig,
) -> Result<CapturedGroup<Graphs>, GraphedError> {
    capture_group(std::slice::from_ref(member), config)
}

/// Graphs are never made here ([`capture_group`] refuses); were one asked, it would answer as
/// a backend without graphs does.
#[derive(Clone, Debug)]
#[allow(dead_code)] // never constructed without the `cube` feature
pub(crate) struct Graphs(());

impl Graphs {
    pub(crate) fn backward_pending(&self) -> bool {
        false
    }

    pub(crate) fn stats(&self) -> GraphStats {
        GraphStats::default()
    }

    pub(crate) fn contents(&self) -> &[crate::stats::GraphContents] {
        &[]
    }

    pub(crate) fn is_inference(&self) -> bool {
        false
    }

    pub(crate) fn admit(
        &self,
        _inputs: &[FlatTensor],
        _params: &[FlatTensor],
        _handles: &ParamHandles,
        _training: bool,
    ) -> Result<Admitted, EagerReason> {
        Err(EagerReason::Unsupported)
    }

    pub(crate) fn replay(
        &self,
        call: Admitted,
        _inputs: Vec<FlatTensor>,
        _params: Vec<FlatTensor>,
    ) -> Result<Vec<FlatTensor>, GraphedError> {
        match call {}
    }
}

/// Never admitted: see [`Graphs`].
pub(crate) enum Admitted {}

/// Never made into handles: see [`Graphs`]. (A field, so that `default()` makes it where the
/// engine's own has one.)
#[derive(Default)]
pub(crate) struct ParamHandles(());

/// Device generator states never exist here: generators count on the host.
pub(crate) enum RandomState {}

impl RandomState {
    pub(crate) fn new(_seed: u64, _device: &Device) -> Option<Arc<Self>> {
        None
    }

    pub(crate) fn draw<const D: usize>(
        self: &Arc<Self>,
        _like: Tensor<D>,
        _draw: Draw,
        _a: f32,
        _b: f32,
    ) -> Tensor<D> {
        match **self {}
    }
}

/// Never fuses: the step is handed back.
pub(crate) fn adam_step<const D: usize>(
    _optimizer: &StepOptimizer,
    _lr: LearningRate,
    tensor: Tensor<D>,
    grad: Tensor<D>,
    state: Option<AdamState<D>>,
) -> Result<(Tensor<D>, Option<AdamState<D>>), Box<Unfused<D>>> {
    Err(Box::new((tensor, grad, state)))
}

/// Never gathers: every step is handed back. (A field, so that callers build it with
/// `default()` as they build the engine's.)
#[derive(Default)]
pub(crate) struct AdamBatch(());

impl AdamBatch {
    pub(crate) fn gather<const D: usize>(
        &mut self,
        _optimizer: &StepOptimizer,
        _lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<AdamState<D>>,
    ) -> Result<(Tensor<D>, usize), Box<Unfused<D>>> {
        Err(Box::new((tensor, grad, state)))
    }

    pub(crate) fn finish(self) -> Vec<[DispatchTensor; 3]> {
        Vec::new()
    }
}

/// Whole-step state never exists here: burn's optimizer runs every step.
pub(crate) enum StepState {}

impl StepState {
    pub(crate) fn new(
        _params: &[crate::params::ParamEntry],
        _optimizer: crate::step_optim::StepOptimizer,
        _clipping: Option<crate::step_optim::Clipping>,
    ) -> Result<Option<Arc<Self>>, GraphedError> {
        Ok(None)
    }

    pub(crate) fn steps(&self) -> u64 {
        match *self {}
    }

    pub(crate) fn set_lr(&self, _lr: f64) -> Result<(), GraphedError> {
        match *self {}
    }

    pub(crate) fn param_values(&self) -> Vec<DispatchTensor> {
        match *self {}
    }

    pub(crate) fn state_values(&self) -> Vec<Vec<DispatchTensor>> {
        match *self {}
    }

    pub(crate) fn load_params(&self, _values: &[DispatchTensor]) -> Result<(), GraphedError> {
        match *self {}
    }

    pub(crate) fn load_states(
        &self,
        _states: &[Option<Vec<DispatchTensor>>],
        _steps: u64,
    ) -> Result<(), GraphedError> {
        match *self {}
    }

    pub(crate) fn eager_step(
        &self,
        _run: &crate::callable::StepRunner<'_>,
        _micro_inputs: &[Vec<FlatTensor>],
    ) -> Result<Vec<DispatchTensor>, GraphedError> {
        match *self {}
    }

    pub(crate) fn eager_gradients(
        &self,
        _run: &crate::callable::StepRunner<'_>,
        _micro_inputs: &[Vec<FlatTensor>],
    ) -> Result<(Vec<DispatchTensor>, super::values::Bucket), GraphedError> {
        match *self {}
    }

    pub(crate) fn eager_update(&self, _bucket: &super::values::Bucket) -> Result<(), GraphedError> {
        match *self {}
    }
}

/// Whole-step graphs are never made here.
pub(crate) enum StepGraph {}

impl StepGraph {
    pub(crate) fn held_bytes(&self) -> u64 {
        match *self {}
    }

    pub(crate) fn contents(&self) -> &[crate::stats::GraphContents] {
        match *self {}
    }

    pub(crate) fn replay(
        &self,
        _micro_inputs: &[Vec<FlatTensor>],
    ) -> Result<(Vec<DispatchTensor>, u64), GraphedError> {
        match *self {}
    }

    pub(crate) fn replay_gradients(
        &self,
        _micro_inputs: &[Vec<FlatTensor>],
    ) -> Result<(Vec<DispatchTensor>, u64, super::values::Bucket), GraphedError> {
        match *self {}
    }

    pub(crate) fn replay_update(&self, _averaged: &DispatchTensor) -> Result<(), GraphedError> {
        match *self {}
    }

    pub(crate) fn averaged_layout(&self) -> Option<&super::values::BucketLayout> {
        match *self {}
    }

    pub(crate) fn inputs_written(
        &self,
        _micro_inputs: &[Vec<FlatTensor>],
    ) -> Result<(), GraphedError> {
        match *self {}
    }
}

/// Never reached: [`StepState::new`] makes no state here.
pub(crate) fn capture_step(
    state: &Arc<StepState>,
    _run: &crate::callable::StepRunner<'_>,
    _sample: &[Vec<FlatTensor>],
    _config: &GraphedConfig,
    _cut: super::values::StepCut,
    _meet: &super::values::Meet<'_>,
) -> Result<StepGraph, GraphedError> {
    match **state {}
}

/// Nothing compiles kernels without the `cube` feature: there is no cache to turn on.
pub(crate) fn enable_kernel_cache(_dir: Option<std::path::PathBuf>) -> bool {
    true
}

/// Nothing compiles kernels without the `cube` feature: there is no cache.
pub(crate) fn kernel_cache_location() -> Option<std::path::PathBuf> {
    None
}

/// Without cubecl there is no kernel cache to write from.
pub(crate) fn export_tuned(_out: &std::path::Path) -> Result<crate::stats::TunedBundle, String> {
    Err(NO_CUBECL.into())
}

/// Without cubecl there is no kernel cache to fill.
pub(crate) fn import_tuned(_path: &std::path::Path) -> Result<crate::stats::TunedBundle, String> {
    Err(NO_CUBECL.into())
}

const NO_CUBECL: &str = "this build has no cubecl backend (burn-graphed's features `cuda` or `wgpu`), so no kernel \
     cache";

/// Nothing captures without the `cube` feature: there is no graph to write.
pub(crate) fn write_graphs_as_dot(_dir: Option<std::path::PathBuf>) {}

/// Without cubecl nothing is fused: the tensors go back for burn's composition.
pub(crate) fn norm(
    inputs: super::values::OpInputs,
    _centered: bool,
    _epsilon: f64,
) -> Result<burn::backend::DispatchTensor, Box<super::values::OpInputs>> {
    Err(Box::new(inputs))
}

/// Without cubecl no layer norm is fused.
#[cfg(feature = "testing")]
pub(crate) fn fused_norm_forwards() -> usize {
    0
}

/// Without cubecl nothing is copied into a graph.
#[cfg(feature = "testing")]
pub(crate) fn driver_copies() -> usize {
    0
}

/// Without cubecl no product runs through a vendor library.
#[cfg(feature = "testing")]
pub(crate) fn vendor_gemms() -> usize {
    0
}

/// Without cubecl no attention runs on tensor cores.
#[cfg(feature = "testing")]
pub(crate) fn attention_tensor_core_calls() -> usize {
    0
}

/// Without cubecl no norm is fused: its sums are burn's, one chunk of every row.
#[cfg(feature = "testing")]
pub(crate) fn norm_rows_per_chunk(rows: usize) -> usize {
    rows.max(1)
}

/// Without cubecl no attention runs packed.
#[cfg(feature = "testing")]
pub(crate) fn packed_attention_calls() -> usize {
    0
}

/// Without cubecl no attention is fused: there are no blocks to force.
#[cfg(feature = "testing")]
pub(crate) fn force_attention_blocks(_blocks: Option<(usize, usize)>) {}

/// Without cubecl no convolution is fused: there is no tiling to force.
#[cfg(feature = "testing")]
pub(crate) fn force_conv_tiling(_tiling: Option<(usize, usize, usize)>) {}

/// Without cubecl one chunk: one lane adds it.
#[cfg(feature = "testing")]
pub(crate) fn norm_sum_lanes() -> usize {
    1
}

/// Without cubecl nothing is captured, so nothing reports progress.
#[cfg(feature = "testing")]
pub(crate) fn set_progress_intervals(_first: std::time::Duration, _every: std::time::Duration) {}

/// Without cubecl nothing is fused: the tensors go back for burn's composition.
pub(crate) fn cross_entropy_rows(
    logits: burn::backend::DispatchTensor,
    targets: burn::backend::DispatchTensor,
) -> Result<burn::backend::DispatchTensor, Box<super::values::LossInputs>> {
    Err(Box::new((logits, targets)))
}

/// Without cubecl no embedding is fused: the tensors come back for burn's.
pub(crate) fn embedding_rows(
    table: burn::backend::DispatchTensor,
    ids: burn::backend::DispatchTensor,
) -> Result<burn::backend::DispatchTensor, Box<super::values::EmbeddingInputs>> {
    Err(Box::new((table, ids)))
}

/// Without cubecl nothing is fused: the tensors go back for burn's composition.
pub(crate) fn attention(
    inputs: super::values::AttentionInputs,
    _spec: super::values::AttentionSpec,
) -> Result<burn::backend::DispatchTensor, Box<super::values::AttentionInputs>> {
    Err(Box::new(inputs))
}

/// Without cubecl nothing is fused: the tensors go back for burn's composition.
pub(crate) fn attention_packed(
    inputs: super::values::PackedAttentionInputs,
    _spec: super::values::AttentionSpec,
) -> Result<burn::backend::DispatchTensor, Box<super::values::PackedAttentionInputs>> {
    Err(Box::new(inputs))
}

/// Without cubecl nothing is joined here: the tensors go back for burn's `cat`.
pub(crate) fn join3(
    inputs: super::values::JoinInputs,
) -> Result<burn::backend::DispatchTensor, Box<super::values::JoinInputs>> {
    Err(Box::new(inputs))
}

/// Without cubecl nothing is joined here: the tensors go back for burn's `cat`.
pub(crate) fn join3_biased(
    inputs: super::values::JoinBiasedInputs,
) -> Result<
    (burn::backend::DispatchTensor, burn::backend::DispatchTensor),
    Box<super::values::JoinBiasedInputs>,
> {
    Err(Box::new(inputs))
}

/// Without cubecl no head dimension is taken.
pub(crate) fn attention_supports_dim(_device: &burn::tensor::Device, _dim: usize) -> bool {
    false
}

/// Without cubecl nothing is fused: the tensors go back for burn's composition.
pub(crate) fn linear(
    inputs: super::values::LinearInputs,
    _vendor: bool,
    _relu: bool,
) -> Result<burn::backend::DispatchTensor, Box<super::values::LinearInputs>> {
    Err(Box::new(inputs))
}

/// Without cubecl no convolution is fused: the tensors come back.
pub(crate) fn conv2d(
    inputs: super::values::OpInputs,
    _spec: super::values::ConvSpec,
) -> Result<burn::backend::DispatchTensor, Box<super::values::OpInputs>> {
    Err(Box::new(inputs))
}

/// Without cubecl no product runs through a vendor library.
pub(crate) fn vendor_matmul_available(_device: &burn::tensor::Device) -> bool {
    false
}
