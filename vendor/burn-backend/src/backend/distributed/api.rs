use std::{
    any::{Any, TypeId},
    sync::{Mutex, MutexGuard, OnceLock},
};

use std::collections::HashMap;

use crate::Backend;

use super::{DistributedConfig, DistributedParams, client::DistributedSyncClient};

/// The type-erased box type for [`DistributedSyncClient`].
type ClientBox = Box<dyn Any + Send + Sync>;

/// Global state map from [Backend] to boxed [`DistributedSyncClient`].
static BACKEND_CLIENT_MAP: OnceLock<Mutex<HashMap<TypeId, ClientBox>>> = OnceLock::new();

// TODO: Replace TypeId with DeviceId, the index being i32::MAX, a.k.a. communication index.
/// Gets a locked mutable view of the `STATE_MAP`.
pub(crate) fn get_backend_client_map() -> MutexGuard<'static, HashMap<TypeId, ClientBox>> {
    BACKEND_CLIENT_MAP
        .get_or_init(Default::default)
        .lock()
        .unwrap()
}

/// Get the distributed sync client for the given [Backend].
pub fn get_distributed_sync_client<B: Backend>() -> Option<DistributedSyncClient<B>> {
    let typeid = TypeId::of::<B>();
    let state_map = get_backend_client_map();
    state_map
        .get(&typeid)
        .map(|val| val.downcast_ref().cloned().unwrap())
}

/// Remove the client form the map for the given [Backend].
pub(crate) fn remove_distributed_sync_client<B: Backend>() {
    let typeid = TypeId::of::<B>();
    let mut state_map = get_backend_client_map();
    state_map.remove(&typeid);
}

/// Starts the server used to sync the gradients of parameters sharded across multiple devices.
pub fn start_distributed_sync_server<B: Backend>(devices: &[B::Device], config: DistributedConfig) {
    if get_distributed_sync_client::<B>().is_none() {
        let typeid = TypeId::of::<B>();
        let mut state_map = get_backend_client_map();
        let client = DistributedSyncClient::<B>::new(devices.len(), config);
        state_map.insert(typeid, Box::new(client.clone()));
    }
}

/// Close the gradient syncing server.
pub fn close_distributed_sync_server<B: Backend>() {
    if let Some(client) = get_distributed_sync_client::<B>() {
        client.close();
        remove_distributed_sync_client::<B>();
    }
}

/// A gradient synchronization of the caller's own, for the backward passes of one thread: in
/// place of the distributed sync server (none need be started), autodiff hands it each
/// distributed parameter's gradient as soon as the gradient is final (its last use in the
/// graph has registered its part), while the backward pass goes on.
pub trait GradientSync {
    /// A backward pass begins; `params` are the distributed parameters of its graph.
    fn begin(&mut self, params: &[DistributedParams]);
    /// The gradient of the parameter `params` names is final: `tensor` is the gradient, a
    /// `FloatTensor` of the loss's backend (which the sync may replace with its result).
    fn gradient(&mut self, tensor: &mut dyn Any, params: &DistributedParams);
    /// A backward pass ended (called after every backward pass of the thread, with or without
    /// distributed parameters).
    fn end(&mut self);
}

std::thread_local! {
    static GRADIENT_SYNC: core::cell::RefCell<Option<Box<dyn GradientSync>>> =
        const { core::cell::RefCell::new(None) };
}

/// Installs `sync` for the backward passes of this thread (`None` removes it); returns the one
/// it replaces. While one is installed, the sync server of the backend is not asked.
pub fn set_gradient_sync(sync: Option<Box<dyn GradientSync>>) -> Option<Box<dyn GradientSync>> {
    GRADIENT_SYNC.with(|cell| cell.replace(sync))
}

/// Runs `f` on this thread's gradient sync, if one is installed; whether one is.
pub(crate) fn with_gradient_sync(f: impl FnOnce(&mut dyn GradientSync)) -> bool {
    GRADIENT_SYNC.with(|cell| match cell.borrow_mut().as_mut() {
        Some(sync) => {
            f(sync.as_mut());
            true
        }
        None => false,
    })
}
