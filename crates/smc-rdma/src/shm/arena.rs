//! The remote-access memory of one protection domain.
//!
//! A region registered with REMOTE_WRITE is handed to the peer as a memfd
//! descriptor, which the owner must keep open to hand it out. One memfd per
//! region made every SMC-R connection cost a descriptor for its RMB (beside
//! its TCP socket), so 10,000 connections needed 20,000 descriptors. Here the
//! regions of a PD are ranges (page aligned: a header page and the bytes) of
//! a few memfds of that PD — *chunks* — so a PD costs one descriptor per
//! chunk, however many regions it holds.
//!
//! * Chunks grow geometrically ([`MIN_CHUNK`], twice the largest chunk
//!   alive, ... up to [`MAX_CHUNK`]); a region larger than that gets a chunk
//!   of exactly its size. A chunk is created at its final size and sealed
//!   against shrinking and growing, as a region's memfd was.
//! * Ranges are taken first-fit; a region that goes gives its range back,
//!   and its pages to the system (a hole is punched: the memory does not
//!   stay at the PD's peak). A chunk whose last region went is closed.
//!   (A peer that still checks a freed region's header — `PeerMr::valid`,
//!   before it forgets the region — reads a punched page of a shared memfd
//!   mapping, and such a read allocates a zeroed page again: at most the
//!   header page of each freed region comes back, until its range is reused
//!   (`alloc` discards it) or the chunk closes.)
//! * An arena belongs to one PD and is never shared: a peer granted one
//!   region gets the descriptor of the whole chunk, so a chunk holds only
//!   regions a peer of that PD may reach anyway (all remote-write regions of
//!   the PD its QP is granted, as an RNIC peer holding the link group's
//!   rkeys), never another PD's, nor a local-only region (those keep their
//!   own memfd, closed at once).
//! * The owner maps a chunk once; its regions are slices of that mapping.
#![forbid(unsafe_code)]

use crate::sys::{self, SharedMem};
use std::io;
use std::sync::{Arc, Mutex};

/// The first chunk of a PD.
pub const MIN_CHUNK: usize = 8 << 20;
/// The largest chunk made for several regions (a larger region gets a chunk
/// of its own, of its size).
pub const MAX_CHUNK: usize = 256 << 20;

/// One memfd of an arena: its mapping (which keeps the descriptor) and its
/// free ranges.
struct Chunk {
    mem: Arc<SharedMem>,
    /// Free ranges `(offset, length)`, sorted by offset, never adjacent.
    free: Vec<(usize, usize)>,
    /// Bytes handed out.
    used: usize,
}

impl Chunk {
    /// First fit: the offset of `len` free bytes, taken.
    fn take(&mut self, len: usize) -> Option<usize> {
        let i = self.free.iter().position(|&(_, l)| l >= len)?;
        let (off, l) = self.free[i];
        if l == len {
            self.free.remove(i);
        } else {
            self.free[i] = (off + len, l - len);
        }
        self.used += len;
        Some(off)
    }

    /// Gives `len` bytes at `off` back, merged with free neighbours.
    fn give(&mut self, off: usize, len: usize) {
        let i = self.free.partition_point(|&(o, _)| o < off);
        self.free.insert(i, (off, len));
        if i + 1 < self.free.len() && off + len == self.free[i + 1].0 {
            self.free[i].1 += self.free[i + 1].1;
            self.free.remove(i + 1);
        }
        if i > 0 && self.free[i - 1].0 + self.free[i - 1].1 == off {
            self.free[i - 1].1 += self.free[i].1;
            self.free.remove(i);
        }
        self.used -= len;
    }
}

/// The remote-access memory of one PD (see the module documentation).
#[derive(Default)]
pub struct Arena {
    chunks: Mutex<Vec<Chunk>>,
}

/// A range of an arena chunk, given back when dropped.
pub struct Slice {
    arena: Arc<Arena>,
    mem: Arc<SharedMem>,
    off: usize,
    len: usize,
}

impl Slice {
    /// The chunk's mapping (and descriptor).
    pub fn mem(&self) -> &Arc<SharedMem> {
        &self.mem
    }
    /// The range's offset in the chunk (page aligned).
    pub fn offset(&self) -> usize {
        self.off
    }
}

impl Drop for Slice {
    fn drop(&mut self) {
        self.arena.give(&self.mem, self.off, self.len);
    }
}

impl Arena {
    /// An empty arena (no chunk, no descriptor).
    pub fn new() -> Arc<Arena> {
        Arc::new(Arena::default())
    }

    /// `len` zeroed bytes (rounded up to whole pages) of a chunk of this
    /// arena; a new chunk if none has room.
    pub fn alloc(self: &Arc<Self>, len: usize) -> io::Result<Slice> {
        let page = sys::page_size();
        let len = len
            .checked_next_multiple_of(page)
            .filter(|l| *l > 0)
            .ok_or(io::ErrorKind::InvalidInput)?;
        let mut chunks = crate::shm::lock(&self.chunks);
        for c in chunks.iter_mut() {
            if let Some(off) = c.take(len) {
                // Zero what a writer of the region that had these pages may
                // have written after it went (its memory was given back).
                if let Err(e) = c.mem.discard(off, len) {
                    c.give(off, len);
                    return Err(e);
                }
                return Ok(Slice {
                    arena: self.clone(),
                    mem: c.mem.clone(),
                    off,
                    len,
                });
            }
        }
        let largest = chunks.iter().map(|c| c.mem.len()).max().unwrap_or(0);
        let mut size = largest.saturating_mul(2).clamp(MIN_CHUNK, MAX_CHUNK);
        while size < len && size < MAX_CHUNK {
            size *= 2;
        }
        let size = if len > size { len } else { size };
        let mem = Arc::new(SharedMem::create("smc-pd-arena", size)?);
        let mut c = Chunk {
            mem,
            free: vec![(0, size)],
            used: 0,
        };
        let off = c.take(len).expect("a new chunk holds the region");
        let s = Slice {
            arena: self.clone(),
            mem: c.mem.clone(),
            off,
            len,
        };
        chunks.push(c);
        Ok(s)
    }

    /// Takes back a range: its pages go back to the system, and the chunk
    /// is closed once nothing of it is used.
    fn give(&self, mem: &Arc<SharedMem>, off: usize, len: usize) {
        let mut chunks = crate::shm::lock(&self.chunks);
        let Some(i) = chunks.iter().position(|c| Arc::ptr_eq(&c.mem, mem)) else {
            return;
        };
        // Failure leaves the pages in place (the range is reused anyway, and
        // zeroed again when it is).
        let _ = mem.discard(off, len);
        chunks[i].give(off, len);
        if chunks[i].used == 0 {
            chunks.swap_remove(i);
        }
    }

    /// Chunks alive (their descriptors), and their total size.
    #[cfg(test)]
    fn footprint(&self) -> (usize, usize) {
        let chunks = crate::shm::lock(&self.chunks);
        (chunks.len(), chunks.iter().map(|c| c.mem.len()).sum())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_fit_merges_and_reuses() {
        let mut c = Chunk {
            mem: Arc::new(SharedMem::create("t", 16 * 4096).unwrap()),
            free: vec![(0, 16 * 4096)],
            used: 0,
        };
        let a = c.take(4096).unwrap();
        let b = c.take(2 * 4096).unwrap();
        let d = c.take(4096).unwrap();
        assert_eq!((a, b, d), (0, 4096, 3 * 4096));
        c.give(b, 2 * 4096);
        assert_eq!(c.take(4096), Some(4096), "first fit takes the hole");
        c.give(4096, 4096);
        c.give(a, 4096);
        assert_eq!(c.free, vec![(0, 3 * 4096), (4 * 4096, 12 * 4096)]);
        c.give(d, 4096);
        assert_eq!(c.free, vec![(0, 16 * 4096)], "neighbours merge");
        assert_eq!(c.used, 0);
        assert_eq!(c.take(17 * 4096), None);
    }

    #[test]
    fn chunks_grow_geometrically_and_close_when_empty() {
        let a = Arena::new();
        let r1 = a.alloc(MIN_CHUNK / 2).unwrap();
        let r2 = a.alloc(MIN_CHUNK / 2).unwrap();
        assert_eq!(a.footprint(), (1, MIN_CHUNK), "two halves fill one chunk");
        assert!(Arc::ptr_eq(r1.mem(), r2.mem()));
        let first = Arc::downgrade(r1.mem());
        let r3 = a.alloc(100).unwrap();
        assert_eq!(
            a.footprint(),
            (2, 3 * MIN_CHUNK),
            "the next chunk is twice as large"
        );
        assert_eq!(r3.offset(), 0);
        // Written pages go back to the system when their region goes.
        r3.mem().fill(r3.offset(), 4096, 0xaa).unwrap();
        let big = a.alloc(MAX_CHUNK + 4096).unwrap();
        assert_eq!(
            big.mem().len(),
            MAX_CHUNK + 4096,
            "a huge region: a chunk of its size"
        );
        drop(big);
        assert_eq!(a.footprint().0, 2, "an empty chunk is closed");
        let off = r3.offset();
        let mem = r3.mem().clone();
        drop(r3);
        assert_eq!(a.footprint().0, 1);
        let mut b = [0u8; 8];
        mem.read(off, &mut b).unwrap();
        assert_eq!(b, [0; 8], "a freed range reads as zeros");
        drop(mem);
        let r4 = a.alloc(4096).unwrap();
        assert_eq!(
            a.footprint(),
            (2, 3 * MIN_CHUNK),
            "the first chunk had no room"
        );
        assert!(!Arc::ptr_eq(r4.mem(), r1.mem()));
        let second = Arc::downgrade(r4.mem());
        drop((r1, r2, r4));
        assert_eq!(a.footprint(), (0, 0));
        assert!(
            first.upgrade().is_none() && second.upgrade().is_none(),
            "the chunks (mappings and descriptors) are gone"
        );
    }
}
