//! Generational handles: [`ConnId`] and [`LgrId`], and the table they index.
//!
//! A connection's or link group's record lives in a slot that is reused
//! once the record is freed. A handle names the slot and the generation the
//! slot had when the record was put there; the table bumps a slot's
//! generation when it frees the record, so a handle kept past the free (a
//! socket's id read by a late epoll event, a timer, a stale list) finds
//! nothing instead of whatever record took the slot next. Before, ids were
//! bare slot numbers, and each such holder had to check the alert token or
//! the phase to tell the two apart.

use std::fmt;
use std::marker::PhantomData;

/// Handle of a connection.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(Key);

/// Handle of a link group.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LgrId(Key);

/// A slot and its generation.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Key {
    slot: u32,
    gen: u32,
}

/// What [`Slots`] needs of a handle type.
pub(super) trait SlotId: Copy {
    #[doc(hidden)]
    fn key(self) -> (u32, u32);
    #[doc(hidden)]
    fn from_key(slot: u32, gen: u32) -> Self;
}

macro_rules! handle {
    ($t:ident, $tag:literal) => {
        impl SlotId for $t {
            fn key(self) -> (u32, u32) {
                (self.0.slot, self.0.gen)
            }
            fn from_key(slot: u32, gen: u32) -> Self {
                $t(Key { slot, gen })
            }
        }

        impl $t {
            /// The handle as one number (slot in the high half, generation
            /// in the low), e.g. for an epoll event's data; see
            /// [`Self::from_bits`].
            pub const fn to_bits(self) -> u64 {
                ((self.0.slot as u64) << 32) | self.0.gen as u64
            }

            /// The handle [`Self::to_bits`] gave. Any number makes a handle;
            /// one that names no live record finds nothing.
            pub const fn from_bits(bits: u64) -> Self {
                $t(Key {
                    slot: (bits >> 32) as u32,
                    gen: bits as u32,
                })
            }

            /// The slot: small, reused after the record is freed (for
            /// display next to Linux's tools, which show no generation).
            pub const fn slot(self) -> usize {
                self.0.slot as usize
            }
        }

        impl fmt::Debug for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($tag, "{}.{}"), self.0.slot, self.0.gen)
            }
        }

        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(self, f)
            }
        }
    };
}

handle!(ConnId, "conn#");
handle!(LgrId, "lgr#");

struct Entry<T> {
    /// Bumped when the record is freed: handles of the old one stop
    /// matching.
    gen: u32,
    val: Option<T>,
}

/// Records indexed by generational handles. A freed slot is reused by the
/// next insert (last freed first), so the table is as long as the most
/// records alive at once.
pub(super) struct Slots<I, T> {
    entries: Vec<Entry<T>>,
    /// Slots without a record.
    free: Vec<u32>,
    _id: PhantomData<fn() -> I>,
}

impl<I: SlotId, T> Default for Slots<I, T> {
    fn default() -> Self {
        Slots {
            entries: Vec::new(),
            free: Vec::new(),
            _id: PhantomData,
        }
    }
}

impl<I: SlotId, T> Slots<I, T> {
    /// Puts `val` into a free slot and returns its handle.
    pub(super) fn insert(&mut self, val: T) -> I {
        match self.free.pop() {
            Some(slot) => {
                let e = &mut self.entries[slot as usize];
                debug_assert!(e.val.is_none());
                e.val = Some(val);
                I::from_key(slot, e.gen)
            }
            None => {
                // 2^32 records alive at once cannot be: the memory runs out first
                let slot = u32::try_from(self.entries.len()).expect("2^32 live records");
                self.entries.push(Entry {
                    gen: 0,
                    val: Some(val),
                });
                I::from_key(slot, 0)
            }
        }
    }

    fn entry(&self, id: I) -> Option<&Entry<T>> {
        let (slot, gen) = id.key();
        self.entries.get(slot as usize).filter(|e| e.gen == gen)
    }

    /// The record of `id`, if it is alive.
    pub(super) fn get(&self, id: I) -> Option<&T> {
        self.entry(id)?.val.as_ref()
    }

    /// The record of `id`, if it is alive.
    pub(super) fn get_mut(&mut self, id: I) -> Option<&mut T> {
        let (slot, gen) = id.key();
        let e = self.entries.get_mut(slot as usize)?;
        if e.gen != gen {
            return None;
        }
        e.val.as_mut()
    }

    /// Takes the record of `id` out: `id` and every copy of it find nothing
    /// from now on, whatever the slot holds next.
    pub(super) fn remove(&mut self, id: I) -> Option<T> {
        let (slot, gen) = id.key();
        let e = self.entries.get_mut(slot as usize)?;
        if e.gen != gen {
            return None;
        }
        let val = e.val.take()?;
        // A slot reused 2^32 times gives an old handle's generation again:
        // a handle would have to be kept unused through all of them.
        e.gen = e.gen.wrapping_add(1);
        self.free.push(slot);
        Some(val)
    }

    /// The live records with their handles, in slot order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (I, &T)> + '_ {
        self.entries.iter().enumerate().filter_map(|(slot, e)| {
            let v = e.val.as_ref()?;
            Some((I::from_key(slot as u32, e.gen), v))
        })
    }

    /// The live records.
    pub(super) fn values(&self) -> impl Iterator<Item = &T> + '_ {
        self.entries.iter().filter_map(|e| e.val.as_ref())
    }

    /// The live records, mutable.
    pub(super) fn values_mut(&mut self) -> impl Iterator<Item = &mut T> + '_ {
        self.entries.iter_mut().filter_map(|e| e.val.as_mut())
    }

    /// The handles of the live records.
    pub(super) fn ids(&self) -> impl Iterator<Item = I> + '_ {
        self.iter().map(|(id, _)| id)
    }

    /// A walk over the live records' handles, slot by slot, that does not
    /// hold the table: the walker may change the table's owner between
    /// steps (records freed meanwhile are skipped, new ones may or may not
    /// be seen). See [`Walk::next`].
    pub(super) fn walk(&self) -> Walk {
        Walk(0)
    }

    /// The handle of the first live record at slot `from` or after, and
    /// the slot after it.
    fn live_from(&self, from: usize) -> Option<(I, usize)> {
        self.entries
            .iter()
            .enumerate()
            .skip(from)
            .find(|(_, e)| e.val.is_some())
            .map(|(slot, e)| (I::from_key(slot as u32, e.gen), slot + 1))
    }

    /// How many records are alive.
    pub(super) fn len(&self) -> usize {
        self.entries.len() - self.free.len()
    }
}

/// Where a [`Slots::walk`] stands: the next slot to look at.
pub(super) struct Walk(usize);

impl Walk {
    /// The next live record's handle in `slots` (the table the walk was
    /// made from), `None` at the end.
    pub(super) fn next<I: SlotId, T>(&mut self, slots: &Slots<I, T>) -> Option<I> {
        let (id, after) = slots.live_from(self.0)?;
        self.0 = after;
        Some(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_freed_handle_finds_nothing_though_its_slot_is_taken_again() {
        let mut t: Slots<ConnId, &str> = Slots::default();
        let a = t.insert("a");
        let b = t.insert("b");
        assert_eq!(t.remove(a), Some("a"));
        assert_eq!(t.get(a), None);
        let c = t.insert("c");
        assert_eq!(c.slot(), a.slot(), "the freed slot is reused");
        assert_ne!(c, a);
        assert_eq!(
            t.get(a),
            None,
            "the old handle does not reach the new record"
        );
        assert_eq!(t.get_mut(a), None);
        assert_eq!(t.remove(a), None);
        assert_eq!(t.get(c), Some(&"c"));
        assert_eq!(t.get(b), Some(&"b"));
        assert_eq!(t.len(), 2);
        assert_eq!(t.ids().collect::<Vec<_>>(), vec![c, b]);
    }

    #[test]
    fn a_walk_goes_on_past_records_freed_during_it() {
        let mut t: Slots<ConnId, u8> = Slots::default();
        let ids: Vec<ConnId> = (0..4).map(|v| t.insert(v)).collect();
        let mut w = t.walk();
        let mut seen = Vec::new();
        while let Some(id) = w.next(&t) {
            seen.push(id);
            // (the walker changes the table between steps)
            if id == ids[0] {
                t.remove(ids[1]);
            }
        }
        assert_eq!(seen, vec![ids[0], ids[2], ids[3]]);
    }

    #[test]
    fn a_handle_survives_its_trip_through_bits() {
        let mut t: Slots<LgrId, u8> = Slots::default();
        let a = t.insert(1);
        t.remove(a);
        let b = t.insert(2);
        assert_eq!(LgrId::from_bits(b.to_bits()), b);
        assert_ne!(a.to_bits(), b.to_bits());
        assert_eq!(t.get(LgrId::from_bits(u64::MAX)), None);
    }
}
