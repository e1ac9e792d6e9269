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

use crate::events::{Event, Removed, Stored};
use crate::keys::Tokens;
use crate::msgpack::{canonical, validate, Head, Limits, Reader};

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

/// A map's entries: string keys with the position of their value (a repeated key: the last wins),
/// and how many keys were not strings.
struct Fields<'a> {
    named: Vec<(&'a str, usize)>,
    other_keys: u64,
}

impl<'a> Fields<'a> {
    fn get(&self, name: &str) -> Option<usize> {
        self.named.iter().rev().find(|(k, _)| *k == name).map(|&(_, p)| p)
    }

    fn unknown(&self, known: &[&str]) -> u64 {
        let mut seen: Vec<&str> = Vec::new();
        for (k, _) in &self.named {
            if !known.contains(k) && !seen.contains(k) {
                seen.push(k);
            }
        }
        seen.len() as u64 + self.other_keys
    }
}

struct Dec<'a> {
    buf: &'a [u8],
    max_tokens: u64,
    unknown_fields: u64,
    unknown_tags: Vec<String>,
}

impl<'a> Dec<'a> {
    fn head(&self, pos: usize) -> (Head<'a>, usize) {
        let mut r = Reader::new(self.buf);
        r.pos = pos;
        let h = r.head();
        (h, r.pos)
    }

    /// Positions of the first `k` elements of the array whose elements start at `pos`.
    fn elements(&self, pos: usize, k: u32) -> Vec<usize> {
        let mut r = Reader::new(self.buf);
        r.pos = pos;
        (0..k)
            .map(|_| {
                let p = r.pos;
                r.skip();
                p
            })
            .collect()
    }

    fn fields(&self, pos: usize, n: u32) -> Fields<'a> {
        let mut r = Reader::new(self.buf);
        r.pos = pos;
        let mut f = Fields {
            named: Vec::with_capacity(n as usize),
            other_keys: 0,
        };
        for _ in 0..n {
            let before = r.pos;
            match r.head() {
                Head::Str(k) => f.named.push((k, r.pos)),
                _ => {
                    r.pos = before;
                    r.skip();
                    f.other_keys += 1;
                }
            }
            r.skip(); // the value
        }
        f
    }

    fn hash_of(h: Head<'_>) -> Result<u64, Malformed> {
        match h {
            Head::Int(v) => Ok(v as i64 as u64), // msgpack ints are within i64..u64: two's complement
            Head::Bin(b) if !b.is_empty() => Ok(b[b.len().saturating_sub(8)..]
                .iter()
                .fold(0u64, |acc, &x| acc << 8 | x as u64)),
            Head::Bin(_) => bad(Reason::BadHash, "empty bytes hash"),
            _ => bad(Reason::BadHash, "hash must be an int or bytes"),
        }
    }

    fn hashes(&self, pos: usize) -> Result<Vec<u64>, Malformed> {
        let (h, mut p) = self.head(pos);
        let Head::Array(n) = h else {
            return bad(Reason::BadType, "block_hashes must be an array");
        };
        if n as u64 > self.max_tokens {
            return bad(Reason::TooLarge, "too many block_hashes");
        }
        let mut r = Reader::new(self.buf);
        let mut out = Vec::with_capacity(n as usize);
        for _ in 0..n {
            r.pos = p;
            out.push(Self::hash_of(r.head())?);
            p = r.pos;
        }
        Ok(out)
    }

    fn opt_hash(&self, pos: usize) -> Result<Option<u64>, Malformed> {
        match self.head(pos).0 {
            Head::Nil => Ok(None),
            h => Self::hash_of(h).map(Some),
        }
    }

    fn tokens(&self, pos: usize) -> Result<Tokens, Malformed> {
        let (h, p) = self.head(pos);
        let Head::Array(n) = h else {
            return bad(Reason::BadType, "token_ids must be an array");
        };
        if n as u64 > self.max_tokens {
            return bad(Reason::TooLarge, "too many token_ids");
        }
        let mut r = Reader::new(self.buf);
        r.pos = p;
        let mut narrow: Vec<u32> = Vec::with_capacity(n as usize);
        for i in 0..n {
            // Also rejects SGLang EAGLE bigram pairs ([a, b] per token): read as plain tokens they
            // would index other content.
            let Head::Int(v) = r.head() else {
                return bad(Reason::BadType, "token_ids must all be ints");
            };
            if let Ok(t) = u32::try_from(v) {
                narrow.push(t);
                continue;
            }
            // Out of u32: the whole sequence is keyed as 64-bit (u64 beyond i64 as two's complement).
            let mut wide: Vec<i64> = narrow.iter().map(|&t| t as i64).collect();
            wide.push(v as i64);
            for _ in i + 1..n {
                let Head::Int(v) = r.head() else {
                    return bad(Reason::BadType, "token_ids must all be ints");
                };
                wide.push(v as i64);
            }
            return Ok(Tokens::I64(wide));
        }
        Ok(Tokens::U32(narrow))
    }

    fn block_size(&self, pos: usize) -> Result<i64, Malformed> {
        match self.head(pos).0 {
            Head::Int(v) if v <= 0 => bad(Reason::BadValue, "block_size must be positive"),
            Head::Int(v) => Ok(v.min(i64::MAX as i128) as i64),
            _ => bad(Reason::BadType, "block_size must be an int"),
        }
    }

    fn opt_int(&self, pos: Option<usize>, detail: &'static str) -> Result<Option<i64>, Malformed> {
        let Some(pos) = pos else { return Ok(None) };
        match self.head(pos).0 {
            Head::Nil => Ok(None),
            Head::Int(v) => Ok(Some(v.clamp(i64::MIN as i128, i64::MAX as i128) as i64)),
            _ => bad(Reason::BadType, detail),
        }
    }

    fn opt_str(&self, pos: Option<usize>, detail: &'static str) -> Result<Option<String>, Malformed> {
        let Some(pos) = pos else { return Ok(None) };
        match self.head(pos).0 {
            Head::Nil => Ok(None),
            Head::Str(s) => Ok(Some(s.to_owned())),
            _ => bad(Reason::BadType, detail),
        }
    }

    /// vLLM's per-block extra keys, each as canonical bytes (empty for a block without).
    fn extra_keys(&self, pos: Option<usize>) -> Result<Option<Vec<Vec<u8>>>, Malformed> {
        let Some(pos) = pos else { return Ok(None) };
        let (h, p) = self.head(pos);
        let n = match h {
            Head::Nil => return Ok(None),
            Head::Array(n) => n,
            _ => return bad(Reason::BadType, "extra_keys must be an array or nil"),
        };
        let mut r = Reader::new(self.buf);
        r.pos = p;
        let (mut height, mut any_map) = (0, false);
        let mut out = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let mut bytes = Vec::new();
            if let (Head::Nil, next) = self.head(r.pos) {
                r.pos = next;
            } else {
                let (d, m) = canonical(&mut r, &mut bytes);
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

    /// SGLang's `BlockStoredWithMetadata` map `{"cache_salt": str}`.
    fn metadata_salt(&mut self, pos: Option<usize>) -> Result<Option<String>, Malformed> {
        let Some(pos) = pos else { return Ok(None) };
        let (h, p) = self.head(pos);
        let n = match h {
            Head::Nil => return Ok(None),
            Head::Map(n) => n,
            _ => return bad(Reason::BadType, "metadata must be a map"),
        };
        let f = self.fields(p, n);
        self.unknown_fields += f.unknown(&["cache_salt"]);
        self.opt_str(f.get("cache_salt"), "metadata.cache_salt must be a string or nil")
    }

    fn stored_array(&mut self, pos: usize, n: u32) -> Result<Stored, Malformed> {
        // [tag, block_hashes, parent, token_ids, block_size, lora_id, medium, lora_name | metadata,
        //  extra_keys, group_idx, kv_cache_spec_kind, sliding_window, locality, ownership, session_id,
        //  lookahead_token_ids]; the first vLLM release stopped at lora_id.
        if n < 5 {
            return bad(Reason::BadShape, "BlockStored array is too short");
        }
        if n > STORED_ARRAY_FIELDS {
            self.unknown_fields += (n - STORED_ARRAY_FIELDS) as u64;
        }
        let at = self.elements(pos, n.min(11));
        let field = |i: usize| at.get(i).copied();
        let (mut lora_name, mut cache_salt) = (None, None);
        if let Some(p7) = field(7) {
            // Index 7 is vLLM's lora_name, but SGLang's BlockStoredWithMetadata (same tag) puts its
            // metadata map there instead; the type tells them apart.
            if let Head::Map(_) = self.head(p7).0 {
                cache_salt = self.metadata_salt(Some(p7))?;
            } else {
                lora_name = self.opt_str(Some(p7), "lora_name must be a string or nil")?;
            }
        }
        let block_hashes = self.hashes(at[1])?;
        let parent_block_hash = self.opt_hash(at[2])?;
        let tokens = self.tokens(at[3])?;
        let block_size = self.block_size(at[4])?;
        let medium = self.opt_str(field(6), "medium must be a string or nil")?;
        let lora_id = self.opt_int(field(5), "lora_id must be an int or nil")?;
        Ok(Stored {
            block_hashes,
            parent_block_hash,
            tokens,
            block_size,
            medium,
            lora_id,
            lora_name,
            extra_keys: self.extra_keys(field(8))?,
            cache_salt,
            group_idx: self.opt_int(field(9), "group_idx must be an int or nil")?,
            kv_cache_spec_kind: self.opt_str(field(10), "kv_cache_spec_kind must be a string or nil")?,
        })
    }

    fn stored_map(&mut self, f: &Fields<'a>) -> Result<Stored, Malformed> {
        self.unknown_fields += f.unknown(&STORED_KEYS);
        let (Some(hashes), Some(tokens), Some(block_size)) =
            (f.get("block_hashes"), f.get("token_ids"), f.get("block_size"))
        else {
            return bad(Reason::BadShape, "BlockStored map misses a required field");
        };
        let mut cache_salt = self.opt_str(f.get("cache_salt"), "cache_salt must be a string or nil")?;
        if cache_salt.is_none() {
            cache_salt = self.metadata_salt(f.get("metadata"))?;
        }
        let block_hashes = self.hashes(hashes)?;
        let parent_block_hash = match f.get("parent_block_hash") {
            Some(p) => self.opt_hash(p)?,
            None => None,
        };
        let tokens = self.tokens(tokens)?;
        let block_size = self.block_size(block_size)?;
        let medium = self.opt_str(f.get("medium"), "medium must be a string or nil")?;
        let lora_id = self.opt_int(f.get("lora_id"), "lora_id must be an int or nil")?;
        Ok(Stored {
            block_hashes,
            parent_block_hash,
            tokens,
            block_size,
            medium,
            lora_id,
            lora_name: self.opt_str(f.get("lora_name"), "lora_name must be a string or nil")?,
            extra_keys: self.extra_keys(f.get("extra_keys"))?,
            cache_salt,
            group_idx: self.opt_int(f.get("group_idx"), "group_idx must be an int or nil")?,
            kv_cache_spec_kind: self.opt_str(
                f.get("kv_cache_spec_kind"),
                "kv_cache_spec_kind must be a string or nil",
            )?,
        })
    }

    fn removed_array(&mut self, pos: usize, n: u32) -> Result<Removed, Malformed> {
        // [tag, block_hashes, medium, group_idx, locality, ownership]; the first release had hashes only.
        if n < 2 {
            return bad(Reason::BadShape, "BlockRemoved array has no block_hashes");
        }
        if n > REMOVED_ARRAY_FIELDS {
            self.unknown_fields += (n - REMOVED_ARRAY_FIELDS) as u64;
        }
        let at = self.elements(pos, n.min(4));
        Ok(Removed {
            block_hashes: self.hashes(at[1])?,
            medium: self.opt_str(at.get(2).copied(), "medium must be a string or nil")?,
            group_idx: self.opt_int(at.get(3).copied(), "group_idx must be an int or nil")?,
        })
    }

    fn removed_map(&mut self, f: &Fields<'a>) -> Result<Removed, Malformed> {
        self.unknown_fields += f.unknown(&REMOVED_KEYS);
        let Some(hashes) = f.get("block_hashes") else {
            return bad(Reason::BadShape, "BlockRemoved map misses block_hashes");
        };
        Ok(Removed {
            block_hashes: self.hashes(hashes)?,
            medium: self.opt_str(f.get("medium"), "medium must be a string or nil")?,
            group_idx: self.opt_int(f.get("group_idx"), "group_idx must be an int or nil")?,
        })
    }

    fn events(&mut self, pos: usize, max_events: u64) -> Result<Vec<Event>, Malformed> {
        let (h, first) = self.head(pos);
        let Head::Array(n) = h else {
            return bad(Reason::BadType, "events must be an array");
        };
        if n as u64 > max_events {
            return bad(Reason::TooLarge, "too many events in the batch");
        }
        let mut out = Vec::with_capacity(n as usize);
        let mut r = Reader::new(self.buf);
        r.pos = first;
        for _ in 0..n {
            let start = r.pos;
            r.skip();
            let (h, body) = self.head(start);
            let ev = match h {
                Head::Map(m) => {
                    let f = self.fields(body, m);
                    let tag = match f.get("type").map(|p| self.head(p).0) {
                        Some(Head::Str(tag)) => tag,
                        _ => return bad(Reason::BadType, "event tag must be a string"),
                    };
                    match tag {
                        "BlockStored" | "BlockStoredWithMetadata" => Event::Stored(self.stored_map(&f)?),
                        "BlockRemoved" => Event::Removed(self.removed_map(&f)?),
                        "AllBlocksCleared" => {
                            self.unknown_fields += f.unknown(&["type"]);
                            Event::AllCleared
                        }
                        other => {
                            self.unknown_tags.push(other.chars().take(MAX_TAG_CHARS).collect());
                            continue;
                        }
                    }
                }
                Head::Array(0) => return bad(Reason::BadShape, "empty event array"),
                Head::Array(m) => {
                    let tag = match self.head(body).0 {
                        Head::Str(tag) => tag,
                        _ => return bad(Reason::BadType, "event tag must be a string"),
                    };
                    match tag {
                        "BlockStored" | "BlockStoredWithMetadata" => Event::Stored(self.stored_array(body, m)?),
                        "BlockRemoved" => Event::Removed(self.removed_array(body, m)?),
                        "AllBlocksCleared" => {
                            self.unknown_fields += (m - 1) as u64;
                            Event::AllCleared
                        }
                        other => {
                            self.unknown_tags.push(other.chars().take(MAX_TAG_CHARS).collect());
                            continue;
                        }
                    }
                }
                _ => return bad(Reason::BadShape, "event must be an array or a map"),
            };
            out.push(ev);
        }
        Ok(out)
    }

    fn ts(&self, pos: usize) -> Result<f64, Malformed> {
        match self.head(pos).0 {
            Head::Float(f) => Ok(f),
            Head::Int(v) => Ok(v as f64),
            _ => bad(Reason::BadType, "ts must be a number"),
        }
    }

    fn rank(&self, pos: Option<usize>) -> Result<Option<i64>, Malformed> {
        match self.opt_int(pos, "rank must be an int or nil")? {
            Some(r) if r < 0 => bad(Reason::BadValue, "rank must not be negative"),
            r => Ok(r),
        }
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
    validate(payload, &bounds)?;
    let mut d = Dec {
        buf: payload,
        max_tokens: limits.max_tokens_per_event,
        unknown_fields: 0,
        unknown_tags: Vec::new(),
    };
    let (h, body) = d.head(0);
    let (ts, events, rank) = match h {
        Head::Array(size) => {
            if size < 2 {
                return bad(Reason::BadShape, "batch array is too short");
            }
            if size > 3 {
                d.unknown_fields += (size - 3) as u64;
            }
            let at = d.elements(body, size.min(3));
            (at[0], at[1], at.get(2).copied())
        }
        Head::Map(n) => {
            // No release encodes a batch as a map, but one vLLM main commit would (docs/kv-wire.md 1.3).
            let f = d.fields(body, n);
            d.unknown_fields += f.unknown(&BATCH_KEYS);
            let (Some(ts), Some(events)) = (f.get("ts"), f.get("events")) else {
                return bad(Reason::BadShape, "batch map misses ts or events");
            };
            let rank = match f.get("data_parallel_rank") {
                Some(p) if d.head(p).0 != Head::Nil => Some(p),
                _ => f.get("attn_dp_rank"),
            };
            (ts, events, rank)
        }
        _ => return bad(Reason::BadShape, "batch must be an array or a map"),
    };
    let ts = d.ts(ts)?;
    let events = d.events(events, limits.max_events)?;
    let data_parallel_rank = d.rank(rank)?;
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
