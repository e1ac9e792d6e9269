//! The radix index: which carrier (engine, DP rank) holds which KV blocks, in which tiers.
//!
//! Storage. A node is one block position in the prefix trie, named by its chained block key (`keys`):
//! the key identifies the whole path from the root, so the trie is flat: `slot_of` maps a key to its
//! slot in the node arena (`arena.rs`), and a lookup is one probe per block, or none where a chain
//! is walked in the order it was stored (the arena's child hint). A node holds its key, its parent's
//! key (by key, never by slot, so a parent that is dropped and stored again is found again) and its
//! holders: per carrier, the tier bits and the engine hash it announced the block under. A node no
//! carrier holds is dropped at once and its slot reused; its descendants stay (an engine may hold a
//! child whose parent it evicted) but are unreachable until the parent is stored again, which is
//! exactly what the engine can serve. Each carrier keeps `engine hash -> slot` for its own blocks,
//! because removals and parent links arrive as engine hashes, opaque and meaningful per carrier only.
//! Both tables store slots only (the keys and hashes live in the arena): about 60 bytes per block.
//!
//! Run cold, never wrong: a store whose parent this carrier never announced, with another block size,
//! a non-full-attention group or an unknown medium is skipped and counted, never hung off the root.
//!
//! Visibility is the one predicate readers use (`match`, the snapshot export): per carrier the tiers
//! currently visible, 0 while its engine is disconnected, so hiding or re-adopting is one store.

use std::collections::HashMap as StdHashMap;
use std::hash::{BuildHasherDefault, Hasher};

use hashbrown::{HashMap, HashTable};

use crate::arena::{Arena, Holder, NO_SLOT};
use crate::events::{medium_tier, store_skip, Event, Removed, Skip, Stored, ALL_TIERS, DEVICE};
use crate::keys::{namespace_root, vllm_namespace, KeyChain, Tokens};

/// A carrier's id inside one index: small, reused after the carrier is removed.
pub type Cid = u16;

/// splitmix64's finalizer: keys are already hashes, but engine hashes and peers' keys need not be
/// uniform, and hashbrown wants well-mixed high and low bits.
#[derive(Default)]
pub struct Mix(u64);

impl Hasher for Mix {
    fn finish(&self) -> u64 {
        let mut z = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ b as u64;
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = x;
    }
}

pub type U64Map<V> = HashMap<u64, V, BuildHasherDefault<Mix>>;

fn mix(x: u64) -> u64 {
    let mut h = Mix::default();
    h.write_u64(x);
    h.finish()
}

/// Key -> slot. Only the slot is stored (4 bytes an entry): the key lives in the node, so a probe
/// compares against the arena. Halves the table against a map of (key, slot) pairs.
#[derive(Default)]
struct KeyTable(HashTable<u32>);

impl KeyTable {
    fn get(&self, arena: &Arena, key: u64) -> Option<u32> {
        self.0.find(mix(key), |&s| arena.key(s) == key).copied()
    }

    /// `key` must be absent, and its node already in `slot`.
    fn insert(&mut self, arena: &Arena, key: u64, slot: u32) {
        self.0.insert_unique(mix(key), slot, |&s| mix(arena.key(s)));
    }

    /// While the node still names its key.
    fn remove(&mut self, arena: &Arena, key: u64) {
        if let Ok(e) = self.0.find_entry(mix(key), |&s| arena.key(s) == key) {
            e.remove();
        }
    }
}

/// One carrier's engine hash -> slot, storing only the slot: the engine hash lives in the carrier's
/// holder on that node. Every entry names a slot the carrier holds.
#[derive(Default)]
struct EngineHashes(HashTable<u32>);

impl EngineHashes {
    fn get(&self, arena: &Arena, cid: Cid, h: u64) -> Option<u32> {
        self.0.find(mix(h), |&s| arena.ehash_of(s, cid) == Some(h)).copied()
    }

    /// The carrier's holder on `slot` must already carry `h`, and `h` must be absent.
    fn insert(&mut self, arena: &Arena, cid: Cid, h: u64, slot: u32) {
        self.0
            .insert_unique(mix(h), slot, |&s| mix(arena.ehash_of(s, cid).unwrap_or(0)));
    }

    /// Before the holder stops carrying `h`.
    fn remove(&mut self, arena: &Arena, cid: Cid, h: u64) {
        if let Ok(e) = self.0.find_entry(mix(h), |&s| arena.ehash_of(s, cid) == Some(h)) {
            e.remove();
        }
    }

    fn slots(&self) -> impl Iterator<Item = u32> + '_ {
        self.0.iter().copied()
    }

    fn len(&self) -> usize {
        self.0.len()
    }
}

struct CarrierState {
    engine: String,
    rank: u32,
    /// Bumped every time the id is given to a carrier: the export tells incarnations of an id apart.
    generation: u64,
    by_ehash: EngineHashes,
    tier_blocks: [u64; 4],
    visible: u8,
}

/// What applying one batch did; the writer turns it into metrics.
#[derive(Default, Debug)]
pub struct ApplyStats {
    pub stored: u64,
    pub removed: u64,
    pub cleared: u64,
    /// (event type, medium or "", events): a handful of distinct entries per batch.
    pub events: Vec<(&'static str, String, u64)>,
    /// Blocks skipped, by reason (indexed like `Skip::ALL`).
    pub skipped: [u64; Skip::ALL.len()],
}

impl ApplyStats {
    fn skip(&mut self, reason: Skip, blocks: usize) {
        self.skipped[reason as usize] += blocks as u64;
    }

    fn event(&mut self, kind: &'static str, medium: Option<&str>) {
        let medium = medium.unwrap_or("");
        match self.events.iter_mut().find(|(k, m, _)| *k == kind && m == medium) {
            Some(entry) => entry.2 += 1,
            None => self.events.push((kind, medium.to_owned(), 1)),
        }
    }

    /// Blocks skipped for `reason`.
    pub fn skipped(&self, reason: Skip) -> u64 {
        self.skipped[reason as usize]
    }
}

/// A carrier's matched prefix: its length in blocks, and how many of those it holds at best in each
/// tier (device, host, disk, external).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CarrierMatch {
    pub cid: Cid,
    pub blocks: u32,
    pub tier_blocks: [u32; 4],
}

/// One node as the export and the debugging reads see it.
pub struct NodeView<'a> {
    pub key: u64,
    pub parent: Option<u64>,
    slot: u32,
    arena: &'a Arena,
}

impl NodeView<'_> {
    /// (carrier, tier bits, engine hash) of every holder.
    pub fn holders(&self) -> impl Iterator<Item = (Cid, u8, u64)> + '_ {
        self.arena.holders(self.slot).map(|h| (h.cid, h.tiers, h.ehash))
    }
}

pub struct Index {
    block_size: i64,
    full_attention_group: i64,
    slot_of: KeyTable,
    arena: Arena,
    carriers: Vec<Option<CarrierState>>,
    ids: StdHashMap<(String, u32), Cid>,
    generations: u64,
    /// Nodes a graft in progress reserved room for: `maintain` never shrinks the key table below it
    /// (the room would be given back at once, and the graft would grow it again by doublings, each a
    /// stall of the writer).
    reserved: usize,
}

fn best_slot(tiers: u8) -> usize {
    tiers.trailing_zeros() as usize // DEVICE=1 < HOST=2 < DISK=4 < EXTERNAL=8
}

impl Index {
    pub fn new(block_size: i64, full_attention_group: i64) -> Result<Index, crate::Error> {
        if block_size <= 0 {
            return Err(crate::Error::BlockSize);
        }
        Ok(Index {
            block_size,
            full_attention_group,
            slot_of: KeyTable::default(),
            arena: Arena::default(),
            carriers: Vec::new(),
            ids: StdHashMap::new(),
            generations: 0,
            reserved: 0,
        })
    }

    pub fn block_size(&self) -> i64 {
        self.block_size
    }

    pub fn full_attention_group(&self) -> i64 {
        self.full_attention_group
    }

    // ---- carriers ------------------------------------------------------------------------------

    /// The id of carrier (engine, rank), created (empty, every tier visible) if new. The lowest free id
    /// is reused, so ids stay small.
    pub fn carrier(&mut self, engine: &str, rank: u32) -> Result<Cid, crate::Error> {
        if let Some(&cid) = self.ids.get(&(engine.to_owned(), rank)) {
            return Ok(cid);
        }
        let cid = match self.carriers.iter().position(Option::is_none) {
            Some(i) => i,
            None if self.carriers.len() <= Cid::MAX as usize => {
                self.carriers.push(None);
                self.carriers.len() - 1
            }
            None => return Err(crate::Error::TooManyCarriers),
        };
        self.generations += 1;
        self.carriers[cid] = Some(CarrierState {
            engine: engine.to_owned(),
            rank,
            generation: self.generations,
            by_ehash: EngineHashes::default(),
            tier_blocks: [0; 4],
            visible: ALL_TIERS,
        });
        self.ids.insert((engine.to_owned(), rank), cid as Cid);
        Ok(cid as Cid)
    }

    /// (engine, rank, generation) of a live carrier id.
    pub fn carrier_identity(&self, cid: Cid) -> Option<(&str, u32, u64)> {
        self.state(cid).map(|s| (s.engine.as_str(), s.rank, s.generation))
    }

    /// Live carrier ids, ascending.
    pub fn carrier_ids(&self) -> impl Iterator<Item = Cid> + '_ {
        self.carriers
            .iter()
            .enumerate()
            .filter(|(_, s)| s.is_some())
            .map(|(i, _)| i as Cid)
    }

    fn state(&self, cid: Cid) -> Option<&CarrierState> {
        self.carriers.get(cid as usize).and_then(Option::as_ref)
    }

    fn state_mut(&mut self, cid: Cid) -> &mut CarrierState {
        self.carriers[cid as usize].as_mut().expect("a live carrier id")
    }

    pub fn node_count(&self) -> usize {
        self.slot_of.0.len()
    }

    /// Holders over all nodes (each has its entry in its carrier's engine-hash table).
    pub fn holder_count(&self) -> usize {
        self.carriers.iter().flatten().map(|s| s.by_ehash.len()).sum()
    }

    /// Blocks a carrier holds per tier slot (device, host, disk, external).
    pub fn carrier_blocks(&self, cid: Cid) -> [u64; 4] {
        self.state(cid).map_or([0; 4], |s| s.tier_blocks)
    }

    /// The engine hashes a carrier holds, per tier slot: what the index believes the engine holds, in
    /// the engine's own terms.
    pub fn carrier_engine_hashes(&self, cid: Cid) -> [Vec<u64>; 4] {
        let mut out: [Vec<u64>; 4] = Default::default();
        if let Some(st) = self.state(cid) {
            for slot in st.by_ehash.slots() {
                let Some(x) = self.arena.holder(slot, cid) else {
                    continue;
                };
                for (t, hashes) in out.iter_mut().enumerate() {
                    if x.tiers >> t & 1 == 1 {
                        hashes.push(x.ehash);
                    }
                }
            }
        }
        out
    }

    pub fn visible_tiers(&self, cid: Cid) -> u8 {
        self.state(cid).map_or(0, |s| s.visible)
    }

    /// Make exactly `tiers` of this carrier visible to readers (0: invisible).
    pub fn set_visible(&mut self, cid: Cid, tiers: u8) {
        self.state_mut(cid).visible = tiers & ALL_TIERS;
    }

    // ---- mutations (the writer only) ------------------------------------------------------------

    pub fn apply(&mut self, cid: Cid, events: &[Event]) -> ApplyStats {
        let mut stats = ApplyStats::default();
        for ev in events {
            match ev {
                Event::Stored(s) => self.store(cid, s, &mut stats),
                Event::Removed(r) => self.remove(cid, r, &mut stats),
                Event::AllCleared => {
                    stats.event("AllBlocksCleared", None);
                    stats.cleared += self.clear_carrier(cid);
                }
            }
        }
        stats
    }

    fn store(&mut self, cid: Cid, ev: &Stored, stats: &mut ApplyStats) {
        stats.event("BlockStored", ev.medium.as_deref());
        let n = ev.block_hashes.len();
        if let Some(skip) = store_skip(ev, self.block_size, self.full_attention_group) {
            stats.skip(skip, n);
            return;
        }
        let bits = ev.medium.as_deref().map_or(Some(DEVICE), medium_tier).unwrap_or(DEVICE);
        // vLLM's salt rides in its extra keys: read as the namespace, as SGLang sends it (keys.rs).
        let lora = ev.lora_name.as_deref();
        let (salt, extra) = match ev.extra_keys.as_deref() {
            Some(x) if ev.cache_salt.is_none() => match vllm_namespace(x, lora, ev.parent_block_hash.is_none()) {
                Some(salt) => (salt, None),
                None => (None, Some(x)),
            },
            x => (ev.cache_salt.clone(), x),
        };
        let (mut parent, mut parent_slot, seed) = match ev.parent_block_hash {
            None => (None, None, namespace_root(lora, salt.as_deref())),
            // A parent this carrier no longer holds is as unknown as one it never announced (every
            // entry of the engine-hash table is a block the carrier holds).
            Some(ph) => match self.state(cid).and_then(|s| s.by_ehash.get(&self.arena, cid, ph)) {
                Some(slot) => {
                    let key = self.arena.key(slot);
                    (Some(key), Some(slot), key)
                }
                None => {
                    stats.skip(Skip::UnknownParent, n);
                    return;
                }
            },
        };
        let keys = KeyChain::new(&ev.tokens, self.block_size as usize, seed, extra);
        for (&h, key) in ev.block_hashes.iter().zip(keys) {
            let (new, slot) = self.hold(cid, key, parent, parent_slot, bits, h);
            stats.stored += new as u64;
            (parent, parent_slot) = (Some(key), Some(slot));
        }
    }

    fn remove(&mut self, cid: Cid, ev: &Removed, stats: &mut ApplyStats) {
        stats.event("BlockRemoved", ev.medium.as_deref());
        if ev.group_idx.is_some_and(|g| g != self.full_attention_group) {
            stats.skip(Skip::OtherGroup, ev.block_hashes.len());
            return;
        }
        // Untagged or unknown medium: clear every tier (the engine holds it nowhere we know of).
        let tiers = ev.medium.as_deref().and_then(medium_tier).unwrap_or(ALL_TIERS);
        for &h in &ev.block_hashes {
            match self.state(cid).and_then(|s| s.by_ehash.get(&self.arena, cid, h)) {
                Some(slot) => stats.removed += self.release(cid, slot, tiers) as u64,
                None => stats.skip(Skip::UnknownBlock, 1),
            }
        }
    }

    /// Record that `cid` holds `key` (under `parent`; None: a chain's first block, and in
    /// `parent_slot` when the caller knows it) in `bits` tiers as engine hash `ehash`. The one way a
    /// carrier gains a block: events and snapshot grafts both come here. Returns how many tier bits
    /// were new, and the node's slot (NO_SLOT when nothing was held).
    pub fn hold(
        &mut self,
        cid: Cid,
        key: u64,
        parent: Option<u64>,
        parent_slot: Option<u32>,
        bits: u8,
        ehash: u64,
    ) -> (u32, u32) {
        let bits = bits & ALL_TIERS;
        if bits == 0 || self.state(cid).is_none() {
            return (0, NO_SLOT);
        }
        if let Some(old) = self.state(cid).and_then(|s| s.by_ehash.get(&self.arena, cid, ehash)) {
            if self.arena.key(old) != key {
                // The engine reused a hash for other content: the old position is no longer held.
                self.release(cid, old, ALL_TIERS);
            }
        }
        let slot = match self.slot_of.get(&self.arena, key) {
            Some(slot) => slot,
            None => {
                // The caller's parent slot may have been freed just above: a hint only if it still is.
                let ps = parent_slot.filter(|&p| self.arena.is_live(p) && Some(self.arena.key(p)) == parent);
                let slot = self.arena.create(key, parent, ps);
                self.slot_of.insert(&self.arena, key, slot);
                slot
            }
        };
        // The engine-hash table finds its entries through the holder, so an entry leaves while its
        // holder still carries the hash, and arrives once it does.
        let old = self.arena.holder(slot, cid);
        let st = self.carriers[cid as usize].as_mut().expect("a live carrier id");
        if let Some(x) = old.filter(|x| x.ehash != ehash) {
            st.by_ehash.remove(&self.arena, cid, x.ehash); // the same position under a new engine hash
        }
        let had = old.map_or(0, |x| x.tiers);
        self.arena.set(
            slot,
            Holder {
                ehash,
                cid,
                tiers: had | bits,
            },
        );
        if old.map(|x| x.ehash) != Some(ehash) {
            st.by_ehash.insert(&self.arena, cid, ehash, slot);
        }
        let new = bits & !had;
        for t in 0..4 {
            st.tier_blocks[t] += (new >> t & 1) as u64;
        }
        (new.count_ones(), slot)
    }

    /// Clear `tiers` of one carrier on one node; a holder left in no tier is dropped with its engine
    /// hash, and a node left with no holder is dropped. Returns whether any tier was cleared.
    fn release(&mut self, cid: Cid, slot: u32, tiers: u8) -> bool {
        let Some(h) = self.arena.holder(slot, cid) else {
            return false;
        };
        let gone = h.tiers & tiers;
        if gone == 0 {
            return false;
        }
        let left = h.tiers & !gone;
        let st = self.carriers[cid as usize].as_mut().expect("a live carrier id");
        for t in 0..4 {
            st.tier_blocks[t] -= (gone >> t & 1) as u64;
        }
        if left != 0 {
            self.arena.set(slot, Holder { tiers: left, ..h });
            return true;
        }
        st.by_ehash.remove(&self.arena, cid, h.ehash); // while the holder still carries it
        if self.arena.remove(slot, cid) {
            self.drop_node(slot);
        }
        true
    }

    fn drop_node(&mut self, slot: u32) {
        self.slot_of.remove(&self.arena, self.arena.key(slot)); // while the node still names its key
        self.arena.free(slot);
    }

    /// Forget every block of a carrier (AllBlocksCleared, a gap replay could not cover, a restart).
    /// Returns how many blocks it held.
    pub fn clear_carrier(&mut self, cid: Cid) -> u64 {
        let Some(st) = self.carriers.get_mut(cid as usize).and_then(Option::as_mut) else {
            return 0;
        };
        let held = std::mem::take(&mut st.by_ehash);
        st.tier_blocks = [0; 4];
        let mut n = 0;
        for slot in held.0 {
            if self.arena.holder(slot, cid).is_some() {
                n += 1;
                if self.arena.remove(slot, cid) {
                    self.drop_node(slot);
                }
            }
        }
        n
    }

    /// Forget a carrier entirely (its engine left discovery, or restarted as a new incarnation).
    pub fn remove_carrier(&mut self, cid: Cid) -> u64 {
        let n = self.clear_carrier(cid);
        if let Some(st) = self.carriers.get_mut(cid as usize).and_then(Option::take) {
            self.ids.remove(&(st.engine, st.rank));
        }
        n
    }

    /// Forget `tiers` of every block a carrier holds (a device tier that did not survive a restart);
    /// blocks left in no tier are forgotten. O(blocks). Returns the blocks that lost a tier.
    pub fn drop_tiers(&mut self, cid: Cid, tiers: u8) -> u64 {
        let tiers = tiers & ALL_TIERS;
        let Some(st) = self.state(cid) else { return 0 };
        if tiers == 0 {
            return 0;
        }
        if tiers == ALL_TIERS {
            return self.clear_carrier(cid);
        }
        let slots: Vec<u32> = st.by_ehash.slots().collect();
        slots
            .into_iter()
            .map(|slot| self.release(cid, slot, tiers) as u64)
            .sum()
    }

    // ---- reads -----------------------------------------------------------------------------------

    /// Per carrier that holds at least the first block (visibly): its matched prefix. Hashes while
    /// walking, so a prompt that misses early costs one block's hash.
    pub fn match_tokens(&self, tokens: &Tokens, root: u64) -> Vec<CarrierMatch> {
        if self.slot_of.0.is_empty() {
            return Vec::new();
        }
        self.match_keys(KeyChain::new(tokens, self.block_size as usize, root, None))
    }

    /// `match_tokens` for precomputed keys.
    pub fn match_keys(&self, keys: impl IntoIterator<Item = u64>) -> Vec<CarrierMatch> {
        // Carriers still holding the whole prefix walked so far, with their visible tiers (fixed for
        // the walk); when one misses a node it is done.
        let mut alive: smallvec::SmallVec<[(CarrierMatch, u8); 8]> = smallvec::SmallVec::new();
        let mut done = Vec::new();
        let mut slot = NO_SLOT;
        for (depth, key) in keys.into_iter().enumerate() {
            // The child hint first: along a chain stored in walking order it saves the table probe.
            let hint = if slot == NO_SLOT {
                NO_SLOT
            } else {
                self.arena.node(slot).child
            };
            slot = if self.arena.is_live(hint) && self.arena.key(hint) == key {
                hint
            } else {
                match self.slot_of.get(&self.arena, key) {
                    Some(s) => s,
                    None => break,
                }
            };
            let (cid0, tiers0, rest) = self.arena.holders_split(slot);
            if depth == 0 {
                let first = (tiers0 != 0).then_some((cid0, tiers0));
                for (cid, tiers) in first.into_iter().chain(rest.iter().map(|h| (h.cid, h.tiers))) {
                    let visible = self.visible_tiers(cid);
                    if tiers & visible != 0 {
                        let mut m = CarrierMatch {
                            cid,
                            blocks: 1,
                            tier_blocks: [0; 4],
                        };
                        m.tier_blocks[best_slot(tiers & visible)] = 1;
                        alive.push((m, visible));
                    }
                }
            } else {
                let mut i = 0;
                while i < alive.len() {
                    let (m, visible) = &mut alive[i];
                    let tiers = if cid0 == m.cid && tiers0 != 0 {
                        tiers0
                    } else {
                        rest.iter().find(|h| h.cid == m.cid).map_or(0, |h| h.tiers)
                    };
                    if tiers & *visible == 0 {
                        done.push(alive.swap_remove(i).0);
                        continue;
                    }
                    m.blocks += 1;
                    m.tier_blocks[best_slot(tiers & *visible)] += 1;
                    i += 1;
                }
            }
            if alive.is_empty() {
                break;
            }
        }
        done.extend(alive.into_iter().map(|(m, _)| m));
        done.sort_by_key(|m| m.cid);
        done
    }

    pub fn keys_for(&self, tokens: &Tokens, lora_name: Option<&str>, cache_salt: Option<&str>) -> Vec<u64> {
        KeyChain::new(
            tokens,
            self.block_size as usize,
            namespace_root(lora_name, cache_salt),
            None,
        )
        .collect()
    }

    /// The slot of the live node named `key`.
    pub fn slot(&self, key: u64) -> Option<u32> {
        self.slot_of.get(&self.arena, key)
    }

    /// Room for `n` more nodes, so that adding them moves no table (the graft asks before it starts),
    /// kept until `release_reserved`.
    pub fn reserve_nodes(&mut self, n: usize) {
        self.reserved = self.slot_of.0.len() + n;
        let arena = &self.arena;
        self.slot_of.0.reserve(n, |&s| mix(arena.key(s)));
        self.arena.reserve(n);
    }

    /// Room for `n` more blocks of carrier `cid`.
    pub fn reserve_carrier(&mut self, cid: Cid, n: usize) {
        let arena = &self.arena;
        if let Some(st) = self.carriers.get_mut(cid as usize).and_then(Option::as_mut) {
            st.by_ehash.0.reserve(n, |&s| mix(arena.ehash_of(s, cid).unwrap_or(0)));
        }
    }

    /// Slots ever allocated (live or free): the export walks `[0, slot_end())` in slot order.
    pub fn slot_end(&self) -> usize {
        self.arena.len()
    }

    /// The live node in `slot`, if any.
    pub fn node_at(&self, slot: usize) -> Option<NodeView<'_>> {
        let slot = u32::try_from(slot).ok()?;
        if !self.arena.is_live(slot) {
            return None;
        }
        Some(NodeView {
            key: self.arena.key(slot),
            parent: self.arena.parent(slot),
            slot,
            arena: &self.arena,
        })
    }

    pub fn nodes(&self) -> impl Iterator<Item = NodeView<'_>> {
        (0..self.arena.len()).filter_map(|s| self.node_at(s))
    }

    /// Give back memory after a mass removal: the tables only grow on their own. Called by the writer
    /// between batches; a no-op unless the key table is mostly empty (then one rehash, O(live nodes)).
    /// The graft that reserved room is done (or gone): the key table may shrink again.
    pub fn release_reserved(&mut self) {
        self.reserved = 0;
    }

    pub fn maintain(&mut self) {
        let cap = self.slot_of.0.capacity();
        if cap > 1 << 16 && self.slot_of.0.len().max(self.reserved) < cap / 8 {
            let arena = &self.arena;
            self.slot_of.0.shrink_to_fit(|&s| mix(arena.key(s)));
        }
    }

    /// The structure's invariants, checked in full (for tests): every holder is in its carrier's
    /// engine-hash table and back, no holder is held in no tier and no carrier holds a node twice,
    /// the key table names exactly the live nodes, and the per-tier counters agree with a recount.
    pub fn check(&self) -> Result<(), String> {
        let mut counts: StdHashMap<Cid, [u64; 4]> = StdHashMap::new();
        let mut holders: StdHashMap<Cid, usize> = StdHashMap::new();
        let mut live = 0;
        for slot in 0..self.arena.len() as u32 {
            if !self.arena.is_live(slot) {
                continue;
            }
            live += 1;
            if self.slot_of.get(&self.arena, self.arena.key(slot)) != Some(slot) {
                return Err(format!("slot {slot} is not the key table's entry for its key"));
            }
            let mut seen = Vec::new();
            for h in self.arena.holders(slot) {
                let st = self
                    .state(h.cid)
                    .ok_or(format!("slot {slot} held by dead carrier {}", h.cid))?;
                if h.tiers == 0 || h.tiers & !ALL_TIERS != 0 || seen.contains(&h.cid) {
                    return Err(format!(
                        "slot {slot}: carrier {} holds it wrongly ({:#x})",
                        h.cid, h.tiers
                    ));
                }
                seen.push(h.cid);
                if st.by_ehash.get(&self.arena, h.cid, h.ehash) != Some(slot) {
                    return Err(format!(
                        "slot {slot}: carrier {}'s engine hash does not map back",
                        h.cid
                    ));
                }
                let c = counts.entry(h.cid).or_default();
                (0..4).for_each(|t| c[t] += (h.tiers >> t & 1) as u64);
                *holders.entry(h.cid).or_default() += 1;
            }
        }
        if live != self.slot_of.0.len() {
            return Err(format!("{} keys for {live} live nodes", self.slot_of.0.len()));
        }
        for cid in self.carrier_ids() {
            let st = self.state(cid).expect("live");
            if holders.get(&cid).copied().unwrap_or(0) != st.by_ehash.len() {
                return Err(format!("carrier {cid}: engine hashes and holders differ in number"));
            }
            if counts.get(&cid).copied().unwrap_or_default() != st.tier_blocks {
                return Err(format!("carrier {cid}: tier counters disagree with a recount"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::plain_root;

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[i64]) -> Event {
        Event::Stored(Stored::plain(hashes, parent, tokens, 2))
    }

    #[test]
    fn maintenance_keeps_the_room_a_graft_reserved_until_it_is_released() {
        let mut ix = Index::new(2, 0).unwrap();
        ix.reserve_nodes(1 << 20);
        let cap = ix.slot_of.0.capacity();
        ix.maintain();
        assert_eq!(ix.slot_of.0.capacity(), cap, "a reservation in use is not shrunk away");
        ix.release_reserved();
        ix.maintain();
        assert!(ix.slot_of.0.capacity() < cap);
    }

    fn removed(hashes: &[u64], medium: Option<&str>) -> Event {
        Event::Removed(Removed {
            block_hashes: hashes.to_vec(),
            medium: medium.map(crate::events::medium),
            group_idx: None,
        })
    }

    fn toks(ids: &[i64]) -> Tokens {
        Tokens::from_i64(ids)
    }

    #[test]
    fn store_match_remove() {
        let mut ix = Index::new(2, 0).unwrap();
        let a = ix.carrier("a", 0).unwrap();
        ix.apply(a, &[stored(&[10, 11], None, &[1, 2, 3, 4])]);
        assert_eq!(ix.node_count(), 2);
        let m = ix.match_tokens(&toks(&[1, 2, 3, 4, 5]), plain_root());
        assert_eq!(
            m,
            vec![CarrierMatch {
                cid: a,
                blocks: 2,
                tier_blocks: [2, 0, 0, 0]
            }]
        );
        let stats = ix.apply(a, &[removed(&[11, 99], None)]);
        assert_eq!((stats.removed, stats.skipped(Skip::UnknownBlock)), (1, 1));
        assert_eq!(ix.match_tokens(&toks(&[1, 2, 3, 4]), plain_root())[0].blocks, 1);
    }

    #[test]
    fn unknown_parent_is_skipped_not_rooted() {
        let mut ix = Index::new(2, 0).unwrap();
        let a = ix.carrier("a", 0).unwrap();
        let stats = ix.apply(a, &[stored(&[11], Some(10), &[3, 4])]);
        assert_eq!(stats.skipped(Skip::UnknownParent), 1);
        assert_eq!(ix.node_count(), 0);
    }

    #[test]
    fn child_survives_its_parent_but_is_unreachable() {
        let mut ix = Index::new(2, 0).unwrap();
        let a = ix.carrier("a", 0).unwrap();
        ix.apply(a, &[stored(&[10, 11], None, &[1, 2, 3, 4]), removed(&[10], None)]);
        assert_eq!(ix.node_count(), 1);
        assert!(ix.match_tokens(&toks(&[1, 2, 3, 4]), plain_root()).is_empty());
        ix.apply(a, &[stored(&[10], None, &[1, 2])]);
        assert_eq!(ix.match_tokens(&toks(&[1, 2, 3, 4]), plain_root())[0].blocks, 2);
    }

    #[test]
    fn tiers_and_visibility() {
        let mut ix = Index::new(2, 0).unwrap();
        let a = ix.carrier("a", 0).unwrap();
        let b = ix.carrier("b", 1).unwrap();
        ix.apply(a, &[stored(&[10, 11], None, &[1, 2, 3, 4])]);
        ix.apply(b, &[stored(&[20], None, &[1, 2])]);
        let mut disk = stored(&[21], Some(20), &[3, 4]);
        if let Event::Stored(s) = &mut disk {
            s.medium = Some(crate::events::medium("DISK"));
        }
        ix.apply(b, &[disk]);
        let m = ix.match_tokens(&toks(&[1, 2, 3, 4]), plain_root());
        assert_eq!(
            m[1],
            CarrierMatch {
                cid: b,
                blocks: 2,
                tier_blocks: [1, 0, 1, 0]
            }
        );
        ix.set_visible(a, 0);
        assert_eq!(ix.match_tokens(&toks(&[1, 2, 3, 4]), plain_root()).len(), 1);
        assert_eq!(ix.drop_tiers(b, DEVICE), 1);
        assert_eq!(ix.carrier_blocks(b), [0, 0, 1, 0]);
        assert_eq!(ix.node_count(), 2, "b shares both of a's nodes");
    }

    #[test]
    fn reused_engine_hash_moves_the_block() {
        let mut ix = Index::new(2, 0).unwrap();
        let a = ix.carrier("a", 0).unwrap();
        ix.apply(a, &[stored(&[10], None, &[1, 2])]);
        ix.apply(a, &[stored(&[10], None, &[7, 8])]);
        assert_eq!(ix.node_count(), 1);
        assert!(ix.match_tokens(&toks(&[1, 2]), plain_root()).is_empty());
        assert_eq!(ix.carrier_blocks(a), [1, 0, 0, 0]);
    }

    #[test]
    fn removed_carrier_id_is_reused_with_a_new_generation() {
        let mut ix = Index::new(2, 0).unwrap();
        let a = ix.carrier("a", 0).unwrap();
        let gen = ix.carrier_identity(a).unwrap().2;
        ix.apply(a, &[stored(&[10], None, &[1, 2])]);
        assert_eq!(ix.remove_carrier(a), 1);
        assert_eq!(ix.node_count(), 0);
        let b = ix.carrier("b", 0).unwrap();
        assert_eq!(b, a);
        assert!(ix.carrier_identity(b).unwrap().2 > gen);
    }
}
