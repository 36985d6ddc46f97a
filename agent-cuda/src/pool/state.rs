//! The pool's bookkeeping under its lock: blocks in segments, per-stream
//! free lists, and the counters. No device calls happen here; the pool
//! calls the device before or after taking the lock.

use std::collections::BTreeSet;
use std::panic::Location;

use super::counters::Counters;
use super::sizes::{is_small, should_split};
use super::StreamId;
use crate::tag::Tag;

/// "No block" in the prev/next links.
pub const NIL: u32 = u32::MAX;

pub type Site = &'static Location<'static>;

#[derive(Debug)]
pub struct Block {
    pub addr: u64,
    pub size: u64,
    /// What the caller asked for (0 while free).
    pub requested: u64,
    pub prev: u32,
    pub next: u32,
    pub segment: u32,
    pub allocated: bool,
    pub tag: Option<Tag>,
    pub site: Option<Site>,
}

#[derive(Debug)]
pub struct Segment {
    pub addr: u64,
    pub size: u64,
    pub stream: StreamId,
    pub small: bool,
    /// The block at the segment's start; merging never removes it.
    pub head: u32,
}

/// A vector with reusable slots, so block ids stay small and stable.
#[derive(Debug)]
pub struct Slab<T> {
    items: Vec<Option<T>>,
    vacant: Vec<u32>,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab {
            items: Vec::new(),
            vacant: Vec::new(),
        }
    }
}

impl<T> Slab<T> {
    pub fn insert(&mut self, item: T) -> u32 {
        match self.vacant.pop() {
            Some(i) => {
                self.items[i as usize] = Some(item);
                i
            }
            None => {
                self.items.push(Some(item));
                (self.items.len() - 1) as u32
            }
        }
    }
    pub fn remove(&mut self, i: u32) -> Option<T> {
        let item = self.items.get_mut(i as usize)?.take();
        if item.is_some() {
            self.vacant.push(i);
        }
        item
    }
    pub fn get(&self, i: u32) -> Option<&T> {
        self.items.get(i as usize)?.as_ref()
    }
    #[inline]
    pub fn at(&self, i: u32) -> &T {
        self.items[i as usize].as_ref().expect("live slab slot")
    }
    #[inline]
    pub fn at_mut(&mut self, i: u32) -> &mut T {
        self.items[i as usize].as_mut().expect("live slab slot")
    }
    pub fn iter(&self) -> impl Iterator<Item = (u32, &T)> {
        self.items
            .iter()
            .enumerate()
            .filter_map(|(i, t)| t.as_ref().map(|t| (i as u32, t)))
    }
}

/// Free blocks of one stream, best fit first: (size, addr, block id).
type FreeSet = BTreeSet<(u64, u64, u32)>;

#[derive(Default, Debug)]
pub struct State {
    pub blocks: Slab<Block>,
    pub segments: Slab<Segment>,
    /// Per stream: [small pool, large pool]. Few streams, so a short list.
    free: Vec<(StreamId, [FreeSet; 2])>,
    pub counters: Counters,
}

/// What to record about a new allocation (nothing in the untracked pool).
pub struct Owner {
    pub tag: Option<Tag>,
    pub site: Option<Site>,
}

impl State {
    fn free_set(&mut self, stream: StreamId, small: bool) -> &mut FreeSet {
        let i = match self.free.iter().position(|(s, _)| *s == stream) {
            Some(i) => i,
            None => {
                self.free.push((stream, Default::default()));
                self.free.len() - 1
            }
        };
        &mut self.free[i].1[usize::from(!small)]
    }

    fn stream_of(&self, block: u32) -> (StreamId, bool) {
        let seg = self.segments.at(self.blocks.at(block).segment);
        (seg.stream, seg.small)
    }

    fn list_insert(&mut self, id: u32) {
        let (stream, small) = self.stream_of(id);
        let b = self.blocks.at(id);
        let key = (b.size, b.addr, id);
        self.free_set(stream, small).insert(key);
    }

    fn list_remove(&mut self, id: u32) {
        let (stream, small) = self.stream_of(id);
        let b = self.blocks.at(id);
        let key = (b.size, b.addr, id);
        self.free_set(stream, small).remove(&key);
    }

    /// A free block that is part of a split segment counts as inactive_split.
    fn split_contribution(&self, id: u32) -> Option<(bool, u64)> {
        let b = self.blocks.at(id);
        let split = !b.allocated && (b.prev != NIL || b.next != NIL);
        split.then(|| (self.segments.at(b.segment).small, b.size))
    }

    fn count_inactive_split(&mut self, id: u32, sign: i64, track: bool) {
        if !track {
            return;
        }
        if let Some((small, size)) = self.split_contribution(id) {
            self.counters.inactive_split.add(small, sign);
            self.counters
                .inactive_split_bytes
                .add(small, sign * size as i64);
        }
    }

    /// The best-fitting cached block of `size` on `stream`, taken out of
    /// its free list.
    pub fn take_cached(&mut self, stream: StreamId, size: u64, track: bool) -> Option<u32> {
        let small = is_small(size);
        let set = self.free_set(stream, small);
        let key = *set.range((size, 0, 0)..).next()?;
        set.remove(&key);
        self.count_inactive_split(key.2, -1, track);
        Some(key.2)
    }

    /// Records a segment fresh from the device; returns its only block
    /// (not yet in any free list).
    pub fn add_segment(&mut self, addr: u64, size: u64, stream: StreamId, track: bool) -> u32 {
        let small = is_small_segment(size);
        let seg = self.segments.insert(Segment {
            addr,
            size,
            stream,
            small,
            head: NIL,
        });
        let block = self.blocks.insert(Block {
            addr,
            size,
            requested: 0,
            prev: NIL,
            next: NIL,
            segment: seg,
            allocated: false,
            tag: None,
            site: None,
        });
        self.segments.at_mut(seg).head = block;
        if track {
            self.counters.segment.add(small, 1);
            self.counters.reserved_bytes.add(small, size as i64);
        }
        self.counters.num_device_alloc += 1;
        block
    }

    /// Marks free block `id` (out of the free lists) allocated for a
    /// request of `requested` bytes rounded to `size`, splitting off the
    /// rest where PyTorch would. Returns the block's address.
    pub fn allocate(
        &mut self,
        id: u32,
        size: u64,
        requested: u64,
        owner: Owner,
        track: bool,
    ) -> u64 {
        let small = self.segments.at(self.blocks.at(id).segment).small;
        let (addr, bsize, next, segment) = {
            let b = self.blocks.at(id);
            (b.addr, b.size, b.next, b.segment)
        };
        if should_split(small, bsize, size) {
            let rest = self.blocks.insert(Block {
                addr: addr + size,
                size: bsize - size,
                requested: 0,
                prev: id,
                next,
                segment,
                allocated: false,
                tag: None,
                site: None,
            });
            if next != NIL {
                self.blocks.at_mut(next).prev = rest;
            }
            let b = self.blocks.at_mut(id);
            b.next = rest;
            b.size = size;
            self.list_insert(rest);
            self.count_inactive_split(rest, 1, track);
        }
        let b = self.blocks.at_mut(id);
        b.allocated = true;
        b.requested = requested;
        b.tag = owner.tag;
        b.site = owner.site;
        let size = b.size as i64;
        if track {
            let c = &mut self.counters;
            c.allocation.add(small, 1);
            c.active.add(small, 1);
            c.allocated_bytes.add(small, size);
            c.active_bytes.add(small, size);
            c.requested_bytes.add(small, requested as i64);
        }
        addr
    }

    /// Returns allocated block `id` to its stream's free list, merged with
    /// free neighbours.
    pub fn release(&mut self, id: u32, track: bool) {
        let (small, size, requested) = {
            let small = self.segments.at(self.blocks.at(id).segment).small;
            let b = self.blocks.at_mut(id);
            debug_assert!(b.allocated, "double free of block {id}");
            b.allocated = false;
            b.tag = None;
            b.site = None;
            (
                small,
                b.size as i64,
                std::mem::take(&mut b.requested) as i64,
            )
        };
        if track {
            let c = &mut self.counters;
            c.allocation.add(small, -1);
            c.active.add(small, -1);
            c.allocated_bytes.add(small, -size);
            c.active_bytes.add(small, -size);
            c.requested_bytes.add(small, -requested);
        }
        let mut id = id;
        let prev = self.blocks.at(id).prev;
        if prev != NIL && !self.blocks.at(prev).allocated {
            self.list_remove(prev);
            self.count_inactive_split(prev, -1, track);
            self.absorb_next(prev);
            id = prev;
        }
        let next = self.blocks.at(id).next;
        if next != NIL && !self.blocks.at(next).allocated {
            self.list_remove(next);
            self.count_inactive_split(next, -1, track);
            self.absorb_next(id);
        }
        self.count_inactive_split(id, 1, track);
        self.list_insert(id);
    }

    /// Block `id` swallows its next block; neither may be in a free list.
    fn absorb_next(&mut self, id: u32) {
        let next = self.blocks.at(id).next;
        let gone = self.blocks.remove(next).expect("next block exists");
        if gone.next != NIL {
            self.blocks.at_mut(gone.next).prev = id;
        }
        let b = self.blocks.at_mut(id);
        b.size += gone.size;
        b.next = gone.next;
    }

    /// Takes every segment that is entirely free out of the pool and
    /// returns `(addr, size)` for the caller to give back to the device.
    pub fn drain_free_segments(&mut self, track: bool) -> Vec<(u64, u64)> {
        let whole: Vec<u32> = self
            .free
            .iter()
            .flat_map(|(_, sets)| sets.iter().flatten())
            .map(|k| k.2)
            .filter(|id| {
                let b = self.blocks.at(*id);
                b.prev == NIL && b.next == NIL
            })
            .collect();
        let mut out = Vec::with_capacity(whole.len());
        for id in whole {
            self.list_remove(id);
            let b = self.blocks.remove(id).expect("free block");
            let seg = self.segments.remove(b.segment).expect("segment");
            if track {
                self.counters.segment.add(seg.small, -1);
                self.counters
                    .reserved_bytes
                    .add(seg.small, -(seg.size as i64));
            }
            out.push((seg.addr, seg.size));
        }
        out
    }

    /// The largest cached free block, on any stream.
    pub fn largest_free_block(&self) -> u64 {
        self.free
            .iter()
            .flat_map(|(_, sets)| sets.iter())
            .filter_map(|s| s.last().map(|k| k.0))
            .max()
            .unwrap_or(0)
    }

    /// The blocks of one segment, in address order.
    pub fn segment_blocks(&self, seg: u32) -> impl Iterator<Item = (u32, &Block)> {
        let mut next = self.segments.at(seg).head;
        std::iter::from_fn(move || {
            if next == NIL {
                return None;
            }
            let id = next;
            let b = self.blocks.at(id);
            next = b.next;
            Some((id, b))
        })
    }

    /// Ids of all free-listed blocks (for the invariant check).
    pub fn free_listed(&self) -> Vec<(StreamId, bool, u64, u64, u32)> {
        self.free
            .iter()
            .flat_map(|(stream, sets)| {
                sets.iter()
                    .enumerate()
                    .flat_map(move |(i, s)| s.iter().map(move |k| (*stream, i == 0, k.0, k.1, k.2)))
            })
            .collect()
    }
}

/// Small-pool segments are exactly [`super::sizes::SMALL_BUFFER`].
fn is_small_segment(size: u64) -> bool {
    size == super::sizes::SMALL_BUFFER
}
