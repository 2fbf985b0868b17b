//! The process-wide handle tables that give C callers `uint64_t` names for engines and batches.
//!
//! A handle packs three fields: a kind tag (bits 56..64: 1 = engine, 2 = batch), the slot's
//! generation (bits 32..56) and the slot index (bits 0..32). The tag is never 0, so 0 is never a
//! valid handle. Freeing a slot bumps its generation, so a stale handle never names the value
//! that reuses the slot; a slot whose generation is exhausted is retired. The table's lock is
//! held only to look a value up (its `Arc` is cloned out), never while an engine or a batch
//! works or waits.

use std::sync::{Arc, Mutex};

use ferry::Error;

use crate::errors::CResult;

const INDEX_BITS: u32 = 32;
const GENERATION_BITS: u32 = 24;
const GENERATION_MAX: u32 = (1 << GENERATION_BITS) - 1;
const KIND_SHIFT: u32 = INDEX_BITS + GENERATION_BITS;

struct Slot<T> {
    generation: u32,
    value: Option<Arc<T>>,
}

struct Slots<T> {
    slots: Vec<Slot<T>>,
    free: Vec<u32>,
}

/// A table of values of one kind, named by generation-carrying handles.
pub(crate) struct HandleTable<T> {
    tag: u8,
    kind: &'static str,
    gone: &'static str,
    inner: Mutex<Slots<T>>,
}

/// What a handle value says about itself.
struct Parts {
    tag: u8,
    generation: u32,
    index: u32,
}

fn split(handle: u64) -> Parts {
    Parts {
        tag: (handle >> KIND_SHIFT) as u8,
        generation: ((handle >> INDEX_BITS) as u32) & GENERATION_MAX,
        index: handle as u32,
    }
}

/// Name of the kind carried by tag `tag`.
fn kind_name(tag: u8) -> Option<&'static str> {
    match tag {
        ENGINE_TAG => Some("an engine"),
        BATCH_TAG => Some("a batch"),
        _ => None,
    }
}

/// Tag of engine handles.
pub(crate) const ENGINE_TAG: u8 = 1;
/// Tag of batch handles.
pub(crate) const BATCH_TAG: u8 = 2;

impl<T> HandleTable<T> {
    /// An empty table whose handles carry `tag`; `kind` names the values in messages ("engine"),
    /// `gone` says what happened to a released one ("destroyed").
    pub(crate) const fn new(tag: u8, kind: &'static str, gone: &'static str) -> Self {
        Self { tag, kind, gone, inner: Mutex::new(Slots { slots: Vec::new(), free: Vec::new() }) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Slots<T>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn handle(&self, generation: u32, index: u32) -> u64 {
        (u64::from(self.tag) << KIND_SHIFT) | (u64::from(generation) << INDEX_BITS) | u64::from(index)
    }

    /// Stores `value` and returns its new handle (never 0).
    pub(crate) fn insert(&self, value: T) -> CResult<u64> {
        let value = Arc::new(value);
        let mut t = self.lock();
        if let Some(index) = t.free.pop() {
            let slot = &mut t.slots[index as usize];
            slot.value = Some(value);
            return Ok(self.handle(slot.generation, index));
        }
        let index = u32::try_from(t.slots.len())
            .map_err(|_| Error::new(ferry::ErrorKind::Busy, format!("the {} handle table is full", self.kind)))?;
        t.slots.push(Slot { generation: 1, value: Some(value) });
        Ok(self.handle(1, index))
    }

    fn not_found(&self, handle: u64, t: &Slots<T>) -> Error {
        let p = split(handle);
        let why = if handle == 0 {
            "is 0, which is never a valid handle".to_owned()
        } else if p.tag != self.tag {
            match kind_name(p.tag) {
                Some(other) => format!("is {other} handle, not {} {} handle", article(self.kind), self.kind),
                None => "was never issued by Ferry".to_owned(),
            }
        } else {
            match t.slots.get(p.index as usize) {
                Some(slot) if p.generation != 0 && p.generation < slot.generation => format!("was {}", self.gone),
                Some(slot) if p.generation == slot.generation && slot.value.is_none() => format!("was {}", self.gone),
                _ => "was never issued by Ferry".to_owned(),
            }
        };
        Error::not_found(format!("{} handle {handle} {why}", self.kind))
    }

    /// The value behind `handle`.
    pub(crate) fn get(&self, handle: u64) -> CResult<Arc<T>> {
        let t = self.lock();
        let p = split(handle);
        match t.slots.get(p.index as usize) {
            Some(Slot { generation, value: Some(v) }) if p.tag == self.tag && p.generation == *generation => {
                Ok(v.clone())
            }
            _ => Err(self.not_found(handle, &t)),
        }
    }

    /// Removes and returns the value behind `handle`; the handle is invalid from now on.
    pub(crate) fn remove(&self, handle: u64) -> CResult<Arc<T>> {
        let mut t = self.lock();
        let p = split(handle);
        let live = matches!(
            t.slots.get(p.index as usize),
            Some(Slot { generation, value: Some(_) }) if p.tag == self.tag && p.generation == *generation
        );
        if !live {
            return Err(self.not_found(handle, &t));
        }
        let slot = &mut t.slots[p.index as usize];
        let value = slot.value.take().expect("checked live above");
        if slot.generation < GENERATION_MAX {
            slot.generation += 1;
            t.free.push(p.index);
        }
        // else: retired, so no handle value is ever issued twice.
        Ok(value)
    }

    /// Every live value (clones of the references; the table's lock is not held afterwards).
    pub(crate) fn values(&self) -> Vec<Arc<T>> {
        self.lock().slots.iter().filter_map(|s| s.value.clone()).collect()
    }

    /// Number of live values.
    #[cfg(test)]
    fn live(&self) -> usize {
        self.lock().slots.iter().filter(|s| s.value.is_some()).count()
    }
}

fn article(word: &str) -> &'static str {
    if word.starts_with(['a', 'e', 'i', 'o', 'u']) { "an" } else { "a" }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_are_never_zero_and_never_reused() {
        let t: HandleTable<u32> = HandleTable::new(ENGINE_TAG, "engine", "destroyed");
        let a = t.insert(1).unwrap();
        assert_ne!(a, 0);
        assert_eq!(*t.get(a).unwrap(), 1);
        assert_eq!(*t.remove(a).unwrap(), 1);
        let b = t.insert(2).unwrap();
        assert_ne!(a, b, "the slot is reused with a new generation");
        assert_eq!(split(a).index, split(b).index);
        let e = t.get(a).unwrap_err();
        assert_eq!(e.kind(), ferry::ErrorKind::NotFound);
        assert!(e.message().contains(&format!("engine handle {a} was destroyed")), "{e}");
        assert!(t.remove(a).is_err());
        assert_eq!(*t.get(b).unwrap(), 2);
        assert_eq!(t.live(), 1);
    }

    #[test]
    fn messages_tell_zero_foreign_and_unknown_handles_apart() {
        let engines: HandleTable<u8> = HandleTable::new(ENGINE_TAG, "engine", "destroyed");
        let batches: HandleTable<u8> = HandleTable::new(BATCH_TAG, "batch", "freed");
        let b = batches.insert(0).unwrap();
        assert!(engines.get(0).unwrap_err().message().contains("is 0"));
        let e = engines.get(b).unwrap_err();
        assert!(e.message().contains("is a batch handle, not an engine handle"), "{e}");
        assert!(engines.get(12345).unwrap_err().message().contains("never issued"));
        let forged = engines.handle(7, 0);
        assert!(engines.get(forged).unwrap_err().message().contains("never issued"));
    }

    #[test]
    fn an_exhausted_slot_is_retired() {
        let t: HandleTable<u8> = HandleTable::new(BATCH_TAG, "batch", "freed");
        let h = t.insert(0).unwrap();
        t.lock().slots[0].generation = GENERATION_MAX;
        let h = t.handle(GENERATION_MAX, split(h).index);
        t.remove(h).unwrap();
        let next = t.insert(1).unwrap();
        assert_eq!(split(next).index, 1, "slot 0 is retired");
    }
}
