//! Export the index as flat columns, and graft such columns back, a chunk at a time.
//!
//! The export is a list of node records where every parent precedes its children and is referenced by
//! record index (never by hash): `parent[i] < i`, -1 for a chain's first block. A record with no
//! carriers is structure only (the parent of records that have some, or a placeholder naming a block
//! nobody holds now). Each carrier entry has its tier bits and its engine hash: future removals and
//! parent links arrive as engine hashes, so a graft without them could never be corrected.
//!
//! Both walks stop every `budget` records so the writer can apply live events in between. The export
//! is therefore a point-in-time aggregate, safe because the caller reads the per-rank cursors before the
//! walk starts and the consumer re-applies every batch after them (stores and removals are idempotent).
//! Slots reused during the walk may export a node created after the cursors: harmless for the same
//! reason. Trust: the graft takes columns that the bootstrap plane's vetting produced.

use std::collections::HashMap as StdHashMap;
use std::time::{Duration, Instant};

use crate::arena::NO_SLOT;
use crate::index::{Cid, Index, U64Map};

/// The longest one step of either walk runs, whatever its record budget: the writer applies live events
/// between steps, and a step slowed by cold memory (a graft's first steps fault in the tables it just
/// reserved, one page per random insert) must not hold them for tens of milliseconds.
pub const STEP_TIME: Duration = Duration::from_micros(2000);
/// Records between two looks at the clock.
const CLOCK_EVERY: usize = 64;

/// Node records as parallel arrays. Record `i` owns carrier entries `[start[i], start[i] + ncar[i])` of
/// `worker`/`tiers`/`hash`, with `start` the running sum of `ncar`.
#[derive(Default, Debug, Clone, PartialEq, Eq)]
pub struct Columns {
    pub parent: Vec<i64>,
    pub key: Vec<u64>,
    pub ncar: Vec<u16>,
    pub worker: Vec<u32>,
    pub tiers: Vec<u8>,
    pub hash: Vec<u64>,
}

/// Walks an index into `Columns`. The worker table is keyed by carrier incarnation (id and generation),
/// so an id reused mid-walk is never misattributed.
pub struct Exporter {
    end: usize,
    pos: usize,
    /// Per slot, one more than the record it was exported as (0: not yet). Checked against the record's
    /// key, since a slot freed and reused during the walk holds another node. A vector, not a map: no
    /// hashing, and no table that doubles (and stalls the writer) as the export grows; zero for "not
    /// yet", so it is allocated zeroed by the system, not filled inside the writer's turn.
    record_at: Vec<u32>,
    /// Records of blocks nobody held when met (placeholders), by key: rare.
    placeholder: U64Map<u32>,
    pub columns: Columns,
    /// (engine, rank) of each worker index.
    pub workers: Vec<(String, u32)>,
    worker_of: StdHashMap<(Cid, u64), u32>,
}

/// What one step knows of each carrier id: the tiers it exports (0: none) and its worker index.
struct StepCarriers {
    mask: Vec<u8>,
    worker: Vec<u32>,
}

impl Exporter {
    pub fn new(index: &Index) -> Exporter {
        let end = index.slot_end();
        let (nodes, holders) = (index.node_count(), index.holder_count());
        // Reserved up front: a column that doubles mid-walk copies itself inside one writer turn.
        let mut columns = Columns::default();
        columns.parent.reserve(nodes);
        columns.key.reserve(nodes);
        columns.ncar.reserve(nodes);
        columns.worker.reserve(holders);
        columns.tiers.reserve(holders);
        columns.hash.reserve(holders);
        Exporter {
            end,
            pos: 0,
            record_at: vec![0; end],
            placeholder: U64Map::default(),
            columns,
            workers: Vec::new(),
            worker_of: StdHashMap::new(),
        }
    }

    pub fn done(&self) -> bool {
        self.pos >= self.end
    }

    /// The record a live node was exported as, if it was.
    fn exported(&self, slot: u32, key: u64) -> Option<u32> {
        let r = self.record_at.get(slot as usize)?.checked_sub(1)?;
        (self.columns.key[r as usize] == key).then_some(r)
    }

    /// The carriers' export masks and worker indices for one step: asked once per carrier, not per
    /// holder. A carrier goes out with its visible tiers if `include` says so.
    fn step_carriers(&mut self, index: &Index, include: &dyn Fn(Cid) -> bool) -> StepCarriers {
        let n = index.carrier_ids().last().map_or(0, |c| c as usize + 1);
        let mut out = StepCarriers {
            mask: vec![0; n],
            worker: vec![NO_SLOT; n],
        };
        for cid in index.carrier_ids() {
            if !include(cid) {
                continue;
            }
            let (engine, rank, generation) = index.carrier_identity(cid).expect("a live carrier");
            let next = self.workers.len() as u32;
            let w = *self.worker_of.entry((cid, generation)).or_insert(next);
            if w == next {
                self.workers.push((engine.to_owned(), rank));
            }
            out.mask[cid as usize] = index.visible_tiers(cid);
            out.worker[cid as usize] = w;
        }
        out
    }

    /// Export up to `budget` more slots (fewer if the step reaches `STEP_TIME`). `include(cid)` says which carriers go out (asked by the caller
    /// once per chunk); hidden tiers never do. Returns whether the walk is done.
    pub fn step(&mut self, index: &Index, budget: usize, include: &dyn Fn(Cid) -> bool) -> bool {
        let stop = self.end.min(self.pos.saturating_add(budget)).min(index.slot_end());
        let carriers = self.step_carriers(index, include);
        let mut chain: Vec<u32> = Vec::new();
        let started = Instant::now();
        let mut reached = stop;
        for slot in self.pos..stop {
            if (slot - self.pos) % CLOCK_EVERY == CLOCK_EVERY - 1 && started.elapsed() > STEP_TIME {
                reached = slot;
                break;
            }
            let slot = slot as u32;
            let Some(node) = index.node_at(slot as usize) else {
                continue;
            };
            if self.exported(slot, node.key).is_some() {
                continue;
            }
            // Up the chain to an exported ancestor, the root, or a block nobody holds now.
            chain.clear();
            chain.push(slot);
            let mut parent = node.parent;
            let mut below = slot;
            let mut pidx = -1;
            while let Some(p) = parent {
                // A chain is stored in walk order, so the parent is most often the slot just before:
                // checked by key first, which spares a probe of the key table per node.
                let before = (below.checked_sub(1)).filter(|&s| index.node_at(s as usize).is_some_and(|n| n.key == p));
                let Some(ps) = before.or_else(|| index.slot(p)) else {
                    // The chain hangs under a block nobody holds now: unreachable today, but a later
                    // store may make it reachable, so it goes under a carrier-less placeholder.
                    pidx = match self.placeholder.get(&p) {
                        Some(&r) => r as i64,
                        None => {
                            let r = self.record(p, -1);
                            self.placeholder.insert(p, r);
                            r as i64
                        }
                    };
                    break;
                };
                if let Some(r) = self.exported(ps, p) {
                    pidx = r as i64;
                    break;
                }
                chain.push(ps);
                below = ps;
                parent = index.node_at(ps as usize).and_then(|n| n.parent);
            }
            for &s in chain.iter().rev() {
                pidx = self.emit(index, s, pidx, &carriers) as i64;
            }
        }
        self.pos = reached.max(self.pos);
        if index.slot_end() < self.end {
            self.end = index.slot_end();
        }
        self.done()
    }

    fn record(&mut self, key: u64, pidx: i64) -> u32 {
        let cols = &mut self.columns;
        let i = cols.key.len() as u32;
        cols.parent.push(pidx);
        cols.key.push(key);
        cols.ncar.push(0);
        i
    }

    fn emit(&mut self, index: &Index, slot: u32, pidx: i64, carriers: &StepCarriers) -> u32 {
        let node = index.node_at(slot as usize).expect("a chain node is live");
        let i = self.record(node.key, pidx);
        if let Some(r) = self.record_at.get_mut(slot as usize) {
            *r = i + 1;
        }
        let mut n = 0u16;
        for (cid, tiers, ehash) in node.holders() {
            let vis = tiers & carriers.mask.get(cid as usize).copied().unwrap_or(0);
            if vis == 0 {
                continue;
            }
            self.columns.worker.push(carriers.worker[cid as usize]);
            self.columns.tiers.push(vis);
            self.columns.hash.push(ehash);
            n += 1;
        }
        *self.columns.ncar.last_mut().expect("just recorded") = n;
        i
    }
}

/// Columns that passed `vet_columns`: the only value a `Grafter` takes. Nothing else builds one.
pub struct Vetted {
    columns: Columns,
    /// Entries that name a usable worker with a tier left.
    pub usable: u64,
}

impl Vetted {
    pub fn columns(&self) -> &Columns {
        &self.columns
    }
}

/// Applies vetted columns onto a live index a chunk at a time: absent nodes are created, present ones
/// get the carriers unioned in. Bad indices (which vetting rules out) are skipped, never a panic.
pub struct Grafter {
    columns: Columns,
    /// Entries per worker index: what the first step reserves in each carrier's table.
    per_worker: Vec<usize>,
    /// Each record's slot once grafted (NO_SLOT before, or when no carrier of it was admitted): the
    /// parent slot a child's node takes its walk hint from.
    slots: Vec<u32>,
    pos: usize,
    car: usize,
    /// Tables reserved so far: the key table, then one per worker.
    reserved: usize,
    /// Tier bits newly held.
    pub blocks: u64,
}

impl Grafter {
    /// Counted here, off the writer (the caller builds a grafter beside the loop): only the table
    /// reservations run in the first step.
    pub fn new(vetted: Vetted) -> Grafter {
        let columns = vetted.columns;
        let workers = columns.worker.iter().max().map_or(0, |&w| w as usize + 1);
        let mut per_worker = vec![0usize; workers];
        columns.worker.iter().for_each(|&w| per_worker[w as usize] += 1);
        Grafter {
            slots: vec![NO_SLOT; columns.key.len()],
            columns,
            per_worker,
            pos: 0,
            car: 0,
            reserved: 0,
            blocks: 0,
        }
    }

    /// Grow the index's tables, before the first record, to what the graft may add: a table that
    /// doubles inside a chunk moves every entry in one writer turn (tens of milliseconds per million).
    /// One table per step (the key table first, then each worker's carrier), since each allocation
    /// is itself a pause of the writer at 8M nodes. Returns whether every table is reserved.
    fn reserve(&mut self, index: &mut Index, carrier_of: &[Option<Cid>]) -> bool {
        match self.reserved {
            0 => index.reserve_nodes(self.columns.key.len()),
            r => {
                if let (Some(&n), Some(Some(cid))) = (self.per_worker.get(r - 1), carrier_of.get(r - 1)) {
                    index.reserve_carrier(*cid, n);
                }
            }
        }
        self.reserved += 1;
        self.reserved > self.per_worker.len()
    }

    pub fn done(&self) -> bool {
        self.pos >= self.columns.key.len()
    }

    /// Graft up to `budget` more records (fewer if the step reaches `STEP_TIME`); `carrier_of[w]` is the local carrier id for worker `w` in this
    /// chunk, None to skip its entries. Returns whether the graft is done.
    pub fn step(&mut self, index: &mut Index, budget: usize, carrier_of: &[Option<Cid>]) -> bool {
        if self.reserved <= self.per_worker.len() && !self.reserve(index, carrier_of) {
            return false;
        }
        let cols = &self.columns;
        let stop = cols.key.len().min(self.pos.saturating_add(budget));
        let mut car = self.car;
        let started = Instant::now();
        let mut reached = stop;
        for i in self.pos..stop {
            if (i - self.pos) % CLOCK_EVERY == CLOCK_EVERY - 1 && started.elapsed() > STEP_TIME {
                reached = i;
                break;
            }
            let n = cols.ncar[i] as usize;
            if n == 0 {
                continue;
            }
            let key = cols.key[i];
            let p = cols.parent[i];
            let parent = if p < 0 { None } else { cols.key.get(p as usize).copied() };
            if p >= 0 && (p as usize >= i || parent.is_none()) {
                car += n;
                continue;
            }
            for j in car..car + n {
                let (Some(&w), Some(&tiers), Some(&h)) = (cols.worker.get(j), cols.tiers.get(j), cols.hash.get(j))
                else {
                    break;
                };
                if let Some(Some(cid)) = carrier_of.get(w as usize) {
                    let parent_slot = (p >= 0).then(|| self.slots[p as usize]).filter(|&s| s != NO_SLOT);
                    let (new, slot) = index.hold(*cid, key, parent, parent_slot, tiers, h);
                    self.blocks += new as u64;
                    if slot != NO_SLOT {
                        self.slots[i] = slot;
                    }
                }
            }
            car += n;
        }
        self.pos = reached;
        self.car = car;
        if self.done() {
            index.release_reserved();
        }
        self.done()
    }
}

/// Why a snapshot's columns were refused; `as_str` is the vetting error's value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ColumnsRefused {
    /// Columns of lengths that do not fit together (record columns, entry columns, the ncar sum).
    Inconsistent,
    /// A forward, self or out-of-range parent reference.
    InvalidParent,
    TooDeep,
    WorkerOutOfRange,
}

impl ColumnsRefused {
    pub fn as_str(self) -> &'static str {
        match self {
            ColumnsRefused::Inconsistent => "inconsistent_columns",
            ColumnsRefused::InvalidParent => "invalid_parent",
            ColumnsRefused::TooDeep => "too_deep",
            ColumnsRefused::WorkerOutOfRange => "worker_out_of_range",
        }
    }
}

/// The column checks of vetting, in one pass each: the columns consistent in length, parents strictly
/// backward (-1 for a root) and the depth bounded; every worker index in range; tier bits masked to
/// `known_tiers`. Entries left with no tier are pointed at worker `usable.len()` (one past the table:
/// the caller maps it to "skip"); `Vetted::usable` counts the entries left for a usable worker (none
/// may be a cold peer to the caller). Rejects rather than repairs; the only way to a `Vetted`.
pub fn vet_columns(
    mut columns: Columns,
    usable: &[bool],
    known_tiers: u8,
    max_depth: u32,
) -> Result<Vetted, ColumnsRefused> {
    let c = &mut columns;
    let records = c.key.len();
    let entries = c.worker.len();
    if c.parent.len() != records
        || c.ncar.len() != records
        || c.tiers.len() != entries
        || c.hash.len() != entries
        || c.ncar.iter().map(|&n| n as usize).sum::<usize>() != entries
    {
        return Err(ColumnsRefused::Inconsistent);
    }
    let mut depth: Vec<u32> = Vec::with_capacity(records);
    for (i, &p) in c.parent.iter().enumerate() {
        let d = match p {
            -1 => 1,
            p if p < 0 || p as usize >= i => return Err(ColumnsRefused::InvalidParent),
            p => depth[p as usize] + 1,
        };
        if d > max_depth {
            return Err(ColumnsRefused::TooDeep);
        }
        depth.push(d);
    }
    drop(depth);
    if c.worker.iter().any(|&w| w as usize >= usable.len()) {
        return Err(ColumnsRefused::WorkerOutOfRange);
    }
    let skip = usable.len() as u32;
    let mut n = 0;
    for (w, t) in c.worker.iter_mut().zip(c.tiers.iter_mut()) {
        *t &= known_tiers;
        if *t == 0 {
            *w = skip; // never grafted as "held in no tier"
        } else if usable[*w as usize] {
            n += 1;
        }
    }
    Ok(Vetted { columns, usable: n })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::{Event, Stored};
    use crate::keys::Tokens;

    fn index_with(chains: &[(&str, &[u64], &[i64])]) -> Index {
        let mut ix = Index::new(2, 0).unwrap();
        for (engine, hashes, tokens) in chains {
            let cid = ix.carrier(engine, 0).unwrap();
            ix.apply(cid, &[Event::Stored(Stored::plain(hashes, None, tokens, 2))]);
        }
        ix
    }

    fn export(ix: &Index, budget: usize) -> Exporter {
        let mut ex = Exporter::new(ix);
        while !ex.step(ix, budget, &|_| true) {}
        ex
    }

    fn vetted(cols: Columns, workers: usize) -> Vetted {
        vet_columns(cols, &vec![true; workers], 0xF, 1000).expect("vetted")
    }

    #[test]
    fn parents_precede_children_and_round_trip() {
        let src = index_with(&[("a", &[1, 2, 3], &[1, 2, 3, 4, 5, 6]), ("b", &[7, 8], &[1, 2, 9, 9])]);
        let ex = export(&src, 1);
        let cols = &ex.columns;
        assert!(cols.parent.iter().enumerate().all(|(i, &p)| p < i as i64));
        assert_eq!(cols.key.len(), 4, "the shared first block once");
        let mut dst = Index::new(2, 0).unwrap();
        let cids: Vec<Option<Cid>> = ex
            .workers
            .iter()
            .map(|(e, r)| Some(dst.carrier(e, *r).unwrap()))
            .collect();
        let mut g = Grafter::new(vetted(ex.columns.clone(), cids.len()));
        while !g.step(&mut dst, 2, &cids) {}
        assert_eq!(g.blocks, 5);
        let m = dst.match_tokens(&Tokens::from_i64(&[1, 2, 3, 4, 5, 6]), crate::keys::plain_root());
        assert_eq!(m.iter().map(|m| m.blocks).collect::<Vec<_>>(), vec![3, 1]);
    }

    fn two(parent: Vec<i64>, worker: Vec<u32>, tiers: Vec<u8>) -> Columns {
        Columns {
            key: vec![1, 2],
            ncar: vec![1, 1],
            hash: vec![5, 6],
            parent,
            worker,
            tiers,
        }
    }

    #[test]
    fn vetting_refuses_forward_parents_and_masks_tiers() {
        let ok = [true, true];
        let refused = |c, depth| vet_columns(c, &ok, 0xF, depth).err();
        assert_eq!(
            refused(two(vec![-1, 1], vec![0, 1], vec![0x11, 0x20]), 9),
            Some(ColumnsRefused::InvalidParent)
        );
        assert_eq!(
            refused(two(vec![-1, 0], vec![0, 1], vec![0x11, 0x20]), 1),
            Some(ColumnsRefused::TooDeep)
        );
        assert_eq!(
            refused(two(vec![-1, 0], vec![0, 2], vec![1, 1]), 9),
            Some(ColumnsRefused::WorkerOutOfRange)
        );
        let v = vet_columns(two(vec![-1, 0], vec![0, 1], vec![0x11, 0x20]), &ok, 0xF, 9).unwrap();
        assert_eq!(v.usable, 1);
        assert_eq!((&v.columns().worker, &v.columns().tiers), (&vec![0, 2], &vec![0x1, 0]));
    }

    #[test]
    fn inconsistent_columns_are_refused() {
        let cols = Columns {
            parent: vec![5, -1, 0],
            key: vec![1, 2, 3],
            ncar: vec![1, 3, 1],
            worker: vec![9, 0],
            tiers: vec![1, 1],
            hash: vec![1],
        };
        assert_eq!(
            vet_columns(cols, &[true], 0xF, 9).err(),
            Some(ColumnsRefused::Inconsistent)
        );
    }
}
