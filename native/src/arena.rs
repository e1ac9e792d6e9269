//! The node arena: one 32-byte record per trie node, addressed by slot, with the first holder inline.
//!
//! Most nodes are held by one carrier, so the first holder (carrier id, tier bits, engine hash) lives
//! in the node itself. A prefix several carriers share keeps all its holders in a block of `pool`
//! (capacity 2, 4, 8, ... holders, recycled per size), which the node's engine-hash field points to:
//! a walk reads a shared node's holders from one place, with no table probe. The node keeps a copy of
//! the block's first carrier and tiers, so a node's liveness and first holder are read from the node.
//! A slot whose first holder has no tier bits is free. Each node also remembers the slot of the child
//! created last under it: a chain is stored in the order it is walked, so a match follows that hint
//! and touches the key table only at a branch (the hint is checked against the key, so a stale one
//! costs a probe, never a wrong answer).

use crate::index::Cid;

pub const NO_SLOT: u32 = u32::MAX;
const ROOT: u8 = 1; // the node is a chain's first block: `parent` means nothing
const SPILLED: u8 = 2; // the holders are in a pool block (`Block`), the node's `ehash` says where

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Holder {
    pub ehash: u64,
    pub cid: Cid,
    pub tiers: u8,
}

const NO_HOLDER: Holder = Holder {
    ehash: 0,
    cid: 0,
    tiers: 0,
};

pub struct Node {
    pub key: u64,
    parent: u64,
    /// The inline holder's engine hash; a spilled node's `Block`, packed.
    ehash: u64,
    cid: Cid,
    tiers: u8,
    flags: u8,
    /// The child created last under this node, or NO_SLOT: a hint for the walk.
    pub child: u32,
}

const _: () = assert!(std::mem::size_of::<Node>() == 32);

/// Where a spilled node's holders are: `len` of them from `start` in the pool, in a block of
/// `2 << class`.
#[derive(Clone, Copy)]
struct Block {
    start: u32,
    len: u32, // < 2**24
    class: u8,
}

impl Block {
    fn pack(self) -> u64 {
        self.start as u64 | (self.len as u64) << 32 | (self.class as u64) << 56
    }

    fn unpack(v: u64) -> Block {
        Block {
            start: v as u32,
            len: ((v >> 32) & 0xff_ffff) as u32,
            class: (v >> 56) as u8,
        }
    }

    fn cap(self) -> u32 {
        2 << self.class
    }

    fn range(self) -> std::ops::Range<usize> {
        self.start as usize..(self.start + self.len) as usize
    }
}

/// The holder blocks of shared nodes, with a free list per size.
#[derive(Default)]
struct Pool {
    holders: Vec<Holder>,
    free: Vec<Vec<u32>>,
}

impl Pool {
    fn alloc(&mut self, class: u8) -> u32 {
        if let Some(start) = self.free.get_mut(class as usize).and_then(Vec::pop) {
            return start;
        }
        let start = self.holders.len();
        self.holders.resize(start + (2usize << class), NO_HOLDER);
        start as u32
    }

    fn release(&mut self, b: Block) {
        let class = b.class as usize;
        if self.free.len() <= class {
            self.free.resize_with(class + 1, Vec::new);
        }
        self.free[class].push(b.start);
    }
}

#[derive(Default)]
pub struct Arena {
    nodes: Vec<Node>,
    pool: Pool,
    free: Vec<u32>,
}

impl Arena {
    /// Slots ever allocated, live or free.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Room for `n` more nodes without moving the arena.
    pub fn reserve(&mut self, n: usize) {
        self.nodes.reserve(n.saturating_sub(self.free.len()));
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    pub fn node(&self, slot: u32) -> &Node {
        &self.nodes[slot as usize]
    }

    pub fn is_live(&self, slot: u32) -> bool {
        self.nodes.get(slot as usize).is_some_and(|n| n.tiers != 0)
    }

    pub fn key(&self, slot: u32) -> u64 {
        self.nodes[slot as usize].key
    }

    pub fn parent(&self, slot: u32) -> Option<u64> {
        let n = &self.nodes[slot as usize];
        (n.flags & ROOT == 0).then_some(n.parent)
    }

    /// A new slot for `key` under `parent` (None: a root), with no holder yet; the parent's slot, when
    /// known, gets the new slot as its child hint.
    pub fn create(&mut self, key: u64, parent: Option<u64>, parent_slot: Option<u32>) -> u32 {
        let node = Node {
            key,
            parent: parent.unwrap_or(0),
            ehash: 0,
            cid: 0,
            tiers: 0,
            flags: if parent.is_none() { ROOT } else { 0 },
            child: NO_SLOT,
        };
        let slot = match self.free.pop() {
            Some(slot) => {
                self.nodes[slot as usize] = node;
                slot
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        if let Some(p) = parent_slot {
            self.nodes[p as usize].child = slot;
        }
        slot
    }

    /// Give a slot with no holder left back to the free list.
    pub fn free(&mut self, slot: u32) {
        let n = &mut self.nodes[slot as usize];
        debug_assert!(n.tiers == 0 && n.flags & SPILLED == 0);
        n.child = NO_SLOT;
        self.free.push(slot);
    }

    /// A spilled node's holders.
    fn block(&self, n: &Node) -> &[Holder] {
        &self.pool.holders[Block::unpack(n.ehash).range()]
    }

    pub fn holders(&self, slot: u32) -> impl Iterator<Item = Holder> + '_ {
        let n = &self.nodes[slot as usize];
        let (inline, block) = if n.flags & SPILLED != 0 {
            (None, self.block(n))
        } else {
            let first = (n.tiers != 0).then_some(Holder {
                ehash: n.ehash,
                cid: n.cid,
                tiers: n.tiers,
            });
            (first, &[][..])
        };
        inline.into_iter().chain(block.iter().copied())
    }

    /// The first holder's carrier and tiers (tiers 0: none), from the node, and the other holders:
    /// what a walk reads per node, from the node and at most one pool block.
    #[inline]
    pub fn holders_split(&self, slot: u32) -> (Cid, u8, &[Holder]) {
        let n = &self.nodes[slot as usize];
        let rest = if n.flags & SPILLED != 0 {
            &self.block(n)[1..]
        } else {
            &[]
        };
        (n.cid, n.tiers, rest)
    }

    pub fn holder(&self, slot: u32, cid: Cid) -> Option<Holder> {
        let n = self.nodes.get(slot as usize)?;
        if n.flags & SPILLED != 0 {
            return self.block(n).iter().find(|h| h.cid == cid).copied();
        }
        (n.tiers != 0 && n.cid == cid).then_some(Holder {
            ehash: n.ehash,
            cid,
            tiers: n.tiers,
        })
    }

    pub fn ehash_of(&self, slot: u32, cid: Cid) -> Option<u64> {
        self.holder(slot, cid).map(|h| h.ehash)
    }

    /// Set `cid`'s holder on `slot` to `tiers` (non-zero) and `ehash`, adding it if absent.
    pub fn set(&mut self, slot: u32, h: Holder) {
        debug_assert!(h.tiers != 0);
        let Arena { nodes, pool, .. } = self;
        let n = &mut nodes[slot as usize];
        if n.flags & SPILLED == 0 {
            if n.tiers == 0 || n.cid == h.cid {
                (n.ehash, n.cid, n.tiers) = (h.ehash, h.cid, h.tiers);
                return;
            }
            // A second carrier: both go to a block of two, the inline one first.
            let start = pool.alloc(0);
            let inline = Holder {
                ehash: n.ehash,
                cid: n.cid,
                tiers: n.tiers,
            };
            pool.holders[start as usize..start as usize + 2].copy_from_slice(&[inline, h]);
            n.ehash = Block {
                start,
                len: 2,
                class: 0,
            }
            .pack();
            n.flags |= SPILLED;
            return;
        }
        let mut b = Block::unpack(n.ehash);
        if let Some(i) = pool.holders[b.range()].iter().position(|x| x.cid == h.cid) {
            pool.holders[b.start as usize + i] = h;
            if i == 0 {
                n.tiers = h.tiers;
            }
            return;
        }
        if b.len == b.cap() {
            let bigger = Block {
                start: pool.alloc(b.class + 1),
                len: b.len,
                class: b.class + 1,
            };
            pool.holders.copy_within(b.range(), bigger.start as usize);
            pool.release(b);
            b = bigger;
        }
        pool.holders[(b.start + b.len) as usize] = h;
        b.len += 1;
        n.ehash = b.pack();
    }

    /// Drop `cid`'s holder from `slot`; returns whether the node is left with none.
    pub fn remove(&mut self, slot: u32, cid: Cid) -> bool {
        let Arena { nodes, pool, .. } = self;
        let n = &mut nodes[slot as usize];
        if n.flags & SPILLED == 0 {
            if n.tiers != 0 && n.cid == cid {
                n.tiers = 0;
                return true;
            }
            return false;
        }
        let mut b = Block::unpack(n.ehash);
        let Some(i) = pool.holders[b.range()].iter().position(|x| x.cid == cid) else {
            return false;
        };
        pool.holders.swap(b.start as usize + i, (b.start + b.len - 1) as usize);
        b.len -= 1;
        let first = pool.holders[b.start as usize];
        if b.len == 1 {
            // One holder left: back inline, the block recycled.
            pool.release(b);
            (n.ehash, n.cid, n.tiers) = (first.ehash, first.cid, first.tiers);
            n.flags &= !SPILLED;
        } else {
            n.ehash = b.pack();
            (n.cid, n.tiers) = (first.cid, first.tiers);
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// Holders set and dropped at random by up to 40 carriers on a few nodes, against a map: every
    /// size class grows and shrinks, blocks are recycled, and the node's copy of its first holder
    /// always agrees with its block.
    #[test]
    fn shared_nodes_hold_what_a_map_holds() {
        let mut arena = Arena::default();
        let slots: Vec<u32> = (0..4).map(|k| arena.create(k, None, None)).collect();
        let mut model: Vec<BTreeMap<Cid, Holder>> = vec![BTreeMap::new(); slots.len()];
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for step in 0..200_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let i = (x % slots.len() as u64) as usize;
            let cid = ((x >> 8) % 40) as Cid;
            // Phases: mostly adding, then mostly removing, so nodes fill past 16 and drain to none.
            let adding = (x >> 20) % 100 < if (step / 20_000) % 2 == 0 { 70 } else { 30 };
            if adding {
                let h = Holder {
                    ehash: x,
                    cid,
                    tiers: 1 + ((x >> 40) % 15) as u8,
                };
                arena.set(slots[i], h);
                model[i].insert(cid, h);
            } else {
                let had = model[i].remove(&cid).is_some();
                let empty = arena.remove(slots[i], cid);
                assert_eq!(empty, had && model[i].is_empty(), "step {step}");
                if model[i].is_empty() {
                    assert!(!arena.is_live(slots[i]));
                }
            }
            let got: BTreeMap<Cid, Holder> = arena.holders(slots[i]).map(|h| (h.cid, h)).collect();
            assert_eq!(got, model[i], "step {step}");
            let (cid0, tiers0, rest) = arena.holders_split(slots[i]);
            assert_eq!(rest.len() + (tiers0 != 0) as usize, model[i].len());
            if tiers0 != 0 {
                assert_eq!(model[i][&cid0].tiers, tiers0);
            }
            for (c, h) in &model[i] {
                assert_eq!(arena.holder(slots[i], *c), Some(*h));
            }
        }
        // Blocks are recycled: the pool never grew past what the fullest moment needed, by size.
        assert!(
            arena.pool.holders.len() <= slots.len() * 2 * 64,
            "{}",
            arena.pool.holders.len()
        );
    }
}
