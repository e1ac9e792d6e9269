//! Decode one KV event batch payload, in any engine dialect, straight from its msgpack bytes.
//!
//! Accepted shapes (docs/kv-wire.md sections 1.3, 2 and 6):
//! - batch: `[ts, events]` or `[ts, events, rank]` (extra trailing elements counted as unknown), or
//!   defensively a map `{"ts", "events", "data_parallel_rank" | "attn_dp_rank"}`;
//! - events: tagged arrays read by position (vLLM <= 0.25, older SGLang; shorter arrays from older
//!   versions are fine) and `"type"`-keyed maps read by name (vLLM >= 0.26, SGLang 0.5.23);
//! - tags `BlockStored` (also `BlockStoredWithMetadata`), `BlockRemoved`, `AllBlocksCleared`; others
//!   are skipped and counted.
//!
//! A payload is all or nothing: a batch is applied under one sequence number, so one bad event drops
//! the whole batch. Every failure is a `Malformed` with a low-cardinality `Reason` (a metric label)
//! and a detail that never contains token IDs or hashes. Block hashes become u64: signed ints as two's
//! complement, byte strings by their last 8 bytes big-endian.

use crate::events::{medium, Event, Medium, Removed, Stored};
use crate::keys::Tokens;
use crate::msgpack::{canonical, validated, Head, Limits, Reader};

/// Why a frame was dropped. The strings are stable metric label values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    TooLarge,
    Truncated,
    TrailingData,
    NotMsgpack,
    BadShape,
    BadType,
    BadValue,
    BadHash,
    Unexpected,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::TooLarge => "too_large",
            Reason::Truncated => "truncated",
            Reason::TrailingData => "trailing_data",
            Reason::NotMsgpack => "not_msgpack",
            Reason::BadShape => "bad_shape",
            Reason::BadType => "bad_type",
            Reason::BadValue => "bad_value",
            Reason::BadHash => "bad_hash",
            Reason::Unexpected => "unexpected",
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
pub struct Malformed {
    pub reason: Reason,
    pub detail: &'static str,
}

fn bad<T>(reason: Reason, detail: &'static str) -> Result<T, Malformed> {
    Err(Malformed { reason, detail })
}

impl From<Reason> for Malformed {
    fn from(reason: Reason) -> Self {
        let detail = match reason {
            Reason::TooLarge => "a value over our bounds",
            Reason::Truncated => "msgpack ended early",
            Reason::TrailingData => "bytes after the msgpack object",
            Reason::BadType => "unhashable map key",
            _ => "invalid msgpack",
        };
        Malformed { reason, detail }
    }
}

/// Bounds on one payload. `max_tokens_per_event` also bounds the hashes of one event.
#[derive(Clone, Copy)]
pub struct DecodeLimits {
    pub max_bytes: usize,
    pub max_events: u64,
    pub max_tokens_per_event: u64,
}

impl Default for DecodeLimits {
    fn default() -> Self {
        DecodeLimits {
            max_bytes: 64 << 20,
            max_events: 1 << 20,
            max_tokens_per_event: 1 << 22,
        }
    }
}

/// A decoded batch, and what decoding skipped (which only counts when the whole batch decodes).
pub struct Batch {
    pub ts: f64,
    pub events: Vec<Event>,
    pub data_parallel_rank: Option<i64>,
    pub unknown_fields: u64,
    /// Unknown event tags met, each cut to 64 characters.
    pub unknown_tags: Vec<String>,
}

// Positional layouts: the highest index understood + 1; more elements are counted as unknown.
const STORED_ARRAY_FIELDS: u32 = 16; // tag + 15 fields in vLLM 0.33
const REMOVED_ARRAY_FIELDS: u32 = 6; // tag, block_hashes, medium, group_idx, locality, ownership
                                     // Map keys read, plus those known but deliberately not carried (they are not "unknown").
const STORED_KEYS: [&str; 18] = [
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "cache_salt", // SGLang 0.5.23
    "metadata",   // SGLang BlockStoredWithMetadata
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
];
const REMOVED_KEYS: [&str; 6] = ["type", "block_hashes", "medium", "group_idx", "locality", "ownership"];
const BATCH_KEYS: [&str; 4] = ["ts", "events", "data_parallel_rank", "attn_dp_rank"];
const MAX_TAG_CHARS: usize = 64;
// extra_keys nesting we are willing to freeze when it holds a map.
const MAX_FREEZE_DEPTH: usize = 32;

type Field<T> = Option<Result<T, Malformed>>;

/// Take a field: absent is `Ok(None)` (or `absent`), present is its parse result.
fn take<T>(f: Field<T>) -> Result<Option<T>, Malformed> {
    f.transpose()
}

/// The fields of one event, each parsed as it is met (one pass over the event); which ones count
/// is decided once the tag is known, in the order the rules are checked.
#[derive(Default)]
struct EventFields<'a> {
    tag: Option<Head<'a>>,
    block_hashes: Field<Vec<u64>>,
    parent_block_hash: Field<Option<u64>>,
    token_ids: Field<Tokens>,
    block_size: Field<i64>,
    lora_id: Field<Option<i64>>,
    medium: Field<Option<Medium>>,
    lora_name: Field<Option<String>>,
    extra_keys: Field<Option<Vec<Vec<u8>>>>,
    group_idx: Field<Option<i64>>,
    kv_cache_spec_kind: Field<Option<String>>,
    cache_salt: Field<Option<String>>,
    /// SGLang's metadata map: (its cache salt, its unknown keys).
    metadata: Field<(Option<String>, u64)>,
    /// Distinct string keys met (maps only) and keys that were not strings.
    keys: smallvec::SmallVec<[&'a str; 24]>,
    other_keys: u64,
}

impl EventFields<'_> {
    fn unknown(&self, known: &[&str]) -> u64 {
        self.keys.iter().filter(|k| !known.contains(k)).count() as u64 + self.other_keys
    }
}

struct Dec {
    max_tokens: u64,
    unknown_fields: u64,
    unknown_tags: Vec<String>,
}

/// Run `parse` on the value at the reader; whatever it finds, the reader ends past that value.
fn field<'a, T>(r: &mut Reader<'a>, parse: impl FnOnce(&mut Reader<'a>) -> Result<T, Malformed>) -> Field<T> {
    let start = r.pos;
    let out = parse(r);
    if out.is_err() {
        r.pos = start;
        r.skip();
    }
    Some(out)
}

/// An engine block hash as u64: i64 two's complement, u64 as is, bytes by their last 8 bytes BE
/// (zero-extended when shorter). The one rule, for the decoder and for `normalize_hash`.
pub fn hash_of(h: Head<'_>) -> Result<u64, Malformed> {
    match h {
        Head::UInt(v) => Ok(v),
        Head::NInt(v) => Ok(v as u64), // two's complement
        Head::Bin(b) if !b.is_empty() => Ok(b[b.len().saturating_sub(8)..]
            .iter()
            .fold(0u64, |acc, &x| acc << 8 | x as u64)),
        Head::Bin(_) => bad(Reason::BadHash, "empty bytes hash"),
        _ => bad(Reason::BadHash, "hash must be an int or bytes"),
    }
}

fn hashes(r: &mut Reader<'_>, max: u64) -> Result<Vec<u64>, Malformed> {
    let Head::Array(n) = r.head() else {
        return bad(Reason::BadType, "block_hashes must be an array");
    };
    if n as u64 > max {
        return bad(Reason::TooLarge, "too many block_hashes");
    }
    (0..n).map(|_| hash_of(r.head())).collect()
}

fn opt_hash(r: &mut Reader<'_>) -> Result<Option<u64>, Malformed> {
    match r.head() {
        Head::Nil => Ok(None),
        h => hash_of(h).map(Some),
    }
}

fn tokens(r: &mut Reader<'_>, max: u64) -> Result<Tokens, Malformed> {
    let Head::Array(n) = r.head() else {
        return bad(Reason::BadType, "token_ids must be an array");
    };
    if n as u64 > max {
        return bad(Reason::TooLarge, "too many token_ids");
    }
    let mut narrow: Vec<u32> = Vec::with_capacity(n as usize);
    for i in 0..n {
        // Also rejects SGLang EAGLE bigram pairs ([a, b] per token): read as plain tokens they would
        // index other content.
        let v = match r.head() {
            Head::UInt(v) if v <= u32::MAX as u64 => {
                narrow.push(v as u32);
                continue;
            }
            Head::UInt(v) => v as i64, // beyond i64: two's complement, as the key scheme reads it
            Head::NInt(v) => v,
            _ => return bad(Reason::BadType, "token_ids must all be ints"),
        };
        // Out of u32: the whole sequence is keyed as 64-bit.
        let mut wide: Vec<i64> = narrow.iter().map(|&t| t as i64).collect();
        wide.push(v);
        for _ in i + 1..n {
            match r.head() {
                Head::UInt(v) => wide.push(v as i64),
                Head::NInt(v) => wide.push(v),
                _ => return bad(Reason::BadType, "token_ids must all be ints"),
            }
        }
        return Ok(Tokens::I64(wide));
    }
    Ok(Tokens::U32(narrow))
}

fn block_size(r: &mut Reader<'_>) -> Result<i64, Malformed> {
    match r.head() {
        Head::UInt(0) | Head::NInt(_) => bad(Reason::BadValue, "block_size must be positive"),
        Head::UInt(v) => Ok(v.min(i64::MAX as u64) as i64),
        _ => bad(Reason::BadType, "block_size must be an int"),
    }
}

fn opt_int(r: &mut Reader<'_>, detail: &'static str) -> Result<Option<i64>, Malformed> {
    match r.head() {
        Head::Nil => Ok(None),
        Head::UInt(v) => Ok(Some(v.min(i64::MAX as u64) as i64)),
        Head::NInt(v) => Ok(Some(v)),
        _ => bad(Reason::BadType, detail),
    }
}

fn opt_str(r: &mut Reader<'_>, detail: &'static str) -> Result<Option<String>, Malformed> {
    match r.head() {
        Head::Nil => Ok(None),
        Head::Str(s) => Ok(Some(s.to_owned())),
        _ => bad(Reason::BadType, detail),
    }
}

fn opt_medium(r: &mut Reader<'_>) -> Result<Option<Medium>, Malformed> {
    match r.head() {
        Head::Nil => Ok(None),
        Head::Str(s) => Ok(Some(medium(s))),
        _ => bad(Reason::BadType, "medium must be a string or nil"),
    }
}

/// vLLM's per-block extra keys, each as canonical bytes (empty for a block without).
fn extra_keys(r: &mut Reader<'_>) -> Result<Option<Vec<Vec<u8>>>, Malformed> {
    let n = match r.head() {
        Head::Nil => return Ok(None),
        Head::Array(n) => n,
        _ => return bad(Reason::BadType, "extra_keys must be an array or nil"),
    };
    let (mut height, mut any_map) = (0, false);
    let mut out = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let mut bytes = Vec::new();
        let start = r.pos;
        if r.head() != Head::Nil {
            r.pos = start;
            let (d, m) = canonical(r, &mut bytes);
            height = height.max(d);
            any_map |= m;
        }
        out.push(bytes);
    }
    // A map makes the value unhashable: it is frozen (into pairs), as deep as we are willing to go.
    if any_map && height + 1 > MAX_FREEZE_DEPTH {
        return bad(Reason::BadShape, "extra_keys nested too deeply");
    }
    Ok(Some(out))
}

/// SGLang's `BlockStoredWithMetadata` map `{"cache_salt": str}`: (the salt, unknown keys).
fn metadata(r: &mut Reader<'_>) -> Result<(Option<String>, u64), Malformed> {
    let n = match r.head() {
        Head::Nil => return Ok((None, 0)),
        Head::Map(n) => n,
        _ => return bad(Reason::BadType, "metadata must be a map"),
    };
    let (mut salt, mut unknown, mut seen) = (None, 0, Vec::new());
    for _ in 0..n {
        let start = r.pos;
        match r.head() {
            Head::Str("cache_salt") => salt = field(r, |r| opt_str(r, "metadata.cache_salt must be a string or nil")),
            Head::Str(k) => {
                if !seen.contains(&k) {
                    seen.push(k);
                    unknown += 1;
                }
                r.skip();
            }
            _ => {
                // A key that is not a string is skipped whole (it may be a container), then its value.
                r.pos = start;
                r.skip();
                unknown += 1;
                r.skip();
            }
        }
    }
    Ok((take(salt)?.flatten(), unknown))
}

impl Dec {
    /// One field of a map event, by name; keys not read are skipped.
    fn map_field<'a>(&self, r: &mut Reader<'a>, f: &mut EventFields<'a>, key: &'a str) {
        let max = self.max_tokens;
        match key {
            "type" => {
                let start = r.pos;
                f.tag = Some(r.head());
                r.pos = start;
                r.skip();
            }
            "block_hashes" => f.block_hashes = field(r, |r| hashes(r, max)),
            "parent_block_hash" => f.parent_block_hash = field(r, opt_hash),
            "token_ids" => f.token_ids = field(r, |r| tokens(r, max)),
            "block_size" => f.block_size = field(r, block_size),
            "lora_id" => f.lora_id = field(r, |r| opt_int(r, "lora_id must be an int or nil")),
            "medium" => f.medium = field(r, opt_medium),
            "lora_name" => f.lora_name = field(r, |r| opt_str(r, "lora_name must be a string or nil")),
            "extra_keys" => f.extra_keys = field(r, extra_keys),
            "group_idx" => f.group_idx = field(r, |r| opt_int(r, "group_idx must be an int or nil")),
            "kv_cache_spec_kind" => {
                f.kv_cache_spec_kind = field(r, |r| opt_str(r, "kv_cache_spec_kind must be a string or nil"))
            }
            "cache_salt" => f.cache_salt = field(r, |r| opt_str(r, "cache_salt must be a string or nil")),
            "metadata" => f.metadata = field(r, metadata),
            _ => r.skip(),
        }
        if !f.keys.contains(&key) {
            f.keys.push(key);
        }
    }

    /// One event, read in one pass; None for an unknown tag (skipped and counted).
    fn event(&mut self, r: &mut Reader<'_>) -> Result<Option<Event>, Malformed> {
        let mut f = EventFields::default();
        let positional = match r.head() {
            Head::Map(m) => {
                for _ in 0..m {
                    let start = r.pos;
                    match r.head() {
                        Head::Str(key) => self.map_field(r, &mut f, key),
                        _ => {
                            r.pos = start;
                            r.skip();
                            r.skip();
                            f.other_keys += 1;
                        }
                    }
                }
                None
            }
            Head::Array(0) => return bad(Reason::BadShape, "empty event array"),
            Head::Array(m) => {
                let start = r.pos;
                f.tag = Some(r.head());
                if !matches!(f.tag, Some(Head::Str(_))) {
                    r.pos = start;
                }
                Some(m)
            }
            _ => return bad(Reason::BadShape, "event must be an array or a map"),
        };
        let tag = match f.tag {
            Some(Head::Str(tag)) => tag,
            _ => return bad(Reason::BadType, "event tag must be a string"),
        };
        let stored = matches!(tag, "BlockStored" | "BlockStoredWithMetadata");
        if let Some(m) = positional {
            self.array_fields(r, &mut f, m, tag);
        }
        let ev = if stored {
            if positional.is_none() {
                self.unknown_fields += f.unknown(&STORED_KEYS);
            }
            Event::Stored(self.stored(f, positional)?)
        } else if tag == "BlockRemoved" {
            if positional.is_none() {
                self.unknown_fields += f.unknown(&REMOVED_KEYS);
            }
            let hashes = match take(f.block_hashes)? {
                Some(h) => h,
                None if positional.is_some() => return bad(Reason::BadShape, "BlockRemoved array has no block_hashes"),
                None => return bad(Reason::BadShape, "BlockRemoved map misses block_hashes"),
            };
            Event::Removed(Removed {
                block_hashes: hashes,
                medium: take(f.medium)?.flatten(),
                group_idx: take(f.group_idx)?.flatten(),
            })
        } else if tag == "AllBlocksCleared" {
            if positional.is_none() {
                self.unknown_fields += f.unknown(&["type"]);
            }
            Event::AllCleared
        } else {
            self.unknown_tags.push(tag.chars().take(MAX_TAG_CHARS).collect());
            return Ok(None);
        };
        Ok(Some(ev))
    }

    /// The elements after the tag of a positional event, read into their fields by index.
    fn array_fields<'a>(&mut self, r: &mut Reader<'a>, f: &mut EventFields<'a>, m: u32, tag: &str) {
        let max = self.max_tokens;
        let stored = matches!(tag, "BlockStored" | "BlockStoredWithMetadata");
        let (understood, counted) = match tag {
            _ if stored => (STORED_ARRAY_FIELDS, STORED_ARRAY_FIELDS),
            "BlockRemoved" => (4, REMOVED_ARRAY_FIELDS),
            "AllBlocksCleared" => (1, 1),
            _ => (1, m), // an unknown tag: skipped whole, nothing counted
        };
        if m > counted {
            self.unknown_fields += (m - counted) as u64;
        }
        for i in 1..m {
            if i >= understood {
                r.skip();
                continue;
            }
            match (stored, i) {
                (_, 1) => f.block_hashes = field(r, |r| hashes(r, max)),
                (true, 2) => f.parent_block_hash = field(r, opt_hash),
                (true, 3) => f.token_ids = field(r, |r| tokens(r, max)),
                (true, 4) => f.block_size = field(r, block_size),
                (true, 5) => f.lora_id = field(r, |r| opt_int(r, "lora_id must be an int or nil")),
                (true, 6) | (false, 2) => f.medium = field(r, opt_medium),
                (true, 7) => {
                    // vLLM's lora_name, or SGLang's BlockStoredWithMetadata map (same tag): the type
                    // tells them apart.
                    let start = r.pos;
                    let is_map = matches!(r.head(), Head::Map(_));
                    r.pos = start;
                    if is_map {
                        f.metadata = field(r, metadata);
                    } else {
                        f.lora_name = field(r, |r| opt_str(r, "lora_name must be a string or nil"));
                    }
                }
                (true, 8) => f.extra_keys = field(r, extra_keys),
                (true, 9) | (false, 3) => f.group_idx = field(r, |r| opt_int(r, "group_idx must be an int or nil")),
                (true, 10) => {
                    f.kv_cache_spec_kind = field(r, |r| opt_str(r, "kv_cache_spec_kind must be a string or nil"))
                }
                _ => r.skip(),
            }
        }
    }

    /// A store from its fields, checked in a fixed order (the first fault met is the one reported).
    fn stored(&mut self, mut f: EventFields<'_>, positional: Option<u32>) -> Result<Stored, Malformed> {
        let mut lora_name = None;
        let cache_salt = if let Some(m) = positional {
            if m < 5 {
                return bad(Reason::BadShape, "BlockStored array is too short");
            }
            // Element 7 is read first: the lora name, or the metadata map in its place.
            let meta = take(f.metadata)?;
            lora_name = take(f.lora_name.take())?.flatten();
            if let Some((_, unknown)) = meta {
                self.unknown_fields += unknown;
            }
            meta.and_then(|(salt, _)| salt)
        } else {
            if f.block_hashes.is_none() || f.token_ids.is_none() || f.block_size.is_none() {
                return bad(Reason::BadShape, "BlockStored map misses a required field");
            }
            let mut salt = take(f.cache_salt)?.flatten();
            if salt.is_none() {
                let meta = take(f.metadata)?;
                if let Some((s, unknown)) = meta {
                    self.unknown_fields += unknown;
                    salt = s;
                }
            }
            salt
        };
        let block_hashes = take(f.block_hashes)?.unwrap_or_default();
        let parent_block_hash = take(f.parent_block_hash)?.flatten();
        let tokens = take(f.token_ids)?.unwrap_or(Tokens::U32(Vec::new()));
        let block_size = take(f.block_size)?.unwrap_or(0);
        let medium = take(f.medium)?.flatten();
        let lora_id = take(f.lora_id)?.flatten();
        if positional.is_none() {
            lora_name = take(f.lora_name.take())?.flatten();
        }
        Ok(Stored {
            block_hashes,
            parent_block_hash,
            tokens,
            block_size,
            medium,
            lora_id,
            lora_name,
            extra_keys: take(f.extra_keys)?.flatten(),
            cache_salt,
            group_idx: take(f.group_idx)?.flatten(),
            kv_cache_spec_kind: take(f.kv_cache_spec_kind)?.flatten(),
        })
    }

    fn events(&mut self, r: &mut Reader<'_>, max_events: u64) -> Result<Vec<Event>, Malformed> {
        let Head::Array(n) = r.head() else {
            return bad(Reason::BadType, "events must be an array");
        };
        if n as u64 > max_events {
            return bad(Reason::TooLarge, "too many events in the batch");
        }
        let mut out = Vec::with_capacity(n as usize);
        for _ in 0..n {
            if let Some(ev) = self.event(r)? {
                out.push(ev);
            }
        }
        Ok(out)
    }
}

fn ts(r: &mut Reader<'_>) -> Result<f64, Malformed> {
    match r.head() {
        Head::Float(f) => Ok(f),
        Head::UInt(v) => Ok(v as f64),
        Head::NInt(v) => Ok(v as f64),
        _ => bad(Reason::BadType, "ts must be a number"),
    }
}

fn rank(r: &mut Reader<'_>) -> Result<Option<i64>, Malformed> {
    match opt_int(r, "rank must be an int or nil")? {
        Some(v) if v < 0 => bad(Reason::BadValue, "rank must not be negative"),
        v => Ok(v),
    }
}

/// Decode one msgpack batch payload. Never panics on any input; any fault is a `Malformed`.
pub fn decode_batch(payload: &[u8], limits: &DecodeLimits) -> Result<Batch, Malformed> {
    if payload.len() > limits.max_bytes {
        return bad(Reason::TooLarge, "payload over max_bytes");
    }
    let array_bound = limits.max_events.max(limits.max_tokens_per_event).max(64);
    let bounds = Limits {
        max_array: array_bound,
        max_map: 1 << 12,
        max_str: 1 << 16,
        max_bin: 1 << 16,
        max_ext: 1 << 16,
        max_depth: 512,
    };
    let payload = validated(payload, &bounds)?;
    let mut d = Dec {
        max_tokens: limits.max_tokens_per_event,
        unknown_fields: 0,
        unknown_tags: Vec::new(),
    };
    let mut r = Reader::new(payload);
    let (mut ts_f, mut events_f, mut rank_f, mut attn_f): (Field<f64>, Field<Vec<Event>>, Field<_>, Field<_>) =
        (None, None, None, None);
    match r.head() {
        Head::Array(size) => {
            if size < 2 {
                return bad(Reason::BadShape, "batch array is too short");
            }
            if size > 3 {
                d.unknown_fields += (size - 3) as u64;
            }
            ts_f = field(&mut r, ts);
            events_f = field(&mut r, |r| d.events(r, limits.max_events));
            if size > 2 {
                rank_f = field(&mut r, rank);
            }
        }
        Head::Map(n) => {
            // No release encodes a batch as a map, but one vLLM main commit would (docs/kv-wire.md 1.3).
            let mut seen: Vec<&str> = Vec::new();
            for _ in 0..n {
                let start = r.pos;
                let key = match r.head() {
                    Head::Str(k) => k,
                    _ => {
                        r.pos = start;
                        r.skip();
                        r.skip();
                        d.unknown_fields += 1;
                        continue;
                    }
                };
                match key {
                    "ts" => ts_f = field(&mut r, ts),
                    "events" => events_f = field(&mut r, |r| d.events(r, limits.max_events)),
                    "data_parallel_rank" => rank_f = field(&mut r, rank),
                    "attn_dp_rank" => attn_f = field(&mut r, rank),
                    _ => r.skip(),
                }
                if !BATCH_KEYS.contains(&key) && !seen.contains(&key) {
                    seen.push(key);
                    d.unknown_fields += 1;
                }
            }
            if ts_f.is_none() || events_f.is_none() {
                return bad(Reason::BadShape, "batch map misses ts or events");
            }
            if matches!(rank_f, None | Some(Ok(None))) {
                rank_f = attn_f; // the rank under its other name
            }
        }
        _ => return bad(Reason::BadShape, "batch must be an array or a map"),
    }
    let ts = take(ts_f)?.unwrap_or(0.0);
    let events = take(events_f)?.unwrap_or_default();
    let data_parallel_rank = take(rank_f)?.flatten();
    Ok(Batch {
        ts,
        events,
        data_parallel_rank,
        unknown_fields: d.unknown_fields,
        unknown_tags: d.unknown_tags,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(payload: &[u8]) -> Reason {
        match decode_batch(payload, &DecodeLimits::default()) {
            Err(m) => m.reason,
            Ok(_) => panic!("decoded"),
        }
    }

    #[test]
    fn msgpack_level_faults() {
        assert_eq!(reason(b""), Reason::Truncated);
        assert_eq!(reason(b"\xc1"), Reason::NotMsgpack);
        assert_eq!(reason(b"\x90\x90"), Reason::TrailingData);
        assert_eq!(reason(b"\x92\xa1\xff\x90"), Reason::NotMsgpack);
        let mut huge = b"\x93\xcb".to_vec();
        huge.extend([0; 8]);
        huge.extend(b"\xdd\xff\xff\xff\xff");
        assert_eq!(reason(&huge), Reason::TooLarge);
        let mut cut = b"\x93\xcb".to_vec();
        cut.extend([0; 8]);
        cut.extend(b"\xdc\x01\x00");
        assert_eq!(reason(&cut), Reason::Truncated);
        assert_eq!(reason(b"\x81\x81\x00\x00\x00"), Reason::BadType, "a map as a map key");
    }

    #[test]
    fn a_container_key_in_the_metadata_map_is_skipped_whole() {
        // [0.0, [["BlockStored", [1], nil, [1, 2], 2, nil, nil, {[1, 2, 3]: 5, "cache_salt": "s"}, nil]]]
        let mut p = b"\x92\xcb".to_vec();
        p.extend([0; 8]);
        p.extend(b"\x91\x99\xabBlockStored\x91\x01\xc0\x92\x01\x02\x02\xc0\xc0");
        p.extend(b"\x82\x93\x01\x02\x03\x05\xaacache_salt\xa1s\xc0");
        let b = decode_batch(&p, &DecodeLimits::default()).unwrap();
        let Event::Stored(s) = &b.events[0] else { panic!() };
        assert_eq!((s.cache_salt.as_deref(), b.unknown_fields), (Some("s"), 1));
    }

    #[test]
    fn tagged_array_store() {
        // [0.0, [["BlockStored", [1, -1], nil, [1, 2, 3, 4], 2, nil, "CPU"]], 0]
        let mut p = b"\x93\xcb".to_vec();
        p.extend([0; 8]);
        p.extend(b"\x91\x97\xabBlockStored\x92\x01\xff\xc0\x94\x01\x02\x03\x04\x02\xc0\xa3CPU\x00");
        let b = decode_batch(&p, &DecodeLimits::default()).unwrap();
        assert_eq!(b.data_parallel_rank, Some(0));
        let Event::Stored(s) = &b.events[0] else { panic!() };
        assert_eq!(s.block_hashes, vec![1, u64::MAX]);
        assert_eq!(s.medium.as_deref(), Some("CPU"));
        assert_eq!(s.tokens.len(), 4);
    }
}
