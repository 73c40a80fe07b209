//! Where a fused optimizer writes a parameter's update: into the static parameter buffer of the
//! graph that holds the parameter's values, so that the next replay copies nothing, when no
//! user tensor can tell; into a new buffer otherwise. [`claim`] is the one way in.

use std::sync::{Arc, Mutex, Weak};

use super::super::buffers::FusedTensor;
use super::session::Session;
use crate::sync::lock;

/// Every live session, for [`claim`] (weak: a dropped session leaves at the next
/// registration).
static LIVE: Mutex<Vec<Weak<Session>>> = Mutex::new(Vec::new());

/// Makes `session`'s parameter buffers claimable.
pub(crate) fn register(session: &Arc<Session>) {
    let mut live = lock(&LIVE);
    live.retain(|weak| weak.strong_count() > 0);
    live.push(Arc::downgrade(session));
}

/// A graph's static parameter buffer: session and parameter slot.
#[derive(Clone)]
pub(crate) struct ParamSlot {
    session: Arc<Session>,
    index: usize,
}

impl ParamSlot {
    fn is(&self, other: &ParamSlot) -> bool {
        Arc::ptr_eq(&self.session, &other.session) && self.index == other.index
    }

    /// The buffer, as a tensor to write in place.
    pub(crate) fn buffer(&self) -> &FusedTensor {
        &self.session.params[self.index].fused
    }

    /// Records that `updated`, a tensor over this buffer just written in place, is handed to
    /// user code as the parameter (see `StaticBuffer::hand_over`).
    pub(crate) fn hand_over(&self, updated: &FusedTensor) {
        self.session.params[self.index].hand_over(updated);
    }
}

/// What an update of one parameter reads and where it may write.
pub(crate) struct Claim {
    /// The parameter's values: a graph's static buffer where one holds them, else the
    /// parameter tensor itself.
    pub values: FusedTensor,
    /// The static buffer the update may write in place, if any.
    pub in_place: Option<ParamSlot>,
}

/// Claims the buffer of the parameter `param` for its update.
///
/// Where a graph's static buffer holds the parameter's values (the forward replay copied them
/// there, or the previous step wrote them there), the update reads that buffer, and writes it
/// in place when no user tensor can observe the change: the graph was captured on this thread
/// (its graphs replay on this thread's stream), its backward is not pending (a pending backward
/// still reads the current values), and no tensor handed out over the buffer is still held (a
/// clone of the module); `param` is dropped before that check, so that it no longer counts as
/// a holder. A buffer among `taken` (claimed by the same step already) is left alone.
pub(crate) fn claim(param: FusedTensor, taken: &[Option<ParamSlot>]) -> Claim {
    let holder = {
        // Called once per parameter per optimizer step: searched under the lock, no
        // allocation. Nothing locks `LIVE` while holding a session's or a buffer's lock.
        let live = lock(&LIVE);
        live.iter().filter_map(Weak::upgrade).find_map(|session| {
            let index = session.params.iter().position(|b| b.holds(param.id))?;
            (session.thread == std::thread::current().id() && !session.backward_pending())
                .then_some(ParamSlot { session, index })
        })
    };
    // A buffer already claimed by the same step is not written twice: the update then reads
    // the parameter tensor and goes to a new buffer.
    let Some(slot) = holder.filter(|slot| !taken.iter().flatten().any(|other| other.is(slot)))
    else {
        return Claim {
            values: param,
            in_place: None,
        };
    };
    drop(param);
    // `values` is one more holder of the buffer's own handle until the update is queued;
    // nothing asks `can_mut` of a parameter buffer's own handle (`release_alias` asks it of the
    // tensor handed out over it).
    let values = slot.buffer().clone();
    let writable = slot.session.params[slot.index].release_alias();
    Claim {
        values,
        in_place: writable.then_some(slot),
    }
}
