//! RouterFleet's native index core, and its Python bindings (the `routerfleet_index` module).
//!
//! The pure-Rust core (`keys`, `events`, `index`, `snapshot`) knows nothing of Python; this file is
//! the shell that converts (`extproc` and `otlp` carry their own shells). Python keeps the sockets, the single writer task and carrier identity
//! (`router_runtime/kv/index.py` wraps `Index`); every call here runs under the GIL on that writer or
//! on a reader of the same loop, so a match never observes a half-applied batch.

pub mod arena;
pub mod decode;
pub mod envelope;
pub mod events;
pub mod extproc;
pub mod index;
pub mod keys;
pub mod msgpack;
pub mod otlp;
pub mod snapshot;

use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use events::{Event, Removed, Skip, Stored};
use index::{Cid, Index};
use keys::Tokens;

#[derive(thiserror::Error, Debug)]
pub enum Error {
    #[error("block_size must be positive")]
    BlockSize,
    #[error("too many carriers: an index holds at most 65,536")]
    TooManyCarriers,
    #[error("unknown carrier id {0}")]
    UnknownCarrier(Cid),
    #[error("not a KV event: {0}")]
    NotAnEvent(String),
    #[error("columns of lengths that do not fit together")]
    Inconsistent,
    #[error("column {0}: {1} bytes is not a whole number of {2}-byte items")]
    ColumnBytes(&'static str, usize, usize),
}

pyo3::create_exception!(
    routerfleet_index,
    DecodeError,
    pyo3::exceptions::PyException,
    "A payload that does not decode: args (reason, detail), reason a stable metric label."
);

pyo3::create_exception!(
    routerfleet_index,
    WireRefused,
    pyo3::exceptions::PyException,
    "A snapshot envelope that does not read: args (kind, detail), kind a stable metric label."
);

pyo3::create_exception!(
    routerfleet_index,
    ColumnsRefused,
    pyo3::exceptions::PyException,
    "Snapshot columns that vetting refuses: args (reason,), a vetting error value."
);

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        PyValueError::new_err(e.to_string())
    }
}

// ---- conversions -----------------------------------------------------------------------------------

/// Token IDs from a list or tuple of ints (anything else iterable through the slow path). This is
/// the routing hot path: a 4,096-token prompt is read with one C call per item, no Python iteration
/// (what is left, about 3 ns an item, is reaching the int objects themselves).
fn tokens_from_py(obj: &Bound<'_, PyAny>) -> PyResult<Tokens> {
    let py = obj.py();
    let (ptr, n, get): (
        _,
        isize,
        unsafe fn(*mut pyo3::ffi::PyObject, isize) -> *mut pyo3::ffi::PyObject,
    ) = if let Ok(list) = obj.cast::<PyList>() {
        (list.as_ptr(), list.len() as isize, pyo3::ffi::PyList_GET_ITEM)
    } else if let Ok(tuple) = obj.cast::<PyTuple>() {
        (tuple.as_ptr(), tuple.len() as isize, pyo3::ffi::PyTuple_GET_ITEM)
    } else {
        let ids: Vec<i64> = obj.extract()?;
        return Ok(Tokens::from_i64(&ids));
    };
    let mut narrow: Vec<u32> = Vec::with_capacity(n as usize);
    for i in 0..n {
        // SAFETY: `ptr` is a list or tuple of length `n` that we hold a reference to, under the GIL;
        // the item is borrowed only for the conversion, which raises (and is checked) on a non-int.
        let x = unsafe { pyo3::ffi::PyLong_AsLongLong(get(ptr, i)) };
        if x == -1 && PyErr::occurred(py) {
            return Err(PyErr::fetch(py));
        }
        match u32::try_from(x) {
            Ok(t) => narrow.push(t),
            Err(_) => {
                // Out of u32: the whole sequence is keyed as 64-bit; the slow path reads it again.
                let ids: Vec<i64> = obj.extract()?;
                return Ok(Tokens::from_i64(&ids));
            }
        }
    }
    Ok(Tokens::U32(narrow))
}

/// How a conversion treats a store's extra keys: hashed into the keys (encoded by the given Python
/// callable), or not read at all (for the skip rule, which never looks at them).
#[derive(Clone, Copy)]
enum Extra<'a> {
    Encode(Option<&'a Py<PyAny>>),
    Ignore,
}

fn stored_from_py(ev: &Bound<'_, PyAny>, extra: Extra<'_>) -> PyResult<Stored> {
    let py = ev.py();
    let extra_keys = match (extra, ev.getattr(intern!(py, "extra_keys"))?) {
        (Extra::Ignore, _) => None,
        (_, x) if x.is_none() => None,
        (Extra::Encode(encode), x) => {
            // Never hash without them: the same tokens with other extra keys are other content.
            let encode = encode.ok_or_else(|| PyValueError::new_err("extra keys need an encoder"))?;
            let mut out = Vec::new();
            for item in x.try_iter()? {
                out.push(encode.bind(py).call1((item?,))?.extract::<Vec<u8>>()?);
            }
            Some(out)
        }
    };
    Ok(Stored {
        block_hashes: ev.getattr(intern!(py, "block_hashes"))?.extract()?,
        parent_block_hash: ev.getattr(intern!(py, "parent_block_hash"))?.extract()?,
        tokens: tokens_from_py(&ev.getattr(intern!(py, "token_ids"))?)?,
        block_size: ev.getattr(intern!(py, "block_size"))?.extract()?,
        medium: ev
            .getattr(intern!(py, "medium"))?
            .extract::<Option<String>>()?
            .map(|m| events::medium(&m)),
        lora_id: ev.getattr(intern!(py, "lora_id"))?.extract()?,
        lora_name: ev.getattr(intern!(py, "lora_name"))?.extract()?,
        extra_keys,
        cache_salt: ev.getattr(intern!(py, "cache_salt"))?.extract()?,
        group_idx: ev.getattr(intern!(py, "group_idx"))?.extract()?,
        kv_cache_spec_kind: ev.getattr(intern!(py, "kv_cache_spec_kind"))?.extract()?,
    })
}

fn event_from_py(ev: &Bound<'_, PyAny>, encode_extra: Option<&Py<PyAny>>) -> PyResult<Event> {
    let py = ev.py();
    let name = ev.get_type().name()?;
    Ok(match name.to_str()? {
        "BlockStored" => Event::Stored(stored_from_py(ev, Extra::Encode(encode_extra))?),
        "BlockRemoved" => Event::Removed(Removed {
            block_hashes: ev.getattr(intern!(py, "block_hashes"))?.extract()?,
            medium: ev
                .getattr(intern!(py, "medium"))?
                .extract::<Option<String>>()?
                .map(|m| events::medium(&m)),
            group_idx: ev.getattr(intern!(py, "group_idx"))?.extract()?,
        }),
        "AllBlocksCleared" => Event::AllCleared,
        other => return Err(Error::NotAnEvent(other.to_owned()).into()),
    })
}

fn column<const N: usize, T>(name: &'static str, b: &[u8], from: fn([u8; N]) -> T) -> Result<Vec<T>, Error> {
    if !b.len().is_multiple_of(N) {
        return Err(Error::ColumnBytes(name, b.len(), N));
    }
    Ok(b.chunks_exact(N)
        .map(|c| from(c.try_into().expect("exact chunk")))
        .collect())
}

fn le_vec<T: Copy, const N: usize>(xs: &[T], to: fn(T) -> [u8; N]) -> Vec<u8> {
    let mut out = Vec::with_capacity(xs.len() * N);
    xs.iter().for_each(|&x| out.extend_from_slice(&to(x)));
    out
}

// ---- the index -------------------------------------------------------------------------------------

/// The radix index (see `index.rs`). Carriers are small integer ids here; the Python wrapper maps
/// them to its `Carrier` values.
#[pyclass(module = "routerfleet_index", name = "Index")]
struct PyIndex {
    inner: Index,
}

type MatchRow = (Cid, u32, u32, u32, u32, u32);
type StatsRow = (
    u64,
    u64,
    u64,
    Vec<(&'static str, String, u64)>,
    Vec<(&'static str, u64)>,
);

fn stats_row(s: index::ApplyStats) -> StatsRow {
    let skipped = Skip::ALL
        .into_iter()
        .filter(|&r| s.skipped(r) > 0)
        .map(|r| (r.as_str(), s.skipped(r)))
        .collect();
    (s.stored, s.removed, s.cleared, s.events, skipped)
}
type NodeRow = (u64, Option<u64>, Vec<(Cid, u8)>);

fn rows(ms: Vec<index::CarrierMatch>) -> Vec<MatchRow> {
    ms.into_iter()
        .map(|m| {
            (
                m.cid,
                m.blocks,
                m.tier_blocks[0],
                m.tier_blocks[1],
                m.tier_blocks[2],
                m.tier_blocks[3],
            )
        })
        .collect()
}

impl PyIndex {
    fn live(&self, cid: Cid) -> Result<Cid, Error> {
        self.inner
            .carrier_identity(cid)
            .map(|_| cid)
            .ok_or(Error::UnknownCarrier(cid))
    }
}

#[pymethods]
impl PyIndex {
    #[new]
    #[pyo3(signature = (block_size, full_attention_group = 0))]
    fn new(block_size: i64, full_attention_group: i64) -> PyResult<Self> {
        Ok(PyIndex {
            inner: Index::new(block_size, full_attention_group)?,
        })
    }

    #[getter]
    fn block_size(&self) -> i64 {
        self.inner.block_size()
    }

    #[getter]
    fn full_attention_group(&self) -> i64 {
        self.inner.full_attention_group()
    }

    /// The id of carrier (engine, rank), created empty and visible if new.
    fn carrier(&mut self, engine: &str, rank: u32) -> PyResult<Cid> {
        Ok(self.inner.carrier(engine, rank)?)
    }

    fn node_count(&self) -> usize {
        self.inner.node_count()
    }

    /// Apply a native ``Batch`` (decoded from the wire, or converted once) for carrier ``cid``. Returns
    /// (stored, removed, cleared, [(event type, medium or "", n)], [(skip reason, blocks)]).
    fn apply_batch(&mut self, cid: Cid, batch: PyRef<'_, PyBatch>) -> PyResult<StatsRow> {
        self.live(cid)?;
        Ok(stats_row(self.inner.apply(cid, &batch.inner.events)))
    }

    fn clear_carrier(&mut self, cid: Cid) -> u64 {
        self.inner.clear_carrier(cid)
    }

    fn remove_carrier(&mut self, cid: Cid) -> u64 {
        self.inner.remove_carrier(cid)
    }

    fn set_visible(&mut self, cid: Cid, tiers: u8) -> PyResult<()> {
        self.live(cid)?;
        self.inner.set_visible(cid, tiers);
        Ok(())
    }

    fn visible_tiers(&self, cid: Cid) -> u8 {
        self.inner.visible_tiers(cid)
    }

    fn drop_tiers(&mut self, cid: Cid, tiers: u8) -> u64 {
        self.inner.drop_tiers(cid, tiers)
    }

    fn maintain(&mut self) {
        self.inner.maintain()
    }

    /// (device, host, disk, external) blocks held by a carrier.
    fn carrier_blocks(&self, cid: Cid) -> [u64; 4] {
        self.inner.carrier_blocks(cid)
    }

    /// Engine hashes a carrier holds, per tier slot.
    fn carrier_engine_hashes(&self, cid: Cid) -> [Vec<u64>; 4] {
        self.inner.carrier_engine_hashes(cid)
    }

    /// Matched prefix per carrier: rows of (id, blocks, device, host, disk, external), by id.
    #[pyo3(signature = (token_ids, lora_name = None, cache_salt = None))]
    fn match_tokens(
        &self,
        token_ids: &Bound<'_, PyAny>,
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> PyResult<Vec<MatchRow>> {
        let tokens = tokens_from_py(token_ids)?;
        Ok(rows(
            self.inner
                .match_tokens(&tokens, keys::namespace_root(lora_name, cache_salt)),
        ))
    }

    fn match_keys(&self, keys: Vec<u64>) -> Vec<MatchRow> {
        rows(self.inner.match_keys(keys))
    }

    #[pyo3(signature = (token_ids, lora_name = None, cache_salt = None))]
    fn keys_for(
        &self,
        token_ids: &Bound<'_, PyAny>,
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> PyResult<Vec<u64>> {
        Ok(self.inner.keys_for(&tokens_from_py(token_ids)?, lora_name, cache_salt))
    }

    /// Check the structure's invariants in full (for tests); raises AssertionError naming the first
    /// one broken.
    fn check(&self) -> PyResult<()> {
        self.inner.check().map_err(pyo3::exceptions::PyAssertionError::new_err)
    }

    /// Every node as (key, parent key or None, [(carrier id, tier bits)]), for tests and debugging.
    fn nodes(&self) -> Vec<NodeRow> {
        self.inner
            .nodes()
            .map(|n| (n.key, n.parent, n.holders().map(|(c, t, _)| (c, t)).collect()))
            .collect()
    }
}

// ---- snapshot walks --------------------------------------------------------------------------------

/// The chunked export (see `snapshot.rs`).
#[pyclass(module = "routerfleet_index", name = "Exporter")]
struct PyExporter {
    inner: snapshot::Exporter,
}

#[pymethods]
impl PyExporter {
    #[new]
    fn new(index: PyRef<'_, PyIndex>) -> Self {
        PyExporter {
            inner: snapshot::Exporter::new(&index.inner),
        }
    }

    #[getter]
    fn done(&self) -> bool {
        self.inner.done()
    }

    /// Export up to ``budget`` more slots; only carriers in ``include`` (ids) go out.
    fn step(&mut self, index: PyRef<'_, PyIndex>, budget: usize, include: Vec<Cid>) -> bool {
        let mut allowed = vec![false; Cid::MAX as usize + 1];
        include.iter().for_each(|&c| allowed[c as usize] = true);
        self.inner.step(&index.inner, budget, &|c| allowed[c as usize])
    }

    /// (engine, rank) of each worker index.
    #[getter]
    fn workers(&self) -> Vec<(String, u32)> {
        self.inner.workers.clone()
    }

    /// The exported columns, moved out (the exporter is left empty): call once the walk is done.
    fn take_columns(&mut self) -> PyColumns {
        PyColumns {
            inner: std::mem::take(&mut self.inner.columns),
        }
    }
}

/// Snapshot columns, decoded or exported: well-formed in shape, NOT trusted (``vet_columns`` decides).
#[pyclass(module = "routerfleet_index", name = "Columns")]
#[derive(Default)]
struct PyColumns {
    inner: snapshot::Columns,
}

/// A new ``bytes`` of `data`, copied with the GIL released: ``PyBytes::new`` copies under it, and for a
/// snapshot of hundreds of MiB that is a stall of every thread, the event loop's included.
fn bytes_off_gil<'py>(py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
    let len = pyo3::ffi::Py_ssize_t::try_from(data.len()).map_err(|_| PyValueError::new_err("too large"))?;
    // SAFETY: a bytes object created with a null source is allocated and left uninitialised; it is
    // not visible to any other thread until it is returned, so filling it without the GIL is sound,
    // and every byte is written before Python can read it.
    unsafe {
        let obj = Bound::from_owned_ptr_or_err(py, pyo3::ffi::PyBytes_FromStringAndSize(std::ptr::null(), len))?;
        let dst = std::slice::from_raw_parts_mut(pyo3::ffi::PyBytes_AsString(obj.as_ptr()) as *mut u8, data.len());
        py.detach(|| dst.copy_from_slice(data));
        Ok(obj.cast_into_unchecked())
    }
}

fn le_tuple<'py>(py: Python<'py>, c: &snapshot::Columns) -> PyResult<Bound<'py, PyTuple>> {
    // Encoded with the GIL released (millions of records), copied into bytes the same way.
    let raw = py.detach(|| {
        [
            le_vec(&c.parent, i64::to_le_bytes),
            le_vec(&c.key, u64::to_le_bytes),
            le_vec(&c.ncar, u16::to_le_bytes),
            le_vec(&c.worker, u32::to_le_bytes),
            c.tiers.clone(),
            le_vec(&c.hash, u64::to_le_bytes),
        ]
    });
    let out: Vec<Bound<'py, PyBytes>> = raw.iter().map(|b| bytes_off_gil(py, b)).collect::<PyResult<_>>()?;
    PyTuple::new(py, out)
}

#[pymethods]
impl PyColumns {
    #[new]
    fn empty() -> Self {
        PyColumns::default()
    }

    /// Columns from little-endian bytes (parent i64, key u64, ncar u16, worker u32, tiers u8, hash u64),
    /// checked to fit together: record columns of one length, entry columns of the ncar sum.
    #[staticmethod]
    fn from_le(
        py: Python<'_>,
        parent: &[u8],
        key: &[u8],
        ncar: &[u8],
        worker: &[u8],
        tiers: &[u8],
        hash: &[u8],
    ) -> PyResult<Self> {
        let inner = py.detach(|| -> Result<snapshot::Columns, Error> {
            let c = snapshot::Columns {
                parent: column("parent", parent, i64::from_le_bytes)?,
                key: column("key", key, u64::from_le_bytes)?,
                ncar: column("ncar", ncar, u16::from_le_bytes)?,
                worker: column("worker", worker, u32::from_le_bytes)?,
                tiers: tiers.to_vec(),
                hash: column("hash", hash, u64::from_le_bytes)?,
            };
            let entries: usize = c.ncar.iter().map(|&n| n as usize).sum();
            if c.parent.len() != c.key.len()
                || c.ncar.len() != c.key.len()
                || [c.worker.len(), c.tiers.len(), c.hash.len()] != [entries; 3]
            {
                return Err(Error::Inconsistent);
            }
            Ok(c)
        })?;
        Ok(PyColumns { inner })
    }

    /// The columns as little-endian bytes, in ``from_le``'s order.
    fn le<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        le_tuple(py, &self.inner)
    }

    fn __len__(&self) -> usize {
        self.inner.key.len()
    }
}

/// Columns that passed ``vet_columns``: the only value a ``Grafter`` takes. Python cannot build one.
#[pyclass(module = "routerfleet_index", name = "VettedColumns")]
struct PyVetted {
    inner: Option<snapshot::Vetted>,
}

#[pymethods]
impl PyVetted {
    /// The vetted columns as little-endian bytes (``Columns.le``'s order), for inspection.
    fn le<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let empty = snapshot::Columns::default();
        le_tuple(py, self.inner.as_ref().map_or(&empty, |v| v.columns()))
    }
}

/// The chunked graft (see `snapshot.rs`), of vetted columns.
#[pyclass(module = "routerfleet_index", name = "Grafter")]
struct PyGrafter {
    inner: snapshot::Grafter,
}

#[pymethods]
impl PyGrafter {
    /// Takes the vetted columns (a ``VettedColumns`` grafts once).
    #[new]
    fn new(py: Python<'_>, mut vetted: PyRefMut<'_, PyVetted>) -> PyResult<Self> {
        let v = vetted
            .inner
            .take()
            .ok_or_else(|| PyValueError::new_err("these vetted columns were grafted already"))?;
        Ok(PyGrafter {
            inner: py.detach(|| snapshot::Grafter::new(v)),
        })
    }

    #[getter]
    fn done(&self) -> bool {
        self.inner.done()
    }

    #[getter]
    fn blocks(&self) -> u64 {
        self.inner.blocks
    }

    /// Graft up to ``budget`` more records; ``carrier_of[w]``: the carrier id for worker ``w``, or None.
    fn step(&mut self, mut index: PyRefMut<'_, PyIndex>, budget: usize, carrier_of: Vec<Option<Cid>>) -> bool {
        self.inner.step(&mut index.inner, budget, &carrier_of)
    }
}

// ---- decoded batches -------------------------------------------------------------------------------

/// A batch of KV events held natively: decoded from a payload (``decode_batch``) or converted once
/// from Python events (``from_events``). The index applies it without a Python object per event.
#[pyclass(module = "routerfleet_index", name = "Batch", frozen)]
struct PyBatch {
    inner: decode::Batch,
}

/// (reason, blocks, block_size, group_idx, kv_cache_spec_kind, medium): a run of stores refused for
/// one configuration reason, described by its first store.
type RefusalRow = (&'static str, u64, i64, Option<i64>, Option<String>, Option<String>);

#[pymethods]
impl PyBatch {
    /// A native batch of Python events (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``);
    /// ``encode_extra`` gives a block's extra keys as canonical bytes.
    #[staticmethod]
    #[pyo3(signature = (ts, events, data_parallel_rank = None, encode_extra = None))]
    fn from_events(
        ts: f64,
        events: &Bound<'_, PyAny>,
        data_parallel_rank: Option<i64>,
        encode_extra: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let events = events
            .try_iter()?
            .map(|ev| event_from_py(&ev?, encode_extra.as_ref()))
            .collect::<PyResult<Vec<_>>>()?;
        Ok(PyBatch {
            inner: decode::Batch {
                ts,
                events,
                data_parallel_rank,
                unknown_fields: 0,
                unknown_tags: vec![],
            },
        })
    }

    /// The removals and clears of ``batches``, in order, as one batch: what a stream that will never
    /// be applied may still say about evictions.
    #[staticmethod]
    fn evictions(batches: Vec<PyRef<'_, PyBatch>>) -> Self {
        let events = batches
            .iter()
            .flat_map(|b| b.inner.events.iter())
            .filter(|ev| !matches!(ev, Event::Stored(_)))
            .cloned()
            .collect();
        PyBatch {
            inner: decode::Batch {
                ts: 0.0,
                events,
                data_parallel_rank: None,
                unknown_fields: 0,
                unknown_tags: vec![],
            },
        }
    }

    #[getter]
    fn ts(&self) -> f64 {
        self.inner.ts
    }

    #[getter]
    fn data_parallel_rank(&self) -> Option<i64> {
        self.inner.data_parallel_rank
    }

    #[getter]
    fn unknown_fields(&self) -> u64 {
        self.inner.unknown_fields
    }

    #[getter]
    fn unknown_tags(&self) -> Vec<String> {
        self.inner.unknown_tags.clone()
    }

    fn __len__(&self) -> usize {
        self.inner.events.len()
    }

    /// The index's store rule over this batch: (blocks accepted, runs of configuration refusals).
    fn fit(&self, block_size: i64, full_attention_group: i64) -> (u64, Vec<RefusalRow>) {
        let mut accepted = 0;
        let mut runs: Vec<RefusalRow> = Vec::new();
        for ev in &self.inner.events {
            let Event::Stored(s) = ev else { continue };
            let n = s.block_hashes.len() as u64;
            match events::store_skip(s, block_size, full_attention_group) {
                None => accepted += n,
                Some(skip) if skip.is_config() => match runs.last_mut() {
                    Some(run) if run.0 == skip.as_str() => run.1 += n,
                    _ => runs.push((
                        skip.as_str(),
                        n,
                        s.block_size,
                        s.group_idx,
                        s.kv_cache_spec_kind.clone(),
                        s.medium.as_deref().map(str::to_owned),
                    )),
                },
                Some(_) => {}
            }
        }
        (accepted, runs)
    }

    /// The events as Python objects (for tests and tools): ``stored``, ``removed`` and ``cleared``
    /// are the classes to build (called with keyword arguments); ``unpack_extra`` turns a block's
    /// canonical extra-key bytes back into its value.
    fn to_events<'py>(
        &self,
        py: Python<'py>,
        stored: &Bound<'py, PyAny>,
        removed: &Bound<'py, PyAny>,
        cleared: &Bound<'py, PyAny>,
        unpack_extra: &Bound<'py, PyAny>,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let mut out = Vec::with_capacity(self.inner.events.len());
        for ev in &self.inner.events {
            let kw = PyDict::new(py);
            out.push(match ev {
                Event::Stored(s) => {
                    kw.set_item("block_hashes", PyTuple::new(py, &s.block_hashes)?)?;
                    kw.set_item("parent_block_hash", s.parent_block_hash)?;
                    let tokens = match &s.tokens {
                        Tokens::U32(v) => PyTuple::new(py, v)?,
                        Tokens::I64(v) => PyTuple::new(py, v)?,
                    };
                    kw.set_item("token_ids", tokens)?;
                    kw.set_item("block_size", s.block_size)?;
                    kw.set_item("medium", s.medium.as_deref())?;
                    kw.set_item("lora_id", s.lora_id)?;
                    kw.set_item("lora_name", &s.lora_name)?;
                    let extra = match &s.extra_keys {
                        None => None,
                        Some(blocks) => Some(PyTuple::new(
                            py,
                            blocks
                                .iter()
                                .map(|b| {
                                    if b.is_empty() {
                                        Ok(py.None().into_bound(py))
                                    } else {
                                        unpack_extra.call1((PyBytes::new(py, b),))
                                    }
                                })
                                .collect::<PyResult<Vec<_>>>()?,
                        )?),
                    };
                    kw.set_item("extra_keys", extra)?;
                    kw.set_item("cache_salt", &s.cache_salt)?;
                    kw.set_item("group_idx", s.group_idx)?;
                    kw.set_item("kv_cache_spec_kind", &s.kv_cache_spec_kind)?;
                    stored.call((), Some(&kw))?
                }
                Event::Removed(r) => {
                    kw.set_item("block_hashes", PyTuple::new(py, &r.block_hashes)?)?;
                    kw.set_item("medium", r.medium.as_deref())?;
                    kw.set_item("group_idx", r.group_idx)?;
                    removed.call((), Some(&kw))?
                }
                Event::AllCleared => cleared.call0()?,
            });
        }
        Ok(out)
    }
}

/// Decode one batch payload (any dialect). Raises ``DecodeError(reason, detail)``, never another
/// exception, whatever the bytes.
#[pyfunction]
#[pyo3(signature = (payload, max_bytes = 64 << 20, max_events = 1 << 20, max_tokens_per_event = 1 << 22))]
fn decode_batch(payload: &[u8], max_bytes: usize, max_events: u64, max_tokens_per_event: u64) -> PyResult<PyBatch> {
    let limits = decode::DecodeLimits {
        max_bytes,
        max_events,
        max_tokens_per_event,
    };
    let result =
        std::panic::catch_unwind(|| decode::decode_batch(payload, &limits)).unwrap_or(Err(decode::Malformed {
            reason: decode::Reason::Unexpected,
            detail: "decoder panicked",
        }));
    match result {
        Ok(inner) => Ok(PyBatch { inner }),
        Err(m) => Err(DecodeError::new_err((m.reason.as_str(), m.detail))),
    }
}

/// An engine block hash as u64, by the decoder's own rule (`decode::hash_of`).
#[pyfunction]
fn normalize_hash(x: &Bound<'_, PyAny>) -> PyResult<u64> {
    let fail = |m: decode::Malformed| DecodeError::new_err((m.reason.as_str(), m.detail));
    let head = if x.is_instance_of::<pyo3::types::PyBool>() {
        msgpack::Head::Bool(x.extract()?)
    } else if let Ok(v) = x.extract::<i128>() {
        match v {
            v if (0..=u64::MAX as i128).contains(&v) => msgpack::Head::UInt(v as u64),
            v if (i64::MIN as i128..0).contains(&v) => msgpack::Head::NInt(v as i64),
            _ => {
                let detail = "int hash outside the i64/u64 range";
                return Err(fail(decode::Malformed {
                    reason: decode::Reason::BadHash,
                    detail,
                }));
            }
        }
    } else if x.is_instance_of::<PyBytes>() || x.is_instance_of::<pyo3::types::PyByteArray>() {
        let b: Vec<u8> = x.extract()?;
        return decode::hash_of(msgpack::Head::Bin(&b)).map_err(fail);
    } else {
        msgpack::Head::Nil
    };
    decode::hash_of(head).map_err(fail)
}

/// Vetting's column checks (see `snapshot::vet_columns`), with the GIL released. Moves the columns out
/// of ``columns`` (left empty) into the returned (usable entries, ``VettedColumns``), tiers masked and
/// tierless entries pointed one past the worker table; or raises ``ColumnsRefused(reason)``.
#[pyfunction]
fn vet_columns(
    py: Python<'_>,
    mut columns: PyRefMut<'_, PyColumns>,
    usable: Vec<bool>,
    known_tiers: u8,
    max_depth: u32,
) -> PyResult<(u64, PyVetted)> {
    let cols = std::mem::take(&mut columns.inner);
    let v = py
        .detach(|| snapshot::vet_columns(cols, &usable, known_tiers, max_depth))
        .map_err(|e| ColumnsRefused::new_err(e.as_str()))?;
    Ok((v.usable, PyVetted { inner: Some(v) }))
}

/// A format-2 snapshot envelope of ``meta`` (msgpack bytes) and ``columns`` (see `envelope.rs`),
/// built with the GIL released.
#[pyfunction]
#[pyo3(signature = (meta, columns=None))]
fn encode_snapshot<'py>(
    py: Python<'py>,
    meta: &[u8],
    columns: Option<PyRef<'_, PyColumns>>,
) -> PyResult<Bound<'py, PyBytes>> {
    let empty = snapshot::Columns::default();
    let cols = columns.as_ref().map_or(&empty, |c| &c.inner);
    let out = py.detach(|| envelope::encode(meta, cols));
    bytes_off_gil(py, &out)
}

/// Whether ``data`` starts as a format-2 envelope.
#[pyfunction]
fn is_envelope(data: &[u8]) -> bool {
    envelope::is_envelope(data)
}

/// Read a format-2 envelope, with the GIL released: (meta bytes, ``Columns``), or raises
/// ``WireRefused(kind, detail)``.
#[pyfunction]
fn decode_snapshot(
    py: Python<'_>,
    data: &[u8],
    max_bytes: usize,
    max_records: u64,
    max_entries: u64,
    max_meta: usize,
) -> PyResult<(Py<PyBytes>, PyColumns)> {
    let limits = envelope::Limits {
        max_bytes,
        max_records,
        max_entries,
        max_meta,
    };
    let (meta, inner) = py
        .detach(|| envelope::decode(data, &limits))
        .map_err(|e| WireRefused::new_err((e.kind(), e.to_string())))?;
    Ok((PyBytes::new(py, &meta).unbind(), PyColumns { inner }))
}

// ---- module ----------------------------------------------------------------------------------------

/// The index's rule for a ``BlockStored``: the skip reason, or None when it can be indexed.
#[pyfunction]
fn store_skip(ev: &Bound<'_, PyAny>, block_size: i64, full_attention_group: i64) -> PyResult<Option<&'static str>> {
    let ev = stored_from_py(ev, Extra::Ignore)?;
    Ok(events::store_skip(&ev, block_size, full_attention_group).map(Skip::as_str))
}

#[pymodule]
fn routerfleet_index(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyIndex>()?;
    m.add_class::<extproc::PyExtProcServer>()?;
    m.add_class::<PyExporter>()?;
    m.add_class::<PyGrafter>()?;
    m.add_class::<PyColumns>()?;
    m.add_class::<PyVetted>()?;
    m.add("WireRefused", m.py().get_type::<WireRefused>())?;
    m.add_function(wrap_pyfunction!(encode_snapshot, m)?)?;
    m.add_function(wrap_pyfunction!(decode_snapshot, m)?)?;
    m.add_function(wrap_pyfunction!(is_envelope, m)?)?;
    m.add_class::<PyBatch>()?;
    m.add("DecodeError", m.py().get_type::<DecodeError>())?;
    m.add_function(wrap_pyfunction!(decode_batch, m)?)?;
    m.add_function(wrap_pyfunction!(normalize_hash, m)?)?;
    m.add_function(wrap_pyfunction!(vet_columns, m)?)?;
    m.add("ColumnsRefused", m.py().get_type::<ColumnsRefused>())?;
    m.add_function(wrap_pyfunction!(store_skip, m)?)?;
    m.add_function(wrap_pyfunction!(otlp::encode_spans, m)?)?;
    m.add_function(wrap_pyfunction!(otlp::encode_attributes, m)?)?;
    m.add("SCHEME", keys::SCHEME)?;
    let media = PyDict::new(m.py());
    for (medium, tier) in events::MEDIUM_TIERS {
        media.set_item(medium, tier)?;
    }
    m.add("MEDIUM_TIERS", media)?;
    m.add("SKIP_REASONS", Skip::ALL.map(Skip::as_str).to_vec())?;
    let config: Vec<&str> = Skip::ALL
        .into_iter()
        .filter(|s| s.is_config())
        .map(Skip::as_str)
        .collect();
    m.add("CONFIG_SKIPS", config)?;
    Ok(())
}
