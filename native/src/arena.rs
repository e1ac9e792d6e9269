//! The node arena: one 32-byte record per trie node, addressed by slot, with the first holder inline.
//!
//! Most nodes are held by one carrier, so the first holder (carrier id, tier bits, engine hash) lives
//! in the node itself; a prefix several carriers share keeps the others in `spill`. A slot whose
//! first holder has no tier bits is free. Each node also remembers the slot of the child created last
//! under it: a chain is stored in the order it is walked, so a match follows that hint and touches
//! the key table only at a branch (the hint is checked against the key, so a stale one costs a probe,
//! never a wrong answer).

use std::hash::BuildHasherDefault;

use hashbrown::HashMap;

use crate::index::{Cid, Mix};

pub const NO_SLOT: u32 = u32::MAX;
const ROOT: u8 = 1; // the node is a chain's first block: `parent` means nothing
const SPILLED: u8 = 2; // more holders in `spill`

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Holder {
    pub ehash: u64,
    pub cid: Cid,
    pub tiers: u8,
}

pub struct Node {
    pub key: u64,
    parent: u64,
    ehash: u64,
    cid: Cid,
    tiers: u8,
    flags: u8,
    /// The child created last under this node, or NO_SLOT: a hint for the walk.
    pub child: u32,
}

const _: () = assert!(std::mem::size_of::<Node>() == 32);

#[derive(Default)]
pub struct Arena {
    nodes: Vec<Node>,
    /// Holders beyond the first, by slot: one more fits in the entry itself (measured: 52 MiB per
    /// million held blocks, against 56 with a heap list for every shared node and 56 with two inline).
    spill: HashMap<u32, smallvec::SmallVec<[Holder; 1]>, BuildHasherDefault<Mix>>,
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

    pub fn holders(&self, slot: u32) -> impl Iterator<Item = Holder> + '_ {
        let n = &self.nodes[slot as usize];
        let first = (n.tiers != 0).then_some(Holder {
            ehash: n.ehash,
            cid: n.cid,
            tiers: n.tiers,
        });
        let rest = if n.flags & SPILLED != 0 {
            self.spill.get(&slot).map(|v| v.as_slice())
        } else {
            None
        };
        first.into_iter().chain(rest.unwrap_or(&[]).iter().copied())
    }

    /// The inline holder's carrier and tiers (tiers 0: none), and the spilled holders: what a walk
    /// reads per node, with at most one probe of the spill table.
    #[inline]
    pub fn holders_split(&self, slot: u32) -> (Cid, u8, &[Holder]) {
        let n = &self.nodes[slot as usize];
        let rest = if n.flags & SPILLED != 0 {
            self.spill.get(&slot).map_or(&[][..], |v| v.as_slice())
        } else {
            &[]
        };
        (n.cid, n.tiers, rest)
    }

    pub fn holder(&self, slot: u32, cid: Cid) -> Option<Holder> {
        let n = self.nodes.get(slot as usize)?;
        if n.tiers != 0 && n.cid == cid {
            return Some(Holder {
                ehash: n.ehash,
                cid,
                tiers: n.tiers,
            });
        }
        if n.flags & SPILLED == 0 {
            return None;
        }
        self.spill.get(&slot)?.iter().find(|h| h.cid == cid).copied()
    }

    pub fn ehash_of(&self, slot: u32, cid: Cid) -> Option<u64> {
        self.holder(slot, cid).map(|h| h.ehash)
    }

    /// Set `cid`'s holder on `slot` to `tiers` (non-zero) and `ehash`, adding it if absent.
    pub fn set(&mut self, slot: u32, h: Holder) {
        debug_assert!(h.tiers != 0);
        let n = &mut self.nodes[slot as usize];
        if n.tiers == 0 || n.cid == h.cid {
            (n.ehash, n.cid, n.tiers) = (h.ehash, h.cid, h.tiers);
            return;
        }
        let rest = self.spill.entry(slot).or_default();
        match rest.iter_mut().find(|x| x.cid == h.cid) {
            Some(x) => *x = h,
            None => {
                rest.reserve_exact(1); // few holders per shared node: no doubling
                rest.push(h);
            }
        }
        n.flags |= SPILLED;
    }

    /// Drop `cid`'s holder from `slot`; returns whether the node is left with none.
    pub fn remove(&mut self, slot: u32, cid: Cid) -> bool {
        let n = &mut self.nodes[slot as usize];
        let spilled = n.flags & SPILLED != 0;
        if n.tiers != 0 && n.cid == cid {
            n.tiers = 0;
            if !spilled {
                return true;
            }
            // Promote a spilled holder into the inline place.
            let rest = self.spill.get_mut(&slot).expect("spilled");
            let h = rest.pop().expect("a spilled holder");
            (n.ehash, n.cid, n.tiers) = (h.ehash, h.cid, h.tiers);
            if rest.is_empty() {
                self.spill.remove(&slot);
                n.flags &= !SPILLED;
            }
            return false;
        }
        if spilled {
            let rest = self.spill.get_mut(&slot).expect("spilled");
            if let Some(i) = rest.iter().position(|x| x.cid == cid) {
                rest.swap_remove(i);
            }
            if rest.is_empty() {
                self.spill.remove(&slot);
                n.flags &= !SPILLED;
            }
        }
        false
    }
}
